"""The OpenAI error shape for what aiohttp answers before any route runs.

aiohttp's HTTP parser refuses a request it cannot read (a bad request line, a header over the
limit, broken chunking, a Content-Length that is no number) and answers it itself, in plain text
("Invalid method encountered: ..."), logging an ERROR with a traceback. A client of an OpenAI API
reads `{"error": {...}}` from every 4xx and 5xx, and on a gateway facing the internet that log is
noise whoever scans it controls. Here these get the JSON every other 4xx has, and one WARNING
line. (The worker has its own copy: it stands alone.)
"""

from __future__ import annotations

import logging

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMethod, HttpProcessingError
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest
from aiohttp.web_server import Server

from router.errors import error_response

log = logging.getLogger("router.http")


class OpenAIErrorRequestHandler(RequestHandler):
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
            # TLS or another protocol on the HTTP port: aiohttp, too, keeps that out of the log.
            level = logging.DEBUG if isinstance(exc, BadHttpMethod) else logging.WARNING
            log.log(level, "malformed HTTP request from %s: %s", request.remote, reason)
            resp = error_response(status, f"malformed HTTP request: {reason}")
        else:
            # An exception no handler caught: aiohttp logs it with its traceback, and raises when
            # a response had started (then there is nothing left to send).
            super().handle_error(request, status, exc, message)
            resp = error_response(status, "internal server error", "server_error")
        resp.force_close()  # after a parse error the rest of the stream is unreadable
        return resp


class _OpenAIErrorServer(Server):
    def __call__(self) -> RequestHandler:
        return OpenAIErrorRequestHandler(self, loop=self._loop, **self._kwargs)


class OpenAIErrorAppRunner(web.AppRunner):
    """An AppRunner whose connections answer in the OpenAI error shape (see the module)."""

    async def _make_server(self) -> Server:
        # aiohttp has no setting for the protocol class; the server it builds is re-classed to
        # one that only differs in the handler it makes. tests/router pins the answers, so an
        # aiohttp that builds servers otherwise fails there, not in front of a client.
        server = await super()._make_server()
        server.__class__ = _OpenAIErrorServer
        return server
