"""A worker's error answer in the OpenAI error shape the gateway promises its clients.

Engines answer errors in shapes of their own: TGI `{"error": "...", "error_type": "validation"}`,
SGLang and older vLLM `{"object": "error", "message": ..., "type": ..., "code": 400}`, FastAPI's
`{"detail": "..."}` or `{"detail": [{"loc": [...], "msg": ...}]}`, plain text, an HTML page, or
nothing at all. An OpenAI client reads `{"error": {"message", "type", "param", "code"}}` from
every 4xx and 5xx: anything else reaches its user as "unknown error" or a parse failure. Here
the worker's message (and its type, code and param where it had them) is carried over into that
shape; a body already in it is relayed byte for byte.
"""

from __future__ import annotations

import json
from http import HTTPStatus
from typing import Any

import aiohttp
from aiohttp import web

from router.errors import error_body

# The most of an error answer read from a worker: enough for any engine's message, and a worker
# that sends megabytes with its 4xx (an echoed prompt, a debug dump) costs no more than this.
ERROR_BODY_LIMIT = 64 * 1024
# The most of a worker's text kept as the message (an HTML error page is mostly markup).
_MESSAGE_LIMIT = 4096
# How far into a 200 answer an error body names itself ({"error": ..., {"object": "error", ...).
_SNIFF = 64


async def read_bounded(up: aiohttp.ClientResponse, limit: int = ERROR_BODY_LIMIT) -> bytes:
    """Up to `limit` bytes of the answer's body. (The rest is left unread: aiohttp then closes
    the connection instead of reusing it, as a half-read body must be.)"""
    parts: list[bytes] = []
    size = 0
    while size < limit:
        piece = await up.content.read(limit - size)  # may return less than asked before the end
        if not piece:
            break
        parts.append(piece)
        size += len(piece)
    return b"".join(parts)


def default_type(status: int) -> str:
    """OpenAI's error type for a status, when the worker named none."""
    if status == 401:
        return "authentication_error"
    if status == 403:
        return "permission_error"
    if status == 429:
        return "rate_limit_error"
    return "server_error" if status >= 500 else "invalid_request_error"


def is_openai_error(obj: Any) -> bool:
    """Already the shape clients read: an `error` object with a text message and type."""
    if not isinstance(obj, dict):
        return False
    err = obj.get("error")
    return isinstance(err, dict) and isinstance(err.get("message"), str) and isinstance(
        err.get("type"), str)


def error_code_of(resp: web.StreamResponse) -> str | None:
    """The code (else the type) of an error answer the gateway sends, for the access log's
    `error=` field. Every such answer is in the OpenAI shape by then (the gateway's own, or a
    worker's relayed through relayed_error). None for a streamed answer (its body is gone) or
    another body. Error answers only: it parses the body."""
    body = getattr(resp, "body", None)
    if not isinstance(body, bytes) or len(body) > ERROR_BODY_LIMIT:
        return None
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not is_openai_error(obj):
        return None
    code = obj["error"].get("code")
    return code if isinstance(code, str) and code else obj["error"]["type"] or None


def openai_error(status: int, data: bytes) -> bytes | None:
    """The worker's error answer `data` (given with `status`) in the OpenAI shape; None when it
    is in that shape already (relayed unchanged)."""
    try:
        obj = json.loads(data) if data.strip() else None
    except (ValueError, UnicodeDecodeError, RecursionError):
        obj = data  # not JSON: its text is the message
    if is_openai_error(obj):
        return None
    message, type_, code, param = _fields(obj)
    if not message:
        message = f"the worker answered {status} {_phrase(status)}".rstrip()
    return error_body(message[:_MESSAGE_LIMIT], type_ or default_type(status),
                      code if code is not None else status, param)


def error_status_of_ok(data: bytes) -> int | None:
    """The status a 200 answer stands for when its body is an error (some engines write some
    errors so, or put them in a stream's place): its code when that is a 4xx or 5xx, else 502 (a
    worker's error of no known kind). None: no error. Only a body that names "error" near its
    start is parsed: every answer passes here."""
    if b'"error"' not in data[:_SNIFF]:
        return None
    try:
        obj = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    if not isinstance(obj, dict):
        return None
    # A Responses API object carries `"error": null` (or a failed response's error) as a field
    # of its own: an answer with an `object` that is not "error" is no error body.
    if obj.get("object") != "error" if "object" in obj else not obj.get("error"):
        return None
    err = obj.get("error")
    code = obj.get("code", err.get("code") if isinstance(err, dict) else None)
    if isinstance(code, int) and not isinstance(code, bool) and 400 <= code <= 599:
        return code
    return 502


def answer_status(status: int, data: bytes) -> int:
    """The status a worker's whole answer stands for: its own, or an error's in a 200's body."""
    return (error_status_of_ok(data) or status) if status == 200 else status


def relayed_error(status: int, data: bytes, content_type: str) -> tuple[bytes, str]:
    """(body, content type) to relay for a worker's error answer: its own when already in the
    OpenAI shape, else the shape built from it."""
    shaped = openai_error(status, data)
    return (data, content_type) if shaped is None else (shaped, "application/json")


def _fields(obj: Any) -> tuple[str, str | None, int | str | None, str | None]:
    """(message, type, code, param) of an error body in one of the engines' shapes; a shape
    not known here gives its JSON text as the message."""
    if isinstance(obj, bytes):
        return obj.decode(errors="replace").strip(), None, None, None
    if obj is None:
        return "", None, None, None
    if not isinstance(obj, dict):
        return json.dumps(obj), None, None, None
    err = obj.get("error")
    if isinstance(err, dict):  # the OpenAI shape with a part missing or mistyped
        return _text(err.get("message")) or json.dumps(err), _name(err.get("type")), \
            _code(err.get("code")), _name(err.get("param"))
    if isinstance(err, str):  # TGI, Triton's core HTTP API
        return err, _name(obj.get("error_type") or obj.get("type")), _code(obj.get("code")), None
    if "detail" in obj:  # FastAPI (HTTPException, or a validation failure's list)
        return _detail(obj["detail"])
    if "message" in obj:  # SGLang, older vLLM (`"object": "error"`), and the like
        return _text(obj.get("message")), _name(obj.get("type")), _code(obj.get("code")), \
            _name(obj.get("param"))
    return json.dumps(obj), None, None, None


def _detail(detail: Any) -> tuple[str, str | None, int | str | None, str | None]:
    """FastAPI's `detail`: a message, or a validation failure's list of {loc, msg, type}."""
    if not isinstance(detail, list):
        return _text(detail), None, None, None
    messages: list[str] = []
    param = None
    for item in detail:
        if not isinstance(item, dict):
            messages.append(_text(item))
            continue
        # The body field it names, as OpenAI's `param` does ("body" is FastAPI's, not the field's).
        loc = [str(part) for part in item.get("loc") or () if part != "body"]
        where = ".".join(loc)
        param = param or where or None
        text = _text(item.get("msg"))
        messages.append(f"{where}: {text}" if where else text)
    return "; ".join(messages), None, None, param


def _text(value: Any) -> str:
    if value is None:
        return ""
    return value if isinstance(value, str) else json.dumps(value)


def _name(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _code(value: Any) -> int | str | None:
    if isinstance(value, bool):
        return None
    return value if isinstance(value, int | str) else None


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return ""
