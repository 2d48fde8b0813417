"""Batched schedule/release calls: `POST /v1/batch` and the WebSocket channel `GET /v1/channel`.

Why: a request through the gateway costs the scheduler two HTTP requests (schedule,
release), and their per-request HTTP handling costs several times the decision itself.
A batch carries every call the gateway made in one event-loop iteration; the WebSocket
channel carries batches over one persistent connection with no HTTP parsing per batch.

A batch is a JSON array of operations, answered by a JSON array of the same length in
the same order:
    {"op": "schedule", <ScheduleRequest fields; wait_ms must be 0>}  -> [200, ScheduleDecision]
                                                                       [503, ScheduleWait]
                                                                       [404 or 400, OpenAI error]
    {"op": "release", <LeaseRelease fields>}                         -> [204, null] or [404/400, error]
    {"op": "prefilled", <LeasePrefilled fields>}                     -> [204, null] or [404/400, error]
    {"op": "renew", <LeaseRenewal fields>}                           -> [204, null] or [404/400, error]
Held calls (wait_ms > 0) would hold up every answer behind them, so they stay on
`POST /v1/schedule`.

On the channel every binary or text message is one batch. A message with at least one
schedule operation is answered by one message (the answer array); a message of releases,
prefilled reports and renewals only is not answered (all fire-and-forget; the lease expiry
covers a lost release, the next scrape a lost report, the next renewal a lost one).
A message that is not a JSON array closes the channel with code 1007.

A gateway that names itself (the upgrade's `X-Gateway-Instance` header, scheduler/gateways.py)
has the leases decided on its channel tagged with its id, and its channel counts as its sign of
life: the scheduler pings it every CHANNEL_HEARTBEAT_S (a channel whose peer's host is gone
sends no FIN, and would stay open for ever), and once its gateway has no channel open for
--gateway-gone-grace-s its leases end. A channel without the header (an older gateway) is
served as before: no pings, its leases end on release or at the TTL.
"""

from __future__ import annotations

import asyncio
import socket
import time
import weakref
from collections.abc import Callable
from typing import Any

from aiohttp import WSCloseCode, WSMsgType, web
from pydantic import BaseModel, ValidationError
from pydantic_core import from_json, to_json

from scheduler.clip import MAX_SHOWN_CHARS, clip, clip_repr
from scheduler.gateways import GATEWAY_INSTANCE_HEADER, valid_instance
from scheduler.policies import Request
from scheduler.protocol import (
    CLIENT_LEFT,
    MAX_TOKENS_COUNTED,
    LeasePrefilled,
    LeaseRelease,
    LeaseRenewal,
    ScheduleRequest,
)
from scheduler.service import UNKNOWN_MODEL, SchedulerService, Wait


def _error(status: int, message: str, param: str | None = None, code: str | None = None) -> list:
    return [status, {"error": {"message": message, "type": "invalid_request_error", "param": param,
                               "code": code}}]


def _bad(exc: ValidationError) -> list:
    err = exc.errors()[0]
    loc = err.get("loc") or ()
    param = str(loc[0]) if loc else None
    return _error(400, validation_message(param, err.get("msg")), param)


def validation_message(param: str | None, msg: object) -> str:
    """A pydantic error's message as the 400 says it (the HTTP routes' and the batch's): its
    words are short and quote no input, but cut all the same (clip.py), as the worker cuts them."""
    text = clip(str(msg), 4 * MAX_SHOWN_CHARS)
    return f"{param}: {text}" if param else text


def request_of(r: ScheduleRequest) -> Request:
    """The policies' view of a schedule call, its token counts clamped (MAX_TOKENS_COUNTED)."""
    cap = MAX_TOKENS_COUNTED
    max_tokens = None if r.max_tokens is None else min(r.max_tokens, cap)
    return Request(r.model, min(r.prompt_tokens, cap), max_tokens, r.prefix_hashes, r.lora,
                   frozenset(r.exclude) if r.exclude else None, r.reserved_only, r.worker_id,
                   min(r.cached_tokens, cap), r.flow, r.attach and r.worker_id is not None,
                   r.priority, r.session)


def _schedule(svc: SchedulerService, op: dict, gateway: str | None) -> list:
    try:
        r = ScheduleRequest.model_validate(op)
    except ValidationError as exc:
        return _bad(exc)
    if not r.model:
        return _error(400, "model is required", "model")
    if r.wait_ms:
        return _error(400, "wait_ms is not supported in a batch: use POST /v1/schedule", "wait_ms")
    out = svc.schedule_now(request_of(r), time.monotonic())
    if isinstance(out, dict):
        if gateway is not None:
            svc.leases.tag(out["lease_id"], gateway)
        return [200, out]
    if out == UNKNOWN_MODEL:
        return _error(404, f"no worker serves model {clip_repr(r.model)}", "model", "model_not_found")
    assert isinstance(out, Wait)
    return [503, {"wait": True, "retry_after_ms": out.retry_after_ms, "reason": out.reason}]


# The lease operations, in both the batch and the plain HTTP form (scheduler/app.py): the wire
# model, what the service does with it (False: no such lease), and the 404 message.
LEASE_OPS: dict[str, tuple[type[BaseModel], Callable[[SchedulerService, Any], bool], str]] = {
    "release": (LeaseRelease, SchedulerService.release_reported, "unknown or expired lease"),
    "prefilled": (LeasePrefilled, lambda svc, rep: svc.prefilled(rep.lease_id),
                  "unknown or released lease, or already reported"),
    "renew": (LeaseRenewal, lambda svc, rep: svc.renew(rep.lease_id), "unknown, released or expired lease"),
}


def _lease_op(svc: SchedulerService, kind: str, op: dict) -> list:
    model, apply, not_found = LEASE_OPS[kind]
    try:
        body = model.model_validate(op)
    except ValidationError as exc:
        return _bad(exc)
    if not apply(svc, body):
        return _error(404, not_found, "lease_id", "lease_not_found")
    return [204, None]


def run_batch(svc: SchedulerService, ops: list, gateway: str | None = None) -> tuple[list, bool]:
    """The answers, in order, and whether any operation was a schedule call. gateway: the
    instance id of the gateway that sent it, if it named itself (scheduler/gateways.py)."""
    answers = []
    any_schedule = False
    for op in ops:
        kind = op.get("op") if isinstance(op, dict) else None
        if kind == "schedule":
            any_schedule = True
            answers.append(_schedule(svc, op, gateway))
        elif isinstance(kind, str) and kind in LEASE_OPS:
            answers.append(_lease_op(svc, kind, op))
        else:
            answers.append(_error(400, "each operation must be an object with op 'schedule', 'release', "
                                  "'prefilled' or 'renew'", "op"))
    return answers, any_schedule


def caller_gone(transport: asyncio.BaseTransport | None) -> bool:
    """Whether the caller of a call just decided has hung up: its connection is closing here,
    or its end is closed with the close not read yet (a pending EOF or reset). A scheduler
    that was stopped (SIGSTOP, a frozen host) reads, when it resumes, calls its gateways gave
    up on and closed meanwhile, and each lease decided for them counted as load on its worker
    until it expired (--lease-ttl-s, 10 minutes). One peek at the socket: no loop iteration."""
    if transport is None or transport.is_closing():
        return True
    tsock = transport.get_extra_info("socket")
    if tsock is None:
        return False
    try:
        # A dup of the descriptor (asyncio's socket wrapper has no recv), closed at once.
        with tsock.dup() as sock:
            return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (BlockingIOError, InterruptedError):
        return False  # open, nothing unread: the caller is there
    except OSError:
        return True  # reset


def give_back_decided(svc: SchedulerService, answers: list) -> None:
    """Release the leases of a batch's decisions that cannot reach their caller (caller_gone)."""
    for status, payload in answers:
        if status == 200 and isinstance(payload, dict) and payload.get("lease_id"):
            svc.release(payload["lease_id"], ok=True, error=CLIENT_LEFT)


def run_batch_bytes(svc: SchedulerService, raw: bytes, gateway: str | None = None) -> list | None:
    """POST /v1/batch: the answers, or None when the body is not a JSON array."""
    try:
        ops = from_json(raw)
    except ValueError:
        return None
    return run_batch(svc, ops, gateway)[0] if isinstance(ops, list) else None


def server_frame(payload: bytes) -> bytes:
    """One unmasked binary WebSocket frame (FIN set)."""
    n = len(payload)
    if n < 126:
        return bytes((0x82, n)) + payload
    if n < 65536:
        return bytes((0x82, 126)) + n.to_bytes(2, "big") + payload
    return bytes((0x82, 127)) + n.to_bytes(8, "big") + payload


# Open channels, closed on shutdown: aiohttp would otherwise wait for their handlers (up to
# its 60 s shutdown timeout) before the process can exit.
OPEN_CHANNELS = web.AppKey("open_channels", weakref.WeakSet)


async def close_channels(app: web.Application) -> None:
    channels = list(app[OPEN_CHANNELS])
    if channels:
        await asyncio.gather(
            *(ws.close(code=WSCloseCode.GOING_AWAY, message=b"scheduler shutting down") for ws in channels),
            return_exceptions=True,
        )


# A gateway that stops reading its answers is broken: beyond this much unsent data the
# channel is closed (it reconnects) rather than buffering without bound.
MAX_UNSENT_BYTES = 8 << 20
# A named gateway's channel is pinged this often, and closed when a pong is not back within half
# of it: a gateway whose host is gone (no FIN) is then gone within 15 s plus the grace. A
# gateway stopped for longer (SIGSTOP, a frozen VM) loses its leases as a crashed one does; its
# requests' releases, when it resumes, are answered as for expired leases.
CHANNEL_HEARTBEAT_S = 10.0


def gateway_instance(request: web.Request) -> str | web.Response | None:
    """The instance id a gateway named itself by, None when it named none (an older gateway),
    or the 400 for one that is not an id."""
    value = request.headers.get(GATEWAY_INSTANCE_HEADER)
    if value is None:
        return None
    if not valid_instance(value):
        return web.Response(status=400, body=to_json(_error(
            400, f"{GATEWAY_INSTANCE_HEADER} must be 1 to 128 printable ASCII characters without "
            "spaces", GATEWAY_INSTANCE_HEADER)[1]), content_type="application/json")
    return value


async def serve_channel(request: web.Request, svc: SchedulerService) -> web.StreamResponse:
    gateway = gateway_instance(request)
    if isinstance(gateway, web.Response):
        return gateway
    ws = web.WebSocketResponse(compress=False, max_msg_size=4 << 20, autoping=True,
                               heartbeat=CHANNEL_HEARTBEAT_S if gateway is not None else None)
    if not ws.can_prepare(request).ok:  # prepare() would answer a plain-text 400
        return web.Response(status=400, body=to_json(_error(400, "this endpoint takes only a WebSocket "
                                                            "upgrade (GET with Upgrade: websocket)")[1]),
                            content_type="application/json")
    if caller_gone(request.transport):
        # An upgrade read late (the scheduler was stopped, its gateway gave up and closed):
        # prepare() would fail writing to the closed connection, an ERROR with a traceback.
        return web.Response(status=499)
    await ws.prepare(request)
    request.app[OPEN_CHANNELS].add(ws)
    transport = request.transport
    sock = transport.get_extra_info("socket") if transport else None
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if gateway is None:
        return await _serve(ws, transport, svc, None)
    svc.gateways.opened(gateway)
    try:
        return await _serve(ws, transport, svc, gateway)
    finally:
        svc.gateways.closed(gateway)


async def _serve(ws: web.WebSocketResponse, transport: asyncio.Transport | None, svc: SchedulerService,
                 gateway: str | None) -> web.WebSocketResponse:
    """The channel's batches, until it closes."""
    async for msg in ws:
        if msg.type not in (WSMsgType.BINARY, WSMsgType.TEXT):
            continue
        try:
            ops = from_json(msg.data)
        except ValueError:
            ops = None
        if not isinstance(ops, list):
            await ws.close(code=1007, message=b"a message must be a JSON array of operations")
            break
        answers, any_schedule = run_batch(svc, ops, gateway)
        if not any_schedule:
            continue
        if caller_gone(transport):
            give_back_decided(svc, answers)
            break
        # Written straight to the transport: aiohttp's frame writer (Python) cost more than
        # the decision (py-spy at concurrency 1). A whole frame per write() call, so it never
        # interleaves with the pongs and close frames aiohttp writes itself.
        transport.write(server_frame(to_json(answers)))
        if transport.get_write_buffer_size() > MAX_UNSENT_BYTES:
            await ws.close(code=1008, message=b"answers are not being read")
            break
    return ws
