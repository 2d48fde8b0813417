"""WebSocket proxy: GET /v1/ws on the gateway <-> GET /v1/ws on one worker.

The worker's protocol: each client text message is a completions or chat body; the
worker answers with chunk objects and a final end message. The gateway places the
connection when the first message arrives (it names the model), connects to that
worker, and from then on copies messages both ways untouched. The connection holds
one lease until it closes. A worker that cannot be connected to is excluded and
the placement retried, like an HTTP request before its first byte.

A stopping gateway (SIGTERM) does with its sockets what a stopping worker does: a socket
with nothing owed is closed at once with 1001 (going away), one with requests in flight
gets their answers first; a request sent meanwhile is refused (`shutting_down`). The client
reconnects, through the load balancer, to another gateway replica. Without this an idle
socket held the gateway's exit for aiohttp's shutdown timeout and was then cut.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable

import aiohttp
from aiohttp import WSCloseCode, web

from router.access_log import RequestRecord
from router.errors import error_response
from router.proxy import Proxy
from router.queue import QueueFull, QueueTimeout
from router.scheduling import NoWorkerError
from router.tokens import render_prompt
from scheduler.client import SchedulerError

log = logging.getLogger("router.ws")


_GOING_AWAY_MESSAGE = b"the gateway is shutting down"
# The worker's messages that end a request's answer (websocket.py in the worker): `done`, or
# an error object. Its chunks start with '{"id"'.
_TERMINAL_PREFIXES = ('{"type": "done"', '{"error"')


class WsSessions:
    """The gateway's open client sockets, for a graceful stop (see the module docstring)."""

    def __init__(self) -> None:
        self.open: set[WsSession] = set()
        self.closing = False
        self._none_open = asyncio.Event()

    def add(self, session: WsSession) -> None:
        self.open.add(session)

    def remove(self, session: WsSession) -> None:
        self.open.discard(session)
        if not self.open:
            self._none_open.set()

    async def drain(self, timeout_s: float) -> int:
        """The gateway stops: idle sockets go now, busy ones after their answers. Waits up to
        timeout_s for the last to go; returns how many were still open then. Run before
        aiohttp's own shutdown, which stops reading every connection (so cancels and close
        replies would go unread)."""
        self.closing = True
        if not self.open:
            return 0
        self._none_open.clear()
        await asyncio.gather(*(s.going_away_if_idle() for s in list(self.open)))
        if self.open:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._none_open.wait(), timeout_s)
        return len(self.open)


class WsSession:
    """One client socket: the requests forwarded and not yet answered."""

    __slots__ = ("client", "owed")

    def __init__(self, client: web.WebSocketResponse) -> None:
        self.client = client
        self.owed = 0

    async def going_away_if_idle(self) -> bool:
        if self.owed > 0 or self.client.closed:
            return False
        await self.client.close(code=WSCloseCode.GOING_AWAY, message=_GOING_AWAY_MESSAGE)
        return True


def _ws_error(message: str, code: int | str) -> str:
    return json.dumps(
        {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}
    )


_SHUTTING_DOWN = _ws_error("the gateway is shutting down: reconnect", "shutting_down")


# Browsers cannot set headers on a WebSocket, only subprotocols: a page passes its API key as
# the subprotocol `openai-insecure-api-key.<key>` (OpenAI's convention for its Realtime API).
KEY_PROTOCOL_PREFIX = "openai-insecure-api-key."


def _offered_protocols(request: web.Request) -> list[str]:
    header = request.headers.get("Sec-WebSocket-Protocol", "")
    return [p.strip() for p in header.split(",") if p.strip()]


def _authorization(request: web.Request, offered: list[str]) -> str | None:
    header = request.headers.get("Authorization")
    if header is not None:
        return header
    for protocol in offered:
        if protocol.startswith(KEY_PROTOCOL_PREFIX):
            return "Bearer " + protocol[len(KEY_PROTOCOL_PREFIX) :]
    return None


async def handle_ws(proxy: Proxy, request: web.Request, sessions: WsSessions) -> web.StreamResponse:
    offered = _offered_protocols(request)
    if not proxy.keys.allows(_authorization(request, offered)):
        return error_response(
            401, "invalid or missing API key", "authentication_error", code="invalid_api_key"
        )
    # A browser fails the handshake unless one offered subprotocol is accepted: accept another
    # than the key's if the page offered one, else the key's (the page's own string, echoed).
    chosen = sorted(offered, key=lambda p: p.startswith(KEY_PROTOCOL_PREFIX))[:1]
    client = web.WebSocketResponse(
        max_msg_size=proxy.cfg.max_body_bytes, autoping=True, heartbeat=30, protocols=chosen
    )
    await client.prepare(request)
    rec = RequestRecord(proxy.request_id(request, "ws"), "WS", "/v1/ws")
    proxy.metrics.in_flight.inc()
    upstream: aiohttp.ClientWebSocketResponse | None = None
    route = None
    session = WsSession(client)
    sessions.add(session)
    try:
        if sessions.closing:
            await session.going_away_if_idle()
            return client
        first = await client.receive()
        if first.type == aiohttp.WSMsgType.BINARY:
            await client.send_str(_ws_error("first message must be a JSON text message with a 'model'", 400))
            rec.status = 400
            return client
        if first.type != aiohttp.WSMsgType.TEXT:
            return client  # closed before asking anything
        try:
            body = json.loads(first.data)
            model = body["model"]
            if not isinstance(model, str) or not model:
                raise TypeError
        except (ValueError, KeyError, TypeError):
            await client.send_str(_ws_error("first message must be a JSON body with a 'model'", 400))
            rec.status = 400
            return client
        rec.model = model
        if sessions.closing:  # the gateway began to stop while this socket said nothing
            await client.send_str(_SHUTTING_DOWN)
            await client.close(code=WSCloseCode.GOING_AWAY, message=_GOING_AWAY_MESSAGE)
            return client
        session.owed = 1  # from here the socket is busy: placing it, then its first answer
        sched_body = proxy.schedule_body(rec, model, body)
        priority = body.get("priority")  # the first request's, as the connection is placed once
        if not isinstance(priority, int) or isinstance(priority, bool):
            priority = 0  # the worker answers a malformed one itself
        exclude: list[str] = []
        deadline = time.monotonic() + proxy.cfg.queue_timeout_ms / 1000
        for _ in range(proxy.cfg.retry_count + 1):
            try:
                route = await proxy._acquire(rec, sched_body, exclude, deadline, priority=priority)
            except (QueueFull, QueueTimeout):
                await client.send_str(_ws_error("no worker available, retry later", 429))
                rec.status = 429
                return client
            except (SchedulerError, NoWorkerError) as exc:
                await client.send_str(_ws_error(str(exc), 404))
                rec.status = 404
                return client
            try:
                upstream = await proxy.session.ws_connect(
                    route.url + "/v1/ws",
                    headers=proxy._upstream_headers(request, rec.id, "/v1/ws"),
                    timeout=aiohttp.ClientWSTimeout(ws_receive=None, ws_close=5.0),
                    max_msg_size=0,
                )
                break
            except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                proxy._failed(route, "connect", rec)
                exclude.append(route.worker_id)
                log.info("ws id=%s worker %s unreachable (%r); retrying", rec.id, route.worker_id, exc)
                route = None
        if upstream is None or route is None:
            await client.send_str(_ws_error("every worker attempt failed", 502))
            rec.status = 502
            return client
        rec.worker = route.worker_id
        rec.status = 101
        await upstream.send_str(first.data)
        await _pump_both(session, sessions, upstream, lambda: proxy._prefilled(route), rec,
                         lambda data: _prompt_tokens(proxy, data))
        return client
    finally:
        sessions.remove(session)
        if upstream is not None:
            await upstream.close()
        if route is not None and upstream is not None:
            proxy._release(route, rec, ok=True)
        if not client.closed:
            await client.close()
        proxy.metrics.in_flight.dec()
        proxy._finish(rec)


# A chunk with a choice in it (not a usage chunk, a terminal message or an error): the
# worker's chunks are compact JSON. Counted as one output token each, the stand-in the SSE
# path uses when a stream ends without usage (the socket's usage chunks are the client's).
_CHOICE_CHUNK = '"choices":[{'


def _prompt_tokens(proxy: Proxy, data: str) -> int:
    """The prompt estimate of one more request on the socket (0 for a cancel or a bad message,
    which the worker answers itself), as the HTTP path counts a request without usage."""
    try:
        body = json.loads(data)
    except ValueError:
        return 0
    if not isinstance(body, dict):
        return 0
    text, ids = render_prompt(body)
    return proxy.tokens.count(text, ids) if text or ids else 0


def _is_cancel(text: str) -> bool:
    """The worker's cancel message (`{"type": "cancel"}`): answered by the request it ends."""
    if len(text) > 64 or '"cancel"' not in text:
        return False
    try:
        body = json.loads(text)
    except ValueError:
        return False
    return isinstance(body, dict) and body.get("type") == "cancel"


async def _pump_both(session: WsSession, sessions: WsSessions,
                     upstream: aiohttp.ClientWebSocketResponse,
                     on_first_answer: Callable[[], None], rec: RequestRecord,
                     count_prompt: Callable[[str], int]) -> None:
    client = session.client

    async def copy(src, dst) -> None:
        first = down = src is upstream
        async for msg in src:
            if first:  # the worker's first chunk: the first request's prompt is prefilled
                first = False
                on_first_answer()
            if msg.type == aiohttp.WSMsgType.TEXT:
                if down:
                    if _CHOICE_CHUNK in msg.data:
                        rec.output_tokens += 1
                    elif msg.data.startswith(_TERMINAL_PREFIXES):
                        session.owed -= 1
                elif _is_cancel(msg.data):
                    pass  # the request it ends answers for it
                elif sessions.closing:
                    await client.send_str(_SHUTTING_DOWN)
                    continue
                else:  # the client's next request on this socket
                    session.owed += 1
                    rec.prompt_tokens += count_prompt(msg.data)
                await dst.send_str(msg.data)
                if down and sessions.closing and await session.going_away_if_idle():
                    break  # the last answer owed is out: the client reconnects elsewhere
            elif msg.type == aiohttp.WSMsgType.BINARY:
                if not down:
                    session.owed += 1  # the worker answers it with an error
                await dst.send_bytes(msg.data)
            else:
                break

    down = asyncio.ensure_future(copy(upstream, client))
    up = asyncio.ensure_future(copy(client, upstream))
    try:
        done, _ = await asyncio.wait({down, up}, return_when=asyncio.FIRST_COMPLETED)
        if down in done and up not in done and not client.closed:
            if upstream.close_code == WSCloseCode.GOING_AWAY:
                # A stopping worker answered what the socket had sent and said goodbye: pass
                # that on, so the client reconnects (and is placed on a live worker).
                await client.close(code=WSCloseCode.GOING_AWAY, message=b"the worker is shutting down")
            else:
                # The worker went away while the client is still connected: say so before
                # closing (a request it was answering is not replayed elsewhere, like SSE).
                await client.send_str(_ws_error("the worker closed the connection", "upstream_closed"))
    finally:
        for t in (down, up):
            t.cancel()
        await asyncio.gather(down, up, return_exceptions=True)
