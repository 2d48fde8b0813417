"""Forwarding one OpenAI request: place it, send it, stream the answer back, retry
before the first byte, release the lease with what happened.

Hot path rules: the body is parsed once with json.loads and only a few fields are
read; it is forwarded as the client's original bytes (or with stream_options
spliced in); answers are written through chunk by chunk; no pydantic.

The parts of `Proxy` kept in their own modules: what is read and checked of a request before
it is placed (router/request_checks.py), streamed answers (router/streaming.py), whole answers
(router/whole_answers.py), calls on stored responses (router/stored_calls.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import secrets
import time
from collections.abc import Mapping
from itertools import count
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web

from router.access_log import AccessLog, RequestRecord, Stats, trace_id_of
from router.auth import KeyChecker
from router.config import RouterConfig
from router.default_model import NoDefaultModel, default_model
from router.errors import error_response
from router.fairness import SHARED_FLOW, flow_of
from router.fallback import NoWorkerError
from router.in_flight import SHUTTING_DOWN, InFlight
from router.lax_fields import lax_true
from router.metrics import RouterMetrics
from router.queue import QueueDisplaced, QueueFull, QueueTimeout
from router.request_checks import STREAMABLE, delivery, is_name, model_request, read_request_body
from router.scheduling import PinnedWorkerGone, Route, Scheduling
from router.sessions import session_of
from router.slash_redirect import endpoint_redirect, unrouted
from router.stored_calls import UNREACHABLE, StoredResponseCalls
from router.stored_responses import STORED_RESPONSE_PATH, Owner, ResponseOwners
from router.streaming import RetryElsewhere, StreamForwarding
from router.tokenizer_calls import NO_LEASE_PATHS, TokenizerCalls
from router.tokens import (
    RESPONSES_PATH,
    TokenCounter,
    answers_of,
    schedule_request,
    schedule_request_off_loop,
)
from router.upstream_errors import error_code_of
from router.whole_answers import AnswerTimedOut, WholeForwarding
from scheduler.client import SchedulerRequestError, UnknownModelError
from scheduler.clip import clip_repr
from scheduler.protocol import CLIENT_LEFT
from scheduler.tls import PeerContext

if TYPE_CHECKING:
    from router.trace_collect import RequestTrace
    from router.tracing import Tracing

log = logging.getLogger("router.proxy")

# Request headers not sent on to the worker: hop-by-hop ones, those the gateway sets itself,
# the client's credentials, and the body's framing and encoding (the body sent on is the one
# the gateway read: decoded, and sized anew). The Sec-WebSocket-* ones (prefix below) too: they
# belong to the client's WebSocket handshake with the gateway (its key, the extensions and
# subprotocols it offered, an API key carried as one); the gateway's handshake with the worker
# sets its own, and a client's key must not reach a worker.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
        "authorization",
        "cookie",
        "accept-encoding",
        "content-encoding",
        # Hop-by-hop too: Expect was the client's to the gateway, which has the body already (a
        # worker's 100 Continue would only cost a round trip); Proxy-Connection is an old
        # clients' Connection.
        "expect",
        "proxy-connection",
    }
)
_WS_HANDSHAKE_PREFIX = "sec-websocket-"
# W3C trace context and baggage: passed on with every request, also on the paths whose
# headers are otherwise rebuilt, so that an engine that traces (vLLM's --otlp-traces-endpoint)
# puts its spans in the client's trace.
TRACE_HEADERS = ("traceparent", "tracestate", "baggage")
# A client's X-Request-Id is kept when it is this plain (it is logged and sent on as is).
_CLIENT_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


class Proxy(StreamForwarding, WholeForwarding, StoredResponseCalls):
    def __init__(
        self,
        cfg: RouterConfig,
        sched: Scheduling,
        metrics: RouterMetrics,
        stats: Stats,
        keys: KeyChecker,
        session: aiohttp.ClientSession,
        worker_tls: PeerContext,
    ) -> None:
        self.cfg = cfg
        self.sched = sched
        self.metrics = metrics
        self.stats = stats
        self.keys = keys
        self.session = session
        # https:// workers: read for each call (ssl=), a reload swaps its context.
        self.worker_tls = worker_tls
        self.timeout = aiohttp.ClientTimeout(
            total=None,
            connect=cfg.connect_timeout_ms / 1000,
            sock_connect=cfg.connect_timeout_ms / 1000,
            sock_read=cfg.first_byte_timeout_ms / 1000,
        )
        # A non-stream answer comes whole at the end of its generation: no first byte before.
        self.whole_timeout = aiohttp.ClientTimeout(
            total=None,
            connect=cfg.connect_timeout_ms / 1000,
            sock_connect=cfg.connect_timeout_ms / 1000,
            sock_read=cfg.request_timeout_ms / 1000,
        )
        self.idle_s = cfg.idle_stream_timeout_ms / 1000
        self._ids = count(1)
        # Random per process: replicas started in the same second must not hand out the same
        # ids, which engines use as their own (vLLM: `chatcmpl-<X-Request-Id>`). Older vLLM
        # releases fail a second request under an id still in flight ("Request id ... already
        # running" in their source); vLLM 0.32 serves it (tests/router/test_real_vllm.py).
        self._id_prefix = secrets.token_hex(4)
        self._live_client_ids: set[str] = set()
        self.tokens = TokenCounter(cfg.tokenizer)
        self.access_log: AccessLog | None = None  # set by the app when --access-log is on
        # Set by the app with --otlp-traces-endpoint (router/tracing.py); None: no tracing code
        # runs, and the client's trace context goes on as it came.
        self.tracing: Tracing | None = None
        self.upstream_auth = f"Bearer {cfg.upstream_api_key}" if cfg.upstream_api_key else None
        self.owners = ResponseOwners()
        self.tokenizer = TokenizerCalls(sched, session, worker_tls, self.timeout, self.report_failed)
        self.in_flight = InFlight()  # what a stopping gateway waits for

    # ---- entry points ------------------------------------------------------------------
    async def handle(self, request: web.Request) -> web.StreamResponse:
        path = request.match_info.get("tail")
        if path is not None:
            path = "/v1/" + path
        else:  # a root path (pooling, tokenizer), under the base path too
            root = request.match_info.get("root")
            path = "/" + root if root is not None else request.path
        rec = RequestRecord(self.request_id(request, ""), request.method, path)
        rec.trace = trace_id_of(request.headers.get("traceparent"))
        if self.tracing is not None:
            self.begin_trace(request, rec)
        rec.flow = self.flow_of(request)
        self.metrics.in_flight.inc()
        self.in_flight.enter()
        try:
            resp = await self._handle(request, rec, path)
            rec.status = resp.status if rec.status == 0 else rec.status
            if rec.status >= 400 and rec.error is None:
                rec.error = error_code_of(resp)
            return resp
        except asyncio.CancelledError:
            if self.in_flight.cutting and rec.status == 0:
                # Cut by the stopping gateway before any byte went out (queued, or waiting for
                # its worker): a 503 the client retries on another replica.
                asyncio.current_task().uncancel()  # type: ignore[union-attr]
                rec.status, rec.error = 503, "shutting_down"
                return error_response(503, SHUTTING_DOWN, "server_error", code="shutting_down")
            rec.status = rec.status or 499  # client went away
            rec.error = rec.error or "client_disconnected"
            raise
        finally:
            self.metrics.in_flight.dec()
            self.in_flight.leave()
            self._finish(rec)

    def begin_trace(self, request: web.Request, rec: RequestRecord) -> None:
        """The gateway's trace of the request (tracing on): the client's trace, or a new one,
        which the access log names then when it is kept."""
        assert self.tracing is not None
        spans = rec.spans = self.tracing.begin(request.headers)
        if spans.sampled:
            rec.trace = spans.trace_hex

    def observe_answer(self, model: str, ttft_s: float | None, e2e_s: float, output_tokens: int,
                       answers: int) -> None:
        """One answer's latencies (a request's, or one request's on a WebSocket, whose socket
        may stay open for hours: its life is no request's latency)."""
        _, _, ttft_h, tpot_h, e2e_h = self.metrics.per_model(model)
        e2e_h.observe(e2e_s)
        if ttft_s is None:
            return
        ttft_h.observe(ttft_s)
        # Per answer: n answers (or a batch's) stream side by side, so their tokens together
        # over the time would read n times too fast.
        per_answer = output_tokens / answers
        if per_answer > 1:
            tpot_h.observe((e2e_s - ttft_s) / (per_answer - 1))

    def flow_of(self, request: web.Request) -> str:
        """The request's flow (tenant) in the admission queue (router/fairness.py)."""
        if not self.cfg.fair_queueing:
            return SHARED_FLOW
        return flow_of(request.headers, self.cfg.fairness_header)

    def settle_fair(self, rec: RequestRecord) -> None:
        """Its flow's charge in the queue's token turns (scheduler/fair_share.py) gives way to what
        it used since the last settlement: at its end, and on a WebSocket at each answer's end
        too (a socket can carry a tenant's requests for hours, charged once when placed)."""
        if rec.fair_charge is None:
            return
        used = rec.served
        prompt = rec.prompt_tokens * rec.choices if used else 0
        output = rec.output_tokens if used else 0
        settled_prompt, settled_output = rec.fair_settled
        self.sched.queue.settle(rec.model, rec.flow, rec.fair_charge, prompt - settled_prompt,
                                output - settled_output)
        rec.fair_charge, rec.fair_settled = 0.0, (prompt, output)

    def request_id(self, request: web.Request, kind: str) -> str:
        """The client's X-Request-Id when it is usable as one (tracing through the gateway to
        the engine, which takes it as its own, as vLLM and our worker do), else a new one."""
        client_id = request.headers.get("X-Request-Id")
        own = f"{self._id_prefix}-{kind}{next(self._ids)}"
        if client_id is None or not _CLIENT_ID.fullmatch(client_id):
            return own
        if client_id in self._live_client_ids:
            # The client reused an id still in flight here: older vLLM releases (and engines
            # keyed by request id) fail a second request under the id of one they are running.
            return f"{client_id}-{own}"
        self._live_client_ids.add(client_id)
        return client_id

    def model_label(self, rec: RequestRecord) -> str:
        """The request's model as router_requests_total labels it. Refused before any worker
        took it (a malformed body, a full queue), a request's model is the client's word:
        made-up names would each open a series, until the bound counted the real models' new
        series as "other". ("-": it names none, as a GET of a stored response.)"""
        model = rec.model
        if not (rec.model_known or model == "-" or self.metrics.has_model(model)
                or model in self.sched.fallback.models()):
            return "unknown"
        return model

    def _finish(self, rec: RequestRecord) -> None:
        self._live_client_ids.discard(rec.id)
        m = self.metrics
        m.request_done(self.model_label(rec), rec.status, rec.worker)
        # A refusal counts in router_requests_total only (see RequestRecord.served); nor
        # does an invented model name open a label set of the per-model series.
        if rec.served and (rec.prompt_tokens or rec.output_tokens or rec.ttft_ms is not None):
            tenant_requests, tenant_prompt, tenant_output = m.per_tenant(rec.flow)
            tenant_requests.inc()
            tenant_prompt.inc(rec.prompt_tokens)
            tenant_output.inc(rec.output_tokens)
            prompt_c, gen_c, _, _, _ = m.per_model(rec.model)
            prompt_c.inc(rec.prompt_tokens)
            gen_c.inc(rec.output_tokens)
            # A socket's latencies are its answers' (observe_answer); a background response's
            # answer is its `queued` acknowledgment, a few milliseconds that are no answer's
            # latency (its generation goes on in the worker, unseen here).
            if rec.method != "WS" and not (rec.detached and not rec.stream):
                ttft_s = rec.ttft_ms / 1000 if rec.ttft_ms is not None else None
                self.observe_answer(rec.model, ttft_s, time.perf_counter() - rec.start,
                                    rec.output_tokens, rec.sequences)
        self.settle_fair(rec)
        self.stats.add(rec)
        if self.access_log is not None:
            self.access_log.add(rec)
        if rec.spans is not None and self.tracing is not None:
            self.tracing.publish(rec)

    # ---- one request ---------------------------------------------------------------------
    async def _handle(self, request: web.Request, rec: RequestRecord, path: str) -> web.StreamResponse:
        if not self.keys.allows(request.headers.get("Authorization")):
            return error_response(
                401, "invalid or missing API key", "authentication_error", code="invalid_api_key"
            )
        redirect = endpoint_redirect(request, path)
        if redirect is not None:  # `/v1/chat/completions/`: to the endpoint, as vLLM does
            return redirect
        raw = await read_request_body(request, path, self.cfg)
        if isinstance(raw, web.Response):
            return raw

        stored = STORED_RESPONSE_PATH.fullmatch(path)
        if stored is not None:  # GET or cancel on a stored response: to its worker, no model
            return await self.stored_response_call(request, rec, path, stored.group(1), raw)

        req = model_request(request, path, raw)
        if req is None:
            return await unrouted(request)
        if isinstance(req, web.Response):
            return req
        if req.model is None:
            try:
                req.model = default_model(await self.sched.models(self.cfg.models_cache_ms / 1000))
            except NoDefaultModel as exc:
                return error_response(400, str(exc), param="model")
        rec.model = model = req.model
        body = req.body
        if path in NO_LEASE_PATHS:
            return await self.tokenizer.relay(request, rec, path, raw,
                                              self._upstream_headers(request, rec.id, path, rec.spans))
        how = delivery(request, path, req, rec)
        if isinstance(how, web.Response):
            return how
        raw, stream, priority, strip_usage = how.raw, how.stream, how.priority, how.strip_usage

        sched_body = await self.schedule_body_off_loop(rec, model, body)
        self.note_session(sched_body, request.headers, body)
        # A background response goes on in the worker after its answer (`queued`) is out.
        rec.detached = path == RESPONSES_PATH and lax_true(body.get("background"))
        previous = body.get("previous_response_id") if path == RESPONSES_PATH else None
        pinned: Owner | None = None
        if previous is not None:
            # It continues a response one worker stores: that worker, or a 404 as it would say.
            if previous == "":  # no worker stores it: vLLM looks it up, and says so
                return error_response(404, "Response with id '' not found.", param="previous_response_id")
            if not is_name(previous):
                return error_response(400, "'previous_response_id' must be a non-empty string",
                                      param="previous_response_id")
            found = await self.stored_owner(previous, request, "previous_response_id")
            if isinstance(found, web.Response):
                return found  # lost with its worker, or held by none
            pinned = found
            sched_body["worker_id"] = pinned.worker_id
            if pinned.tokens:  # the conversation so far: KV on that worker, already prefilled
                sched_body["prompt_tokens"] = sched_body.get("prompt_tokens", 0) + pinned.tokens
                sched_body["cached_tokens"] = pinned.tokens

        spans = rec.spans
        headers = self._upstream_headers(request, rec.id, path, spans)
        deadline = time.monotonic() + self.cfg.queue_timeout_ms / 1000
        exclude: list[str] = []
        last_failure = ""
        overloaded = False
        for attempt in range(self.cfg.retry_count + 1):
            try:
                route = await self._acquire(rec, sched_body, exclude, deadline,
                                            pinned.url if pinned is not None else None, priority)
            except PinnedWorkerGone:
                assert previous is not None and pinned is not None
                return self.unplaceable(previous, pinned, gone=True)
            except QueueFull as exc:
                displaced = isinstance(exc, QueueDisplaced)
                self.metrics.rejected.labels("displaced" if displaced else "queue_full").inc()
                return error_response(
                    429,
                    "too many requests waiting: the queue is full, retry later"
                    + (f" (this request's place went to {exc.by})" if displaced else ""),
                    "rate_limit_error",
                    code="queue_full",
                    headers={"Retry-After": "1"},
                )
            except QueueTimeout:
                self.metrics.rejected.labels("queue_timeout").inc()
                return error_response(
                    429,
                    "no worker became free within the queue timeout",
                    "rate_limit_error",
                    code="queue_timeout",
                    headers={"Retry-After": "1"},
                )
            except UnknownModelError as exc:
                return error_response(
                    404,
                    f"model {clip_repr(model)} is not served here ({exc})",
                    code="model_not_found",
                    param="model",
                )
            except NoWorkerError as exc:
                if exc.unknown_model:
                    return error_response(404, str(exc), code="model_not_found", param="model")
                if attempt > 0:  # every worker of the model was tried: the last failure tells
                    break
                if pinned is not None and previous is not None:
                    # Its one worker cannot take it: it left the pool (the last of its model
                    # did, and the scheduler knows the model no more), or it is down for now.
                    return self.unplaceable(previous, pinned, gone=False)
                self.metrics.rejected.labels("no_worker").inc()
                return error_response(
                    503, str(exc), "service_unavailable", code="no_worker", headers={"Retry-After": "1"}
                )
            except SchedulerRequestError as exc:
                return error_response(400, str(exc))
            rec.worker = route.worker_id
            if spans is not None:  # the worker's parent span is this attempt's
                headers["traceparent"] = spans.attempt(route.worker_id, route.url + path)
            try:
                if stream:
                    answer = await self._forward_stream(
                        request, rec, route, path, raw, headers, strip_usage
                    )
                else:
                    answer = await self._forward(request, rec, route, path, raw, headers)
                if (pinned is not None and previous is not None and answer.status == 404
                        and isinstance(answer.body, bytes) and previous.encode() in answer.body):
                    # The worker no longer holds it (restarted, evicted, deleted behind this
                    # gateway): lost, and said so now and to the next follow-up, which is not
                    # pinned (and queued) to a worker that would only answer 404 again.
                    return self.owner_dropped(previous, pinned, "previous_response_id", answer.headers)
                return answer
            except asyncio.CancelledError:
                # The client went away: the worker was not at fault; give the lease back (a
                # background response goes on without its client).
                self._release_client_left(route, rec)
                raise
            except AnswerTimedOut as exc:
                self._failed(route, "timeout", rec)
                rec.status, rec.error = 504, "upstream_timeout"
                log.warning("id=%s worker %s sent no answer within --request-timeout-ms (%s)",
                            rec.id, route.worker_id, exc)
                return error_response(
                    504, f"the worker sent no answer within {self.cfg.request_timeout_ms} ms",
                    "upstream_error", code="upstream_timeout")
            except RetryElsewhere as r:
                reason = r.reason
                last_failure = f"{reason}: {r.detail}" if r.detail else reason
                if spans is not None:
                    spans.attempt_failed(reason)
                overloaded = r.overloaded
                if overloaded:
                    # Full, not down: no failure report (that would take it out of rotation),
                    # and no KV credit for tokens it never held.
                    self._release(route, rec, ok=True, error="overloaded", held_kv=False)
                else:
                    self._failed(route, reason, rec, r.refused)
                    if pinned is not None and previous is not None and reason in UNREACHABLE:
                        # No other worker holds what it continues: no retry, and the answer
                        # every call on the response gets while its worker is out of reach.
                        rec.error = last_failure
                        return self.owner_unreachable(previous, pinned, reason, "previous_response_id")
                exclude.append(route.worker_id)
                # No worker holds the request until the next attempt is placed: a client that
                # leaves meanwhile was served by none (its prompt is no input a worker took).
                rec.worker = "-"
                if attempt < self.cfg.retry_count:
                    rec.retries += 1
                    self.metrics.retries.labels(reason).inc()
                    log.info(
                        "id=%s worker %s failed before the first byte (%s); retrying",
                        rec.id,
                        route.worker_id,
                        last_failure,
                    )
            except Exception:
                # Anything else is a gateway bug or an answer nothing here expected: the lease
                # goes back now rather than count as load until it expires.
                rec.status, rec.error = 500, "gateway_error"
                self._release(route, rec, ok=False, error="gateway_error")
                if request.writer.output_size:
                    raise  # a stream had started: aiohttp logs it and cuts the connection
                # Nothing was sent yet: the client gets a 500 in the OpenAI shape it can parse,
                # not aiohttp's plain text, and the log one line with the traceback.
                log.exception("id=%s gateway error forwarding to worker %s", rec.id, route.worker_id)
                return error_response(500, "the gateway failed to relay the worker's answer",
                                      "internal_error", code="gateway_error")
        rec.error = last_failure
        rec.worker = exclude[-1]  # the last to fail it, for the access log and the error counts
        if overloaded:
            # The last worker tried was full: a client should come back, as from a full queue.
            self.metrics.rejected.labels("workers_overloaded").inc()
            return error_response(
                429,
                f"every worker tried is overloaded; last: {last_failure}",
                "rate_limit_error",
                code="workers_overloaded",
                headers={"Retry-After": "1"},
            )
        return error_response(
            502, f"every attempt failed; last: {last_failure}", "upstream_error", code="upstream_failed"
        )

    async def _acquire(
        self, rec: RequestRecord, body: dict[str, Any], exclude: list[str], deadline: float,
        pinned_url: str | None = None, priority: int = 0,
    ) -> Route:
        """sched.acquire, timed into the record and the queue-wait histogram however the wait
        ends: placed, timed out, or abandoned by its client (the longest waits end that way,
        and a histogram of the placed alone would hide them). A full queue's refusal waited
        for nothing and is counted as rejected instead."""
        t0 = time.perf_counter()
        refused = False
        spans = rec.spans
        try:
            placing = self.sched.acquire(body, exclude, deadline, pinned_url, priority, rec.flow, spans)
            route = await (placing if spans is None else spans.placing(placing))
            rec.model_known = True
            rec.fair_charge = (rec.fair_charge or 0.0) + route.charge  # a retry is charged again
            return route
        except QueueFull as exc:
            refused = not isinstance(exc, QueueDisplaced)  # a displaced request did wait
            raise
        except NoWorkerError as exc:
            rec.model_known = rec.model_known or not exc.unknown_model
            raise
        finally:
            if not refused:
                waited = time.perf_counter() - t0
                rec.queue_ms += waited * 1000
                self.metrics.queue_wait.observe(waited)

    def _upstream_headers(self, request: web.Request, req_id: str, path: str,
                          spans: RequestTrace | None = None) -> dict[str, str]:
        """The headers a worker is sent. `spans` (tracing on): its trace context names the
        gateway's span as the parent instead of the client's."""
        if path in STREAMABLE:
            headers = {"Content-Type": "application/json"}
            for name in TRACE_HEADERS:
                value = request.headers.get(name)
                if value is not None:
                    headers[name] = value
        else:
            hop = HOP_BY_HOP
            connection = request.headers.get("Connection")
            if connection:
                # The headers a Connection header names are hop-by-hop as well (RFC 9110 7.6.1).
                hop = hop | {name.strip().lower() for name in connection.split(",")}
            headers = {
                k: v
                for k, v in request.headers.items()
                if k.lower() not in hop and not k.lower().startswith(_WS_HANDSHAKE_PREFIX)
            }
        headers["X-Request-Id"] = req_id
        if spans is not None:
            spans.upstream_headers(headers)
        if self.cfg.forward_api_key and "Authorization" in request.headers:
            headers["Authorization"] = request.headers["Authorization"]
        elif self.upstream_auth:
            headers["Authorization"] = self.upstream_auth
        return headers

    def _response_headers(self, route: Route, rec: RequestRecord) -> dict[str, str]:
        h = {"x-router-worker": route.worker_id, "x-request-id": rec.id}
        if self.cfg.debug_headers:
            reason = route.reason
            h["x-router-policy"] = route.policy
            if "score" in reason:
                h["x-router-score"] = str(reason["score"])
            age = reason.get("data_age_ms", reason.get("age_ms"))
            if age is not None:
                h["x-router-data-age-ms"] = str(age)
            h["x-router-queue-ms"] = f"{rec.queue_ms:.2f}"
            if reason:
                h["x-router-reason"] = json.dumps(reason, separators=(",", ":"))[:2000]
        return h

    def _failed(self, route: Route, reason: str, rec: RequestRecord, refused: bool = False) -> None:
        self.report_failed(route, reason, refused)
        self._release(route, rec, ok=False, error=reason)

    def report_failed(self, route: Route, reason: str, refused: bool = False) -> None:
        """The worker failed a request (`reason`: router/streaming.py's kinds, or "draining":
        router/draining.py; `refused`: its port refused the connection): the fallback's round
        robin passes it over, and the scheduler is told."""
        self.sched.fallback.mark_failed(route.url)
        client = self.sched.client
        if client is not None and not route.fallback:
            client.report_failure_nowait(route.worker_id, reason, refused)

    def _prefilled(self, route: Route) -> None:
        """The first chunk of a stream comes after the worker prefilled the prompt: the
        scheduler can count the worker free for more prompt work a scrape earlier."""
        if self.cfg.report_prefilled and route.lease_id is not None and not route.released:
            self.sched.prefilled_nowait(route.lease_id)

    def schedule_body(self, rec: RequestRecord, model: str, body: dict[str, Any]) -> dict[str, Any]:
        """What the scheduler is told of a request; notes its prompt estimate and choices."""
        sched_body, rec.prompt_tokens, rec.choices = schedule_request(self.tokens, model, body, rec.path)
        rec.sequences = answers_of(body)
        return sched_body

    def note_session(self, sched_body: dict[str, Any], headers: Mapping[str, str],
                     body: dict[str, Any]) -> None:
        """Name the request's session to the scheduler, when sessions are on and it has one
        (router/sessions.py): every call placing it (retries, queued asks, a WebSocket's moves)
        sends this body."""
        key = session_of(headers, body, self.cfg.session_header)
        if key is not None:
            sched_body["session"] = key

    async def schedule_body_off_loop(self, rec: RequestRecord, model: str, body: dict[str, Any]
                                     ) -> dict[str, Any]:
        """schedule_body, with a long prompt tokenized in a thread (--tokenizer): on the loop,
        a prompt of megabytes paused every stream the gateway relays while it was counted."""
        sched_body, rec.prompt_tokens, rec.choices = await schedule_request_off_loop(
            self.tokens, model, body, rec.path)
        rec.sequences = answers_of(body)
        return sched_body

    def _release(
        self, route: Route, rec: RequestRecord, ok: bool, error: str | None = None, held_kv: bool = True,
        handed_off: bool = False,
    ) -> None:
        """Give the lease back. The tokens sent with it are KV the scheduler credits as freed
        before the next scrape shows it: none when the worker refused the request.
        `handed_off`: the worker goes on with the request (a background response), so nothing
        is freed and its load counts until a scrape shows it there."""
        self.release_lease(route, ok, rec.prompt_tokens * rec.choices if held_kv else 0,
                           rec.output_tokens if held_kv else 0, rec.ttft_ms, error, handed_off)

    def release_lease(self, route: Route, ok: bool, prompt_tokens: int, output_tokens: int,
                      ttft_ms: float | None = None, error: str | None = None,
                      handed_off: bool = False) -> None:
        """_release with the KV it held given apart (a WebSocket's requests each hold a lease)."""
        if route.lease_id is None or route.released or self.sched.client is None:
            return
        route.released = True
        rel: dict[str, Any] = {
            "lease_id": route.lease_id,
            "ok": ok,
            "prompt_tokens": prompt_tokens,
            "output_tokens": output_tokens,
        }
        if handed_off:
            rel["handed_off"] = True
        if ttft_ms is not None:
            rel["ttft_ms"] = round(ttft_ms, 3)
        if error:
            rel["error"] = error
        self.sched.release_nowait(rel)

    def _release_client_left(self, route: Route, rec: RequestRecord) -> None:
        """The client went away: no failure of the worker's. A background response goes on in
        it (handed off); anything else is marked as a client that left, which is no verdict on
        a half-open worker's trial."""
        self._release(route, rec, ok=True, handed_off=rec.detached,
                      error=None if rec.detached else CLIENT_LEFT)
