"""HTTP API of the scheduler (aiohttp). The schedule and release bodies are validated with
pydantic-core straight from bytes and answers encoded with pydantic_core.to_json: both
measured cheaper than the stdlib json module (benchmarks/scheduler_bench.py, `wire`)."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
import weakref

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from pydantic_core import from_json, to_json

from scheduler.admin_auth import require_admin
from scheduler.channel import (
    LEASE_OPS,
    OPEN_CHANNELS,
    caller_gone,
    close_channels,
    gateway_instance,
    request_of,
    run_batch_bytes,
    serve_channel,
    validation_message,
)
from scheduler.clip import clip, clip_repr
from scheduler.cordons import clean_reason
from scheduler.discovery.registration import (
    RegistrationError,
    check_token,
    deregister,
    resolve_and_register,
)
from scheduler.gateway_auth import TokenRef, require_token
from scheduler.policies import Request
from scheduler.protocol import CLIENT_LEFT, ScheduleRequest
from scheduler.receive_timeout import RequestBodyTimeout, read_body_within
from scheduler.service import UNKNOWN_MODEL, SchedulerService, Wait

log = logging.getLogger(__name__)
HTTP_LOG = logging.getLogger("scheduler.http")  # what clients send on the wire (scheduler/http_errors.py)

_dumps = json.JSONEncoder(separators=(",", ":")).encode
SERVICE_KEY = web.AppKey("service", SchedulerService)


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def _error_body(message: str, param: str | None, code: str | None, type_: str) -> bytes:
    return _dumps({"error": {"message": message, "type": type_, "param": param, "code": code}})


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   type_: str = "invalid_request_error") -> web.Response:
    return web.Response(status=status, body=_error_body(message, param, code, type_),
                        content_type="application/json")


def connection_error(status: int, message: str, type_: str) -> web.Response:
    """What aiohttp would answer in plain text outside any route (scheduler/http_errors.py)."""
    return error_response(status, message, code="malformed_http_request" if status < 500 else None,
                          type_=type_)


async def read_body(request: web.Request) -> bytes:
    """The request body; one that cannot be decoded (a Content-Encoding that lies) is the
    client's error, answered 400 in the usual shape (raised: aiohttp sends an HTTPException
    as the response); one stalled for --request-receive-timeout-ms or too slow past it a 408,
    the connection closed (scheduler/receive_timeout.py)."""
    timeout_s = request.app[SERVICE_KEY].cfg.request_receive_timeout_ms / 1000
    try:
        return await read_body_within(request, timeout_s, HTTP_LOG)
    except RequestBodyTimeout as exc:
        body = _error_body(str(exc), None, "request_timeout", "invalid_request_error")
        answer = web.HTTPRequestTimeout(body=body, content_type="application/json")
        answer.force_close()
        raise answer from None
    except web.RequestPayloadError as exc:
        body = _error_body(f"unreadable request body: {exc}", None, "invalid_body", "invalid_request_error")
        # Marked read, or aiohttp reads the rest after the answer, meets the same error and logs
        # it with a traceback; and the connection closes (its framing is in doubt).
        request.content.feed_eof()
        answer = web.HTTPBadRequest(body=body, content_type="application/json")
        answer.force_close()
        raise answer from None
    except web.HTTPRequestEntityTooLarge as exc:  # past client_max_size: aiohttp's is plain text
        text = _error_body(exc.text or "request body too large", None, "body_too_large",
                           "invalid_request_error")
        raise web.HTTPRequestEntityTooLarge(0, text=text, content_type="application/json") from None


def _json(raw: bytes) -> dict:
    # pydantic-core's parser, not json.loads: the stdlib one takes a lone surrogate escape
    # ("\\ud800"), which no UTF-8 encoder takes (a worker id holding one made every /metrics
    # page a 500), and meets deep nesting with a RecursionError (a 500); this one refuses both.
    try:
        body = from_json(raw)
    except ValueError:
        raise BadRequest("body is not valid JSON") from None
    if not isinstance(body, dict):
        raise BadRequest("body must be a JSON object")
    return body


def _validation_error(exc: ValidationError) -> BadRequest:
    err = exc.errors()[0]
    loc = err.get("loc") or ()
    param = str(loc[0]) if loc else None
    if err.get("type") == "json_invalid":
        return BadRequest("body is not valid JSON")
    if param is None and err.get("type") == "model_type":
        return BadRequest("body must be a JSON object")
    return BadRequest(validation_message(param, err.get("msg")), param)


def parse_schedule(raw: bytes) -> tuple[Request, int, int]:
    """pydantic-core's JSON validation is cheaper here than json.loads plus hand checks
    (measured in benchmarks/scheduler_bench.py, part `wire`)."""
    try:
        r = ScheduleRequest.model_validate_json(raw)
    except ValidationError as exc:
        raise _validation_error(exc) from None
    if not r.model:
        raise BadRequest("model is required", "model")
    return request_of(r), r.wait_ms, r.waited_ms


async def schedule(request: web.Request) -> web.Response:
    svc = request.app[SERVICE_KEY]
    gateway = gateway_instance(request)  # its leases end with it (scheduler/gateways.py)
    if isinstance(gateway, web.Response):
        return gateway
    try:
        req, wait_ms, waited_ms = parse_schedule(await read_body(request))
    except BadRequest as exc:
        return error_response(400, str(exc), exc.param)
    out = await svc.schedule(req, wait_ms, waited_ms)
    if isinstance(out, dict):
        if caller_gone(request.transport):
            # Nobody to answer (a call read late, its gateway gone meanwhile): the lease back.
            svc.release(out["lease_id"], ok=True, error=CLIENT_LEFT)
            return web.Response(status=499)
        if gateway is not None:
            svc.leases.tag(out["lease_id"], gateway)
        return web.Response(body=to_json(out), content_type="application/json")
    if out == UNKNOWN_MODEL:
        return error_response(404, f"no worker serves model {clip_repr(req.model)}", "model",
                              "model_not_found")
    assert isinstance(out, Wait)
    body = {"wait": True, "retry_after_ms": out.retry_after_ms, "reason": out.reason}
    return web.Response(status=503, body=_dumps(body), content_type="application/json",
                        headers={"Retry-After": str(max(1, out.retry_after_ms // 1000))})


async def _lease_call(request: web.Request, kind: str) -> web.Response:
    """POST /v1/release, /v1/prefilled and /v1/renew: the batch's lease operations (LEASE_OPS), one
    per call."""
    model, apply, not_found = LEASE_OPS[kind]
    try:
        body = model.model_validate_json(await read_body(request))
    except ValidationError as exc:
        bad = _validation_error(exc)
        return error_response(400, str(bad), bad.param)
    if not apply(request.app[SERVICE_KEY], body):
        return error_response(404, not_found, "lease_id", "lease_not_found")
    return web.Response(status=204)


async def release(request: web.Request) -> web.Response:
    return await _lease_call(request, "release")


async def prefilled(request: web.Request) -> web.Response:
    return await _lease_call(request, "prefilled")


async def renew(request: web.Request) -> web.Response:
    return await _lease_call(request, "renew")


async def batch(request: web.Request) -> web.Response:
    gateway = gateway_instance(request)
    if isinstance(gateway, web.Response):
        return gateway
    answers = run_batch_bytes(request.app[SERVICE_KEY], await read_body(request), gateway)
    if answers is None:
        return error_response(400, "body must be a JSON array of operations")
    return web.Response(body=to_json(answers), content_type="application/json")


async def channel(request: web.Request) -> web.StreamResponse:
    return await serve_channel(request, request.app[SERVICE_KEY])


async def list_workers(request: web.Request) -> web.Response:
    svc = request.app[SERVICE_KEY]
    # The parameters in force (defaults filled in), so an operator can see what the policy runs.
    body = {"policy": svc.policy.name, "policy_params": dataclasses.asdict(svc.policy.p),
            "workers": svc.workers_view(), "fair_share": svc.fair_state(),
            # Every cordon, those of ids no worker has now included (each worker shows its own).
            "cordons": svc.cordons.views(),
            # Still learning its pool after a start (scheduler/startup.py): a worker missing
            # from this list may only not have heartbeated yet.
            "learning": svc.learning_pool(time.monotonic())}
    return web.Response(body=_dumps(body), content_type="application/json")


async def register_worker(request: web.Request) -> web.Response:
    svc = request.app[SERVICE_KEY]
    try:
        check_token(svc, request.headers.get("Authorization"))
        try:
            body = _json(await read_body(request))
        except BadRequest as exc:
            raise RegistrationError(400, str(exc)) from None
        w, created = await resolve_and_register(svc, body)
    except RegistrationError as exc:
        kind = "authentication_error" if exc.status in (401, 403) else "invalid_request_error"
        return error_response(exc.status, str(exc), exc.param, type_=kind)
    body = {"worker_id": w.worker_id, "url": w.url, "created": created,
            "heartbeat_interval_s": svc.cfg.registration_ttl_s / 3.0}
    return web.Response(status=201 if created else 200, body=_dumps(body), content_type="application/json")


async def delete_worker(request: web.Request) -> web.Response:
    svc = request.app[SERVICE_KEY]
    try:
        check_token(svc, request.headers.get("Authorization"))
    except RegistrationError as exc:
        return error_response(exc.status, str(exc), type_="authentication_error")
    if not deregister(svc, request.match_info["worker_id"]):
        return error_response(404, "no such registered worker", "worker_id", "worker_not_found")
    return web.Response(status=204)


async def _cordon_answer(svc: SchedulerService, worker_id: str, changed: bool) -> web.Response:
    """The worker's cordon state as the call left it, once the cordon file has every cordon."""
    w = svc.registry.workers.get(worker_id)
    body = {"worker_id": worker_id, **svc.cordons.view(worker_id), "changed": changed,
            # Absent: a cordon kept for an id that left the pool (it applies if the id returns).
            "known": w is not None,
            # What still runs there: the worker is drained once this and its running are 0.
            "in_flight_leases": w.in_flight if w is not None else 0}
    # Written on a repeat too: a call repeated after a failed write (a full disk since freed)
    # writes the set again. False: the cordon holds, but a restarted scheduler would not know
    # it; null: no --cordon-file, kept in memory only.
    body["persisted"] = await svc.persist_cordons()
    return web.Response(body=_dumps(body), content_type="application/json")


async def cordon_worker(request: web.Request) -> web.Response:
    """POST /v1/workers/{worker_id}/cordon, optional body {"reason": "..."}: no new requests
    for the worker (scheduler/cordons.py). Idempotent: a repeat keeps the first cordon."""
    svc = request.app[SERVICE_KEY]
    worker_id = request.match_info["worker_id"]
    raw = await read_body(request)
    reason = None
    if raw.strip():
        try:
            body = _json(raw)
        except BadRequest as exc:
            return error_response(400, str(exc))
        given = body.get("reason")
        if given is not None and not isinstance(given, str):
            return error_response(400, "reason must be a string", "reason")
        reason = clean_reason(given)
    # A known worker, or an id cordoned already (its worker left): a typo must not pass silently.
    if worker_id not in svc.registry.workers and worker_id not in svc.cordons:
        return error_response(404, f"no worker {clip_repr(worker_id)} (GET /v1/workers lists them)",
                              "worker_id", "worker_not_found")
    changed = svc.cordon(worker_id, reason, by=request.remote) is not None
    return await _cordon_answer(svc, worker_id, changed)


async def uncordon_worker(request: web.Request) -> web.Response:
    """POST /v1/workers/{worker_id}/uncordon: back in rotation. Idempotent."""
    svc = request.app[SERVICE_KEY]
    worker_id = request.match_info["worker_id"]
    if worker_id not in svc.registry.workers and worker_id not in svc.cordons:
        return error_response(404, f"no worker {clip_repr(worker_id)} and no cordon for it",
                              "worker_id", "worker_not_found")
    changed = svc.uncordon(worker_id, by=request.remote) is not None
    return await _cordon_answer(svc, worker_id, changed)


async def worker_failure(request: web.Request) -> web.Response:
    svc = request.app[SERVICE_KEY]
    try:
        body = _json(await read_body(request))
    except BadRequest as exc:
        return error_response(400, str(exc))
    error = str(body.get("error") or "failure")[:200]
    if not error.isprintable():
        # Anyone who reaches the scheduler may send this, and it is logged with the worker's
        # health change: a newline in it forged log lines. Escaped, it still reads.
        error = error.encode("unicode_escape").decode("ascii")[:200]
    refused = body.get("refused") is True  # absent from an older gateway's report
    if not svc.report_failure(request.match_info["worker_id"], error, refused):
        return error_response(404, "unknown worker", "worker_id", "worker_not_found")
    svc.metrics.failure_reports.inc()
    return web.Response(status=204)


async def health(request: web.Request) -> web.Response:
    svc = request.app[SERVICE_KEY]
    up = sum(1 for w in svc.registry.workers.values() if w.health.routable)
    return web.json_response({"status": "ok", "workers": len(svc.registry.workers), "routable": up})


async def metrics(request: web.Request) -> web.Response:
    svc = request.app[SERVICE_KEY]
    resp = web.Response(body=generate_latest(svc.metrics.registry))
    resp.headers["Content-Type"] = CONTENT_TYPE_LATEST
    return resp


async def not_found(request: web.Request) -> web.Response:
    return error_response(404, f"no route for {clip(request.path)}", code="not_found")


async def method_not_allowed(request: web.Request) -> web.Response:
    message = f"{clip(request.method)} is not allowed on {clip(request.path)}"
    return error_response(405, message, code="method_not_allowed")


def build_app(service: SchedulerService, admin_token: TokenRef | None = None) -> web.Application:
    """admin_token: the admin token in force, replaced while it runs by --admin-token-file's
    reloads (scheduler/admin_auth.py); by default --admin-token's."""
    # No middleware: it would wrap every call on the hot path. Unknown paths and wrong
    # methods get OpenAI-shaped errors from explicit catch-all routes instead.
    app = web.Application(client_max_size=1 << 20)
    app[SERVICE_KEY] = service
    app[OPEN_CHANNELS] = weakref.WeakSet()
    app.on_shutdown.append(close_channels)
    # The decision API: with --gateway-token, only callers that send it (scheduler/gateway_auth.py).
    decisions = [
        ("POST", "/v1/schedule", schedule),
        ("POST", "/v1/release", release),
        ("POST", "/v1/prefilled", prefilled),
        ("POST", "/v1/renew", renew),
        ("POST", "/v1/batch", batch),
        ("GET", "/v1/channel", channel),
        ("POST", "/v1/workers/{worker_id}/failure", worker_failure),
    ]
    token = service.cfg.gateway_token
    if token:
        decisions = [(method, path, require_token(handler, token)) for method, path, handler in decisions]
    # Operators' calls: only with the admin token, and refused (403) while none is in force.
    admin = [
        ("POST", "/v1/workers/{worker_id}/cordon", cordon_worker),
        ("POST", "/v1/workers/{worker_id}/uncordon", uncordon_worker),
    ]
    if admin_token is None:
        admin_token = TokenRef(service.cfg.admin_token)
    admin = [(method, path, require_admin(handler, admin_token)) for method, path, handler in admin]
    routes = [
        *decisions,
        *admin,
        # Read-only (GET /v1/workers, /health, /metrics: Prometheus) or with a token of their own.
        ("GET", "/v1/workers", list_workers),
        ("POST", "/v1/workers", register_worker),
        ("DELETE", "/v1/workers/{worker_id}", delete_worker),
        ("GET", "/health", health),
        ("GET", "/metrics", metrics),
    ]
    resources: dict[str, web.Resource] = {}
    for method, path, handler in routes:
        resource = resources.get(path) or app.router.add_resource(path)
        resources[path] = resource
        resource.add_route(method, handler)
    for resource in resources.values():
        resource.add_route("*", method_not_allowed)
    # Any character (`(?s:.*)`): `.*` stops at a newline, and a path with an escaped one (%0a)
    # got aiohttp's plain-text 404.
    app.router.add_route("*", "/{tail:(?s:.*)}", not_found)
    return app
