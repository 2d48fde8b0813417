"""OpenAI-shaped error responses: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import json
import re

from aiohttp import web

from scheduler.clip import clip


def error_body(
    message: str, type_: str, code: int | str | None = None, param: str | None = None
) -> bytes:
    return json.dumps(
        {"error": {"message": message, "type": type_, "param": param, "code": code}}
    ).encode()


def error_response(
    status: int,
    message: str,
    type_: str = "invalid_request_error",
    *,
    param: str | None = None,
    code: int | str | None = None,
    headers: dict[str, str] | None = None,
) -> web.Response:
    return web.Response(
        status=status,
        body=error_body(message, type_, code if code is not None else status, param),
        content_type="application/json",
        headers=headers,
    )


async def no_route(request: web.Request) -> web.Response:
    """The answer for a request that no route serves: 405 if a route serves its path with
    other methods, else 404. (Catch-alls, which took it, match any method and add none.)"""
    allowed: set[str] = set()
    for resource in request.app.router.resources():  # the error path only: a linear walk is fine
        match, methods = await resource.resolve(request)
        if match is None:
            allowed |= methods
    if allowed:
        methods = ", ".join(sorted(allowed))
        return error_response(
            405, f"{clip(request.method)} is not allowed on {clip(request.path)}: use {methods}",
            code="method_not_allowed", headers={"Allow": methods},
        )
    return error_response(404, f"no such endpoint: {clip(request.method)} {clip(request.path)}",
                          code="not_found")


def sse_error_event(message: str, type_: str = "upstream_error", code: int | str = 502) -> bytes:
    """An error event and a clean end for a stream that already started."""
    return b"data: " + error_body(message, type_, code) + b"\n\ndata: [DONE]\n\n"


# A Responses stream's event numbers, as workers write them (compact JSON or not). A text
# delta that quotes these words has them escaped (\"sequence_number\"), which this does not match.
SEQUENCE_NUMBER = re.compile(rb'"sequence_number"\s*:\s*(\d+)')


def responses_error_event(message: str, code: str, sequence_number: int) -> bytes:
    """OpenAI's Responses stream `error` event: how a Responses stream that already started
    says it failed (its clients parse typed events, and no chat-style `[DONE]`)."""
    data = {"type": "error", "code": code, "message": message, "param": None,
            "sequence_number": sequence_number}
    return f"event: error\ndata: {json.dumps(data)}\n\n".encode()


def next_sequence_number(*sent: bytes) -> int:
    """The number after the last one in the first of `sent` (whole events, latest first) that
    holds any; 0 when none does."""
    for events in sent:
        numbers = SEQUENCE_NUMBER.findall(events)
        if numbers:
            return int(numbers[-1]) + 1
    return 0
