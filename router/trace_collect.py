"""What the gateway's trace of one request is made of, noted as the request goes.

Plain objects and `time.perf_counter()` stamps only, no OpenTelemetry: router/tracing.py
turns a finished request's notes into spans (collected here, published there, as the access
log's RequestRecord is). Only a gateway run with --otlp-traces-endpoint creates a
RequestTrace; everywhere else `rec.spans` is None and each hook costs one `is None` test.

The ids are chosen here, at the request's start, because the worker must be told them before
any span exists: the traceparent sent upstream names the gateway's span for that attempt, so
the engine's own spans (vLLM's --otlp-traces-endpoint) nest under it, in the client's trace.
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from router.scheduling import Route

# version-traceid-parentid-flags (W3C Trace Context level 1). A later version may append
# fields after a '-': parsed as version 00, as the specification asks.
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")
_SAMPLED = 0x01
# Scheduler calls noted per request: a request queued for a minute makes a long poll a second;
# the rest are counted, not kept (a trace of hundreds of identical spans reads worse).
MAX_SCHEDULER_CALLS = 16


def parse_traceparent(value: str | None) -> tuple[int, int, int] | None:
    """(trace id, parent span id, flags) of a valid `traceparent`, else None (a new trace is
    started, as the specification says for a header that does not parse)."""
    if value is None:
        return None
    found = _TRACEPARENT.fullmatch(value.strip())
    if found is None:
        return None
    version, trace_hex, parent_hex, flags_hex, rest = found.groups()
    if version == "ff" or (version == "00" and rest is not None):
        return None
    trace_id, parent_id = int(trace_hex, 16), int(parent_hex, 16)
    if not trace_id or not parent_id:
        return None
    return trace_id, parent_id, int(flags_hex, 16)


def new_span_id() -> int:
    return random.getrandbits(64) or 1


def new_trace_id() -> int:
    return random.getrandbits(128) or 1


class SchedulerCall:
    """One call to the scheduler while placing the request."""

    __slots__ = ("end", "error", "outcome", "policy", "start", "wait_ms", "worker")

    def __init__(self, start: float, wait_ms: int) -> None:
        self.start = start
        self.end = start
        self.wait_ms = wait_ms
        self.outcome = ""  # placed, wait (or unavailable: the scheduler did not answer)
        self.worker: str | None = None
        self.policy = ""
        self.error: str | None = None


class Placing:
    """One placing of the request on a worker (its first, or a retry's): the scheduler calls,
    the wait in the admission queue if it queued, and what it got."""

    __slots__ = ("calls", "end", "error", "fallback", "policy", "queued", "start", "untraced_calls",
                 "worker")

    def __init__(self, start: float) -> None:
        self.start = start
        self.end: float | None = None
        self.queued: float | None = None  # when it took a place in the admission queue
        self.calls: list[SchedulerCall] = []
        self.untraced_calls = 0  # past MAX_SCHEDULER_CALLS
        self.worker: str | None = None
        self.policy = ""
        self.fallback = False
        self.error: str | None = None  # the exception's class name when none was had


class Attempt:
    """One try of the request on a worker, from its sending to its end (or its failure before
    the first byte, when it is retried elsewhere)."""

    __slots__ = ("end", "failure", "span_id", "start", "url", "worker")

    def __init__(self, worker: str, url: str, start: float) -> None:
        self.span_id = new_span_id()
        self.worker = worker
        self.url = url
        self.start = start
        self.end: float | None = None
        self.failure: str | None = None


class RequestTrace:
    """One request's trace: its ids (the client's trace, or a new one) and what it went
    through, for router/tracing.py to publish when it ends."""

    __slots__ = ("attempts", "flags", "parent_id", "placings", "sampled", "span_id", "trace_id")

    def __init__(self, trace_id: int, parent_id: int | None, flags: int) -> None:
        self.trace_id = trace_id
        self.parent_id = parent_id  # the client's span, None when the trace begins here
        self.span_id = new_span_id()  # the gateway's server span
        self.flags = flags
        self.sampled = bool(flags & _SAMPLED)
        self.placings: list[Placing] = []
        self.attempts: list[Attempt] = []

    @classmethod
    def begin(cls, headers: Mapping[str, str], sample_bound: int) -> RequestTrace:
        """The client's trace when it sent one (its sampling decision kept: parent-based), else
        a new one, sampled when its id's low 64 bits are under `sample_bound` (the SDK's
        TraceIdRatioBased rule, so that any other service deciding on it agrees)."""
        parent = parse_traceparent(headers.get("traceparent"))
        if parent is not None:
            trace_id, parent_id, flags = parent
            return cls(trace_id, parent_id, flags)
        trace_id = new_trace_id()
        return cls(trace_id, None, _SAMPLED if trace_id & 0xFFFFFFFFFFFFFFFF < sample_bound else 0)

    @property
    def trace_hex(self) -> str:
        return f"{self.trace_id:032x}"

    def traceparent(self, span_id: int | None = None) -> str:
        """The `traceparent` a worker is sent: this trace, with the gateway's span as parent."""
        return f"00-{self.trace_id:032x}-{span_id or self.span_id:016x}-{self.flags:02x}"

    def upstream_headers(self, headers: dict[str, str]) -> None:
        """Point the trace context sent upstream at the gateway's server span (an attempt then
        points it at its own span). A trace begun here carries no `tracestate` of the client's:
        that belonged to a traceparent that did not parse."""
        # The client's, in whatever case it wrote them (the headers passed on whole keep it).
        drop = ("traceparent",) if self.parent_id is not None else ("traceparent", "tracestate")
        for name in [k for k in headers if k.lower() in drop]:
            del headers[name]
        headers["traceparent"] = self.traceparent()

    # ---- placing ---------------------------------------------------------------------------
    async def placing(self, call: Awaitable[Route]) -> Route:
        """Await `call` (the scheduling's acquire), noted as one placing."""
        placing = Placing(time.perf_counter())
        self.placings.append(placing)
        try:
            route = await call
        except BaseException as exc:
            placing.error = type(exc).__name__
            raise
        finally:
            placing.end = time.perf_counter()
        placing.worker, placing.policy, placing.fallback = route.worker_id, route.policy, route.fallback
        return route

    def queued(self) -> None:
        """The request takes a place in the admission queue (the placing under way waits)."""
        if self.placings:
            self.placings[-1].queued = time.perf_counter()

    async def scheduler_call(self, call: Awaitable[Route | None], wait_ms: int,
                             unavailable: Callable[[], bool]) -> Route | None:
        """Await `call` (one schedule call, held for up to `wait_ms`), noted in the placing
        under way. `unavailable()`: whether the scheduler is marked down after it (a call that
        comes back without a route then got no answer, rather than "wait")."""
        note = SchedulerCall(time.perf_counter(), wait_ms)
        placing = self.placings[-1] if self.placings else None
        if placing is not None:
            if len(placing.calls) < MAX_SCHEDULER_CALLS:
                placing.calls.append(note)
            else:
                placing.untraced_calls += 1
        try:
            route = await call
        except BaseException as exc:
            note.error = type(exc).__name__
            raise
        finally:
            note.end = time.perf_counter()
        if route is not None:
            note.outcome, note.worker, note.policy = "placed", route.worker_id, route.policy
        else:
            note.outcome = "unavailable" if unavailable() else "wait"
        return route

    # ---- upstream attempts -------------------------------------------------------------------
    def attempt(self, worker: str, url: str) -> str:
        """A try on `worker` at `url` begins; returns the traceparent to send it. A try still
        open ends here (a WebSocket moved to another worker)."""
        now = time.perf_counter()
        if self.attempts and self.attempts[-1].end is None:
            self.attempts[-1].end = now
        attempt = Attempt(worker, url, now)
        self.attempts.append(attempt)
        return self.traceparent(attempt.span_id)

    def attempt_failed(self, reason: str) -> None:
        """The try under way failed before its answer began (`reason`: router/streaming.py's
        kinds, e.g. connect, http_503): it is retried elsewhere, or the request fails."""
        if self.attempts and self.attempts[-1].end is None:
            self.attempts[-1].end = time.perf_counter()
            self.attempts[-1].failure = reason
