"""HTTP API of the scheduler (aiohttp). Request bodies are decoded with json + explicit
checks rather than pydantic: the schedule call is on every request's path."""

from __future__ import annotations

import json
import logging

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from scheduler.discovery.registration import RegistrationError, check_token, deregister, register
from scheduler.policies import Request
from scheduler.service import UNKNOWN_MODEL, SchedulerService, Wait

log = logging.getLogger(__name__)

_dumps = json.JSONEncoder(separators=(",", ":")).encode
SERVICE_KEY = web.AppKey("service", SchedulerService)


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   type_: str = "invalid_request_error") -> web.Response:
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return web.Response(status=status, body=_dumps(body), content_type="application/json")


def _json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise BadRequest("body is not valid JSON") from None
    if not isinstance(body, dict):
        raise BadRequest("body must be a JSON object")
    return body


def _int(body: dict, key: str, default, lo: int, hi: int | None = None):
    v = body.get(key, default)
    if v is None and default is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or v < lo or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise BadRequest(f"{key} must be an integer {rng}", key)
    return v


def parse_schedule(raw: bytes) -> tuple[Request, int]:
    body = _json(raw)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("model is required", "model")
    hashes = body.get("prefix_hashes") or []
    if not isinstance(hashes, list) or not all(type(h) is int for h in hashes):
        raise BadRequest("prefix_hashes must be a list of integers", "prefix_hashes")
    lora = body.get("lora")
    if lora is not None and not isinstance(lora, str):
        raise BadRequest("lora must be a string", "lora")
    exclude = body.get("exclude") or None
    if exclude is not None:
        if not isinstance(exclude, list) or not all(isinstance(x, str) for x in exclude):
            raise BadRequest("exclude must be a list of worker ids", "exclude")
        exclude = frozenset(exclude)
    req = Request(model, _int(body, "prompt_tokens", 0, 0), _int(body, "max_tokens", None, 1),
                  hashes, lora, exclude)
    return req, _int(body, "wait_ms", 0, 0, 60_000)


async def schedule(request: web.Request) -> web.Response:
    svc = request.app[SERVICE_KEY]
    try:
        req, wait_ms = parse_schedule(await request.read())
    except BadRequest as exc:
        return error_response(400, str(exc), exc.param)
    out = await svc.schedule(req, wait_ms)
    if isinstance(out, dict):
        return web.Response(body=_dumps(out), content_type="application/json")
    if out == UNKNOWN_MODEL:
        return error_response(404, f"no worker serves model {req.model!r}", "model", "model_not_found")
    assert isinstance(out, Wait)
    body = {"wait": True, "retry_after_ms": out.retry_after_ms, "reason": out.reason}
    return web.Response(status=503, body=_dumps(body), content_type="application/json",
                        headers={"Retry-After": str(max(1, out.retry_after_ms // 1000))})


async def release(request: web.Request) -> web.Response:
    svc = request.app[SERVICE_KEY]
    try:
        body = _json(await request.read())
        lease_id = body.get("lease_id")
        if not isinstance(lease_id, str) or not lease_id:
            raise BadRequest("lease_id is required", "lease_id")
        ok = body.get("ok", True)
        if not isinstance(ok, bool):
            raise BadRequest("ok must be a boolean", "ok")
        error = body.get("error")
        if error is not None and not isinstance(error, str):
            raise BadRequest("error must be a string", "error")
    except BadRequest as exc:
        return error_response(400, str(exc), exc.param)
    found = svc.release(lease_id, ok, error)
    svc.metrics.releases.labels("ok" if ok else "failed" if found else "unknown").inc()
    if not found:
        return error_response(404, "unknown or expired lease", "lease_id", "lease_not_found")
    return web.Response(status=204)


async def list_workers(request: web.Request) -> web.Response:
    svc = request.app[SERVICE_KEY]
    body = {"policy": svc.policy.name, "workers": svc.workers_view()}
    return web.Response(body=_dumps(body), content_type="application/json")


async def register_worker(request: web.Request) -> web.Response:
    svc = request.app[SERVICE_KEY]
    try:
        check_token(svc, request.headers.get("Authorization"))
        try:
            body = _json(await request.read())
        except BadRequest as exc:
            raise RegistrationError(400, str(exc)) from None
        w, created = register(svc, body)
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


async def worker_failure(request: web.Request) -> web.Response:
    svc = request.app[SERVICE_KEY]
    try:
        body = _json(await request.read())
    except BadRequest as exc:
        return error_response(400, str(exc))
    error = body.get("error") or "failure"
    if not svc.report_failure(request.match_info["worker_id"], str(error)[:200]):
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


@web.middleware
async def json_errors(request: web.Request, handler):
    """Unknown paths and wrong methods answer in the OpenAI error shape too."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(exc.status, exc.reason or "error")


def build_app(service: SchedulerService) -> web.Application:
    app = web.Application(middlewares=[json_errors], client_max_size=1 << 20)
    app[SERVICE_KEY] = service
    app.router.add_post("/v1/schedule", schedule)
    app.router.add_post("/v1/release", release)
    app.router.add_get("/v1/workers", list_workers)
    app.router.add_post("/v1/workers", register_worker)
    app.router.add_delete("/v1/workers/{worker_id}", delete_worker)
    app.router.add_post("/v1/workers/{worker_id}/failure", worker_failure)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app
