"""The periodic stats line (vLLM's LoggingStatLogger shape) fed with hand-built stats."""

from __future__ import annotations

import logging
import re

from inference_worker.engine.stats import IterationStats, PrefixCacheStats, SchedulerStats
from inference_worker.metrics.log_line import CachingMetrics, LoggingStatLogger

LINE = re.compile(
    r"Engine 000: Avg prompt throughput: (?P<prompt>[\d.]+) tokens/s, "
    r"Avg generation throughput: (?P<gen>[\d.]+) tokens/s, "
    r"Running: (?P<running>\d+) reqs, Waiting: (?P<waiting>\d+) reqs, "
    r"Preemptions: (?P<preempt>\d+), GPU KV cache usage: (?P<kv>[\d.]+)%, "
    r"Prefix cache hit rate: (?P<hit>[\d.]+)%$"
)


def test_line_reports_interval_throughput_state_and_hit_rate() -> None:
    logger = LoggingStatLogger()
    start = logger._last_log_time
    logger.record(
        SchedulerStats(
            num_running_reqs=3,
            num_waiting_reqs=1,
            kv_cache_usage=0.125,
            prefix_cache_stats=PrefixCacheStats(requests=2, queries=100, hits=25),
        ),
        IterationStats(0, num_prompt_tokens=100, num_generation_tokens=2, num_preempted_reqs=1),
    )
    logger.record(
        SchedulerStats(num_running_reqs=2, num_waiting_reqs=0, kv_cache_usage=0.25),
        IterationStats(iteration_timestamp=0, num_generation_tokens=8),
    )
    line, busy = logger.format_line(now=start + 2.0)
    match = LINE.match(line)
    assert match, line
    assert busy
    assert float(match["prompt"]) == 50.0
    assert float(match["gen"]) == 5.0
    assert (match["running"], match["waiting"], match["preempt"]) == ("2", "0", "1")
    assert float(match["kv"]) == 25.0
    assert float(match["hit"]) == 25.0

    # Next interval: nothing happened. Throughput and preemptions restart from zero, state stays,
    # the hit rate keeps its window. Still INFO (the previous interval was busy), then DEBUG.
    line, busy = logger.format_line(now=start + 4.0)
    match = LINE.match(line)
    assert match, line
    assert (float(match["prompt"]), float(match["gen"]), match["preempt"]) == (0.0, 0.0, "0")
    assert match["running"] == "2"
    assert float(match["hit"]) == 25.0
    assert busy
    _, busy = logger.format_line(now=start + 6.0)
    assert not busy


def test_log_emits_info_when_busy(caplog) -> None:
    logger = LoggingStatLogger()
    logger.record(SchedulerStats(), IterationStats(iteration_timestamp=0, num_generation_tokens=5))
    with caplog.at_level(logging.DEBUG, logger="inference_worker.stats"):
        logger.log()
        logger.log()  # follows a busy interval: still INFO
        logger.log()  # two idle intervals: DEBUG
    levels = [r.levelno for r in caplog.records]
    assert levels == [logging.INFO, logging.INFO, logging.DEBUG]
    assert "Avg generation throughput" in caplog.records[0].getMessage()


def test_hit_rate_window_keeps_the_most_recent_1000_requests() -> None:
    window = CachingMetrics(max_recent_requests=1000)
    # 600 old requests that all missed, then 600 recent ones that all hit.
    for _ in range(6):
        window.observe(PrefixCacheStats(requests=100, queries=1000, hits=0))
    for _ in range(6):
        window.observe(PrefixCacheStats(requests=100, queries=1000, hits=1000))
    # The window drops whole old steps until it holds <= 1000 requests: 400 misses, 600 hits remain.
    assert window.requests == 1000
    assert window.hit_rate == 0.6
    window.observe(PrefixCacheStats(requests=0, queries=0, hits=0))  # steps without new requests are ignored
    assert window.requests == 1000
    assert CachingMetrics().hit_rate == 0.0
