"""Cross-origin requests from browser apps (CORS), for the origins the operator lists.

A chat page served from another origin than the gateway's (a web UI, a notebook in the
browser) can only call the API if the gateway answers the browser's preflight and marks its
answers as readable by that origin. vLLM and LiteLLM allow every origin by default; the gateway
allows none until `--cors-allowed-origins` names some (or `*`), so that putting it in front of
an engine is an explicit choice here.

- Preflight (`OPTIONS` with `Origin` and `Access-Control-Request-Method`): answered here, before
  authentication (browsers never send credentials on it), 204 for a listed origin, 403 in the
  OpenAI error shape for another.
- Every other answer to a listed origin (SSE streams included: the header goes out when the
  response is prepared) carries `Access-Control-Allow-Origin`, and exposes the gateway's
  `x-request-id` and `x-router-*` headers to the page.
- No cookies are involved (the API key travels in `Authorization`), so credentials mode is
  not offered.
Installed only when origins are configured: without it the hot path has no extra step.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from router.errors import error_response
from scheduler.clip import clip_repr

_ALLOW_METHODS = "GET, POST, OPTIONS"
_EXPOSE = "x-request-id, x-router-worker, x-router-policy, x-router-queue-ms, Retry-After"
_PREFLIGHT_MAX_AGE_S = "600"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class CorsPolicy:
    def __init__(self, origins: list[str]) -> None:
        self.any_origin = "*" in origins
        self.origins = frozenset(o.rstrip("/") for o in origins if o != "*")

    def allowed_value(self, origin: str) -> str | None:
        """The Access-Control-Allow-Origin value for this origin, or None if it is not allowed."""
        if self.any_origin:
            return "*"
        return origin if origin in self.origins else None

    def install(self, app: web.Application) -> None:
        app.middlewares.append(self._preflight)
        app.on_response_prepare.append(self._mark_response)

    @web.middleware
    async def _preflight(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        headers = request.headers
        if request.method != "OPTIONS" or "Access-Control-Request-Method" not in headers:
            return await handler(request)
        origin = headers.get("Origin", "")
        allowed = self.allowed_value(origin)
        if allowed is None:
            return error_response(
                403, f"origin {clip_repr(origin)} is not allowed to call this API",
                code="cors_origin_not_allowed",
            )
        answer = {
            "Access-Control-Allow-Origin": allowed,
            "Access-Control-Allow-Methods": _ALLOW_METHODS,
            "Access-Control-Max-Age": _PREFLIGHT_MAX_AGE_S,
        }
        # Authorization is never covered by a "*" here: echo what the page asks to send.
        if asked := headers.get("Access-Control-Request-Headers"):
            answer["Access-Control-Allow-Headers"] = asked
        if allowed != "*":
            answer["Vary"] = "Origin"
        return web.Response(status=204, headers=answer)

    async def _mark_response(self, request: web.Request, response: web.StreamResponse) -> None:
        if "Access-Control-Allow-Origin" in response.headers:  # a preflight's answer: done
            return
        if not self.any_origin:
            # Whether it carries Access-Control-Allow-Origin depends on the request's Origin, for
            # every answer (one to another origin, or to none, included): else a shared cache
            # may keep the unmarked one and serve it to a listed origin's page, which then sees
            # only "failed to fetch".
            response.headers.add("Vary", "Origin")
        origin = request.headers.get("Origin")
        if origin is None:
            return
        allowed = self.allowed_value(origin)
        if allowed is None:
            return
        response.headers["Access-Control-Allow-Origin"] = allowed
        response.headers["Access-Control-Expose-Headers"] = _EXPOSE
