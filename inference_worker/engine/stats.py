"""Plain stats records filled by the engine, read by the stat loggers.

Collecting and publishing are kept apart (as in vLLM v1's stats.py/loggers.py):
the engine fills these dataclasses once per step and hands them to every
`StatLogger`; the Prometheus logger and the log-line logger only read them.

All timestamps are `time.monotonic()` seconds. Interval definitions follow
vLLM v1 exactly (see shared/metrics-reference.md section 1.5):
- TTFT       = first-token iteration time - arrival time
- ITL        = this new-token iteration time - previous one, same request
- queue      = first SCHEDULED - QUEUED (later re-schedules after preemption ignored)
- prefill    = first token - first SCHEDULED
- decode     = last token - first token
- inference  = last token - first SCHEDULED
- e2e        = finishing iteration time - arrival time
- per-request TPOT = decode / (generation tokens - 1), or 0 with one token
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol

from inference_worker.engine.types import FinishReason


class EngineEventType(enum.Enum):
    QUEUED = 1
    SCHEDULED = 2
    PREEMPTED = 3


@dataclass(slots=True)
class EngineEvent:
    type: EngineEventType
    timestamp: float


@dataclass(slots=True)
class PrefixCacheStats:
    """Prefix-cache lookups of newly scheduled requests in one step, in tokens.

    Requests resuming after a preemption are not counted (as in vLLM).
    """

    requests: int = 0
    queries: int = 0
    hits: int = 0


@dataclass(slots=True)
class SchedulerStats:
    """Engine state after one step."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0  # used blocks / total blocks, 0..1
    prefix_cache_stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)


@dataclass(slots=True)
class FinishedRequestStats:
    finish_reason: FinishReason
    e2e_latency: float = 0.0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    max_tokens_param: int | None = None
    # Per request, not per choice: None for the choices of a request with n > 1 but its
    # last to end, which carries n and its longest choice's length (None there: this one's).
    n_param: int | None = 1
    max_num_generation_tokens: int | None = None
    queued_time: float = 0.0
    prefill_time: float = 0.0
    inference_time: float = 0.0
    decode_time: float = 0.0
    mean_time_per_output_token: float = 0.0
    num_preemptions: int = 0
    num_cached_tokens: int = 0


@dataclass(slots=True)
class IterationStats:
    """What one engine step produced, as the frontend credits it."""

    iteration_timestamp: float
    num_prompt_tokens: int = 0  # full prompt length credited when a request emits its first token
    # The part of num_prompt_tokens served from the prefix cache (same requests, same moment);
    # feeds vllm:prompt_tokens_by_source{source="local_cache_hit"|"local_compute"}.
    num_cached_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_preempted_reqs: int = 0
    time_to_first_tokens_iter: list[float] = field(default_factory=list)
    inter_token_latencies_iter: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class CacheConfigInfo:
    """Static cache configuration, published as labels of vllm:cache_config_info."""

    block_size: int
    num_gpu_blocks: int
    enable_prefix_caching: bool
    cache_dtype: str = "auto"
    num_cpu_blocks: int = 0
    gpu_memory_utilization: float = 0.9
    swap_space: int = 0


class StatLogger(Protocol):
    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats | None) -> None:
        """Called by the engine after every step (engine thread)."""
        ...

    def log(self) -> None:
        """Called every --log-stats-interval seconds (periodic summary)."""
        ...
