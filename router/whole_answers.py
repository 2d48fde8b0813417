"""Whole (non-stream) answers: fetched from the worker in one read, given up and retried
elsewhere when the scheduler reports the worker down meanwhile, and counted (usage, the lease,
a stored response's owner) before they are relayed.

`WholeForwarding` is the non-stream half of `router.proxy.Proxy` (kept apart, as
`router.streaming.StreamForwarding` is, to keep each module small); it uses the proxy's
session, timeouts, headers and lease bookkeeping. `_whole_answer` serves streamed requests
too: a worker may answer one with plain JSON.
"""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any

import aiohttp
from aiohttp import web

from router.access_log import RequestRecord
from router.scheduling import Route, Scheduling
from router.sse import usage_of_body
from router.stored_responses import ResponseOwners, response_id_in
from router.streaming import (
    OVERLOADED,
    READ_TIMEOUT,
    UPSTREAM_ERRORS,
    RetryElsewhere,
    before_first_byte,
)
from router.tokens import RESPONSES_PATH
from router.upstream_errors import answer_status, read_bounded, relayed_error
from scheduler.tls import PeerContext


class AnswerTimedOut(Exception):
    """A non-stream answer took longer than --request-timeout-ms: a 504, not retried (it would
    take as long on another worker)."""


class WholeForwarding:
    session: aiohttp.ClientSession
    worker_tls: PeerContext
    whole_timeout: aiohttp.ClientTimeout
    owners: ResponseOwners
    sched: Scheduling

    async def _fetch_whole(self, method: str, url: str, raw: bytes,
                           headers: dict[str, str]) -> tuple[int, bytes, str]:
        """(status, body, content type) of a worker's whole answer. Raises RetryElsewhere
        when it failed before answering, AnswerTimedOut past --request-timeout-ms."""
        try:
            async with self.session.request(
                method, url, data=raw or None, headers=headers, timeout=self.whole_timeout,
                ssl=self.worker_tls.request_ssl,
            ) as up:
                # An error answer is read bounded: only its message is relayed (see
                # router/upstream_errors.py), and some workers echo the whole prompt in it.
                data = await (read_bounded(up) if up.status >= 400 else up.read())
                return up.status, data, up.headers.get("Content-Type", "application/json")
        except READ_TIMEOUT as exc:
            raise AnswerTimedOut(repr(exc)) from None
        except UPSTREAM_ERRORS as exc:
            raise RetryElsewhere.after(exc) from None

    async def _unless_down(self, fetch: Coroutine[Any, Any, tuple[int, bytes, str]],
                           worker_id: str) -> tuple[int, bytes, str]:
        """`fetch`, given up (and retried elsewhere) if the scheduler reports its worker down
        meanwhile (router/down_watch.py): a hung worker would hold it until the request
        timeout, 30 minutes by default."""
        with self.sched.down_watch.watching(worker_id) as down:
            return await before_first_byte(fetch, down)

    def _whole_answer(self, route: Route, rec: RequestRecord, path: str, status: int, data: bytes,
                      ctype: str) -> tuple[bytes, str]:
        """What a worker's whole answer (`status`: answer_status's) counts for, streamed requests'
        included (a worker may answer one with plain JSON): its usage, the lease, the stored
        response's owner. Returns the body and content type to relay (an error's in the OpenAI
        shape). Raises RetryElsewhere when another worker may serve it."""
        if status >= 500 or status == OVERLOADED:
            raise RetryElsewhere.answered(status, data[:200].decode(errors="replace"))
        p, c = usage_of_body(data) if status == 200 else (None, None)
        if status == 200 and path == RESPONSES_PATH:
            self.owners.learn(response_id_in(data), route.worker_id, route.url, (p or 0) + (c or 0))
        if p is not None:
            rec.prompt_tokens = p
        rec.output_tokens = c or 0
        rec.status = status
        self._release(route, rec, ok=status < 400, handed_off=rec.detached and status == 200)
        if route.fallback:
            self.sched.fallback.mark_ok(route.url)
        if status >= 400:
            return relayed_error(status, data, ctype)
        return data, ctype

    async def _forward(
        self,
        request: web.Request,
        rec: RequestRecord,
        route: Route,
        path: str,
        raw: bytes,
        headers: dict[str, str],
    ) -> web.Response:
        url = route.url + path
        if request.query_string:
            url += "?" + request.query_string
        fetch = self._fetch_whole(request.method, url, raw, headers)
        if route.fallback:  # no scheduler to say the worker is down
            status, data, ctype = await fetch
        else:
            status, data, ctype = await self._unless_down(fetch, route.worker_id)
        status = answer_status(status, data)
        data, ctype = self._whole_answer(route, rec, path, status, data, ctype)
        headers_out = self._response_headers(route, rec)
        headers_out["Content-Type"] = ctype
        return web.Response(status=status, body=data, headers=headers_out)
