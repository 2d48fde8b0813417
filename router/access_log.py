"""One log line per request and a stats line every few seconds."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import sys
import time
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from router.trace_collect import RequestTrace

stats_log = logging.getLogger("router.stats")


class RequestRecord:
    """What happened to one request; filled in along the way, logged once at the end."""

    __slots__ = (
        "choices",
        "detached",
        "error",
        "fair_charge",
        "fair_settled",
        "flow",
        "id",
        "method",
        "model",
        "model_known",
        "output_tokens",
        "path",
        "prompt_tokens",
        "queue_ms",
        "retries",
        "sequences",
        "spans",
        "start",
        "status",
        "stream",
        "trace",
        "ttft_ms",
        "worker",
    )

    def __init__(self, req_id: str, method: str, path: str) -> None:
        self.id = req_id
        self.method = method
        self.path = path
        self.start = time.perf_counter()
        self.status = 0
        self.stream = False
        self.ttft_ms: float | None = None
        self.retries = 0
        self.error: str | None = None
        self.trace: str | None = None  # the W3C trace id the client sent (traceparent)
        # The gateway's own trace of it (router/trace_collect.py): only with tracing on.
        self.spans: RequestTrace | None = None
        # The worker goes on with the request after its answer (a background response).
        self.detached = False
        self.flow = ""  # its tenant in the admission queue (router/fairness.py)
        self.forget_placement()

    def forget_placement(self) -> None:
        """What a placement fills in, as before one: also a WebSocket's, whose first request
        could not be placed and whose next one starts afresh (router/ws_proxy.py)."""
        self.model = "-"
        self.choices = 1  # sequences the engine generates (n)
        # Answers the output tokens are spread over (n x the prompts of a batch): they are
        # generated side by side, so the time per output token is per answer, not per token
        # of all of them together.
        self.sequences = 1
        self.worker = "-"
        self.queue_ms = 0.0
        self.prompt_tokens = 0
        self.output_tokens = 0
        # The pool serves its model: a worker was found for it, or the scheduler knows the model
        # but has no healthy worker for it now (a label then, unlike a made-up name).
        self.model_known = False
        # What its flow was charged in the queue's token turns (None: it got no worker), and
        # the (prompt, output) tokens already settled against it (a WebSocket's answers).
        self.fair_charge: float | None = None
        self.fair_settled = (0, 0)

    @property
    def served(self) -> bool:
        """A worker answered it (or was answering when its client left). Only such requests
        count in the token and latency figures: a refusal (full queue, unknown model, every
        attempt failed) counted there would inflate the input rate and pull latencies down
        exactly when the cluster is overloaded."""
        return self.worker != "-" and (self.status < 400 or self.status == 499)


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
        if not rec.served:
            return
        self.prompt_tokens += rec.prompt_tokens
        self.output_tokens += rec.output_tokens
        if rec.ttft_ms is not None:
            self.add_ttft(rec.ttft_ms)

    def add_ttft(self, ms: float) -> None:
        """A first token's time (a request's; or one answer's on a WebSocket, whose record has
        none: a socket's answers are timed each)."""
        self.ttft_sum_ms += ms
        self.ttft_n += 1


MAX_FIELD_CHARS = 120
# version-traceid-parentid-flags (W3C Trace Context); the trace id is what tracing tools search.
_TRACEPARENT = re.compile(r"[0-9a-f]{2}-([0-9a-f]{32})-[0-9a-f]{16}-[0-9a-f]{2}")


def trace_id_of(traceparent: str | None) -> str | None:
    """The trace id of a well-formed `traceparent` header (anything else: None)."""
    if traceparent is None:
        return None
    found = _TRACEPARENT.match(traceparent.strip())
    return found.group(1) if found else None


def log_field(value: str) -> str:
    """A client-chosen value (model name, path, upstream error) as one field of the line: as is
    when short and printable without spaces (nearly always, and cheap to tell); quoted, escaped
    and cut otherwise, so that a newline in a model name cannot forge a log line and a 5,000
    character one cannot flood the log."""
    if len(value) <= MAX_FIELD_CHARS and value.isprintable() and " " not in value:
        return value
    cut = value[:MAX_FIELD_CHARS]
    return json.dumps(cut) + ("..." if len(value) > MAX_FIELD_CHARS else "")


class AccessLog:
    """The per-request line, written in batches: going through `logging` costs ~25 µs and a
    write() per line, a noticeable share of the gateway's per-request budget. Lines are
    formatted with one f-string and flushed together every `flush_s` (and at exit), in the
    same layout as the other log lines."""

    def __init__(self, stream: TextIO | None = None, flush_s: float = 0.1) -> None:
        self.stream = stream or sys.stderr
        self.flush_s = flush_s
        self.lines: list[str] = []
        self._sec = -1
        self._sec_text = ""

    def _stamp(self) -> str:
        now = time.time()
        sec = int(now)
        if sec != self._sec:
            self._sec, self._sec_text = sec, time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(sec))
        return f"{self._sec_text},{int((now - sec) * 1000):03d}"

    def add(self, rec: RequestRecord) -> None:
        e2e_ms = (time.perf_counter() - rec.start) * 1000
        ttft = f"{rec.ttft_ms:.1f}" if rec.ttft_ms is not None else "-"
        extra = f" error={log_field(rec.error)}" if rec.error else ""
        if rec.trace is not None:
            extra += f" trace={rec.trace}"
        if rec.flow:
            extra += f" flow={log_field(rec.flow)}"
        self.lines.append(
            f"{self._stamp()} INFO router.access: id={rec.id} {rec.method} {log_field(rec.path)} "
            f"model={log_field(rec.model)} "
            f"worker={rec.worker} status={rec.status} stream={int(rec.stream)} queue_ms={rec.queue_ms:.1f} "
            f"ttft_ms={ttft} e2e_ms={e2e_ms:.1f} tokens_in={rec.prompt_tokens} "
            f"tokens_out={rec.output_tokens} retries={rec.retries}{extra}\n"
        )

    def flush(self) -> None:
        if self.lines:
            text = "".join(self.lines)
            self.lines.clear()
            try:
                self.stream.write(text)
                self.stream.flush()
            except (OSError, ValueError):
                pass

    async def run(self) -> None:
        try:
            while True:
                await asyncio.sleep(self.flush_s)
                self.flush()
        finally:
            self.flush()


async def stats_loop(stats: Stats, gauges, interval_s: float) -> None:
    """gauges() -> (in_flight, queued, fallback_mode).

    An idle gateway logs one all-zero line after its traffic ends, then none until something
    happens (as vLLM's and our worker's stats lines): it logged a line of zeros every 5 s
    forever, burying the lines that matter."""
    last = Stats()
    last_t = time.monotonic()
    last_idle, last_fallback = True, False  # a gateway just started has nothing to report
    while True:
        await asyncio.sleep(interval_s)
        now = time.monotonic()
        dt = max(now - last_t, 1e-9)
        in_flight, queued, fallback = gauges()
        n = stats.done - last.done
        ttft_n = stats.ttft_n - last.ttft_n
        mean_ttft = (stats.ttft_sum_ms - last.ttft_sum_ms) / ttft_n if ttft_n else 0.0
        idle = not (in_flight or queued or stats.__dict__ != last.__dict__)
        quiet = idle and last_idle and fallback == last_fallback
        last_idle, last_fallback = idle, fallback
        if quiet:
            last_t = now
            continue
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
