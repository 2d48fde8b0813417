"""The optional gateway token of the scheduler's decision API (--gateway-token).

Why: whoever reaches the decision API can take leases (load the pool with phantom requests)
or report any worker failed (a connection failure takes it out of rotation at once). With a
token set, those calls must carry `Authorization: Bearer <token>`; the read-only routes
(GET /v1/workers, /health, /metrics) stay open, and registration keeps its own token.

The check wraps only the guarded handlers, and only when a token is set: no middleware, so
a scheduler without a token pays nothing, and one with it one header lookup and one
constant-time compare per call (the WebSocket channel: once, at the upgrade).
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable

from aiohttp import web

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# Built once: the answer is the same for every refused call (OpenAI error shape).
_REFUSED = json.dumps({"error": {
    "message": "invalid or missing gateway token (the scheduler's --gateway-token, sent by the "
               "gateway's --scheduler-token as Authorization: Bearer)",
    "type": "authentication_error", "param": None, "code": "invalid_gateway_token"}},
    separators=(",", ":")).encode()


def _secret_bytes(value: str) -> bytes:
    # aiohttp hands a header byte that is not UTF-8 on as a lone surrogate, which a plain
    # encode() refuses (a 500): surrogatepass gives bytes back, which then do not match.
    return value.encode("utf-8", "surrogatepass")


def token_matches(authorization: str | None, expected: bytes) -> bool:
    """Whether an Authorization header carries the token (scheme name in any case, RFC 7235)."""
    if not authorization or authorization[:7].lower() != "bearer ":
        # Compared anyway, so that a missing header takes as long as a wrong one.
        hmac.compare_digest(b"", expected)
        return False
    return hmac.compare_digest(_secret_bytes(authorization[7:].strip()), expected)


def refused() -> web.Response:
    return web.Response(status=401, body=_REFUSED, content_type="application/json",
                        headers={"WWW-Authenticate": 'Bearer realm="scheduler"'})


class TokenRef:
    """The token a guard checks calls against, which may be replaced while the service runs (the
    admin token re-read from its file, scheduler/admin_auth.py): each call reads the one in force.
    None: no token."""

    __slots__ = ("expected",)

    def __init__(self, token: str | None = None) -> None:
        self.expected: bytes | None = None
        self.set(token)

    def set(self, token: str | None) -> None:
        self.expected = _secret_bytes(token) if token else None


def require_token(handler: Handler, token: str | TokenRef,
                  refusal: Callable[[], web.Response] = refused) -> Handler:
    """`handler`, answering `refusal()` (a 401) to a call without the token (before its body is
    read, and on the channel before the upgrade). A TokenRef's token is the one in force at each
    call (none in force: every call is refused)."""
    ref = token if isinstance(token, TokenRef) else TokenRef(token)

    async def guarded(request: web.Request) -> web.StreamResponse:
        expected = ref.expected
        if expected is None or not token_matches(request.headers.get("Authorization"), expected):
            return refusal()
        return await handler(request)

    guarded.__name__ = getattr(handler, "__name__", "guarded")
    return guarded
