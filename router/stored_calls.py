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
"""

from __future__ import annotations

import aiohttp
from aiohttp import web

from router.access_log import RequestRecord
from router.errors import SEQUENCE_NUMBER, error_response, responses_error_event
from router.metrics import RouterMetrics
from router.scheduling import Scheduling
from router.sse import usage_of_body
from router.stored_responses import Owner, ResponseOwners, not_found_message
from router.streaming import UPSTREAM_ERRORS
from router.upstream_errors import read_bounded, relayed_error


class StoredResponseCalls:
    session: aiohttp.ClientSession
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
        owner = await self.owners.locate(response_id, workers, self.session, probe_headers)
        self.metrics.stored_response_lookups.labels("found" if owner is not None else "missing").inc()
        return owner

    async def stored_response_call(self, request: web.Request, rec: RequestRecord, path: str,
                                   response_id: str, raw: bytes) -> web.Response:
        owner = await self.owner_of(response_id, request)
        if owner is None:
            return error_response(404, not_found_message(response_id), param="response_id")
        rec.worker = owner.worker_id
        url = owner.url + path
        if request.query_string:
            url += "?" + request.query_string
        headers = {"x-router-worker": owner.worker_id, "x-request-id": rec.id}
        timeout = self.timeout
        if request.query.get("stream", "false").lower() not in ("false", "0"):
            # A replay waits as long as the response does (queued in the engine, it sends
            # nothing): its client, not the first-byte timeout, decides when to give up.
            timeout = aiohttp.ClientTimeout(connect=timeout.connect, sock_connect=timeout.sock_connect)
        try:
            async with self.session.request(
                request.method, url, data=raw or None, timeout=timeout,
                headers=self._upstream_headers(request, rec.id, path),
            ) as up:
                if up.status == 200 and up.content_type == "text/event-stream":
                    return await self._relay_replay(request, up, headers, owner)
                status = up.status
                data = await (read_bounded(up) if status >= 400 else up.read())
                ctype = up.headers.get("Content-Type", "application/json")
        except UPSTREAM_ERRORS as exc:
            return error_response(
                502, f"worker {owner.worker_id!r}, which stores response {response_id!r}, failed: "
                f"{exc!r}", "upstream_error", code="upstream_failed",
            )
        if status == 404 or (status == 200 and request.method == "DELETE"):
            # Evicted there, the worker restarted, or deleted now: a follow-up is no longer
            # pinned (and queued) to a worker that would only answer it 404.
            self.owners.forget(response_id)
        elif status == 200 and request.method == "GET":
            prompt, output = usage_of_body(data)
            if prompt is not None:  # finished: the conversation's length is known now
                self.owners.learn(response_id, owner.worker_id, owner.url, prompt + (output or 0))
        if status >= 400:
            data, ctype = relayed_error(status, data, ctype)
        return web.Response(status=status, body=data, headers={"Content-Type": ctype, **headers})

    @staticmethod
    async def _relay_replay(request: web.Request, up: aiohttp.ClientResponse, headers: dict[str, str],
                            owner: Owner) -> web.StreamResponse:
        """A background response's events, written on as the worker sends them. A worker that
        fails mid-way is told in the stream's own terms: OpenAI's `error` event, numbered after
        the last event relayed (a Responses client reads no chat-style `[DONE]`)."""
        resp = web.StreamResponse(status=200, headers={**headers, "Cache-Control": "no-cache"})
        resp.content_type = "text/event-stream"
        await resp.prepare(request)
        last = -1  # the last sequence number relayed
        tail = b""  # the end of the previous chunk: a number may be cut between two
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
            await resp.write(responses_error_event(
                f"worker {owner.worker_id!r} failed mid-stream ({exc!r})", "upstream_error", last + 1))
        await resp.write_eof()
        return resp


_TAIL_BYTES = 48  # the end of a chunk kept: a sequence number may be cut between two
