"""Metric arithmetic on synthetic request outcomes with hand-computed answers."""

import math

import pytest

from benchmarks.bench_metrics import RequestResult, calculate_metrics, format_summary, per_request_lists

# Three successes and one failure; every expected number below is worked out by hand.
A = RequestResult(success=True, prompt_len=10, ttft=0.1, itl=[0.02, 0.04, 0.03], latency=0.19,
                  output_tokens=4, start_time=0.0)
B = RequestResult(success=True, prompt_len=20, ttft=0.3, itl=[0.05], latency=0.35, output_tokens=2,
                  start_time=0.5)
C = RequestResult(success=True, prompt_len=5, ttft=0.2, itl=[], latency=0.2, output_tokens=1, start_time=1.2)
D = RequestResult(success=False, prompt_len=100, error="HTTP 500: boom", start_time=0.1)
OUTPUTS = [A, B, C, D]


def approx(x):
    return pytest.approx(x, rel=1e-9, abs=1e-9)


def test_counts_and_throughputs_exclude_failed_requests():
    m = calculate_metrics(OUTPUTS, duration=2.0, percentiles=[50, 99])
    assert m["completed"] == 3 and m["failed"] == 1
    assert m["total_input_tokens"] == 35  # the failed request's 100 prompt tokens do not count
    assert m["total_output_tokens"] == 7
    assert m["output_lens"] == [4, 2, 1, 0]
    assert m["request_throughput"] == approx(1.5)
    assert m["output_throughput"] == approx(3.5)
    assert m["total_token_throughput"] == approx(21.0)
    assert m["request_goodput"] is None


def test_ttft_and_e2el_are_statistics_over_requests():
    m = calculate_metrics(OUTPUTS, duration=2.0, percentiles=[50, 99])
    assert m["mean_ttft_ms"] == approx(200.0)
    assert m["median_ttft_ms"] == approx(200.0)
    assert m["std_ttft_ms"] == approx(1000 * math.sqrt(0.02 / 3))  # population std
    assert m["p50_ttft_ms"] == approx(200.0)
    assert m["p99_ttft_ms"] == approx(298.0)  # linear: 0.2 + 0.98 * (0.3 - 0.2)
    assert m["mean_e2el_ms"] == approx(1000 * (0.19 + 0.35 + 0.2) / 3)
    assert m["median_e2el_ms"] == approx(200.0)


def test_tpot_excludes_first_token_and_skips_single_token_outputs():
    m = calculate_metrics(OUTPUTS, duration=2.0, percentiles=[99])
    # A: (0.19 - 0.1) / (4 - 1) = 0.03; B: (0.35 - 0.3) / 1 = 0.05; C (1 token) has no TPOT.
    assert m["mean_tpot_ms"] == approx(40.0)
    assert m["median_tpot_ms"] == approx(40.0)
    assert m["std_tpot_ms"] == approx(10.0)
    assert m["p99_tpot_ms"] == approx(49.8)


def test_itl_pools_every_chunk_gap_of_every_request():
    m = calculate_metrics(OUTPUTS, duration=2.0, percentiles=[99])
    # pooled gaps 20, 40, 30, 50 ms: a per-request mean-of-means would give (30 + 50) / 2 = 40.
    assert m["mean_itl_ms"] == approx(35.0)
    assert m["median_itl_ms"] == approx(35.0)
    assert m["std_itl_ms"] == approx(math.sqrt(125.0))
    assert m["p99_itl_ms"] == approx(49.7)


def test_peak_output_tokens_and_concurrency_per_second():
    m = calculate_metrics(OUTPUTS, duration=2.0)
    # second 0: A's 4 tokens (0.10..0.19 s) + B's 2 (0.80, 0.85 s); second 1: C's single token.
    assert m["max_output_tokens_per_s"] == 6.0
    assert m["max_concurrent_requests"] == 2


@pytest.mark.parametrize(("slo", "good"), [({"ttft": 250}, 2), ({"ttft": 250, "tpot": 40}, 2),
                                            ({"tpot": 20}, 1), ({"e2el": 1000}, 3), ({"ttft": 50}, 0)])
def test_goodput_counts_requests_meeting_every_slo(slo, good):
    # C has one output token, so its TPOT counts as 0 for goodput.
    m = calculate_metrics(OUTPUTS, duration=2.0, goodput_slo_ms=slo)
    assert m["request_goodput"] == approx(good / 2.0)


def test_output_len_falls_back_to_tokenizing_text_when_usage_missing():
    no_usage = RequestResult(success=True, prompt_len=3, ttft=0.1, itl=[0.1, 0.1], latency=0.3,
                             output_tokens=0, generated_text="one two three four five")
    m = calculate_metrics([no_usage], 1.0, count_tokens=lambda text: len(text.split()))
    assert m["output_lens"] == [5]
    assert m["mean_tpot_ms"] == approx(50.0)  # (0.3 - 0.1) / (5 - 1)
    # Without a tokenizer each chunk counts as one token.
    assert calculate_metrics([no_usage], 1.0)["output_lens"] == [3]


def test_all_failed_gives_zeros_not_errors():
    m = calculate_metrics([D, D], duration=1.0, percentiles=[99])
    assert m["completed"] == 0 and m["failed"] == 2
    for name in ("ttft", "tpot", "itl", "e2el"):
        assert m[f"mean_{name}_ms"] == 0 and m[f"p99_{name}_ms"] == 0
    assert m["max_output_tokens_per_s"] == 0 and m["max_concurrent_requests"] == 0


def test_per_request_lists_align_with_requests():
    m = calculate_metrics(OUTPUTS, duration=2.0)
    lists = per_request_lists(OUTPUTS, m["output_lens"])
    assert lists["input_lens"] == [10, 20, 5, 100]
    assert lists["ttfts"] == [0.1, 0.3, 0.2, 0.0]
    assert lists["errors"] == ["", "", "", "HTTP 500: boom"]
    assert lists["itls"][0] == [0.02, 0.04, 0.03]
    assert lists["tpots"][0] == approx(0.03) and lists["tpots"][2] is None and lists["tpots"][3] is None
    assert lists["e2els"] == [0.19, 0.35, 0.2, None]


def test_summary_layout_matches_vllm():
    m = calculate_metrics(OUTPUTS, duration=2.0, percentiles=[99])
    text = format_summary(m, ["ttft", "tpot", "itl"], [99], max_concurrency=None,
                          request_rate=float("inf"), show_goodput=False)
    lines = text.splitlines()
    assert lines[0] == "============ Serving Benchmark Result ============"
    assert lines[1] == f"{'Successful requests:':<40} {3:<10}"
    assert lines[2].startswith("Failed requests:")
    assert lines[3] == f"{'Benchmark duration (s):':<40} {2.0:<10.2f}"
    labels = [line.split(":")[0] for line in lines]
    assert "Maximum request concurrency" not in labels and "Request rate configured (RPS)" not in labels
    assert "Mean E2EL (ms)" not in labels and "Request goodput (req/s)" not in labels
    peak = labels.index("Peak output token throughput (tok/s)")
    assert labels.index("Output token throughput (tok/s)") < peak
    assert labels.index("Peak concurrent requests") < labels.index("Total token throughput (tok/s)")
    assert "-----Time per Output Token (excl. 1st token)------" in lines
    assert f"{'P99 TTFT (ms):':<40} {298.0:<10.2f}" in lines
    assert lines[-1] == "=" * 50

    m2 = calculate_metrics(OUTPUTS, duration=2.0, percentiles=[50, 99.9], goodput_slo_ms={"ttft": 250})
    text2 = format_summary(m2, ["ttft", "e2el"], [50, 99.9], max_concurrency=16, request_rate=4.0,
                           show_goodput=True)
    labels2 = [line.split(":")[0] for line in text2.splitlines()]
    assert labels2[3:5] == ["Maximum request concurrency", "Request rate configured (RPS)"]
    assert "Request goodput (req/s)" in labels2 and "P99.9 E2EL (ms)" in labels2
    assert "Mean ITL (ms)" not in labels2
