"""The one normalised view of a worker's load, whatever engine it runs."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(slots=True)
class RawSample:
    """What one scrape says, before rates: gauges as read, counters as cumulative totals."""

    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None  # 0-1
    block_size: int | None = None  # tokens per KV block
    num_blocks: int | None = None  # KV blocks in the pool
    # KV tokens in use (or reserved), from an engine that publishes that count but not its
    # pool size (TGI's tgi_batch_current_max_tokens): usage needs the capacity from elsewhere.
    used_tokens: float | None = None
    # Cumulative counters by canonical key: prompt_tokens, generation_tokens, prefix_hits,
    # prefix_queries, ttft_sum, ttft_count, itl_sum, itl_count.
    counters: dict[str, float] = field(default_factory=dict)
    # The series each of those sums, by label set (empty: the total is the only series known). A
    # rate is the sum of its series' rates: one series reset or gone is not the whole sum's.
    counter_series: dict[str, dict[frozenset[tuple[str, str]], float]] = field(default_factory=dict)
    # Rates some engines publish directly as gauges (BladeLLM, SGLang gen_throughput).
    prompt_tps: float | None = None
    gen_tps: float | None = None
    prefix_hit_rate: float | None = None  # gauge form (vLLM v0, SGLang cache_hit_rate)
    # Waiting requests held by a transient constraint (LoRA budget, KV transfer), not by the
    # engine's capacity: vLLM's num_requests_waiting_by_reason{reason="deferred"}.
    waiting_deferred: float | None = None


@dataclass(slots=True)
class LoadSnapshot:
    running: float
    waiting: float
    kv_usage: float | None
    prompt_tps: float | None
    gen_tps: float | None
    prefix_hit_rate: float | None
    block_size: int | None
    num_blocks: int | None
    ttft_mean_s: float | None
    itl_mean_s: float | None
    # time.monotonic() when the scrape request was sent: leases issued after it are
    # load this snapshot cannot show yet.
    taken_at: float
    wall_time: float
    dialect: str
    # Cumulative prompt tokens the engine has finished prefilling (vLLM counts a request's
    # prompt when its first token comes out): the scheduler's prefill backlog drains by it.
    # Only the computed part where the engine tells it apart from prefix-cache hits (vLLM's
    # prompt_tokens_by_source{source="local_compute"}, SGLang's prefill_compute), as the
    # backlog is charged only the uncached part of each prompt; else whole prompts.
    prefilled_tokens_total: float | None = None
    prefill_tps: float | None = None  # smoothed rate of that counter
    # Of `waiting`, those held by a transient constraint rather than capacity (0: unknown or
    # none): they do not show the worker is at its running cap.
    waiting_deferred: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)
