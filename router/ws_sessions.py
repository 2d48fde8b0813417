"""The gateway's open client WebSockets and what each is owed, for a graceful stop.

A stopping gateway (SIGTERM) does with its sockets what a stopping worker does: a socket
with nothing owed is closed at once with 1001 (going away), one with requests in flight
gets their answers first; a request sent meanwhile is refused (`shutting_down`), in its turn:
after the answers owed before it (router/ws_relay.py refuse), and the 1001 after the last
answer or refusal owed. The client reconnects, through the load balancer, to another gateway
replica. `drain()` runs before aiohttp's own shutdown, which stops reading every connection
(cancels and close replies would go unread); without it an idle socket held the gateway's
exit for aiohttp's shutdown timeout and was then cut without a close code.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import deque

from aiohttp import WSCloseCode, web

from router.ws_leases import WsTurn

GOING_AWAY_MESSAGE = b"the gateway is shutting down"


def ws_error(message: str, code: int | str, type_: str = "invalid_request_error") -> str:
    return json.dumps({"error": {"message": message, "type": type_, "param": None, "code": code}})


SHUTTING_DOWN = ws_error("the gateway is shutting down: reconnect", "shutting_down")


class WsSession:
    """One client socket: the requests it sent, in order, that have no answer's end yet."""

    __slots__ = ("authorization", "client", "pending", "refusals")

    def __init__(self, client: web.WebSocketResponse, authorization: str | None = None) -> None:
        self.client = client
        self.pending: deque[WsTurn] = deque()
        # What the socket was opened with (the Authorization header or the key subprotocol):
        # each request on it is checked against the keys in force then (a key revoked while the
        # socket is open, router/key_reload.py, stops its new requests).
        self.authorization = authorization
        # The gateway's refusals waiting for their turn (each after an answer owed) or being
        # sent: the socket is not idle until they are out.
        self.refusals = 0

    async def going_away_if_idle(self) -> bool:
        if self.pending or self.refusals or self.client.closed:
            return False
        await self.client.close(code=WSCloseCode.GOING_AWAY, message=GOING_AWAY_MESSAGE)
        return True


class WsSessions:
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
        """Idle sockets go now, busy ones after their answers. Waits up to timeout_s for the
        last to go; returns how many were still open then."""
        self.closing = True
        if not self.open:
            return 0
        self._none_open.clear()
        await asyncio.gather(*(s.going_away_if_idle() for s in list(self.open)))
        if self.open:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._none_open.wait(), timeout_s)
        return len(self.open)
