"""Calls on a stored response (`GET /v1/responses/{id}`, `POST /v1/responses/{id}/cancel`,
`DELETE /v1/responses/{id}`, ...) go to the worker that stores it, and nowhere else
(router/stored_responses.py).
A background response's replay (`GET ...?stream=true`) is relayed as it comes, and a
retrieved response's usage updates the conversation's length the gateway remembers (a
background response is learnt `queued`, before it has any).

`StoredResponseCalls` is a part of `router.proxy.Proxy` (kept apart to keep each module
small); it uses the proxy's session, headers and owner map. Such a call generates nothing,
so it takes no lease and is not queued; it is not retried elsewhere either, since no other
worker holds the response.

A response lives in its worker's memory only, so when that worker is lost the gateway says
so, in the same words for every call on the response (these, and a follow-up that continues
it, `previous_response_id`):
- the worker cannot be reached (its connection fails, or it hangs: a call, a replay included,
  waits on it only until the scheduler reports it down) but is still in the pool: a 503
  `worker_unavailable` with Retry-After, since it may come back with the response;
- the worker answers that it no longer holds the response (it restarted), or it cannot be
  reached and has left the pool (the scheduler's last worker list, read after the worker was
  last known in the pool with the response, no longer has it): a 404 `response_lost` naming
  the worker and why, remembered for later calls (a client polling a background response
  stops polling);
- the worker left the pool but still answers (it drains): its responses are still served,
  and only a follow-up, which cannot be placed there, is a 404 `response_lost`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

import aiohttp
from aiohttp import web

from router.access_log import RequestRecord
from router.down_watch import WorkerDown, unless_down
from router.errors import SEQUENCE_NUMBER, error_response, responses_error_event
from router.metrics import RouterMetrics
from router.scheduling import Scheduling
from router.sse import usage_of_body
from router.stored_responses import (
    DROPPED,
    LEFT,
    Lost,
    Owner,
    ResponseOwners,
    lost_message,
    not_found_message,
)
from router.streaming import UPSTREAM_ERRORS, failure_kind
from router.upstream_errors import read_bounded, relayed_error
from scheduler.clip import clip, clip_repr
from scheduler.tls import PeerContext

log = logging.getLogger("router.proxy")

LOST = "response_lost"
UNAVAILABLE = "worker_unavailable"
# Why a worker could not be reached, by failure kind (router.streaming.failure_kind, and the
# RetryElsewhere reasons that mean the same): the words of the 503 that says so.
UNREACHABLE = {
    "connect": "no connection could be made to it",
    "connection": "its connection failed",
    "timeout": "it did not answer in time",
    "worker_down": "the scheduler reports it down",
    "unavailable": "the scheduler reports it unavailable",
}

class StoredResponseCalls:
    session: aiohttp.ClientSession
    worker_tls: PeerContext
    timeout: aiohttp.ClientTimeout
    owners: ResponseOwners
    sched: Scheduling
    metrics: RouterMetrics

    async def owner_of(self, response_id: str, request: web.Request) -> Owner | None:
        """The worker that stores the response, asking every known worker when the gateway
        has not seen it (another replica answered it, or this one restarted since)."""
        owner = self.owners.get(response_id)
        if owner is not None:
            self.metrics.stored_response_lookups.labels("remembered").inc()
            return owner
        probe_headers = {k: v for k, v in self._upstream_headers(request, "", "").items()
                         if k == "Authorization"}
        # The healthy workers the scheduler last listed, and the static --workers.
        workers = [(w.worker_id, w.url) for w in self.sched.fallback.workers]
        owner = await self.owners.locate(response_id, workers, self.session, self.worker_tls, probe_headers)
        self.metrics.stored_response_lookups.labels("found" if owner is not None else "missing").inc()
        return owner

    async def stored_owner(self, response_id: str, request: web.Request, param: str) -> Owner | web.Response:
        """The worker that stores the response, or the 404 to answer: lost with its worker
        (remembered), or held by no worker."""
        lost = self.owners.lost(response_id)
        if lost is not None:
            self.metrics.stored_response_lookups.labels("lost").inc()
            return lost_answer(response_id, lost, param)
        owner = await self.owner_of(response_id, request)
        if owner is None:
            return error_response(404, not_found_message(response_id), param=param)
        return owner

    def owner_left(self, owner: Owner) -> bool:
        """Whether the worker has left the pool, by the scheduler's last worker list: only one
        read after the worker was last known in the pool with the response tells (an older one
        may predate its joining), and a static worker, a scheduler away or one still learning
        its pool after a restart (the worker may not have heartbeated yet) tells nothing."""
        sched = self.sched
        if (sched.client is None or sched.down_since is not None or sched.scheduler_learning
                or sched.worker_views_at <= owner.in_pool_at):
            return False
        if owner.url in sched.fallback.static_urls:
            return False
        return all(view.get("worker_id") != owner.worker_id for view in sched.worker_views)

    def owner_unreachable(self, response_id: str, owner: Owner, reason: str, param: str) -> web.Response:
        """The answer when the worker could not be reached (`reason`: an UNREACHABLE key): it
        may come back with the response while in the pool; out of it, the response is lost."""
        if self.owner_left(owner):
            return lost_answer(response_id, self.owners.mark_lost(response_id, owner.worker_id, LEFT), param)
        return unavailable_answer(response_id, owner, reason)

    def unplaceable(self, response_id: str, owner: Owner, gone: bool) -> web.Response:
        """A follow-up's answer when the scheduler will not place it on the worker that stores
        what it continues: the worker left the pool (`gone`: the scheduler says so; else by
        its last worker list), or it is down for now. Not marked lost: a worker that left the
        pool but still answers (it drains) serves GET and cancel on what it holds."""
        if gone or self.owner_left(owner):
            return lost_answer(response_id, Lost(owner.worker_id, LEFT), "previous_response_id")
        return unavailable_answer(response_id, owner, "unavailable")

    def owner_dropped(self, response_id: str, owner: Owner, param: str,
                      headers: Mapping[str, str]) -> web.Response:
        """The answer when the worker answered that it no longer holds the response (with its
        answer's `headers`, the x-router-* ones and the request's id)."""
        lost = self.owners.mark_lost(response_id, owner.worker_id, DROPPED)
        kept = {k: v for k, v in headers.items() if k.lower() != "content-type"}
        return lost_answer(response_id, lost, param, kept)

    async def stored_response_call(self, request: web.Request, rec: RequestRecord, path: str,
                                   response_id: str, raw: bytes) -> web.StreamResponse:
        found = await self.stored_owner(response_id, request, "response_id")
        if isinstance(found, web.Response):
            return found
        owner = found
        rec.worker = owner.worker_id
        url = owner.url + path
        if request.query_string:
            url += "?" + request.query_string
        headers = {"x-router-worker": owner.worker_id, "x-request-id": rec.id}
        timeout = self.timeout
        if request.query.get("stream", "false").lower() not in ("false", "0"):
            # A replay waits as long as the response does (queued in the engine, it sends
            # nothing): its client, not the first-byte timeout, decides when to give up (or
            # the scheduler, finding the worker down).
            timeout = aiohttp.ClientTimeout(connect=timeout.connect, sock_connect=timeout.sock_connect)
        with self.sched.down_watch.watching(owner.worker_id) as down:
            try:
                up = await unless_down(self.session.request(
                    request.method, url, data=raw or None, timeout=timeout,
                    headers=self._upstream_headers(request, rec.id, path, rec.spans),
                    ssl=self.worker_tls.request_ssl,
                ), down)
            except (WorkerDown, *UPSTREAM_ERRORS) as exc:
                return self.owner_unreachable(response_id, owner, _failure(exc), "response_id")
            async with up:
                if up.status == 200 and up.content_type == "text/event-stream":
                    # Outside the try: once the replay began, a failure is its error event.
                    return await self._relay_replay(request, up, headers, owner, down)
                status = up.status
                ctype = up.headers.get("Content-Type", "application/json")
                try:
                    data = await unless_down(read_bounded(up) if status >= 400 else up.read(), down)
                except (WorkerDown, *UPSTREAM_ERRORS) as exc:
                    return self.owner_unreachable(response_id, owner, _failure(exc), "response_id")
        if status == 404 and response_id.encode() in data:
            # The worker is up and no longer holds it (it restarted, or dropped it): lost.
            # (A 404 that does not name it, a path the worker lacks, says nothing of it.)
            return self.owner_dropped(response_id, owner, "response_id", headers)
        if status == 200 and request.method == "DELETE":
            self.owners.forget(response_id)  # a follow-up now finds it nowhere, at once
        elif status == 200 and request.method == "GET":
            prompt, output = usage_of_body(data)
            if prompt is not None:  # finished: the conversation's length is known now
                # (An answer to a call sent straight to it says nothing of the pool: a worker
                # that left it but drains answers too.)
                self.owners.learn(response_id, owner.worker_id, owner.url, prompt + (output or 0),
                                  owner.in_pool_at)
        if status >= 400:
            data, ctype = relayed_error(status, data, ctype)
        return web.Response(status=status, body=data, headers={"Content-Type": ctype, **headers})

    @staticmethod
    async def _relay_replay(request: web.Request, up: aiohttp.ClientResponse, headers: dict[str, str],
                            owner: Owner, down: asyncio.Future[None]) -> web.StreamResponse:
        """A background response's events, written on as the worker sends them. A worker that
        fails mid-way, or that the scheduler reports down meanwhile (it hangs), is told in the
        stream's own terms: OpenAI's `error` event, numbered after the last event relayed (a
        Responses client reads no chat-style `[DONE]`)."""
        resp = web.StreamResponse(status=200, headers={**headers, "Cache-Control": "no-cache"})
        resp.content_type = "text/event-stream"
        await resp.prepare(request)

        def cut(fut: asyncio.Future[None]) -> None:
            if not fut.cancelled():  # down, not the end of the watch: the read below ends
                up.close()

        down.add_done_callback(cut)
        last = -1  # the last sequence number relayed
        tail = b""  # the end of the previous chunk: a number may be cut between two
        failure = ""
        try:
            async for chunk in up.content.iter_any():
                await resp.write(chunk)
                numbers = SEQUENCE_NUMBER.findall(tail + chunk)
                if numbers:
                    last = max(last, int(numbers[-1]))
                tail = chunk[-_TAIL_BYTES:]
        except ConnectionResetError:
            return resp  # the client left; the response goes on in the worker
        except UPSTREAM_ERRORS as exc:
            # The client reads what went wrong in words (as a POST stream cut mid-way says it);
            # the exception, which names the HTTP library's internals, goes to the log.
            failure = f"failed mid-stream ({UNREACHABLE[failure_kind(exc)]})"
            log.warning("replay GET %s from worker %s failed mid-stream: %r", clip(request.path),
                        owner.worker_id, exc)
        finally:
            down.remove_done_callback(cut)
        if down.done() and not down.cancelled():
            failure = "stopped answering mid-stream (the scheduler reports it down)"
        if failure:
            await resp.write(responses_error_event(
                f"worker {owner.worker_id!r} {failure}", "upstream_error", last + 1))
        await resp.write_eof()
        return resp


def _failure(exc: BaseException) -> str:
    """The UNREACHABLE key of a call's failure."""
    return "worker_down" if isinstance(exc, WorkerDown) else failure_kind(exc)


def lost_answer(response_id: str, lost: Lost, param: str,
                headers: Mapping[str, str] | None = None) -> web.Response:
    """404: the response was lost with its worker (vLLM's not-found words, then why)."""
    return error_response(404, lost_message(response_id, lost), param=param, code=LOST,
                          headers=dict(headers) if headers else None)


def unavailable_answer(response_id: str, owner: Owner, reason: str) -> web.Response:
    """503: the worker that stores the response cannot be reached now; retryable."""
    return error_response(
        503, f"worker {owner.worker_id!r}, which stores response {clip_repr(response_id)}, cannot be reached "
        f"({UNREACHABLE.get(reason, reason)}); retry later: if it restarted, the response was lost "
        "with it", "service_unavailable", code=UNAVAILABLE, headers={"Retry-After": "1"},
    )


_TAIL_BYTES = 48  # the end of a chunk kept: a sequence number may be cut between two
