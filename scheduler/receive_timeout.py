"""The time a request may take to arrive: aiohttp sets none (slowloris).

aiohttp's keep-alive timer (3630 s from a connection's start or its last answer) was all that
ended a connection that sent nothing or part of its headers, and a body short of its
Content-Length (or its last chunk, or never sent after a `100 Continue`) was waited for as long
as the connection stayed open. Here:
- the head: one not complete `_head_timeout_s` after the connection opened, or after the first
  byte of its next request on a kept-alive connection, closes the connection
  (HeadTimedRequestHandler): one WARNING line when part of one came, a DEBUG line when nothing
  did (a TCP probe).
  No answer: the request is unknown. An idle kept-alive connection stays aiohttp's keep-alive
  timer's;
- the body: `read_body_within`, where every route reads it: not whole that long after the read
  began, RequestBodyTimeout (the service answers 408 and closes the connection).
An answer (a stream) is never timed.

The scheduler (and the gateway, through scheduler/http_errors.py) and the worker each have this
file, the same code (a test keeps them alike): the worker imports nothing of the other parts.
"""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web
from aiohttp.streams import StreamReader
from aiohttp.web_protocol import RequestHandler

# nginx's client_header_timeout and client_body_timeout.
DEFAULT_RECEIVE_TIMEOUT_S = 60.0


class RequestBodyTimeout(Exception):
    """The request body was not complete within the receive timeout (read_body_within)."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(f"request body not complete within {timeout_s:g} s")
        self.timeout_s = timeout_s


async def read_body_within(request: web.Request, timeout_s: float, log: logging.Logger) -> bytes:
    """`request.read()`, the body given `timeout_s` from now to arrive whole. Past it, one
    WARNING line and RequestBodyTimeout: the caller answers 408 and closes the connection
    (`force_close`). The body is marked read, or aiohttp would wait up to 10 s more after the
    answer for the rest of it (its lingering read)."""
    if request.content.is_eof():  # all in, as most bodies come with their head: no timer to set
        return await request.read()
    try:
        async with asyncio.timeout(timeout_s):
            return await request.read()
    except TimeoutError:
        request.content.feed_eof()
        log.warning("request body from %s not complete within %g s (%d bytes in): answered 408, "
                    "connection closed", request.remote, timeout_s, request.content.total_bytes)
        raise RequestBodyTimeout(timeout_s) from None


class HeadTimedRequestHandler(RequestHandler):
    """A connection's handler that closes the connection when a request head is not in within
    `_head_timeout_s`, logging to `_head_log` (both set by the server that makes it)."""

    __slots__ = ("_head_bytes", "_head_log", "_head_timeout_s", "_head_timer", "_last_body")
    _head_log: logging.Logger
    _head_timeout_s: float

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_bytes = 0
        self._last_body: StreamReader | None = None  # the last request's body, as the parser fills it
        super().connection_made(transport)
        self._arm_head_timer()  # a new connection: its first request, or nothing, is timed

    def data_received(self, data: bytes) -> None:
        heads = self._request_count
        # Bytes past the last request's body are the next request's head. (Whether that body's
        # last bytes came with some of the next head is not known: then the head is timed from
        # its next bytes, or, if none come, left to aiohttp's keep-alive timer.)
        next_head = self._last_body is None or self._last_body.is_eof()
        super().data_received(data)
        if self._request_count != heads:  # a request head is in (or refused: answered at once)
            self._stop_head_timer()
            self._last_body = self._messages[-1][1] if self._messages else None
        elif (data and next_head and self._head_timer is None
              and not (self._upgraded or self._close or self._force_close)):
            self._arm_head_timer()  # the first bytes of the next request on a kept-alive connection
        if self._head_timer is not None:
            self._head_bytes += len(data)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._stop_head_timer()
        super().connection_lost(exc)

    def _waiting_for_head(self) -> bool:
        """No request in hand: aiohttp waits for the next one's head (none is queued)."""
        waiter = self._waiter
        return waiter is not None and not waiter.done() and not self._messages

    def _arm_head_timer(self) -> None:
        self._head_bytes = 0
        self._head_timer = self._loop.call_later(self._head_timeout_s, self._head_timed_out)

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport is None or self._force_close or self._upgraded:
            return
        if not self._waiting_for_head():
            # A request still being answered, the next one's head part way in behind it
            # (pipelined): that head is judged once the answer is done, not the answer cut.
            self._head_timer = self._loop.call_later(self._head_timeout_s, self._head_timed_out)
            return
        peer = self.transport.get_extra_info("peername")
        peer = peer[0] if isinstance(peer, tuple) else peer
        log, timeout_s = self._head_log, self._head_timeout_s
        if self._head_bytes:
            log.warning("request head from %s not complete within %g s (%d bytes in): connection "
                        "closed", peer, timeout_s, self._head_bytes)
        else:  # a TCP probe, a pre-opened connection: nothing to warn about
            log.debug("connection from %s sent no request within %g s: closed", peer, timeout_s)
        self.force_close()  # as aiohttp's keep-alive timer closes an idle connection
