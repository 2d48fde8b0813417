"""A path with a trailing slash that names one of the gateway's endpoints without it
(`/v1/models/`, `/tokenize/`, `/v1/chat/completions/`) is redirected there (307, which keeps
the method and the body), as vLLM's server (Starlette's redirect_slashes) does, so a client
that worked against vLLM directly is served here too; it was a 404 "no such endpoint".

Only where the gateway serves the path without the slash: an endpoint route of its own, or, on
the `/v1/{tail}` route that passes any request naming a model on, an endpoint it knows
(request_checks.MODEL_ENDPOINTS). Any other unrouted request gets errors.no_route's answer.
"""

from __future__ import annotations

from aiohttp import web
from yarl import URL

from router.errors import no_route
from router.request_checks import MODEL_ENDPOINTS

# The pattern of the route that passes any /v1 request naming a model (router/app.py).
_PASS_ON_TAIL = "{tail}"


def endpoint_redirect(request: web.Request, path: str) -> web.Response | None:
    """The redirect of a request on the `/v1/{tail}` route (`path`: its path past any base
    path) to the endpoint it names with a trailing slash, before it is read or placed: passed
    on with the slash, its worker (vLLM) redirected it, and the gateway had placed it as a
    request for an unknown path (a stream's usage not asked for, no model not the pool's)."""
    if len(path) < 2 or not path.endswith("/") or path.rstrip("/") not in MODEL_ENDPOINTS:
        return None
    return _redirect(request)


def _redirect(request: web.Request) -> web.Response | None:
    """The 307 to the path as the client spelt it (percent-encoded: a decoded one put raw
    non-ASCII or a newline in the Location header, and the answer was lost), less its trailing
    slashes; None where the slash was itself encoded (%2F: the same URL again)."""
    raw = request.rel_url.raw_path
    target = raw.rstrip("/")
    if not target or target == raw:
        return None
    query = request.rel_url.raw_query_string
    return web.Response(status=307, headers={"Location": target + (f"?{query}" if query else "")})


async def unrouted(request: web.Request) -> web.StreamResponse:
    """The redirect to the path without its trailing slash, where the gateway serves that; else
    the 404 or 405 of errors.no_route."""
    redirect = _redirect(request) if await _slashless_target(request) is not None else None
    return redirect if redirect is not None else await no_route(request)


async def _slashless_target(request: web.Request) -> str | None:
    path = request.path
    stripped = path.rstrip("/")
    if not stripped or stripped == path:
        return None
    clone = request.clone(rel_url=URL.build(path=stripped))
    for resource in request.app.router.resources():  # the error path only: a linear walk is fine
        match, methods = await resource.resolve(clone)
        if match is None:
            if methods:  # served there with other methods: redirected, as vLLM does (then 405)
                return stripped
            continue
        if match.handler is no_route or match.handler is unrouted:  # the catch-all
            return None
        if _PASS_ON_TAIL in resource.canonical and not stripped.endswith(tuple(MODEL_ENDPOINTS)):
            return None
        return stripped
    return None
