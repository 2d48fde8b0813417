"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}`.

`error_middleware` turns every exception a handler raises into the right status,
so a client never sees a traceback or an HTML error page:

- `APIError` (raised by our own checks): its status, type, param and code;
- `RequestBodyTimeout` (a body not complete in time, receive_timeout.py): 408, and the
  connection closed;
- pydantic `ValidationError` (bad JSON, wrong types, out-of-range values): 400 with `param`;
- `ValueError` (the engine's `EngineRequestError`s, e.g. a prompt too long): 400;
- `EngineDeadError`: 503;
- `EngineShutdownError` (the worker stopped before the request finished): 503 `shutting_down`;
- aiohttp's own HTTP errors (unknown route 404, wrong method 405, body too large 413): same status;
- anything else: 500 with the exception's class and message, logged with its traceback here.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from pydantic import ValidationError

from inference_worker.engine.errors import EngineDeadError, EngineShutdownError
from inference_worker.server.clip import MAX_SHOWN_CHARS, clip
from inference_worker.server.receive_timeout import RequestBodyTimeout

logger = logging.getLogger("inference_worker.server")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "server_error",
}


class APIError(Exception):
    """An error the API answers with an OpenAI error object."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPE_BY_STATUS.get(
            status, "server_error" if status >= 500 else "invalid_request_error"
        )

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model `{clip(model)}` does not exist.", param="model", code="model_not_found")


def from_validation_error(exc: ValidationError) -> APIError:
    """The first pydantic error as a 400 whose `param` is the field's dotted path."""
    err = exc.errors(include_url=False)[0]
    if err["type"] == "json_invalid":
        return invalid_request(f"Invalid JSON body: {err['msg']}", code="invalid_json")
    param = ".".join(error_loc(err["loc"])) or None
    message = error_msg(err["msg"])
    if message.startswith(("Value error, ", "Assertion failed, ")):
        message = message.split(", ", 1)[1]
    if param:
        message = f"{param}: {message}"
    return invalid_request(message, param=param, code="invalid_value" if param else None)


def error_loc(loc: tuple[int | str, ...]) -> list[str]:
    """An error's location, each part cut (clip.py): a dict's keys are the client's
    (`logit_bias`, `metadata`), and one of 100 KB was the `param` and the message's start."""
    return [clip(str(part)) for part in loc]


def error_msg(msg: str) -> str:
    """pydantic's message, cut when long. Its own words are short and quote no input, but a
    validator's ValueError may (ours cut what they quote) and a union's tag error quotes the tag."""
    return clip(msg, 4 * MAX_SHOWN_CHARS)


def exception_to_api_error(exc: BaseException) -> APIError:
    """Map any exception to the error the client gets (also used mid-stream and on the WebSocket)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ValidationError):
        return from_validation_error(exc)
    if isinstance(exc, json.JSONDecodeError):
        return invalid_request(f"Invalid JSON body: {exc.msg}", code="invalid_json")
    if isinstance(exc, ValueError):  # the engine's EngineRequestError family and our own checks
        return invalid_request(str(exc) or type(exc).__name__)
    if isinstance(exc, web.RequestPayloadError):  # e.g. a Content-Encoding the body does not match
        return invalid_request(f"Unreadable request body: {exc}", code="invalid_body")
    if isinstance(exc, EngineShutdownError):
        return shutting_down(str(exc))
    if isinstance(exc, EngineDeadError):
        return APIError(503, f"The engine is not running: {exc}", code="engine_dead")
    logger.error("unexpected error while serving a request", exc_info=exc)
    return APIError(500, f"Internal server error ({type(exc).__name__}: {exc})", type="server_error")


def shutting_down(message: str = "The worker is shutting down; send the request to another one.") -> APIError:
    """What a stopping worker answers: 503, which routers (ours too) retry on another worker."""
    return APIError(503, message, code="shutting_down")


def json_error(err: APIError) -> web.Response:
    return web.json_response(err.body(), status=err.status)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = exc.text if exc.text and not exc.text.startswith(f"{exc.status}:") else exc.reason
        # aiohttp's words may quote a client's header whole (a refused WebSocket handshake's
        # Upgrade, Sec-WebSocket-Key or -Version, up to 32 KiB): cut as other echoes are.
        message = clip(message, 4 * MAX_SHOWN_CHARS)
        if exc.status == 404:
            message = f"Not found: {clip(request.method)} {clip(request.path)}"
        elif exc.status == 405:
            message = f"Method {clip(request.method)} not allowed on {clip(request.path)}"
        return json_error(APIError(exc.status, message))
    except web.RequestPayloadError as exc:
        return unreadable_body(request, exception_to_api_error(exc))
    except RequestBodyTimeout as exc:  # the rest of the body is not waited for: closed too
        return unreadable_body(request, APIError(408, f"Request body not complete: {exc.reason}.",
                                                 code="request_timeout"))
    except Exception as exc:
        return json_error(exception_to_api_error(exc))


def unreadable_body(request: web.Request, err: APIError) -> web.Response:
    """The answer to a body that could not be decoded. aiohttp would read the rest of it after
    the answer, meet the same error and log it as unhandled, with a traceback: mark it read,
    and close the connection, whose framing after a bad body is not to be trusted."""
    request.content.feed_eof()
    response = json_error(err)
    response.force_close()
    return response
