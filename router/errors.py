"""OpenAI-shaped error responses: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import json

from aiohttp import web


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
            405, f"{request.method} is not allowed on {request.path}: use {methods}",
            code="method_not_allowed", headers={"Allow": methods},
        )
    return error_response(404, f"no such endpoint: {request.method} {request.path}", code="not_found")


def sse_error_event(message: str, type_: str = "upstream_error", code: int | str = 502) -> bytes:
    """An error event and a clean end for a stream that already started."""
    return b"data: " + error_body(message, type_, code) + b"\n\ndata: [DONE]\n\n"
