"""The OpenAI error shape for what aiohttp answers before any route runs.

aiohttp's HTTP parser refuses a request it cannot read (a bad request line, a header over the
limit, broken chunking, a Content-Length that is no number) and answers it itself, in plain text,
logging an ERROR with a traceback. `error_middleware` never sees these. Here they get the JSON
every other 4xx has, and one WARNING line: what a scanner sends is not the worker's error.
So does a body whose Content-Encoding lies on a route that never reads it (log_exception).

A client that sends its request slowly is given --request-receive-timeout-ms (60 s, as nginx's
client_header_timeout and client_body_timeout): the handler here times the request head, and
every route's body read is timed (receive_timeout.py, a twin of the scheduler's).
An idle kept-alive connection is kept --keepalive-timeout-s (75 s), and at most --max-connections
are served at once, one more answered 503 (connection_limit.py, a twin too).
(The gateway and the scheduler share scheduler/http_errors.py: the worker stands alone.)
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar

from aiohttp import hdrs, http_exceptions, web
from aiohttp.http import HttpVersion11
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest
from aiohttp.web_server import Server

from inference_worker.server.clip import clip, clip_repr
from inference_worker.server.connection_limit import (
    DEFAULT_KEEPALIVE_TIMEOUT_S,
    REFUSED_MESSAGE,
    CappedRequestHandler,
    ConnectionCap,
)
from inference_worker.server.errors import error_body
from inference_worker.server.receive_timeout import (
    DEFAULT_RECEIVE_TIMEOUT_S,
    require_aiohttp_handler,
    require_aiohttp_runner,
)

# An unknown request method, logged at DEBUG (scanners send them). aiohttp before 3.11.18 lacks
# the class; importing it by name would end such an install in an ImportError traceback, before
# require_aiohttp_handler says in one line which aiohttp to install (it refuses those releases).
BadHttpMethod: type[Exception] = getattr(http_exceptions, "BadHttpMethod", HttpProcessingError)

logger = logging.getLogger("inference_worker.server")


class OpenAIErrorRequestHandler(CappedRequestHandler):
    """A connection's handler: the OpenAI error shape, the time a request head has
    (receive_timeout.py), and its place under the connection cap (connection_limit.py)."""

    __slots__ = ()

    # ---- the OpenAI error shape -------------------------------------------------------------
    # aiohttp's, beyond the cap's and the head timer's: the two methods overridden below, so
    # that an aiohttp without them is refused at start-up (require_aiohttp_handler).
    AIOHTTP_METHODS: ClassVar[tuple[str, ...]] = (
        *CappedRequestHandler.AIOHTTP_METHODS, "handle_error", "log_exception")

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if isinstance(exc, HttpProcessingError) and status < 500:
            # The parser's message goes on to echo the refused bytes under a caret: the first
            # line says what was wrong.
            reason = (str(message or exc.message).splitlines() or [""])[0].rstrip(": ")
            # That line may quote the client's bytes (a CONNECT's whole request target, a
            # header): cut, as other echoes are (clip.py).
            reason = clip(reason)
            # TLS or another protocol on the HTTP port: aiohttp, too, keeps that out of the log.
            level = logging.DEBUG if isinstance(exc, BadHttpMethod) else logging.WARNING
            logger.log(level, "malformed HTTP request from %s: %s", request.remote, reason)
            text, kind = f"malformed HTTP request: {reason}", "invalid_request_error"
        else:
            # An exception no middleware caught: aiohttp logs it with its traceback, and raises
            # when a response had started (then there is nothing left to send).
            super().handle_error(request, status, exc, message)
            text, kind = "internal server error", "server_error"
        code = "malformed_http_request" if kind == "invalid_request_error" else None
        resp = web.json_response(error_body(text, kind, code=code), status=status)
        resp.force_close()  # after a parse error the rest of the stream is unreadable
        return resp

    def log_exception(self, *args: Any, **kw: Any) -> None:
        exc = kw.get("exc_info")
        if isinstance(exc, web.RequestPayloadError):
            # A body no route read (a GET, a 404, a cancel) whose Content-Encoding lies: aiohttp
            # drains it after the answer, meets the decoding error and logged an ERROR with three
            # chained tracebacks. The answer was right; one WARNING line (the connection closes).
            peer = self.transport.get_extra_info("peername") if self.transport is not None else None
            reason = (str(exc).splitlines() or [""])[-1].strip()
            logger.warning("unreadable request body from %s: %s",
                           peer[0] if isinstance(peer, tuple) else peer, reason)
            return
        super().log_exception(*args, **kw)


RequestHandlerFn = Callable[[BaseRequest], Awaitable[web.StreamResponse]]


def expectation_checked(handle: RequestHandlerFn) -> RequestHandlerFn:
    """The server's request handler (the app's), with an Expect header other than 100-continue
    answered 417 in the OpenAI shape. aiohttp checks it before error_middleware or any route
    runs: its 417 was plain text, and a value that is not UTF-8 (a lone surrogate as aiohttp
    decodes it) failed to encode, a 500 logged with a traceback. Checked as aiohttp checks it
    (HTTP/1.1 only, any case); 100-continue goes on to aiohttp. A plain function: one header
    lookup per request."""

    def checked(request: BaseRequest) -> Awaitable[web.StreamResponse]:
        expect = request.headers.get(hdrs.EXPECT)
        if expect and request.version == HttpVersion11 and expect.lower() != "100-continue":
            return _refused_expectation(expect)
        return handle(request)

    return checked


async def _refused_expectation(expect: str) -> web.StreamResponse:
    text = f"Expect {clip_repr(expect)} is not supported: only 100-continue is"
    resp = web.json_response(error_body(text, "invalid_request_error", code="expectation_failed"),
                             status=417)
    resp.force_close()  # whether the body follows is the client's guess: the framing is in doubt
    return resp


class _OpenAIErrorServer(Server):
    head_timeout_s: float
    connection_cap: ConnectionCap

    def __call__(self) -> RequestHandler:
        handler = OpenAIErrorRequestHandler(self, loop=self._loop, **self._kwargs)
        handler._head_log, handler._head_timeout_s = logger, self.head_timeout_s
        handler._cap, handler._cap_answer = self.connection_cap, _refusal
        return handler


def _refusal() -> web.Response:
    """The answer on a connection beyond the cap."""
    return web.json_response(error_body(REFUSED_MESSAGE, "server_error", code="too_many_connections"),
                             status=503)


class OpenAIErrorAppRunner(web.AppRunner):
    """An AppRunner whose connections answer in the OpenAI error shape (see the module); a
    request head not complete within `receive_timeout_s` closes its connection; an idle
    kept-alive one is closed after `keepalive_timeout` s; beyond `max_connections` (0: no cap)
    open at once, one is answered 503 and closed (`connections` counts them)."""

    def __init__(self, app: web.Application, *, receive_timeout_s: float = DEFAULT_RECEIVE_TIMEOUT_S,
                 keepalive_timeout: float = DEFAULT_KEEPALIVE_TIMEOUT_S, max_connections: int = 0,
                 **kwargs: Any) -> None:
        # Whoever serves through these handlers: one error now, not one per connection.
        require_aiohttp_handler(OpenAIErrorRequestHandler)
        require_aiohttp_runner()
        super().__init__(app, keepalive_timeout=keepalive_timeout, **kwargs)
        self._receive_timeout_s = receive_timeout_s
        self.connections = ConnectionCap(max_connections, logger)

    async def _make_server(self) -> Server:
        # aiohttp has no setting for the protocol class; the server it builds is re-classed to
        # one that only differs in the handler it makes. tests/worker pins the answers, so an
        # aiohttp that builds servers otherwise fails there, not in front of a client.
        server = await super()._make_server()
        server.__class__ = _OpenAIErrorServer
        server.request_handler = expectation_checked(server.request_handler)
        server.head_timeout_s = self._receive_timeout_s
        server.connection_cap = self.connections
        return server
