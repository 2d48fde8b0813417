"""PrometheusStatLogger fed with hand-built stats: names, types, labels and buckets
against the real vLLM 0.32 captures, and exact values after known records."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from inference_worker.engine.stats import (
    CacheConfigInfo,
    FinishedRequestStats,
    IterationStats,
    PrefixCacheStats,
    SchedulerStats,
)
from inference_worker.engine.types import FinishReason
from inference_worker.metrics import buckets
from inference_worker.metrics.prometheus import PrometheusStatLogger

# Real vLLM 0.32.0 /metrics captures (CPU build serving SmolLM2-135M): idle, 20 running,
# and 4 running + 8 waiting. Copied verbatim from the project's shared reference material.
FIXTURES = Path(__file__).resolve().parent / "fixtures"
FIXTURE_FILES = sorted(FIXTURES.glob("vllm-0.32-*.txt"))
assert len(FIXTURE_FILES) == 3, f"the vLLM captures are missing from {FIXTURES}"

# The families the issue names (exposed names; counters keep their _total here).
REQUIRED = [
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:num_preemptions_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:request_success_total",
    "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens",
    "vllm:request_max_num_generation_tokens",
    "vllm:request_params_max_tokens",
    "vllm:request_params_n",
    "vllm:iteration_tokens_total",
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:request_time_per_output_token_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
    "vllm:request_inference_time_seconds",
    "vllm:cache_config_info",
]
# vLLM 0.32 families this engine deliberately leaves out, and why.
NOT_APPLICABLE = {
    "vllm:estimated_flops_per_gpu": "MFU estimates (--enable-mfu-metrics) are not computed here",
    "vllm:estimated_read_bytes_per_gpu": "MFU estimates are not computed here",
    "vllm:estimated_write_bytes_per_gpu": "MFU estimates are not computed here",
    "vllm:admission_rejections": "this engine has no admission queue limit to reject against",
}
LEGACY = [
    "vllm:gpu_cache_usage_perc",
    "vllm:num_requests_swapped",
    "vllm:gpu_prefix_cache_queries_total",
    "vllm:gpu_prefix_cache_hits_total",
    "vllm:time_per_output_token_seconds",
]
CACHE = CacheConfigInfo(block_size=16, num_gpu_blocks=512, enable_prefix_caching=True)


def families(text: str) -> dict[str, object]:
    """name -> family, keyed by the parser's family name (counters lose _total)."""
    return {f.name: f for f in text_string_to_metric_families(text)}


def exposed_name(family) -> str:
    return f"{family.name}_total" if family.type == "counter" else family.name


def label_names(family) -> set[str]:
    names: set[str] = set()
    for sample in family.samples:
        if sample.name.endswith("_created"):
            continue
        names |= set(sample.labels) - {"le", "quantile"}
    return names


def bucket_bounds(family) -> list[str]:
    seen = []
    for sample in family.samples:
        if sample.name.endswith("_bucket"):
            le = sample.labels["le"]
            if le not in seen:
                seen.append(le)
    return seen


def by_exposed(text: str) -> dict[str, object]:
    """vllm: families by exposed name; `*_created` twins (timestamps prometheus_client adds) left out."""
    return {
        exposed_name(f): f
        for f in text_string_to_metric_families(text)
        if f.name.startswith("vllm:") and not f.name.endswith("_created")
    }


def make_logger(**kwargs) -> tuple[PrometheusStatLogger, CollectorRegistry]:
    registry = CollectorRegistry()
    logger = PrometheusStatLogger(registry, "smollm2", 2048, CACHE, **kwargs)
    return logger, registry


def scrape(registry: CollectorRegistry) -> dict[str, object]:
    return by_exposed(generate_latest(registry).decode())


def value(fams: dict, name: str, sample_name: str | None = None, **labels) -> float:
    fam = fams[name]
    wanted = sample_name or name
    for sample in fam.samples:
        if sample.name == wanted and all(sample.labels.get(k) == v for k, v in labels.items()):
            return sample.value
    raise KeyError(f"{wanted} {labels}")


@pytest.fixture(scope="module")
def ours() -> dict[str, object]:
    _, registry = make_logger()
    return scrape(registry)


@pytest.mark.parametrize("fixture_file", FIXTURE_FILES, ids=lambda p: p.name)
def test_required_families_match_real_vllm(fixture_file: Path, ours: dict) -> None:
    real = by_exposed(fixture_file.read_text())
    for name in REQUIRED:
        assert name in real, f"{name} missing from the real capture"
        assert name in ours, f"{name} missing from our /metrics"
        assert ours[name].type == real[name].type, name
        if name == "vllm:cache_config_info":
            continue  # compared in the next test
        assert label_names(ours[name]) == label_names(real[name]), name


@pytest.mark.parametrize("fixture_file", FIXTURE_FILES, ids=lambda p: p.name)
def test_every_applicable_vllm_family_is_exposed_alike(fixture_file: Path, ours: dict) -> None:
    real = by_exposed(fixture_file.read_text())
    skipped = {f"{n}_total" for n in NOT_APPLICABLE}
    for name, fam in real.items():
        if name in skipped:
            assert name not in ours
            continue
        assert name in ours, f"{name} (in vLLM 0.32) missing from our /metrics"
        assert ours[name].type == fam.type, name
        if name == "vllm:cache_config_info":
            # vLLM stringifies its whole CacheConfig (mamba, offloading, ...); ours labels the fields
            # it shares with vLLM, among them the ones routers read (GIE: block_size, num_gpu_blocks).
            assert {"block_size", "num_gpu_blocks", "enable_prefix_caching", "engine"} <= label_names(
                ours[name]
            )
            assert label_names(ours[name]) <= label_names(fam)
            continue
        assert label_names(ours[name]) == label_names(fam), name
        if fam.type == "histogram":
            assert bucket_bounds(ours[name]) == bucket_bounds(fam), f"{name} buckets differ"
        if name == "vllm:request_success_total":
            reasons = {s.labels["finished_reason"] for s in ours[name].samples}
            assert reasons == {s.labels["finished_reason"] for s in fam.samples}


def test_request_token_buckets_follow_max_model_len() -> None:
    assert buckets.request_tokens(2048) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]
    assert buckets.request_tokens(100) == [1, 2, 5, 10, 20, 50, 100]
    registry2 = CollectorRegistry()
    PrometheusStatLogger(registry2, "m", 300, CACHE)
    fam = scrape(registry2)["vllm:request_prompt_tokens"]
    assert bucket_bounds(fam) == ["1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "100.0", "200.0", "+Inf"]


def test_legacy_aliases_present_with_help_and_hidden_on_request() -> None:
    _, registry = make_logger()
    text = generate_latest(registry).decode()
    fams = by_exposed(text)
    for name in LEGACY:
        assert name in fams, name
        assert "compatibility alias" in fams[name].documentation.lower(), name
        assert "vllm:" in fams[name].documentation.split("alias", 1)[1], f"{name} names no replacement"
    assert fams["vllm:gpu_prefix_cache_queries_total"].type == "counter"
    assert fams["vllm:time_per_output_token_seconds"].type == "histogram"
    _, hidden_registry = make_logger(show_legacy=False)
    hidden = scrape(hidden_registry)
    for name in LEGACY:
        assert name not in hidden
    assert "vllm:kv_cache_usage_perc" in hidden


def finished(reason: FinishReason, **kw) -> FinishedRequestStats:
    defaults = dict(
        e2e_latency=1.25,
        num_prompt_tokens=30,
        num_generation_tokens=8,
        max_tokens_param=8,
        queued_time=0.05,
        prefill_time=0.2,
        inference_time=1.1,
        decode_time=0.9,
        mean_time_per_output_token=0.9 / 7,
        num_preemptions=0,
        num_cached_tokens=16,
    )
    defaults.update(kw)
    return FinishedRequestStats(finish_reason=reason, **defaults)


def test_record_counts_exactly() -> None:
    logger, registry = make_logger()
    step1 = SchedulerStats(
        num_running_reqs=2,
        num_waiting_reqs=3,
        kv_cache_usage=0.25,
        prefix_cache_stats=PrefixCacheStats(requests=2, queries=60, hits=16),
    )
    it1 = IterationStats(
        iteration_timestamp=1.0,
        num_prompt_tokens=60,
        num_cached_prompt_tokens=16,
        num_generation_tokens=2,
        time_to_first_tokens_iter=[0.3, 0.35],
    )
    logger.record(step1, it1)
    step2 = SchedulerStats(num_running_reqs=1, num_waiting_reqs=0, kv_cache_usage=0.5)
    it2 = IterationStats(
        iteration_timestamp=1.1,
        num_generation_tokens=2,
        num_preempted_reqs=1,
        inter_token_latencies_iter=[0.02, 0.2],
        finished_requests=[
            finished(FinishReason.STOP),
            finished(FinishReason.LENGTH, max_tokens_param=None, num_preemptions=2),
            finished(FinishReason.ABORT, num_generation_tokens=1, num_cached_tokens=0),
        ],
    )
    logger.record(step2, it2)
    logger.record(SchedulerStats(), None)  # idle: gauges drop, counters stay
    fams = scrape(registry)
    lbl = {"engine": "0", "model_name": "smollm2"}

    assert value(fams, "vllm:num_requests_running", **lbl) == 0
    assert value(fams, "vllm:prompt_tokens_total", **lbl) == 60
    assert value(fams, "vllm:generation_tokens_total", **lbl) == 4
    assert value(fams, "vllm:prompt_tokens_by_source_total", source="local_cache_hit") == 16
    assert value(fams, "vllm:prompt_tokens_by_source_total", source="local_compute") == 44
    assert value(fams, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == 0
    assert value(fams, "vllm:prefix_cache_queries_total") == 60
    assert value(fams, "vllm:prefix_cache_hits_total") == 16
    assert value(fams, "vllm:prompt_tokens_cached_total") == 16
    assert value(fams, "vllm:gpu_prefix_cache_queries_total") == 60
    assert value(fams, "vllm:gpu_prefix_cache_hits_total") == 16
    assert value(fams, "vllm:num_preemptions_total") == 1
    for reason, count in (("stop", 1), ("length", 1), ("abort", 1), ("error", 0), ("repetition", 0)):
        assert value(fams, "vllm:request_success_total", finished_reason=reason) == count, reason

    def count(name: str) -> float:
        return value(fams, name, f"{name}_count")

    def total(name: str) -> float:
        return value(fams, name, f"{name}_sum")

    assert count("vllm:iteration_tokens_total") == 2  # the idle record has no IterationStats
    assert total("vllm:iteration_tokens_total") == 64
    assert count("vllm:time_to_first_token_seconds") == 2
    assert total("vllm:time_to_first_token_seconds") == pytest.approx(0.65)
    assert count("vllm:inter_token_latency_seconds") == 2
    assert count("vllm:time_per_output_token_seconds") == 2
    assert total("vllm:time_per_output_token_seconds") == pytest.approx(0.22)
    for name in (
        "vllm:e2e_request_latency_seconds",
        "vllm:request_queue_time_seconds",
        "vllm:request_prefill_time_seconds",
        "vllm:request_decode_time_seconds",
        "vllm:request_inference_time_seconds",
        "vllm:request_time_per_output_token_seconds",
        "vllm:request_prompt_tokens",
        "vllm:request_generation_tokens",
        "vllm:request_max_num_generation_tokens",
        "vllm:request_params_n",
        "vllm:request_num_preemptions",
        "vllm:request_prefill_kv_computed_tokens",
    ):
        assert count(name) == 3, name
    # max_tokens is observed only when the client set it (one request left it unset).
    assert count("vllm:request_params_max_tokens") == 2
    assert total("vllm:request_generation_tokens") == 17
    assert total("vllm:request_num_preemptions") == 2
    assert total("vllm:request_prefill_kv_computed_tokens") == 14 + 14 + 30
    # Bucket placement: 0.02 s falls in le=0.025, 0.2 s in le=0.2 (cumulative counts).
    itl = "vllm:inter_token_latency_seconds"
    assert value(fams, itl, f"{itl}_bucket", le="0.01") == 0
    assert value(fams, itl, f"{itl}_bucket", le="0.025") == 1
    assert value(fams, itl, f"{itl}_bucket", le="0.2") == 2


def test_gauges_and_v0_alias_follow_the_last_step() -> None:
    logger, registry = make_logger()
    logger.record(SchedulerStats(num_running_reqs=2, num_waiting_reqs=4, kv_cache_usage=0.75), None)
    fams = scrape(registry)
    assert value(fams, "vllm:num_requests_running") == 2
    assert value(fams, "vllm:num_requests_waiting") == 4
    assert value(fams, "vllm:num_requests_waiting_by_reason", reason="capacity") == 4
    assert value(fams, "vllm:num_requests_waiting_by_reason", reason="deferred") == 0
    assert value(fams, "vllm:kv_cache_usage_perc") == 0.75
    assert value(fams, "vllm:gpu_cache_usage_perc") == 0.75
    assert value(fams, "vllm:num_requests_swapped") == 0
    assert value(fams, "vllm:engine_sleep_state", sleep_state="awake") == 1


def test_cache_config_info_labels() -> None:
    _, registry = make_logger()
    fam = scrape(registry)["vllm:cache_config_info"]
    (sample,) = fam.samples
    assert sample.value == 1
    assert sample.labels["block_size"] == "16"
    assert sample.labels["num_gpu_blocks"] == "512"
    assert sample.labels["enable_prefix_caching"] == "True"
    assert sample.labels["engine"] == "0"
    assert sample.labels["kv_cache_size_tokens"] == str(16 * 512)


def test_gpu_memory_gauges_only_with_a_reading() -> None:
    _, registry = make_logger(gpu_memory=lambda: (3 * 2**30, 80 * 2**30))
    fams = scrape(registry)
    assert value(fams, "vllm:gpu_memory_used_bytes") == 3 * 2**30
    assert value(fams, "vllm:gpu_memory_total_bytes") == 80 * 2**30
    _, cpu_registry = make_logger()
    assert "vllm:gpu_memory_used_bytes" not in scrape(cpu_registry)


def test_several_loggers_in_one_process_do_not_collide() -> None:
    a, reg_a = make_logger()
    _, reg_b = make_logger()
    a.record(SchedulerStats(num_running_reqs=5), IterationStats(0, num_generation_tokens=3))
    assert value(scrape(reg_a), "vllm:generation_tokens_total") == 3
    assert value(scrape(reg_b), "vllm:generation_tokens_total") == 0
