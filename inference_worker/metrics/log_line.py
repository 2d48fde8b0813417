"""The periodic stats log line, shaped like vLLM v1's `LoggingStatLogger`.

    Engine 000: Avg prompt throughput: 12.3 tokens/s, Avg generation throughput: 45.6 tokens/s,
    Running: 4 reqs, Waiting: 2 reqs, Preemptions: 0, GPU KV cache usage: 12.5%,
    Prefix cache hit rate: 33.3%

(one line). Throughputs are averaged over the interval since the previous line,
running/waiting/KV usage are the last step's values, preemptions are those of the
interval, and the prefix-cache hit rate covers the most recent 1,000 requests
(vLLM's `CachingMetrics(max_recent_requests=1000)`). Like vLLM, a line with zero
throughput that follows another idle line goes to DEBUG instead of INFO.

`record` runs on the engine thread, `log` on the event loop: a lock guards the counters.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

from inference_worker.engine.stats import IterationStats, PrefixCacheStats, SchedulerStats

logger = logging.getLogger("inference_worker.stats")


class CachingMetrics:
    """Prefix-cache hit rate over the most recent `max_recent_requests` requests."""

    def __init__(self, max_recent_requests: int = 1000) -> None:
        self.max_recent_requests = max_recent_requests
        self.requests = 0
        self.queries = 0
        self.hits = 0
        self._window: deque[tuple[int, int, int]] = deque()

    def observe(self, stats: PrefixCacheStats) -> None:
        if stats.requests == 0:
            return
        self._window.append((stats.requests, stats.queries, stats.hits))
        self.requests += stats.requests
        self.queries += stats.queries
        self.hits += stats.hits
        # Drop whole old steps while the window holds more than the limit (keep at least one).
        while len(self._window) > 1 and self.requests > self.max_recent_requests:
            old_requests, old_queries, old_hits = self._window.popleft()
            self.requests -= old_requests
            self.queries -= old_queries
            self.hits -= old_hits

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class LoggingStatLogger:
    """A `StatLogger` that prints one summary line every time `log()` is called."""

    def __init__(self, engine_index: int = 0, log: logging.Logger = logger) -> None:
        self.engine_index = engine_index
        self._logger = log
        self._lock = threading.Lock()
        self._prefix_cache = CachingMetrics()
        self._last_scheduler: SchedulerStats | None = None
        self._last_log_time = time.monotonic()
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._preemptions = 0
        self._last_prompt_throughput = 0.0
        self._last_generation_throughput = 0.0

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats | None) -> None:
        with self._lock:
            self._last_scheduler = scheduler_stats
            self._prefix_cache.observe(scheduler_stats.prefix_cache_stats)
            if iteration_stats is not None:
                self._prompt_tokens += iteration_stats.num_prompt_tokens
                self._generation_tokens += iteration_stats.num_generation_tokens
                self._preemptions += iteration_stats.num_preempted_reqs

    def format_line(self, now: float | None = None) -> tuple[str, bool]:
        """Build the line for the interval ending now and start a new interval.

        Returns the line and whether it deserves INFO (some throughput now or in the
        previous interval).
        """
        now = time.monotonic() if now is None else now
        with self._lock:
            elapsed = max(now - self._last_log_time, 1e-9)
            prompt_throughput = self._prompt_tokens / elapsed
            generation_throughput = self._generation_tokens / elapsed
            preemptions = self._preemptions
            sched = self._last_scheduler or SchedulerStats()
            hit_rate = self._prefix_cache.hit_rate
            self._prompt_tokens = self._generation_tokens = self._preemptions = 0
            self._last_log_time = now
        busy = bool(
            prompt_throughput
            or generation_throughput
            or self._last_prompt_throughput
            or self._last_generation_throughput
        )
        self._last_prompt_throughput = prompt_throughput
        self._last_generation_throughput = generation_throughput
        line = (
            f"Engine {self.engine_index:03d}: "
            f"Avg prompt throughput: {prompt_throughput:.1f} tokens/s, "
            f"Avg generation throughput: {generation_throughput:.1f} tokens/s, "
            f"Running: {sched.num_running_reqs} reqs, Waiting: {sched.num_waiting_reqs} reqs, "
            f"Preemptions: {preemptions}, "
            f"GPU KV cache usage: {sched.kv_cache_usage * 100:.1f}%, "
            f"Prefix cache hit rate: {hit_rate * 100:.1f}%"
        )
        return line, busy

    def log(self) -> None:
        line, busy = self.format_line()
        self._logger.log(logging.INFO if busy else logging.DEBUG, "%s", line)
