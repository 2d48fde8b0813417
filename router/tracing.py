"""The gateway's OpenTelemetry traces (--otlp-traces-endpoint): a finished request's notes
(router/trace_collect.py, in its RequestRecord) become spans, exported over OTLP/HTTP by the
SDK's BatchSpanProcessor from its own thread, off the event loop.

Imported only when tracing is on (router/app.py): without it, no opentelemetry module is
loaded at all. The spans are built when the request ends, from the times noted along the way
and the ids chosen at its start (the worker was sent them), as the SDK's finished spans
(ReadableSpan) handed straight to the batch processor: the Tracer API would make each span
live (locks, attribute checks, a processor call at its start) only to end it at once, and cost
the loop ~30 µs a span where this costs ~3 (benchmarks/RESULTS.md, "Gateway overhead").

Per request: a SERVER span (`POST /v1/chat/completions`, in the client's trace when it sent a
traceparent); under it a `router.schedule` span per scheduler call (its decision), a
`router.queue` span for a wait in the admission queue (which holds the held calls made while
queued), and a CLIENT span per upstream attempt (the span whose id the worker got as its parent,
with a `first_token` event). A WebSocket has one SERVER span for its connection and a
`router.ws.answer` span per answer, published as each answer ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import SERVICE_NAME, OTELResourceDetector, Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import TraceIdRatioBased
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

from router.request_checks import MODEL_ENDPOINTS
from router.stored_responses import STORED_RESPONSE_PATH
from router.trace_collect import Attempt, Placing, RequestTrace, new_span_id
from scheduler.clip import MAX_SHOWN_CHARS

if TYPE_CHECKING:
    from router.access_log import RequestRecord

log = logging.getLogger("router.tracing")

DEFAULT_SERVICE_NAME = "llm-router-gateway"
SCOPE = "llm-router.gateway"
TRACES_PATH = "/v1/traces"
# Client-chosen strings in attributes (a model name, a path) are cut: a backend indexes them.
# As many characters as an error message shows of one (scheduler/clip.py).
_MAX_VALUE_CHARS = MAX_SHOWN_CHARS
_OPERATIONS = {"/v1/chat/completions": "chat", "/v1/completions": "text_completion",
               "/v1/embeddings": "embeddings"}
_RESPONSE_ACTIONS = frozenset({"", "/cancel", "/input_items"})
# How a request whose client went away ends (the proxy's, an inner span's exception).
_CLIENT_LEFT = frozenset({"client_disconnected", "CancelledError"})
# Spans per export (the SDK's default is 512, and OTEL_BSP_MAX_EXPORT_BATCH_SIZE still rules):
# the exporter encodes a batch in Python, ~35 µs a span, holding the GIL the event loop needs;
# 512 at once held a request up to ~15 ms (P99 at concurrency 1 in benchmarks/RESULTS.md).
EXPORT_BATCH_SPANS = 64
_UNSET = Status(StatusCode.UNSET)
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP URL spans are posted to: the endpoint as given, or with /v1/traces when it
    names no path (a collector's base URL, as OTEL_EXPORTER_OTLP_ENDPOINT is written)."""
    if urlsplit(endpoint).path in ("", "/"):
        return endpoint.rstrip("/") + TRACES_PATH
    return endpoint


def gateway_resource() -> Resource:
    """service.name llm-router-gateway, unless OTEL_SERVICE_NAME (or service.name in
    OTEL_RESOURCE_ATTRIBUTES) names it, as for any SDK-configured service."""
    if OTELResourceDetector().detect().attributes.get(SERVICE_NAME):
        return Resource.create()
    return Resource.create({SERVICE_NAME: DEFAULT_SERVICE_NAME})


def route_of(path: str) -> str:
    """http.route: the path for the endpoints the gateway knows, a template for a stored
    response's (its id is no route), and /v1/* for the rest (client-chosen paths passed on)."""
    if path in MODEL_ENDPOINTS or path == "/v1/ws":
        return path
    stored = STORED_RESPONSE_PATH.fullmatch(path)
    if stored is not None:
        action = path[stored.end(1):]
        return "/v1/responses/{response_id}" + (action if action in _RESPONSE_ACTIONS else "/{action}")
    return "/v1/*"


def _cut(value: str) -> str:
    return value if len(value) <= _MAX_VALUE_CHARS else value[:_MAX_VALUE_CHARS]


class _Clock:
    """perf_counter seconds (the record's clock) to the epoch nanoseconds spans carry."""

    __slots__ = ("offset_ns",)

    def __init__(self) -> None:
        self.offset_ns = time.time_ns() - time.perf_counter_ns()

    def ns(self, t: float) -> int:
        return int(t * 1e9) + self.offset_ns


def _status(status: int, error: str | None, server: bool) -> Status:
    """A span's status. A SERVER span's 4xx is the client's error (OpenTelemetry's HTTP
    conventions leave its status unset; error.type says what it was); its 5xx, or an answer
    that failed mid-stream (its 200 went out first), is an error, as is any failure of another
    span. A client that left is nobody's failure."""
    if error in _CLIENT_LEFT or (server and 400 <= status < 500):
        return _UNSET
    if error or status >= 400:
        return Status(StatusCode.ERROR, error)
    return _UNSET


def _outcome(attrs: dict[str, Any], status: int, error: str | None) -> None:
    if status:
        attrs["http.response.status_code"] = status
    if error:
        attrs["error.type"] = error


class Tracing:
    def __init__(self, endpoint: str, sample_ratio: float) -> None:
        self.endpoint = traces_url(endpoint)
        # Traces begun here are kept at this ratio; a client's decision is kept as it is.
        # Decided at the request's start (RequestTrace.begin): the worker is told it.
        self.sample_bound = TraceIdRatioBased.get_bound_for_rate(sample_ratio)
        self.resource = gateway_resource()
        self.scope = InstrumentationScope(SCOPE)
        batch = None if os.environ.get("OTEL_BSP_MAX_EXPORT_BATCH_SIZE") else EXPORT_BATCH_SPANS
        self.processor = BatchSpanProcessor(OTLPSpanExporter(endpoint=self.endpoint),
                                            max_export_batch_size=batch)
        self._failed = False

    def begin(self, headers: Mapping[str, str]) -> RequestTrace:
        return RequestTrace.begin(headers, self.sample_bound)

    # ---- publishing ------------------------------------------------------------------------
    def publish(self, rec: RequestRecord) -> None:
        """The finished request's spans, handed to the batch processor (no I/O here)."""
        spans = rec.spans
        if spans is None or not spans.sampled:
            return
        try:
            self._publish(rec, spans)
        except Exception:  # a tracing bug must not fail the request's bookkeeping
            self._log_failure(rec.id)

    def publish_answer(self, spans: RequestTrace, line: RequestRecord) -> None:
        """One answer on a WebSocket (its access-log record), under the socket's span."""
        if not spans.sampled:
            return
        try:
            clock = _Clock()
            attrs = self._request_attributes(line)
            _outcome(attrs, line.status, line.error)
            self._emit("router.ws.answer", spans, new_span_id(), spans.span_id, SpanKind.INTERNAL,
                       attrs, clock.ns(line.start), clock.ns(time.perf_counter()),
                       _status(line.status, line.error, server=True),
                       self._first_token(line, clock, line.start))
        except Exception:
            self._log_failure(line.id)

    def _log_failure(self, req_id: str) -> None:
        if not self._failed:
            self._failed = True
            log.exception("id=%s could not build its trace spans (logged once)", req_id)

    def _emit(self, name: str, spans: RequestTrace, span_id: int, parent_id: int | None,
              kind: SpanKind, attrs: dict[str, Any], start_ns: int, end_ns: int,
              status: Status = _UNSET, events: tuple[Event, ...] = (), remote_parent: bool = False
              ) -> None:
        context = SpanContext(spans.trace_id, span_id, False, _SAMPLED)
        parent = (SpanContext(spans.trace_id, parent_id, remote_parent, TraceFlags(spans.flags))
                  if parent_id is not None else None)
        self.processor.on_end(ReadableSpan(
            name, context, parent, self.resource, attrs, events, (), kind, None, status,
            start_ns, end_ns, self.scope))

    def _publish(self, rec: RequestRecord, spans: RequestTrace) -> None:
        clock = _Clock()
        end_ns = clock.ns(time.perf_counter())
        method = "GET" if rec.method == "WS" else rec.method
        route = route_of(rec.path)
        name = f"{method} {route}"
        attrs = self._request_attributes(rec)
        attrs.update({
            "http.request.method": method,
            "http.route": route,
            "router.queue_ms": round(rec.queue_ms, 3),
            "router.retries": rec.retries,
            "router.attempts": len(spans.attempts),
        })
        if spans.placings:
            last = spans.placings[-1]
            if last.worker is not None:
                attrs["router.policy"], attrs["router.fallback"] = last.policy, last.fallback
        if route != rec.path:  # a templated route: the path as it came
            attrs["url.path"] = _cut(rec.path)
        if rec.flow:
            attrs["router.flow"] = _cut(rec.flow)
        operation = _OPERATIONS.get(rec.path)
        if operation is not None:
            attrs["gen_ai.operation.name"] = operation
        _outcome(attrs, rec.status, rec.error)
        for placing in spans.placings:
            self._placing(placing, spans, clock, end_ns)
        for n, attempt in enumerate(spans.attempts, 1):
            self._attempt(attempt, n, n == len(spans.attempts), rec, spans, name, clock, end_ns)
        self._emit(name, spans, spans.span_id, spans.parent_id, SpanKind.SERVER, attrs,
                   clock.ns(rec.start), end_ns, _status(rec.status, rec.error, server=True),
                   remote_parent=True)

    def _request_attributes(self, rec: RequestRecord) -> dict[str, Any]:
        attrs: dict[str, Any] = {
            "router.request.id": rec.id,
            "gen_ai.request.model": _cut(rec.model),
            "gen_ai.usage.input_tokens": rec.prompt_tokens,
            "gen_ai.usage.output_tokens": rec.output_tokens,
            "router.worker.id": rec.worker,
            "router.stream": rec.stream,
        }
        if rec.ttft_ms is not None:
            attrs["router.ttft_ms"] = round(rec.ttft_ms, 3)
        return attrs

    def _placing(self, placing: Placing, spans: RequestTrace, clock: _Clock, end_ns: int) -> None:
        """A placing's scheduler calls (each its decision, or its wait) and its wait in the
        queue, which holds the calls made while queued (each held until room frees)."""
        placing_end = clock.ns(placing.end) if placing.end is not None else end_ns
        queue_id = None
        if placing.queued is not None:
            queue_id = new_span_id()
            held = sum(call.start >= placing.queued for call in placing.calls)
            attrs: dict[str, Any] = {"router.scheduler.calls": held + placing.untraced_calls}
            if placing.worker is not None:
                attrs["router.worker.id"] = placing.worker
            _outcome(attrs, 0, placing.error)
            self._emit("router.queue", spans, queue_id, spans.span_id, SpanKind.INTERNAL, attrs,
                       clock.ns(placing.queued), placing_end, _status(0, placing.error, False))
        for call in placing.calls:
            attrs = {"router.scheduler.wait_ms": call.wait_ms}
            if call.outcome:
                attrs["router.scheduler.outcome"] = call.outcome
            if call.worker is not None:
                attrs["router.worker.id"], attrs["router.policy"] = call.worker, call.policy
            _outcome(attrs, 0, call.error)
            queued = queue_id is not None and placing.queued is not None and call.start >= placing.queued
            self._emit("router.schedule", spans, new_span_id(), queue_id if queued else spans.span_id,
                       SpanKind.INTERNAL, attrs, clock.ns(call.start), clock.ns(call.end),
                       _status(0, call.error, False))

    def _attempt(self, attempt: Attempt, n: int, last: bool, rec: RequestRecord,
                 spans: RequestTrace, name: str, clock: _Clock, end_ns: int) -> None:
        parts = urlsplit(attempt.url)
        attrs: dict[str, Any] = {
            "http.request.method": name.split(" ", 1)[0],
            "url.full": _cut(attempt.url),
            "server.address": parts.hostname or "",
            "router.worker.id": attempt.worker,
            "router.attempt": n,
        }
        if parts.port is not None:
            attrs["server.port"] = parts.port
        events: tuple[Event, ...] = ()
        if attempt.failure is not None:  # before its answer began: retried, or the request failed
            status, error = 0, attempt.failure
        elif not last:  # a WebSocket moved on to another worker (this one stopped)
            status, error = 0, None
        else:  # the answer the client got
            status, error = rec.status, rec.error
            events = self._first_token(rec, clock, attempt.start)
        _outcome(attrs, status, error)
        self._emit(name, spans, attempt.span_id, spans.span_id, SpanKind.CLIENT, attrs,
                   clock.ns(attempt.start), clock.ns(attempt.end) if attempt.end is not None else end_ns,
                   _status(status, error, False), events)

    @staticmethod
    def _first_token(rec: RequestRecord, clock: _Clock, after: float) -> tuple[Event, ...]:
        if rec.ttft_ms is None:
            return ()
        at = rec.start + rec.ttft_ms / 1000
        return (Event("first_token", timestamp=clock.ns(at)),) if at >= after else ()

    # ---- stopping --------------------------------------------------------------------------
    async def close(self, timeout_s: float) -> None:
        """Export what is left and stop, waiting at most `timeout_s`: the batch processor's
        shutdown joins its thread (which may wait on a slow collector), so it runs in a thread
        of its own, never on the loop; past the bound the rest is dropped, and the process
        exits all the same (the thread is a daemon)."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def shutdown() -> None:
            try:
                self.processor.shutdown()
            except Exception:
                log.exception("exporting the last traces failed")
            finally:
                with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                    loop.call_soon_threadsafe(lambda: done.done() or done.set_result(None))

        threading.Thread(target=shutdown, name="otlp-shutdown", daemon=True).start()
        try:
            await asyncio.wait_for(done, timeout_s)
        except TimeoutError:
            log.warning("the last traces were not exported within %g s of stopping (the collector "
                        "at %s is slow or unreachable): dropped", timeout_s, self.endpoint)
