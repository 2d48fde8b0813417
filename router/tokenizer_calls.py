"""vLLM's `POST /tokenize` and `POST /detokenize` (served at the root, no /v1 form), and the
Anthropic Messages API's `POST /v1/messages/count_tokens` (vLLM serves it beside /v1/messages),
relayed to a worker that serves the body's model, without a lease.

They generate nothing and take microseconds, so they do not go through the scheduler: a lease
would count them as load, and when the pool is saturated they would wait in the admission
queue behind generation requests for an answer any worker of the model gives at once. The
worker is picked here, by round robin over the scheduler's cached worker list (the healthy,
uncordoned workers that serve the model), or over the fallback's workers (the static
--workers and the last healthy list) while the scheduler is away. A worker that cannot be
reached is reported as a failed request would be, and another is tried, up to ATTEMPTS in all.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from itertools import count

import aiohttp
from aiohttp import web

from router.access_log import RequestRecord
from router.errors import error_response
from router.fallback import NoWorkerError
from router.scheduling import Route, Scheduling
from router.streaming import READ_TIMEOUT, UPSTREAM_ERRORS, failure_kind
from router.upstream_errors import read_bounded, relayed_error
from scheduler.clip import clip_repr
from scheduler.protocol import connection_refused
from scheduler.tls import PeerContext

log = logging.getLogger("router.proxy")

TOKENIZER_PATHS = frozenset({"/tokenize", "/detokenize"})  # served at the root
# Every path that counts tokens and generates nothing: relayed here, without a lease (a
# count_tokens call took one, and stood in the queue behind generations when the pool was full).
NO_LEASE_PATHS = TOKENIZER_PATHS | {"/v1/messages/count_tokens"}
ATTEMPTS = 3  # the worker picked, then up to two others
# Answers that say the worker (or a proxy in front of it) cannot serve now, not that the
# request is wrong: another worker is tried, as for a connection that fails.
_AWAY = frozenset({502, 503, 504})
# A model missing from a cached worker list this old is looked up again before its 404: a
# worker that just joined with it is found (at most one scheduler call a second for made-up
# names).
_RECHECK_AFTER_S = 1.0


class TokenizerCalls:
    def __init__(self, sched: Scheduling, session: aiohttp.ClientSession, worker_tls: PeerContext,
                 timeout: aiohttp.ClientTimeout, report_failed: Callable[[Route, str, bool], None]) -> None:
        self.sched = sched
        self.session = session
        self.worker_tls = worker_tls  # read for each call: a reload swaps its context
        self.timeout = timeout  # the proxy's first-byte one: connect and read
        self.report_failed = report_failed
        self._turns = count()

    async def relay(self, request: web.Request, rec: RequestRecord, path: str, raw: bytes,
                    headers: dict[str, str]) -> web.Response:
        """The worker's answer to `path` (a NO_LEASE_PATHS one) for the model in rec.model."""
        tried: list[str] = []
        last_failure = ""
        for _ in range(ATTEMPTS):
            try:
                route = await self._pick(rec.model, tried)
            except NoWorkerError as exc:
                if exc.unknown_model:
                    return error_response(404, f"model {clip_repr(rec.model)} is not served here ({exc})",
                                          code="model_not_found", param="model")
                rec.model_known = True
                if tried:
                    break  # every worker of the model was tried: the last failure tells
                return error_response(503, str(exc), "service_unavailable", code="no_worker",
                                      headers={"Retry-After": "1"})
            rec.model_known = True
            rec.worker = route.worker_id
            tried.append(route.worker_id)
            url = route.url + path + (f"?{request.query_string}" if request.query_string else "")
            try:
                async with self.session.post(url, data=raw, headers=headers, timeout=self.timeout,
                                             ssl=self.worker_tls.request_ssl) as up:
                    status = up.status
                    data = await (read_bounded(up) if status >= 400 else up.read())
                    ctype = up.headers.get("Content-Type", "application/json")
            except READ_TIMEOUT:
                # Not retried: a worker that takes this long on a tokenizer call is hung, and the
                # client has waited the first-byte timeout already.
                self.report_failed(route, "timeout", False)
                rec.error = "upstream_timeout"
                return error_response(504, "the worker sent no answer in time", "upstream_error",
                                      code="upstream_timeout")
            except UPSTREAM_ERRORS as exc:
                last_failure = f"{failure_kind(exc)}: {exc!r}"
                self.report_failed(route, failure_kind(exc), connection_refused(exc))
                log.info("id=%s worker %s failed %s (%s); trying another", rec.id, route.worker_id,
                         path, last_failure)
                continue
            if status in _AWAY:
                last_failure = f"http_{status}: {data[:200].decode(errors='replace')}"
                continue
            if route.fallback:
                self.sched.fallback.mark_ok(route.url)
            if status >= 400:
                data, ctype = relayed_error(status, data, ctype)
            return web.Response(status=status, body=data, headers={
                "Content-Type": ctype, "x-router-worker": route.worker_id, "x-request-id": rec.id})
        rec.error = last_failure
        return error_response(502, f"every attempt failed; last: {last_failure}", "upstream_error",
                              code="upstream_failed")

    async def _pick(self, model: str, tried: list[str]) -> Route:
        """The next worker for `model` not in `tried`. Raises NoWorkerError (unknown_model when
        no worker, healthy or not, serves it)."""
        sched = self.sched
        if sched.leasing and (not sched.worker_views_at or not self._has_model(model)):
            # A refresh when the list is older than that (or none came yet: a gateway just
            # started).
            await sched.models(_RECHECK_AFTER_S)
        if not sched.leasing or not sched.worker_views_at:
            # The scheduler is away (or has not listed its workers yet): the fallback's workers,
            # which rest one that failed for a while, as generation requests do here.
            w = sched.fallback.pick(model, tried)
            return Route(w.worker_id, w.url, None, "tokenizer_round_robin", {}, fallback=True)
        views = [v for v in sched.worker_views
                 if model in v.get("models", ()) and v.get("healthy") and not v.get("cordoned")]
        # Round robin over those up; a half-open one (on trial after being down) after them.
        up = [v for v in views if v.get("state") in ("up", None)]
        if up:
            turn = next(self._turns) % len(up)
            up = up[turn:] + up[:turn]
        for v in up + [v for v in views if v.get("state") not in ("up", None)]:
            if v["worker_id"] not in tried:
                return Route(v["worker_id"], v["url"].rstrip("/"), None, "tokenizer_round_robin", {})
        if not self._has_model(model):
            raise NoWorkerError(f"no worker serves model {clip_repr(model)}", unknown_model=True)
        if not views:
            raise NoWorkerError(f"no healthy worker serves model {clip_repr(model)} now")
        raise NoWorkerError(f"every worker serving model {clip_repr(model)} failed this request")

    def _has_model(self, model: str) -> bool:
        """Some worker the scheduler lists, in whatever state, serves the model."""
        return any(model in v.get("models", ()) for v in self.sched.worker_views)
