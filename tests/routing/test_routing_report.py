"""Tables, goal verdicts, metric parsing and figures of the routing experiment, on synthetic data."""

from __future__ import annotations

import random

import pytest

from benchmarks.routing_plots import per_request_ms, plot_cdfs, plot_timelines
from benchmarks.routing_report import (
    ROWS,
    busy_output_throughput,
    change_pct,
    goal_check,
    policy_table,
    row_value,
    summary_table,
)
from benchmarks.routing_sampler import parse_gauges


def synthetic(ttft_scale: float, tpot_ms: float, out_tps: float, n: int = 50, seed: int = 0) -> dict:
    rng = random.Random(seed)
    ttfts = [rng.expovariate(1.0) * ttft_scale for _ in range(n)]
    out_lens = [rng.randint(2, 40) for _ in range(n)]
    itls = [[tpot_ms / 1000.0] * (k - 1) for k in out_lens]
    ttft_ms = sorted(t * 1000 for t in ttfts)
    return {
        "duration": 100.0, "completed": n, "failed": 0, "total_input_tokens": 12_000,
        "total_output_tokens": int(out_tps * 100), "output_throughput": out_tps,
        "mean_ttft_ms": sum(ttft_ms) / n, "median_ttft_ms": ttft_ms[n // 2], "p99_ttft_ms": ttft_ms[-1],
        "mean_tpot_ms": tpot_ms, "p99_tpot_ms": tpot_ms * 1.5,
        "ttfts": ttfts, "itls": itls, "output_lens": out_lens,
    }


def test_change_and_row_values():
    base = synthetic(2.0, 100.0, 2000.0)
    assert row_value(base, "input_throughput") == 120.0  # derived: total_input_tokens / duration
    assert change_pct(200.0, 50.0) == -75.0
    assert change_pct(0.0, 5.0) is None
    assert change_pct(None, 5.0) is None


def test_policy_table_has_every_reference_row_with_change():
    base, good = synthetic(2.0, 100.0, 2000.0), synthetic(0.2, 50.0, 2200.0, seed=1)
    table = policy_table("llm_aware", base, good)
    for row in ROWS:
        assert f"| {row.label} |" in table
    assert "+10.0% (better)" in table  # output throughput 2000 -> 2200
    assert "-50.0% (better)" in table  # mean TPOT 100 -> 50
    assert "| failed requests | 0 | 0 |" in table


def test_decode_time_per_token_row_weighs_every_token_once():
    base = synthetic(2.0, 100.0, 2000.0)
    assert row_value(base, "token_tpot_ms") is None  # no per-request latencies: n/a, not 0
    # Two 11-token answers at 50 ms per token and a 3-token one that stalled 1 s.
    stalled = dict(base, e2els=[0.6, 0.6, 1.2], ttfts=[0.1, 0.1, 0.1], output_lens=[11, 11, 3],
                   errors=["", "", ""])
    assert row_value(stalled, "token_tpot_ms") == pytest.approx(1000.0 * (0.5 + 0.5 + 1.1) / 22)
    table = policy_table("llm_aware", stalled, stalled)
    assert "| decode time per output token (token-weighted) | 95.45 ms | 95.45 ms |" in table


def test_busy_throughput_counts_only_the_window_while_every_client_is_busy():
    # Clients send at 0, 0 and 10 s (the last send): the window is 10 s. Tokens are spread
    # evenly from each request's first token to its end; the third starts after the window.
    result = {"start_times": [100.0, 100.0, 110.0], "ttfts": [1.0, 1.0, 1.0], "e2els": [11.0, 21.0, 11.0],
              "output_lens": [100, 200, 100], "errors": ["", "", ""]}
    assert busy_output_throughput(result) == pytest.approx((100 * 9 / 10 + 200 * 9 / 20) / 10)
    # A long tail after the last send changes the whole-run throughput, not this one.
    result["e2els"][1] = 201.0
    assert busy_output_throughput(result) == pytest.approx((90 + 200 * 9 / 200) / 10)
    assert busy_output_throughput({"start_times": []}) is None


def test_goal_check_reports_met_and_missed():
    base = synthetic(2.0, 100.0, 2000.0)
    results = {"baseline": base, "round_robin": synthetic(1.9, 99.0, 2000.0, seed=2),
               "llm_aware": synthetic(0.1, 40.0, 2200.0, seed=1)}
    results["llm_aware"]["p99_tpot_ms"] = 20.0
    verdicts = goal_check(results)
    assert all(v.startswith("MET") for v in verdicts), verdicts
    results["llm_aware"]["output_throughput"] = 1800.0
    verdicts = goal_check(results)
    assert any(v.startswith("MISS output_throughput") for v in verdicts)
    assert any(v.startswith("MISS throughput kept") for v in verdicts)
    assert "goal check skipped" in goal_check({"baseline": base})[0]


def test_summary_table_lists_all_policies():
    results = {"baseline": synthetic(2.0, 100.0, 2000.0), "llm_aware": synthetic(0.2, 50.0, 2100.0)}
    table = summary_table(results)
    assert table.splitlines()[0] == "| metric | baseline | llm_aware |"
    assert "(+5%)" in table


def test_per_request_tpot_rebuilt_from_itls():
    result = {"ttfts": [0.5, 0.25], "itls": [[0.01, 0.03], []], "output_lens": [3, 1]}
    assert per_request_ms(result, "ttft") == [500.0, 250.0]
    assert per_request_ms(result, "tpot") == [20.0]  # (10 + 30 ms) / (3 - 1); a 1-token output has none


def test_parse_gauges_sums_engines_and_reads_v0_name():
    text = "\n".join([
        "# HELP vllm:num_requests_waiting x", "# TYPE vllm:num_requests_waiting gauge",
        'vllm:num_requests_waiting{engine="0",model_name="m"} 3.0',
        'vllm:num_requests_waiting{engine="1",model_name="m"} 2.0',
        'vllm:num_requests_running{model_name="m"} 7',
        'vllm:gpu_cache_usage_perc{model_name="m"} 0.5',
        'vllm:num_requests_waiting_by_reason{reason="capacity"} 9',
    ])
    assert parse_gauges(text) == {"waiting": 5.0, "running": 7.0, "kv": 0.5}


def test_figures_are_written(tmp_path):
    results = {"baseline": synthetic(2.0, 100.0, 2000.0), "llm_aware": synthetic(0.2, 50.0, 2100.0)}
    samples = [{"t": i * 0.5, "workers": [{"waiting": i % 3, "kv": 0.1 * (i % 10), "running": 4},
                                          {"waiting": 0, "kv": 0.2, "running": 2}]} for i in range(40)]
    paths = [plot_cdfs(results, "ttft", tmp_path / "ttft.png", "t"),
             plot_cdfs(results, "tpot", tmp_path / "tpot.png", "t"),
             plot_timelines({"baseline": samples, "llm_aware": samples}, tmp_path / "load.png", "t")]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert p.stat().st_size > 5000


def test_steady_state_skips_the_first_wave_and_failures():
    from benchmarks.routing_report import steady_state, steady_state_table

    result = {"start_times": [0.0, 0.0, 1.0, 2.0, 3.0], "ttfts": [5.0, 5.0, 0.1, 0.0, 0.3],
              "errors": ["", "", "", "boom", ""], "tpots": [0.05, 0.05, 0.02, None, 0.04]}
    stats = steady_state(result, skip=2)
    assert stats["requests"] == 2  # the t=0 pair is skipped, the failed one left out
    assert abs(stats["mean_ttft_ms"] - 200.0) < 1e-9
    assert abs(stats["mean_tpot_ms"] - 30.0) < 1e-9
    table = steady_state_table({"baseline": result, "llm_aware": result}, skip=2)
    assert "| mean TTFT | 200.0 | 200.0 (+0%) |" in table
    assert steady_state({"ttfts": [1.0]}, skip=0) is None
