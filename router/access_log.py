"""One log line per request and a stats line every few seconds."""

from __future__ import annotations

import asyncio
import logging
import time

access_log = logging.getLogger("router.access")
stats_log = logging.getLogger("router.stats")


class RequestRecord:
    """What happened to one request; filled in along the way, logged once at the end."""

    __slots__ = (
        "error",
        "id",
        "method",
        "model",
        "output_tokens",
        "path",
        "prompt_tokens",
        "queue_ms",
        "retries",
        "start",
        "status",
        "stream",
        "ttft_ms",
        "worker",
    )

    def __init__(self, req_id: str, method: str, path: str) -> None:
        self.id = req_id
        self.method = method
        self.path = path
        self.start = time.perf_counter()
        self.model = "-"
        self.worker = "-"
        self.status = 0
        self.stream = False
        self.queue_ms = 0.0
        self.ttft_ms: float | None = None
        self.prompt_tokens = 0
        self.output_tokens = 0
        self.retries = 0
        self.error: str | None = None


class Stats:
    """Counters for the periodic stats line (cheap: plain ints)."""

    def __init__(self) -> None:
        self.done = 0
        self.errors = 0
        self.prompt_tokens = 0
        self.output_tokens = 0
        self.ttft_sum_ms = 0.0
        self.ttft_n = 0

    def add(self, rec: RequestRecord) -> None:
        self.done += 1
        if rec.status >= 400 or rec.error:
            self.errors += 1
        self.prompt_tokens += rec.prompt_tokens
        self.output_tokens += rec.output_tokens
        if rec.ttft_ms is not None:
            self.ttft_sum_ms += rec.ttft_ms
            self.ttft_n += 1


def log_request(rec: RequestRecord) -> None:
    if not access_log.isEnabledFor(logging.INFO):
        return
    e2e_ms = (time.perf_counter() - rec.start) * 1000
    ttft = f"{rec.ttft_ms:.1f}" if rec.ttft_ms is not None else "-"
    access_log.info(
        "id=%s %s %s model=%s worker=%s status=%d stream=%d queue_ms=%.1f ttft_ms=%s e2e_ms=%.1f "
        "tokens_in=%d tokens_out=%d retries=%d%s",
        rec.id,
        rec.method,
        rec.path,
        rec.model,
        rec.worker,
        rec.status,
        rec.stream,
        rec.queue_ms,
        ttft,
        e2e_ms,
        rec.prompt_tokens,
        rec.output_tokens,
        rec.retries,
        f" error={rec.error}" if rec.error else "",
    )


async def stats_loop(stats: Stats, gauges, interval_s: float) -> None:
    """gauges() -> (in_flight, queued, fallback_mode)."""
    last = Stats()
    last_t = time.monotonic()
    while True:
        await asyncio.sleep(interval_s)
        now = time.monotonic()
        dt = max(now - last_t, 1e-9)
        in_flight, queued, fallback = gauges()
        n = stats.done - last.done
        ttft_n = stats.ttft_n - last.ttft_n
        mean_ttft = (stats.ttft_sum_ms - last.ttft_sum_ms) / ttft_n if ttft_n else 0.0
        stats_log.info(
            "req/s=%.1f errors=%d in_flight=%d queued=%d prompt_tok/s=%.1f gen_tok/s=%.1f mean_ttft_ms=%.1f "
            "mode=%s",
            n / dt,
            stats.errors - last.errors,
            in_flight,
            queued,
            (stats.prompt_tokens - last.prompt_tokens) / dt,
            (stats.output_tokens - last.output_tokens) / dt,
            mean_ttft,
            "fallback" if fallback else "scheduled",
        )
        for name in Stats().__dict__:
            setattr(last, name, getattr(stats, name))
        last_t = now
