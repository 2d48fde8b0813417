"""The scheduler's admin token (--admin-token), for operators' calls that change routing:
cordon and uncordon (scheduler/cordons.py).

Why fail closed: those calls take workers out of rotation, so a scheduler with no admin token
refuses them (403) rather than let whoever reaches it drain the pool; one with a token wants
`Authorization: Bearer <token>` (else 401). The gateway token is not accepted here: a gateway
has no business cordoning workers, and a leaked gateway token must not give that power.
"""

from __future__ import annotations

import json

from aiohttp import web

from scheduler.gateway_auth import Handler, require_token


def _error(message: str, code: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": "authentication_error", "param": None,
                                 "code": code}}, separators=(",", ":")).encode()


_DISABLED = _error("admin calls are off: the scheduler has no admin token (--admin-token, "
                   "SCHEDULER_ADMIN_TOKEN)", "admin_disabled")
_REFUSED = _error("invalid or missing admin token (the scheduler's --admin-token, sent as "
                  "Authorization: Bearer)", "invalid_admin_token")


def _refused() -> web.Response:
    return web.Response(status=401, body=_REFUSED, content_type="application/json",
                        headers={"WWW-Authenticate": 'Bearer realm="scheduler-admin"'})


def require_admin(handler: Handler, token: str | None) -> Handler:
    """`handler` behind the admin token: 403 to every call while none is set, 401 to a call
    without it (before its body is read)."""
    if not token:
        async def disabled(request: web.Request) -> web.StreamResponse:
            return web.Response(status=403, body=_DISABLED, content_type="application/json")

        disabled.__name__ = getattr(handler, "__name__", "disabled")
        return disabled
    return require_token(handler, token, _refused)
