"""Publish the engine's stats as vLLM-compatible Prometheus metrics.

Family names, types, label names (`engine`, `model_name`, plus `finished_reason`,
`reason`, `source`, `sleep_state` where vLLM has them), HELP texts and bucket
boundaries follow a real vLLM 0.32 `/metrics` capture (shared/fixtures/), so any
router or dashboard that understands vLLM understands this worker.

This logger only *reads* the stats dataclasses the engine fills (collecting and
publishing stay apart, as in vLLM v1). `record` runs on the engine thread after
each step; prometheus_client's metric objects are thread-safe, and `/metrics`
renders the per-app `CollectorRegistry` on the event loop.

The v0 compatibility aliases (`vllm:gpu_cache_usage_perc`, `vllm:num_requests_swapped`,
`vllm:gpu_prefix_cache_{queries,hits}_total`, `vllm:time_per_output_token_seconds`)
are registered unless `show_legacy=False` (`--hide-legacy-metrics`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from inference_worker.engine.stats import (
    CacheConfigInfo,
    FinishedRequestStats,
    IterationStats,
    SchedulerStats,
)
from inference_worker.engine.types import FinishReason
from inference_worker.metrics import buckets

# vLLM's FINISH_REASON_STRINGS plus "repetition"; all pre-created at 0 like vLLM does.
FINISHED_REASON_LABELS = ("stop", "length", "abort", "error", "repetition")
BASE_LABELS = ("engine", "model_name")


class PrometheusStatLogger:
    """A `StatLogger` that keeps vLLM-named metrics in `registry`."""

    def __init__(
        self,
        registry: CollectorRegistry,
        model_name: str,
        max_model_len: int,
        cache_config: CacheConfigInfo,
        *,
        engine_index: int = 0,
        show_legacy: bool = True,
        gpu_memory: Callable[[], tuple[int, int] | None] | None = None,
    ) -> None:
        self.registry = registry
        labels = {"engine": str(engine_index), "model_name": model_name}
        self._labels = labels
        token_buckets = buckets.request_tokens(max_model_len)

        def gauge(name: str, doc: str, extra: tuple[str, ...] = ()) -> Gauge:
            return Gauge(name, doc, (*BASE_LABELS, *extra), registry=registry)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, (*BASE_LABELS, *extra), registry=registry)

        def histogram(name: str, doc: str, bounds: Iterable[float]) -> Histogram:
            return Histogram(name, doc, BASE_LABELS, buckets=list(bounds), registry=registry).labels(**labels)

        # --- scheduler state (gauges) ---
        self.num_requests_running = gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches."
        ).labels(**labels)
        self.num_requests_waiting = gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed."
        ).labels(**labels)
        waiting_by_reason = gauge(
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling "
            "capacity; 'deferred' = deferred by transient constraints (LoRA budget, KV transfer, "
            "blocked status). Sum of all reasons equals vllm:num_requests_waiting.",
            ("reason",),
        )
        # This engine has no deferring constraint: every waiting request waits for capacity.
        self.num_requests_waiting_capacity = waiting_by_reason.labels(**labels, reason="capacity")
        waiting_by_reason.labels(**labels, reason="deferred").set(0)
        sleep_state = gauge(
            "vllm:engine_sleep_state",
            "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; "
            "weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.",
            ("sleep_state",),
        )
        # The engine has no sleep mode: it is always awake.
        for state, value in (("awake", 1), ("weights_offloaded", 0), ("discard_all", 0)):
            sleep_state.labels(**labels, sleep_state=state).set(value)
        self.kv_cache_usage = gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."
        ).labels(**labels)

        # --- counters ---
        self.prefix_cache_queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        ).labels(**labels)
        self.prefix_cache_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        ).labels(**labels)
        # No KV connector and no multimodal input here: these stay 0, as on a vLLM without them.
        for name, doc in (
            (
                "vllm:external_prefix_cache_queries",
                "External prefix cache queries from KV connector cross-instance cache sharing, "
                "in terms of number of queried tokens.",
            ),
            (
                "vllm:external_prefix_cache_hits",
                "External prefix cache hits from KV connector cross-instance cache sharing, "
                "in terms of number of cached tokens.",
            ),
            ("vllm:mm_cache_queries", "Multi-modal cache queries, in terms of number of queried items."),
            ("vllm:mm_cache_hits", "Multi-modal cache hits, in terms of number of cached items."),
        ):
            counter(name, doc).labels(**labels)
        self.num_preemptions = counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine."
        ).labels(**labels)
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.").labels(
            **labels
        )
        by_source = counter("vllm:prompt_tokens_by_source", "Number of prompt tokens by source.", ("source",))
        self.prompt_tokens_local_compute = by_source.labels(**labels, source="local_compute")
        self.prompt_tokens_local_cache_hit = by_source.labels(**labels, source="local_cache_hit")
        by_source.labels(**labels, source="external_kv_transfer")
        self.prompt_tokens_cached = counter(
            "vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external)."
        ).labels(**labels)
        cached_by_source = counter(
            "vllm:prompt_tokens_cached_by_source",
            "Prefix-cache hit tokens by the cache tier that supplied them: device (local HBM), host "
            "(offloaded to DRAM), disk, p2p (transferred from another vLLM instance) or "
            "external_unspecified. Counted at admission; sums to vllm:prefix_cache_hits + "
            "vllm:external_prefix_cache_hits.",
            ("source",),
        )
        # Our only cache tier is the KV pool itself ("device").
        self.prompt_tokens_cached_device = cached_by_source.labels(**labels, source="device")
        for tier in ("host", "p2p", "disk", "external_unspecified"):
            cached_by_source.labels(**labels, source=tier)
        self.generation_tokens = counter(
            "vllm:generation_tokens", "Number of generation tokens processed."
        ).labels(**labels)
        success = counter(
            "vllm:request_success", "Count of successfully processed requests.", ("finished_reason",)
        )
        self.request_success = {
            reason: success.labels(**labels, finished_reason=reason) for reason in FINISHED_REASON_LABELS
        }

        # --- histograms ---
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", token_buckets
        )
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", token_buckets
        )
        self.iteration_tokens = histogram(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            buckets.ITERATION_TOKENS,
        )
        self.request_max_num_generation_tokens = histogram(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            token_buckets,
        )
        self.request_params_n = histogram(
            "vllm:request_params_n", "Histogram of the n request parameter.", buckets.REQUEST_PARAMS_N
        )
        self.request_params_max_tokens = histogram(
            "vllm:request_params_max_tokens",
            "Histogram of the max_tokens request parameter.",
            token_buckets,
        )
        self.time_to_first_token = histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            buckets.TIME_TO_FIRST_TOKEN,
        )
        self.inter_token_latency = histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            buckets.INTER_TOKEN_LATENCY,
        )
        self.request_time_per_output_token = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            buckets.INTER_TOKEN_LATENCY,
        )
        latency = buckets.REQUEST_LATENCY
        self.e2e_request_latency = histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", latency
        )
        self.request_queue_time = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            latency,
        )
        self.request_inference_time = histogram(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            latency,
        )
        self.request_prefill_time = histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            latency,
        )
        self.request_decode_time = histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            latency,
        )
        self.request_num_preemptions = histogram(
            "vllm:request_num_preemptions",
            "Histogram of the number of times a request was preempted.",
            buckets.REQUEST_NUM_PREEMPTIONS,
        )
        self.request_prefill_kv_computed_tokens = histogram(
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
            token_buckets,
        )

        # --- static info ---
        info_labels = cache_config_labels(cache_config, engine_index)
        Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            tuple(info_labels),
            registry=registry,
        ).labels(**info_labels).set(1)

        self.legacy: _LegacyAliases | None = _LegacyAliases(registry, labels) if show_legacy else None
        if gpu_memory is not None:
            registry.register(GpuMemoryCollector(gpu_memory, labels))

    # ------------------------------------------------------------------ StatLogger

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats | None) -> None:
        self.num_requests_running.set(scheduler_stats.num_running_reqs)
        self.num_requests_waiting.set(scheduler_stats.num_waiting_reqs)
        self.num_requests_waiting_capacity.set(scheduler_stats.num_waiting_reqs)
        self.kv_cache_usage.set(scheduler_stats.kv_cache_usage)
        prefix = scheduler_stats.prefix_cache_stats
        if prefix.queries:
            self.prefix_cache_queries.inc(prefix.queries)
        if prefix.hits:
            self.prefix_cache_hits.inc(prefix.hits)
            self.prompt_tokens_cached.inc(prefix.hits)
            self.prompt_tokens_cached_device.inc(prefix.hits)
        legacy = self.legacy
        if legacy is not None:
            legacy.record_scheduler(scheduler_stats)

        if iteration_stats is None:
            return
        it = iteration_stats
        if it.num_prompt_tokens:
            self.prompt_tokens.inc(it.num_prompt_tokens)
            cached = min(it.num_cached_prompt_tokens, it.num_prompt_tokens)
            self.prompt_tokens_local_cache_hit.inc(cached)
            self.prompt_tokens_local_compute.inc(it.num_prompt_tokens - cached)
        if it.num_generation_tokens:
            self.generation_tokens.inc(it.num_generation_tokens)
        if it.num_preempted_reqs:
            self.num_preemptions.inc(it.num_preempted_reqs)
        # vLLM's frontend builds an IterationStats only for an engine step that returned outputs,
        # i.e. produced a token: a step that only ran non-final prefill chunks (or only aborts)
        # is no observation at all, not an observation of 0, so that sum/count stays the mean
        # tokens of a step that produced tokens, as on vLLM.
        if it.num_generation_tokens:
            self.iteration_tokens.observe(it.num_prompt_tokens + it.num_generation_tokens)
        for ttft in it.time_to_first_tokens_iter:
            self.time_to_first_token.observe(ttft)
        itl = self.inter_token_latency
        for gap in it.inter_token_latencies_iter:
            itl.observe(gap)
        if legacy is not None:
            legacy.record_inter_token_latencies(it.inter_token_latencies_iter)
        for finished in it.finished_requests:
            self._record_finished(finished)

    def _record_finished(self, f: FinishedRequestStats) -> None:
        reason = f.finish_reason.value if isinstance(f.finish_reason, FinishReason) else str(f.finish_reason)
        counter = self.request_success.get(reason)
        if counter is None:  # a reason vLLM does not know; count it as an error
            counter = self.request_success["error"]
        counter.inc()
        self.e2e_request_latency.observe(f.e2e_latency)
        self.request_queue_time.observe(f.queued_time)
        self.request_prefill_time.observe(f.prefill_time)
        self.request_inference_time.observe(f.inference_time)
        self.request_decode_time.observe(f.decode_time)
        self.request_prompt_tokens.observe(f.num_prompt_tokens)
        self.request_generation_tokens.observe(f.num_generation_tokens)
        self.request_time_per_output_token.observe(f.mean_time_per_output_token)
        if f.n_param is not None:  # once per request, also with n > 1 (see FinishedRequestStats)
            self.request_params_n.observe(f.n_param)
            longest = f.max_num_generation_tokens
            self.request_max_num_generation_tokens.observe(
                f.num_generation_tokens if longest is None else longest
            )
        if f.max_tokens_param:  # as vLLM: not a 0 (completions' echo with max_tokens 0)
            self.request_params_max_tokens.observe(f.max_tokens_param)
        self.request_num_preemptions.observe(f.num_preemptions)
        self.request_prefill_kv_computed_tokens.observe(max(f.num_prompt_tokens - f.num_cached_tokens, 0))

    def log(self) -> None:
        """Nothing to print: Prometheus pulls."""


def cache_config_labels(cache_config: CacheConfigInfo, engine_index: int) -> dict[str, str]:
    """The cache-config fields vLLM 0.32 also labels (stringified like its `metrics_info()`), sorted.

    (`swap_space` is left out: vLLM v1 removed it.)
    """
    values: dict[str, object] = {
        "block_size": cache_config.block_size,
        "cache_dtype": cache_config.cache_dtype,
        "enable_prefix_caching": cache_config.enable_prefix_caching,
        "engine": engine_index,
        "gpu_memory_utilization": cache_config.gpu_memory_utilization,
        "kv_cache_size_tokens": cache_config.block_size * cache_config.num_gpu_blocks,
        "num_cpu_blocks": cache_config.num_cpu_blocks or None,
        "num_gpu_blocks": cache_config.num_gpu_blocks,
    }
    return {key: str(values[key]) for key in sorted(values)}


class _LegacyAliases:
    """vLLM v0 names that routers still probe; each HELP names its replacement."""

    def __init__(self, registry: CollectorRegistry, labels: dict[str, str]) -> None:
        self.gpu_cache_usage = Gauge(
            "vllm:gpu_cache_usage_perc",
            "Compatibility alias (vLLM v0): GPU KV-cache usage, 1 means 100 percent. "
            "Use vllm:kv_cache_usage_perc instead.",
            BASE_LABELS,
            registry=registry,
        ).labels(**labels)
        Gauge(
            "vllm:num_requests_swapped",
            "Compatibility alias (vLLM v0): requests swapped to CPU, always 0 (this engine preempts "
            "by recompute and never swaps). Replaced by vllm:num_preemptions_total.",
            BASE_LABELS,
            registry=registry,
        ).labels(**labels).set(0)
        self.gpu_prefix_cache_queries = Counter(
            "vllm:gpu_prefix_cache_queries",
            "Compatibility alias (vLLM 0.8): prefix cache queries in tokens. "
            "Use vllm:prefix_cache_queries_total instead.",
            BASE_LABELS,
            registry=registry,
        ).labels(**labels)
        self.gpu_prefix_cache_hits = Counter(
            "vllm:gpu_prefix_cache_hits",
            "Compatibility alias (vLLM 0.8): prefix cache hits in tokens. "
            "Use vllm:prefix_cache_hits_total instead.",
            BASE_LABELS,
            registry=registry,
        ).labels(**labels)
        self.time_per_output_token = Histogram(
            "vllm:time_per_output_token_seconds",
            "Compatibility alias (vLLM v0): same observations as vllm:inter_token_latency_seconds. "
            "Use vllm:inter_token_latency_seconds (per token gap) or "
            "vllm:request_time_per_output_token_seconds (per request mean) instead.",
            BASE_LABELS,
            buckets=list(buckets.INTER_TOKEN_LATENCY),
            registry=registry,
        ).labels(**labels)

    def record_scheduler(self, stats: SchedulerStats) -> None:
        self.gpu_cache_usage.set(stats.kv_cache_usage)
        prefix = stats.prefix_cache_stats
        if prefix.queries:
            self.gpu_prefix_cache_queries.inc(prefix.queries)
        if prefix.hits:
            self.gpu_prefix_cache_hits.inc(prefix.hits)

    def record_inter_token_latencies(self, gaps: list[float]) -> None:
        for gap in gaps:
            self.time_per_output_token.observe(gap)


class GpuMemoryCollector(Collector):
    """GPU memory used/total of the model's device, read at scrape time (on CUDA hosts only).

    `read` returns (used, total) bytes, or None when there is no accelerator. Not a vLLM
    family (vLLM leaves this to DCGM); named in vLLM's style so one scrape of the worker
    shows it beside the KV usage.
    """

    def __init__(self, read: Callable[[], tuple[int, int] | None], labels: dict[str, str]) -> None:
        self.read = read
        self.labels = labels

    def collect(self) -> Iterable[GaugeMetricFamily]:
        reading = self.read()
        if reading is None:
            return []
        used_bytes, total_bytes = reading
        names, values = list(self.labels), list(self.labels.values())
        used = GaugeMetricFamily(
            "vllm:gpu_memory_used_bytes",
            "GPU memory in use on the model's device (all processes), in bytes. "
            "Worker extension, not in vLLM.",
            labels=names,
        )
        used.add_metric(values, float(used_bytes))
        total = GaugeMetricFamily(
            "vllm:gpu_memory_total_bytes",
            "Total GPU memory of the model's device, in bytes. Worker extension, not in vLLM.",
            labels=names,
        )
        total.add_metric(values, float(total_bytes))
        return [used, total]
