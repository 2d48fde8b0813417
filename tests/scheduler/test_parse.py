"""Every dialect against fixtures: the real vLLM 0.32 captures (../shared/fixtures) and
hand-written ones for the other engines (tests/scheduler/fixtures, built from
metrics-reference.md sections 2-8)."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from scheduler.scrape import dialects
from scheduler.scrape.parse import parse_selected
from scheduler.scrape.rates import RateTracker, build_snapshot, counter_delta
from scheduler.scrape.snapshot import RawSample

# Hand-written fixtures, plus verbatim copies of the real vLLM 0.32 captures (vllm-0.32-*.txt).
HERE = Path(__file__).parent / "fixtures"


def load(name: str) -> tuple[str, RawSample]:
    text = (HERE / name).read_text()
    d = dialects.detect(text)
    assert d is not None, name
    return d.name, d.extract(parse_selected(text, d.wanted))


def test_vllm_real_idle():
    name, raw = load("vllm-0.32-cpu-idle.txt")
    assert name == "vllm_v1"
    assert (raw.running, raw.waiting, raw.kv_usage) == (0.0, 0.0, 0.0)
    assert (raw.block_size, raw.num_blocks) == (128, 728)
    assert raw.counters["prompt_tokens"] == 114.0
    assert raw.counters["ttft_count"] == 5.0


def test_vllm_real_running20():
    name, raw = load("vllm-0.32-cpu-running20.txt")
    assert name == "vllm_v1"
    assert (raw.running, raw.waiting) == (20.0, 0.0)
    assert raw.kv_usage == pytest.approx(0.02751031636863821)
    assert raw.counters["itl_sum"] == pytest.approx(25.09370271099965)
    assert raw.counters["itl_count"] == 359.0


def test_prefilled_tokens_are_the_computed_part_when_the_engine_splits_prompts_by_source():
    """The prefill backlog is charged only the uncached part of each prompt, so it must drain by
    the computed part: vLLM's prompt_tokens_by_source{source="local_compute"} where published
    (here a capture edited to show 300 of 454 prompt tokens served from the prefix cache)."""
    text = (HERE / "vllm-0.32-cpu-running20.txt").read_text()
    text = text.replace('source="local_compute"} 454.0', 'source="local_compute"} 154.0')
    text = text.replace('source="local_cache_hit"} 0.0', 'source="local_cache_hit"} 300.0')
    d = dialects.detect(text)
    raw = d.extract(parse_selected(text, d.wanted))
    assert raw.counters["prompt_tokens"] == 454.0
    assert build_snapshot(raw, {}, 1.0, 1.0, "vllm_v1").prefilled_tokens_total == 154.0
    # An engine without the split (vLLM V0 names here): whole prompts.
    _, v0 = load("vllm_v0.txt")
    assert v0.counters["prompt_tokens"] > 0
    assert build_snapshot(v0, {}, 1.0, 1.0, "vllm_v0").prefilled_tokens_total == v0.counters["prompt_tokens"]


def test_vllm_real_waiting():
    _, raw = load("vllm-0.32-cpu-running4-waiting8.txt")
    assert (raw.running, raw.waiting) == (4.0, 8.0)
    assert raw.waiting_deferred == 0.0  # all eight wait for capacity (reason="capacity")
    assert raw.counters["prefix_queries"] == 60.0
    assert raw.counters["prefix_hits"] == 0.0


def test_vllm_data_parallel_sums_engines():
    name, raw = load("vllm_dp2.txt")
    assert name == "vllm_v1"
    assert (raw.running, raw.waiting) == (16.0, 3.0)
    assert raw.kv_usage == pytest.approx(0.6)  # averaged, as vLLM's aggregated log line does
    assert raw.num_blocks == 2000 and raw.block_size == 16
    assert raw.counters["prompt_tokens"] == 150.0
    assert raw.counters["prefix_hits"] == 60.0


def test_vllm_v0():
    name, raw = load("vllm_v0.txt")
    assert name == "vllm_v0"
    assert (raw.running, raw.waiting, raw.kv_usage) == (6.0, 2.0, 0.62)
    assert raw.prefix_hit_rate == 0.4
    assert raw.counters["itl_count"] == 800.0  # from time_per_output_token_seconds
    assert raw.num_blocks == 2000


def test_triton_vllm_backend():
    name, raw = load("triton_vllm.txt")
    assert name == "triton_vllm"
    assert (raw.running, raw.waiting, raw.kv_usage) == (3.0, 1.0, 0.4)
    assert raw.counters["itl_sum"] == pytest.approx(0.95)


@pytest.mark.parametrize(
    ("fixture", "dialect"), [("sglang_colon.txt", "sglang"), ("sglang_underscore.txt", "sglang_")]
)
def test_sglang(fixture, dialect):
    name, raw = load(fixture)
    assert name == dialect
    assert raw.running == 12.0  # dp ranks summed, tp_rank 1 duplicate ignored
    assert raw.waiting == 3.0
    assert raw.kv_usage == pytest.approx(0.4)
    assert (raw.block_size, raw.num_blocks) == (1, 200000)
    assert raw.counters["prompt_tokens"] == 4000.0  # realtime prefill_compute + prefill_cache
    assert raw.counters["prompt_tokens_computed"] == 3000.0  # prefill_compute alone
    assert raw.counters["generation_tokens"] == 9500.0  # realtime decode
    assert raw.counters["prefix_hits"] == 1000.0
    assert raw.counters["ttft_count"] == 10.0


def test_tgi():
    name, raw = load("tgi.txt")
    assert name == "tgi"
    assert (raw.running, raw.waiting, raw.kv_usage) == (12.0, 3.0, None)
    assert raw.counters["prompt_tokens"] == 21000.0
    assert raw.counters["itl_sum"] == pytest.approx(4.2)


def test_triton_core():
    name, raw = load("triton.txt")
    assert name == "triton"
    assert raw.waiting == 7.0
    assert raw.counters["ttft_sum"] == pytest.approx(8.0)  # ms -> s


def test_trtllm():
    name, raw = load("trtllm.txt")
    assert name == "trtllm"
    assert (raw.running, raw.waiting, raw.kv_usage) == (9.0, 4.0, 0.25)
    assert (raw.block_size, raw.num_blocks) == (64, 4000)
    assert raw.counters["generation_tokens"] == 3000.0


def test_trtllm_old_build_without_fraction():
    text = (HERE / "trtllm.txt").read_text()
    text = "\n".join(line for line in text.splitlines() if "fraction" not in line and "waiting" not in line)
    raw = dialects.TRTLLM.extract(parse_selected(text, dialects.TRTLLM.wanted))
    assert raw.kv_usage == pytest.approx(0.25)  # used / max
    assert raw.waiting == 2.0  # falls back to Triton's pending count


def test_bladellm():
    name, raw = load("bladellm.txt")
    assert name == "bladellm"
    assert (raw.running, raw.waiting, raw.kv_usage) == (14.5, 2.0, 0.7)
    assert (raw.prompt_tps, raw.gen_tps) == (1000.0, 500.0)


def test_unknown_text_has_no_dialect():
    assert dialects.detect("process_cpu_seconds_total 3.0\n") is None


def test_counter_reset_delta():
    assert counter_delta(100.0, 150.0) == 50.0
    assert counter_delta(100.0, 7.0) == 7.0  # restarted from zero


def test_rates_over_a_reset():
    tracker = RateTracker(tau_s=1e-9)  # no smoothing: each update is the interval's rate
    raw = RawSample(running=0.0, waiting=0.0, counters={"generation_tokens": 1000.0})
    tracker.update(raw, 10.0)
    raw.counters = {"generation_tokens": 1100.0}
    assert tracker.update(raw, 11.0)["generation_tokens"] == pytest.approx(100.0)
    raw.counters = {"generation_tokens": 30.0}  # worker restarted
    assert tracker.update(raw, 12.0)["generation_tokens"] == pytest.approx(30.0)
    raw.counters = {"generation_tokens": 90.0}
    assert tracker.update(raw, 12.5)["generation_tokens"] == pytest.approx(120.0)


def test_snapshot_histogram_means_and_hit_rate():
    tracker = RateTracker(tau_s=1e-9)
    c0 = {"ttft_sum": 1.0, "ttft_count": 10.0, "prefix_hits": 0.0, "prefix_queries": 0.0}
    tracker.update(RawSample(counters=c0), 0.0)
    c1 = {"ttft_sum": 3.0, "ttft_count": 14.0, "prefix_hits": 30.0, "prefix_queries": 120.0}
    raw = RawSample(running=2.0, waiting=1.0, kv_usage=1.3, counters=c1)
    snap = build_snapshot(raw, tracker.update(raw, 1.0), 1.0, 0.0, "vllm_v1")
    assert snap.ttft_mean_s == pytest.approx(0.5)  # 2 s over 4 new requests
    assert snap.prefix_hit_rate == pytest.approx(0.25)
    assert snap.kv_usage == 1.0  # clamped


def test_vllm_deferred_waits_are_told_apart():
    """Requests vLLM holds for a LoRA budget or a KV transfer (reason="deferred") are waiting,
    but do not show the engine at its running cap."""
    text = (HERE / "vllm-0.32-cpu-running4-waiting8.txt").read_text()
    text = text.replace('reason="capacity"} 8.0', 'reason="capacity"} 5.0').replace(
        'reason="deferred"} 0.0', 'reason="deferred"} 3.0')
    raw = dialects.VLLM_V1.extract(parse_selected(text, dialects.VLLM_V1.wanted))
    assert (raw.waiting, raw.waiting_deferred) == (8.0, 3.0)
    assert build_snapshot(raw, {}, 1.0, 1.0, "vllm_v1").waiting_deferred == 3.0


def test_nan_and_infinite_values_are_no_load_figure_and_do_not_poison_the_rates():
    """An engine that exports NaN (a ratio over nothing) or +Inf for a gauge or a counter: the
    sample is dropped, as if absent. Kept, a NaN KV usage would pass every `>=` check of the
    policy, and one NaN counter value would turn its smoothed rate into NaN for good."""
    text = (HERE / "vllm-0.32-cpu-running20.txt").read_text()
    name = "vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"smollm2\"} "
    assert name in text
    tracker = RateTracker(tau_s=1e-9)
    good = dialects.VLLM_V1.extract(parse_selected(text, dialects.VLLM_V1.wanted))
    tracker.update(good, 0.0)
    poisoned = re.sub(r"(vllm:kv_cache_usage_perc\{[^}]*\}) \S+", r"\1 NaN", text)
    poisoned = re.sub(r"(vllm:generation_tokens_total\{[^}]*\}) \S+", r"\1 +Inf", poisoned)
    raw = dialects.VLLM_V1.extract(parse_selected(poisoned, dialects.VLLM_V1.wanted))
    assert raw.kv_usage is None and "generation_tokens" not in raw.counters
    tracker.update(raw, 1.0)
    for t in (2.0, 3.0):  # the counter is back: a rate again from the next pair of scrapes
        tokens = good.counters["generation_tokens"] + 50.0 * t
        rates = tracker.update(RawSample(counters={**good.counters, "generation_tokens": tokens}), t)
        assert all(math.isfinite(v) for v in rates.values()), rates
    assert rates["generation_tokens"] == pytest.approx(50.0)
