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
- the body: `read_body_within`, where every route reads it, times its pauses, not the whole
  upload (nginx's client_body_timeout: "only for a period between two successive read
  operations"), so that a large body on a slow link is not refused although it never stalled.
  Two rules, past either RequestBodyTimeout (the service answers 408 and closes the
  connection):
  - no byte for `timeout_s` (a stall);
  - a minimum average rate once the body has taken longer than `timeout_s`: at any time t after
    the read began, n bytes received (decoded, for a compressed body), t <= timeout_s +
    n / MIN_BODY_RATE (Apache mod_reqtimeout's `body=timeout_s,MinRate=...`). Each byte earns
    1 / MIN_BODY_RATE s, so a client that keeps up MIN_BODY_RATE, never pausing `timeout_s`, is
    never cut, one trickling a byte per pause is cut about `timeout_s` in, and a body of
    Content-Length L is whole within timeout_s + L / MIN_BODY_RATE at the latest. Only bytes
    that came count, not a declared length: a client announcing 8 MB and trickling buys nothing,
    and a chunked body is judged alike.
An answer (a stream) is never timed.

HeadTimedRequestHandler reads aiohttp's private RequestHandler attributes, which aiohttp renames
between minor releases (3.14.0 renamed `_upgrade` to `_upgraded`): each service checks them at
start-up (require_aiohttp_handler) and refuses to start on an aiohttp that lacks one, rather
than fail on every connection.

The scheduler (and the gateway, through scheduler/http_errors.py) and the worker each have this
file, the same code (a test keeps them alike): the worker imports nothing of the other parts.
"""

from __future__ import annotations

import asyncio
import logging
from typing import ClassVar

import aiohttp
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.streams import StreamReader
from aiohttp.web_protocol import RequestHandler

# nginx's client_header_timeout and client_body_timeout.
DEFAULT_RECEIVE_TIMEOUT_S = 60.0
# The slowest average a body may keep once it has taken longer than the receive timeout:
# 8 KiB/s = 64 kbit/s, a 2G (EDGE) uplink; 3G uplinks give 384 kbit/s and more, so a mobile
# client on a poor link still passes, while a connection held that way costs its client real
# upload (a thousand held connections: 64 Mbit/s), not a byte a minute. The largest gateway body
# (8 MiB) may then take 60 s + ~17 min. A client sending r below it is cut after about
# timeout_s * MIN_BODY_RATE / (MIN_BODY_RATE - r).
MIN_BODY_RATE = 8 * 1024  # bytes per second
# The aiohttp releases whose RequestHandler the handlers here and in connection_limit.py were
# tested against: pyproject.toml's requirement, the same text (a test keeps them equal), named in
# the start-up error on any other aiohttp that lacks what they use.
SUPPORTED_AIOHTTP = ">=3.14.4,<3.15"


def receive_timeout_help(not_timed: str) -> str:
    """--request-receive-timeout-ms's description, in each service's configuration; `not_timed`
    ends it with what of that service is never timed."""
    return ("the longest a client may take to send its request's headers, and pause in its body "
            "(as nginx's client_header_timeout and client_body_timeout): its headers, from its "
            "connecting or the first byte of its next request on a kept-alive connection (past "
            "it: the connection closed), and each pause in its body (past it, or a body under "
            f"{MIN_BODY_RATE // 1024} KiB/s once it has taken that long: a 408 request_timeout, "
            f"the connection closed); not the answer{not_timed}")


class RequestBodyTimeout(Exception):
    """The request body stalled for the receive timeout, or came slower than MIN_BODY_RATE once
    it took longer than that (read_body_within). `reason` says which, for the answer."""

    def __init__(self, timeout_s: float, reason: str) -> None:
        super().__init__(f"request body not complete: {reason}")
        self.timeout_s = timeout_s
        self.reason = reason


async def read_body_within(request: web.Request, timeout_s: float, log: logging.Logger) -> bytes:
    """`request.read()`, with no pause of `timeout_s` and, past `timeout_s`, at least
    MIN_BODY_RATE on average (the module's docstring). Past either, one WARNING line and
    RequestBodyTimeout: the caller answers 408 and closes the connection (`force_close`). The
    body is marked read, or aiohttp would wait up to 10 s more after the answer for the rest of
    it (its lingering read).

    The body is read here chunk by chunk, as `request.read()` does (its client_max_size check,
    its HTTPRequestEntityTooLarge), each read timed: aiohttp tells no one else when bytes come.
    So `request.read()` is not to be called after it: the caller keeps the bytes returned."""
    stream = request.content
    if stream.is_eof():  # all in, as most bodies come with their head: no timer to set
        return await request.read()
    limit = request.client_max_size
    set_chunk_size = getattr(stream, "set_read_chunk_size", None)  # aiohttp >= 3.14
    if limit and set_chunk_size is not None:  # as request.read(): a compressed body inflated in larger steps
        set_chunk_size(limit)
    loop = asyncio.get_running_loop()
    start = last = loop.time()  # the read's start, the last byte's arrival
    body = bytearray()
    while True:
        stall_at = last + timeout_s
        slow_at = start + timeout_s + len(body) / MIN_BODY_RATE
        try:
            async with asyncio.timeout_at(min(stall_at, slow_at)):
                chunk = await stream.readany()  # at once if bytes are buffered, even past a deadline
        except TimeoutError:
            stream.feed_eof()
            if stall_at <= slow_at:
                reason = f"nothing received for {timeout_s:g} s ({len(body)} bytes in)"
            else:
                reason = (f"{len(body)} bytes in {loop.time() - start:.1f} s, under {MIN_BODY_RATE} "
                          f"bytes/s after the first {timeout_s:g} s")
            log.warning("request body from %s not complete: %s: answered 408, connection closed",
                        request.remote, reason)
            raise RequestBodyTimeout(timeout_s, reason) from None
        if not chunk:
            return bytes(body)
        body.extend(chunk)
        if limit and len(body) > limit:
            raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=len(body))
        last = loop.time()


def _fail_body(body: StreamReader, message: object) -> None:
    """`message`, queued as the next request, is the parser's refusal of the body still being read
    (a deflate body that ends unfinished is refused only at its end, when its last bytes came
    after the head): aiohttp queues the refusal but leaves the body waiting for bytes that never
    come, and its handler waited out the receive timeout. The body is failed as aiohttp fails one
    whose bytes cannot be decoded, so its reader answers 400 at once."""
    exc = getattr(message, "exc", None)  # aiohttp's _ErrInfo; a request's head has no `exc`
    if isinstance(exc, HttpProcessingError):
        body.set_exception(web.RequestPayloadError(str(exc)))


def aiohttp_mismatch(handler: type[HeadTimedRequestHandler], base: type | None = None) -> list[str]:
    """What `handler` uses of aiohttp's RequestHandler (`base`: it, unless a test gives a
    stand-in) that it lacks, [] if nothing: an attribute of its AIOHTTP_ATTRIBUTES that none of
    its classes has (aiohttp's are in __slots__, which make class attributes), a method of its
    AIOHTTP_METHODS that aiohttp does not define (an override whose super() would reach only
    asyncio.Protocol's no-op, or a call that would fail), written `name()`."""
    base = RequestHandler if base is None else base
    missing = [name for name in handler.AIOHTTP_ATTRIBUTES if not hasattr(base, name)]
    missing += [f"{name}()" for name in handler.AIOHTTP_METHODS if not _defined_past_asyncio(base, name)]
    return missing


def _defined_past_asyncio(base: type, name: str) -> bool:
    """`name` is defined by one of `base`'s classes, not only by asyncio's Protocol or object."""
    return any(name in cls.__dict__ for cls in base.__mro__
               if cls.__module__.split(".")[0] not in ("asyncio", "builtins"))


def require_aiohttp_handler(handler: type[HeadTimedRequestHandler]) -> None:
    """At start-up, before a connection is served: SystemExit with one line naming the aiohttp
    installed and what it lacks, unless it has all `handler` uses (aiohttp_mismatch).

    Refused, not served without the head timer and the connection cap (aiohttp's plain handler):
    these are the service's defence against slow and idle clients holding its connections and
    file descriptors, which an operator would not want dropped behind a log line and a gauge.
    A mismatch can only come from an aiohttp installed outside SUPPORTED_AIOHTTP; a rollout
    then stops at its first new process (the old ones still serving), whose error says what to
    install. Served on, every connection would fail (AttributeError), or the cap be set where
    aiohttp no longer reads it."""
    missing = aiohttp_mismatch(handler)
    if missing:
        raise SystemExit(
            f"error: aiohttp {aiohttp.__version__} is not one this service runs on: its "
            f"RequestHandler lacks {', '.join(missing)}, which the request-head timeout "
            f"(--request-receive-timeout-ms) and the connection cap (--max-connections) use; "
            f"install a supported release: pip install 'aiohttp{SUPPORTED_AIOHTTP}'")


def require_aiohttp_runner(runner: type | None = None) -> None:
    """At start-up, with require_aiohttp_handler: SystemExit with one line unless aiohttp's
    AppRunner (`runner`: it, unless a test gives a stand-in) still builds its server in
    `_make_server`, which http_errors.OpenAIErrorAppRunner overrides to serve through its own
    handlers. Renamed, the override would never run: every connection served by aiohttp's
    plain handler, without the head timer, the connection cap or the OpenAI error shape, and
    nothing would say so."""
    runner = web.AppRunner if runner is None else runner
    if not _defined_past_asyncio(runner, "_make_server"):
        raise SystemExit(
            f"error: aiohttp {aiohttp.__version__} is not one this service runs on: its AppRunner "
            f"lacks _make_server(), through which the service serves its own request handlers; "
            f"install a supported release: pip install 'aiohttp{SUPPORTED_AIOHTTP}'")


class HeadTimedRequestHandler(RequestHandler):
    """A connection's handler that closes the connection when a request head is not in within
    `_head_timeout_s`, logging to `_head_log` (both set by the server that makes it)."""

    __slots__ = ("_head_bytes", "_head_log", "_head_timeout_s", "_head_timer", "_last_body")
    _head_log: logging.Logger
    _head_timeout_s: float
    # What this class uses of aiohttp's RequestHandler beyond its public API, checked at
    # start-up (require_aiohttp_handler); a test keeps these lists whole. Its attributes:
    AIOHTTP_ATTRIBUTES: ClassVar[tuple[str, ...]] = (
        "_close", "_force_close", "_loop", "_messages", "_request_count", "_upgraded", "_waiter",
        "transport")
    # and the methods it overrides or calls:
    AIOHTTP_METHODS: ClassVar[tuple[str, ...]] = (
        "connection_lost", "connection_made", "data_received", "force_close")

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
        body = self._last_body
        next_head = body is None or body.is_eof()
        super().data_received(data)
        if self._request_count != heads:  # a request head is in (or refused: answered at once)
            self._stop_head_timer()
            if body is not None and not body.is_eof() and self._messages:
                _fail_body(body, self._messages[-1][0])
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
