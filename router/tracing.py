"""The gateway's OpenTelemetry traces (--otlp-traces-endpoint): a finished request's notes
(router/trace_collect.py, in its RequestRecord) become spans, exported over OTLP/HTTP by the
SDK's BatchSpanProcessor from its own thread, off the event loop.

Imported only when tracing is on (router/app.py): without it, no opentelemetry module is
loaded at all. The spans are built when the request ends, with the times noted along the way
and the ids chosen at its start (the worker was sent them), through the SDK's public Tracer
API: an IdGenerator that hands out those ids, explicit start and end times.

Per request: a SERVER span (`POST /v1/chat/completions`, in the client's trace when it sent a
traceparent), and under it one `router.place` span per placing on a worker (with its
`router.schedule` scheduler calls and, when it queued, its `router.queue` wait, which holds the
calls made while queued), and one CLIENT span per upstream attempt (the span whose id the
worker got as its parent, with a `first_token` event). A WebSocket has one SERVER span for its
connection and a `router.ws.answer` span per answer, published as each answer ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from opentelemetry import trace as trace_api
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import SERVICE_NAME, OTELResourceDetector, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, TraceIdRatioBased
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, Status, StatusCode, TraceFlags

from router.proxy import MODEL_ENDPOINTS
from router.stored_responses import STORED_RESPONSE_PATH
from router.trace_collect import Attempt, Placing, RequestTrace

if TYPE_CHECKING:
    from router.access_log import RequestRecord

log = logging.getLogger("router.tracing")

DEFAULT_SERVICE_NAME = "llm-router-gateway"
SCOPE = "llm-router.gateway"
TRACES_PATH = "/v1/traces"
# Client-chosen strings in attributes (a model name, a path) are cut: a backend indexes them.
_MAX_VALUE_CHARS = 256
_OPERATIONS = {"/v1/chat/completions": "chat", "/v1/completions": "text_completion",
               "/v1/embeddings": "embeddings"}
_RESPONSE_ACTIONS = frozenset({"", "/cancel", "/input_items"})
# How a request whose client went away ends (the proxy's, an inner span's exception).
_CLIENT_LEFT = frozenset({"client_disconnected", "CancelledError"})


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


class _ChosenIds(IdGenerator):
    """Hands out the ids chosen when the request began (the worker was told them); a random
    one where none was chosen. Set just before each start_span, on the loop's thread only."""

    def __init__(self) -> None:
        self.trace_id = 0
        self.span_id = 0
        self._random = RandomIdGenerator()

    def generate_span_id(self) -> int:
        chosen, self.span_id = self.span_id, 0
        return chosen or self._random.generate_span_id()

    def generate_trace_id(self) -> int:
        chosen, self.trace_id = self.trace_id, 0
        return chosen or self._random.generate_trace_id()


class _Clock:
    """perf_counter seconds (the record's clock) to the epoch nanoseconds spans carry."""

    __slots__ = ("offset_ns",)

    def __init__(self) -> None:
        self.offset_ns = time.time_ns() - time.perf_counter_ns()

    def ns(self, t: float) -> int:
        return int(t * 1e9) + self.offset_ns


class Tracing:
    def __init__(self, endpoint: str, sample_ratio: float) -> None:
        self.endpoint = traces_url(endpoint)
        # Traces begun here are kept at this ratio; a client's decision is kept as it is.
        self.sample_bound = TraceIdRatioBased.get_bound_for_rate(sample_ratio)
        self._ids = _ChosenIds()
        # The sampling is decided at the request's start (RequestTrace.begin) and only sampled
        # requests are published: the provider's own sampler has nothing left to decide.
        # No exit hook: close() flushes, bounded, within the gateway's stop.
        self.provider = TracerProvider(sampler=ALWAYS_ON, resource=gateway_resource(),
                                       shutdown_on_exit=False, id_generator=self._ids)
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=self.endpoint)))
        self.tracer = self.provider.get_tracer(SCOPE)
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
            if not self._failed:
                self._failed = True
                log.exception("id=%s could not build its trace spans (logged once)", rec.id)

    def publish_answer(self, spans: RequestTrace, line: RequestRecord) -> None:
        """One answer on a WebSocket (its access-log record), under the socket's span."""
        if not spans.sampled:
            return
        try:
            clock = _Clock()
            parent = self._context_of(spans, spans.span_id)
            attrs = self._request_attributes(line)
            span = self.tracer.start_span("router.ws.answer", parent, SpanKind.INTERNAL, attrs,
                                          start_time=clock.ns(line.start))
            self._first_token(span, line, clock, line.start)
            self._end(span, line.status, line.error, clock.ns(time.perf_counter()), server=True)
        except Exception:
            if not self._failed:
                self._failed = True
                log.exception("id=%s could not build its trace spans (logged once)", line.id)

    def _publish(self, rec: RequestRecord, spans: RequestTrace) -> None:
        clock = _Clock()
        end = time.perf_counter()
        if spans.parent_id is not None:
            client = SpanContext(spans.trace_id, spans.parent_id, is_remote=True,
                                 trace_flags=TraceFlags(spans.flags))
            parent = trace_api.set_span_in_context(NonRecordingSpan(client), Context())
        else:
            parent = Context()  # a root: none of the loop's context is ours
            self._ids.trace_id = spans.trace_id
        method = "GET" if rec.method == "WS" else rec.method
        route = route_of(rec.path)
        attrs = self._request_attributes(rec)
        attrs.update({
            "http.request.method": method,
            "http.route": route,
            "url.path": _cut(rec.path),
            "router.queue_ms": round(rec.queue_ms, 3),
            "router.retries": rec.retries,
            "router.attempts": len(spans.attempts),
        })
        if rec.flow:
            attrs["router.flow"] = _cut(rec.flow)
        operation = _OPERATIONS.get(rec.path)
        if operation is not None:
            attrs["gen_ai.operation.name"] = operation
        self._ids.span_id = spans.span_id
        server = self.tracer.start_span(f"{method} {route}", parent, SpanKind.SERVER, attrs,
                                        start_time=clock.ns(rec.start))
        ctx = trace_api.set_span_in_context(server, Context())
        for placing in spans.placings:
            self._placing(placing, ctx, clock, end)
        for n, attempt in enumerate(spans.attempts, 1):
            last = n == len(spans.attempts)
            self._attempt(attempt, n, last, rec, ctx, clock, end)
        self._end(server, rec.status, rec.error, clock.ns(end), server=True)

    def _request_attributes(self, rec: RequestRecord) -> dict:
        attrs: dict = {
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

    def _placing(self, placing: Placing, ctx: Context, clock: _Clock, end: float) -> None:
        attrs: dict = {"router.scheduler.calls": len(placing.calls) + placing.untraced_calls}
        if placing.worker is not None:
            attrs.update({"router.worker.id": placing.worker, "router.policy": placing.policy,
                          "router.fallback": placing.fallback})
        end_ns = clock.ns(placing.end if placing.end is not None else end)
        span = self.tracer.start_span("router.place", ctx, SpanKind.INTERNAL, attrs,
                                      start_time=clock.ns(placing.start))
        place_ctx = trace_api.set_span_in_context(span, Context())
        queue: trace_api.Span | None = None
        if placing.queued is not None:
            queue = self.tracer.start_span("router.queue", place_ctx, SpanKind.INTERNAL,
                                           start_time=clock.ns(placing.queued))
        queue_ctx = trace_api.set_span_in_context(queue, Context()) if queue is not None else place_ctx
        for call in placing.calls:
            attrs = {"router.scheduler.wait_ms": call.wait_ms}
            if call.outcome:
                attrs["router.scheduler.outcome"] = call.outcome
            if call.worker is not None:
                attrs["router.worker.id"] = call.worker
            # The calls made while it queued are the queue's: held calls, each waiting for room.
            queued = placing.queued is not None and call.start >= placing.queued
            sched = self.tracer.start_span("router.schedule", queue_ctx if queued else place_ctx,
                                           SpanKind.INTERNAL, attrs, start_time=clock.ns(call.start))
            self._end(sched, 0, call.error, clock.ns(call.end))
        if queue is not None:
            self._end(queue, 0, placing.error, end_ns)
        self._end(span, 0, placing.error, end_ns)

    def _attempt(self, attempt: Attempt, n: int, last: bool, rec: RequestRecord, ctx: Context,
                 clock: _Clock, end: float) -> None:
        parts = urlsplit(attempt.url)
        method = "GET" if rec.method == "WS" else rec.method
        attrs: dict = {
            "http.request.method": method,
            "url.full": _cut(attempt.url),
            "server.address": parts.hostname or "",
            "router.worker.id": attempt.worker,
            "router.attempt": n,
        }
        if parts.port is not None:
            attrs["server.port"] = parts.port
        self._ids.span_id = attempt.span_id
        span = self.tracer.start_span(f"{method} {route_of(rec.path)}", ctx, SpanKind.CLIENT, attrs,
                                      start_time=clock.ns(attempt.start))
        end_ns = clock.ns(attempt.end if attempt.end is not None else end)
        if attempt.failure is not None:  # before its answer began: retried, or the request failed
            self._end(span, 0, attempt.failure, end_ns)
        elif not last:  # a WebSocket moved on to another worker (this one stopped)
            self._end(span, 0, None, end_ns)
        else:  # the answer the client got
            self._first_token(span, rec, clock, attempt.start)
            self._end(span, rec.status, rec.error, end_ns)

    @staticmethod
    def _first_token(span: trace_api.Span, rec: RequestRecord, clock: _Clock, after: float) -> None:
        if rec.ttft_ms is not None:
            at = rec.start + rec.ttft_ms / 1000
            if at >= after:
                span.add_event("first_token", timestamp=clock.ns(at))

    @staticmethod
    def _end(span: trace_api.Span, status: int, error: str | None, end_ns: int,
             server: bool = False) -> None:
        """Status and error of a span, then its end. A SERVER span's 4xx is the client's error
        (OpenTelemetry's HTTP conventions leave its status unset; error.type says what it
        was); its 5xx, or an answer that failed mid-stream (its 200 went out first), is an
        error, as is any failure of an inner span. A client that left is nobody's failure."""
        if status:
            span.set_attribute("http.response.status_code", status)
        if error:
            span.set_attribute("error.type", error)
        if error in _CLIENT_LEFT:
            failed = False
        elif server and 400 <= status < 500:
            failed = False
        else:
            failed = bool(error) or status >= 400
        if failed:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=end_ns)

    @staticmethod
    def _context_of(spans: RequestTrace, span_id: int) -> Context:
        own = SpanContext(spans.trace_id, span_id, is_remote=False, trace_flags=TraceFlags(spans.flags))
        return trace_api.set_span_in_context(NonRecordingSpan(own), Context())

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
                self.provider.shutdown()
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
