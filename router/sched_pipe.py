"""The gateway's channel to the scheduler for the calls on every request's path: a schedule
call without a long-poll, and the lease release.

Why: a request through the gateway makes two scheduler calls, and with one HTTP request
each the per-request HTTP machinery costs more CPU, on both sides, than the rest of the
scheduling work together. So calls are batched: every call made in the same event-loop
iteration goes out as one message on one persistent connection, and a release may wait
up to 2 ms to ride along with the next schedule call. A schedule call never waits to be
batched (it goes out at the end of the current iteration: no added latency at
concurrency 1).

Two wire forms, picked at connect time:
- "ws": the scheduler's WebSocket channel `GET /v1/channel` (scheduler/channel.py): one
  binary message per batch, a JSON array of operations, answered by one message (the
  answers in order); a batch of releases only is not answered. No HTTP parsing per batch
  on either side. The client frames are written by hand (a zero mask key, which RFC 6455
  allows), the answers parsed with a few bytes operations.
- "http": HTTP/1.1 pipelining of `POST /v1/schedule` and `POST /v1/release` on one
  keep-alive connection, for a scheduler without the channel (it answers the upgrade
  with 404); answers are matched to calls in order.
`channel="auto"` (the default; the environment variable ROUTER_SCHEDULER_CHANNEL
overrides it, for A/B measurements) tries "ws" and falls back to "http".

Long-polls (wait_ms > 0) must not hold up the pipeline, so they, /v1/workers, health
probes and failure reports keep using `scheduler.client.SchedulerClient`.
Errors mean the same as there: UnknownModelError (404), SchedulerRequestError (other
4xx), SchedulerUnavailableError (connection failure, timeout, 5xx other than "wait").
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import socket
import time
from collections import deque
from typing import Any
from urllib.parse import urlsplit

from pydantic_core import from_json, to_json

from scheduler.client import SchedulerRequestError, SchedulerUnavailableError, UnknownModelError

log = logging.getLogger("router.sched_pipe")

_dumps = json.JSONEncoder(separators=(",", ":")).encode
_loads = json.loads
# How long a release may wait to share a send() with the next schedule call. The lease
# is returned that much later at worst, far below the scheduler's scrape interval.
RELEASE_DELAY_S = 0.002
CHANNELS = ("auto", "ws", "http")


def _error_message(raw: bytes) -> str:
    try:
        return str(_loads(raw)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return raw[:200].decode(errors="replace")


def _message_of(payload: Any) -> str:
    try:
        return str(payload["error"]["message"])
    except (KeyError, TypeError):
        return repr(payload)[:200]


class _NoChannel(SchedulerUnavailableError):
    """The scheduler answered the WebSocket upgrade with an HTTP error (it has no channel)."""


def ws_frame(payload: bytes, first_byte: int = 0x82) -> bytes:
    """A client frame (FIN, binary by default) with a zero mask key: masking is then the
    identity, so the payload goes out as is."""
    n = len(payload)
    if n < 126:
        head = bytes((first_byte, 0x80 | n))
    elif n < 65536:
        head = bytes((first_byte, 0xFE)) + n.to_bytes(2, "big")
    else:
        head = bytes((first_byte, 0xFF)) + n.to_bytes(8, "big")
    return head + b"\0\0\0\0" + payload


class _WsPipe(asyncio.Protocol):
    """The scheduler's WebSocket channel on one connection; answer messages are matched to
    the batches that contained a schedule call, in order."""

    kind = "ws"

    def __init__(self, owner: SchedulerPipe, upgrade: bytes) -> None:
        self.owner = owner
        self.upgrade = upgrade
        self.transport: asyncio.Transport | None = None
        self.handshake: asyncio.Future = owner.loop.create_future()
        # Batches awaiting an answer: (one future or None per operation, time sent).
        self.pending: deque[tuple[list[asyncio.Future | None], float]] = deque()
        self.ops: list[bytes] = []
        self.futs: list[asyncio.Future | None] = []
        self.has_schedule = False
        self.buf = bytearray()
        self.flush_scheduled = False
        self.lazy_timer: asyncio.TimerHandle | None = None
        self.closed = False

    def connection_made(self, transport) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        transport.write(self.upgrade)

    def send(self, op: bytes, fut: asyncio.Future) -> None:
        self.ops.append(op)
        self.futs.append(fut)
        self.has_schedule = True
        if not self.flush_scheduled:
            self.flush_scheduled = True
            self.owner.loop.call_soon(self._flush)

    def send_lazy(self, op: bytes) -> None:
        self.ops.append(op)
        self.futs.append(None)
        if not self.flush_scheduled and self.lazy_timer is None:
            self.lazy_timer = self.owner.loop.call_later(RELEASE_DELAY_S, self._flush)

    def _flush(self) -> None:
        self.flush_scheduled = False
        if self.lazy_timer is not None:
            self.lazy_timer.cancel()
            self.lazy_timer = None
        if not self.ops or self.closed:
            return
        payload = b"[" + b",".join(self.ops) + b"]"
        self.ops = []
        if self.has_schedule:
            self.pending.append((self.futs, time.monotonic()))
            self.futs = []
            self.has_schedule = False
        else:
            self.futs.clear()
        self.transport.write(ws_frame(payload))

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        if not self.handshake.done():
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > 65536:
                    self.abort(SchedulerUnavailableError("oversized upgrade answer"))
                return
            head = bytes(buf[:end])
            del buf[: end + 4]
            status = int(head[9:12]) if head.startswith(b"HTTP/1.") and head[9:12].isdigit() else 0
            if status != 101:
                cls = _NoChannel if 400 <= status < 500 else SchedulerUnavailableError
                self.abort(cls(f"scheduler answered the channel upgrade with {status or head[:40]!r}"))
                return
            self.handshake.set_result(None)
        while not self.closed:
            n = len(buf)
            if n < 2:
                return
            b0, b1 = buf[0], buf[1]
            length = b1 & 0x7F
            pos = 2
            if length == 126:
                if n < 4:
                    return
                length, pos = int.from_bytes(buf[2:4], "big"), 4
            elif length == 127:
                if n < 10:
                    return
                length, pos = int.from_bytes(buf[2:10], "big"), 10
            end = pos + length
            if n < end:
                return
            opcode = b0 & 0x0F
            if b1 & 0x80 or not b0 & 0x80 or opcode == 0:
                self.abort(SchedulerUnavailableError("masked or fragmented frame from the scheduler"))
                return
            payload = bytes(buf[pos:end])
            del buf[:end]
            if opcode in (1, 2):
                self._answers(payload)
            elif opcode == 8:
                reason = payload[2:].decode(errors="replace")
                self.abort(SchedulerUnavailableError(f"scheduler closed the channel: {reason}"))
            elif opcode == 9:
                self.transport.write(ws_frame(payload, 0x8A))  # pong

    def _answers(self, payload: bytes) -> None:
        if not self.pending:
            self.abort(SchedulerUnavailableError("unexpected answer from the scheduler"))
            return
        futs, _ = self.pending.popleft()
        try:
            answers = from_json(payload)
        except ValueError:
            answers = None
        if not isinstance(answers, list) or len(answers) != len(futs):
            exc = SchedulerUnavailableError(f"malformed answer from the scheduler: {payload[:200]!r}")
            for fut in futs:
                if fut is not None and not fut.done():
                    fut.set_exception(exc)
            self.abort(exc)
            return
        for fut, answer in zip(futs, answers, strict=True):
            if fut is None:
                continue
            if not fut.done():
                fut.set_result(answer)
            elif fut.cancelled() and answer[0] == 200:
                self.owner._orphan(answer[1])

    def connection_lost(self, exc: Exception | None) -> None:
        self.abort(SchedulerUnavailableError(f"scheduler connection lost: {exc!r}"))

    def abort(self, exc: Exception) -> None:
        if not self.closed:
            self.closed = True
            if self.lazy_timer is not None:
                self.lazy_timer.cancel()
                self.lazy_timer = None
            if self.transport is not None:
                self.transport.abort()
        if not self.handshake.done():
            self.handshake.set_exception(exc)
        unsent, self.futs, self.ops = self.futs, [], []
        batches = [futs for futs, _ in self.pending]
        self.pending.clear()
        for futs in (*batches, unsent):
            for fut in futs:
                if fut is not None and not fut.done():
                    fut.set_exception(exc)
        self.owner._lost(self)


class _Pipe(asyncio.Protocol):
    """HTTP/1.1 pipelining on one connection (schedulers without /v1/channel); answers are
    matched to calls in order."""

    kind = "http"

    def __init__(self, owner: SchedulerPipe) -> None:
        self.owner = owner
        self.transport: asyncio.Transport | None = None
        # (future or None for fire-and-forget, time sent)
        self.pending: deque[tuple[asyncio.Future | None, float]] = deque()
        self.buf = bytearray()
        self.out: list[bytes] = []
        self.flush_scheduled = False
        self.lazy_timer: asyncio.TimerHandle | None = None
        self.closed = False

    def connection_made(self, transport) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def send(self, data: bytes, fut: asyncio.Future | None) -> None:
        self.out.append(data)
        self.pending.append((fut, time.monotonic()))
        if not self.flush_scheduled:
            self.flush_scheduled = True
            self.owner.loop.call_soon(self._flush)

    def send_lazy(self, data: bytes) -> None:
        """A fire-and-forget call that may wait up to RELEASE_DELAY_S to share a send()
        with the next urgent call (under load it always does)."""
        self.out.append(data)
        self.pending.append((None, time.monotonic()))
        if not self.flush_scheduled and self.lazy_timer is None:
            self.lazy_timer = self.owner.loop.call_later(RELEASE_DELAY_S, self._flush)

    def _flush(self) -> None:
        self.flush_scheduled = False
        if self.lazy_timer is not None:
            self.lazy_timer.cancel()
            self.lazy_timer = None
        if self.out and not self.closed:
            data = self.out[0] if len(self.out) == 1 else b"".join(self.out)
            self.out.clear()
            self.transport.write(data)

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        while True:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(buf[:end]).lower()
            i = head.find(b"\r\ncontent-length:")
            if i >= 0:
                j = head.find(b"\r\n", i + 2)
                length = int(head[i + 17 : j if j > 0 else len(head)])
            elif head[9:12] in (b"204", b"304"):
                length = 0
            else:  # no length and not bodiless (chunked): not what the scheduler sends
                self.abort(SchedulerUnavailableError("scheduler answer without Content-Length"))
                return
            total = end + 4 + length
            if len(buf) < total:
                return
            status = int(head[9:12])
            body = bytes(buf[end + 4 : total])
            del buf[:total]
            if not self.pending:
                self.abort(SchedulerUnavailableError("unexpected answer from the scheduler"))
                return
            fut, _ = self.pending.popleft()
            if fut is not None:
                if not fut.done():
                    fut.set_result((status, body))
                elif fut.cancelled() and status == 200:
                    self.owner._orphan(body)
            if b"\r\nconnection: close" in head:
                self.abort(SchedulerUnavailableError("scheduler closed the connection"))
                return

    def connection_lost(self, exc: Exception | None) -> None:
        self.abort(SchedulerUnavailableError(f"scheduler connection lost: {exc!r}"))

    def abort(self, exc: Exception) -> None:
        if not self.closed:
            self.closed = True
            if self.lazy_timer is not None:
                self.lazy_timer.cancel()
                self.lazy_timer = None
            if self.transport is not None:
                self.transport.abort()
        while self.pending:
            fut, _ = self.pending.popleft()
            if fut is not None and not fut.done():
                fut.set_exception(exc)
        self.owner._lost(self)


class SchedulerPipe:
    def __init__(self, base_url: str, *, timeout_s: float = 2.0, channel: str | None = None) -> None:
        u = urlsplit(base_url)
        if u.scheme != "http" or not u.hostname:
            raise ValueError(f"the pipelined channel needs an http:// scheduler URL, got {base_url!r}")
        channel = channel or os.environ.get("ROUTER_SCHEDULER_CHANNEL") or "auto"
        if channel not in CHANNELS:
            raise ValueError(f"scheduler channel must be one of {CHANNELS}, got {channel!r}")
        self.channel = channel
        self.host, self.port = u.hostname, u.port or 80
        prefix = u.path.rstrip("/").encode()
        self.timeout_s = timeout_s
        host_hdr = f"{self.host}:{self.port}".encode()
        self._schedule_head = (
            b"POST "
            + prefix
            + b"/v1/schedule HTTP/1.1\r\nHost: "
            + host_hdr
            + b"\r\nContent-Type: application/json\r\nContent-Length: "
        )
        self._release_head = self._schedule_head.replace(b"/v1/schedule", b"/v1/release")
        key = base64.b64encode(os.urandom(16))
        self._upgrade = (
            b"GET "
            + prefix
            + b"/v1/channel HTTP/1.1\r\nHost: "
            + host_hdr
            + b"\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: "
            + key
            + b"\r\nSec-WebSocket-Version: 13\r\n\r\n"
        )
        self.loop = asyncio.get_running_loop()
        self._pipe: _Pipe | _WsPipe | None = None
        self._connecting: asyncio.Future | None = None
        self._watchdog: asyncio.TimerHandle | None = None

    @property
    def kind(self) -> str | None:
        """The wire form in use: "ws", "http", or None before the first connection."""
        return self._pipe.kind if self._pipe is not None else None

    async def _get_pipe(self) -> _Pipe | _WsPipe:
        pipe = self._pipe
        if pipe is not None and not pipe.closed:
            return pipe
        if self._connecting is None:
            self._connecting = self.loop.create_task(self._connect())
        try:
            return await asyncio.shield(self._connecting)
        finally:
            if self._connecting is not None and self._connecting.done():
                self._connecting = None

    async def _connect(self) -> _Pipe | _WsPipe:
        pipe: _Pipe | _WsPipe | None = None
        try:
            async with asyncio.timeout(self.timeout_s):
                if self.channel != "http":
                    _, ws = await self.loop.create_connection(
                        lambda: _WsPipe(self, self._upgrade), self.host, self.port
                    )
                    try:
                        await ws.handshake
                        pipe = ws
                    except _NoChannel as exc:
                        if self.channel == "ws":
                            raise
                        log.info("scheduler has no batch channel (%s): pipelining HTTP calls", exc)
                        self.channel = "http"
                    except BaseException:
                        ws.abort(SchedulerUnavailableError("channel handshake interrupted"))
                        raise
                if pipe is None:
                    _, pipe = await self.loop.create_connection(lambda: _Pipe(self), self.host, self.port)
        except (OSError, TimeoutError) as exc:
            raise SchedulerUnavailableError(f"scheduler {self.host}:{self.port}: {exc!r}") from exc
        self._pipe = pipe
        if self._watchdog is None:
            self._watchdog = self.loop.call_later(self.timeout_s / 4, self._check_timeouts)
        return pipe

    def _lost(self, pipe: _Pipe | _WsPipe) -> None:
        if self._pipe is pipe:
            self._pipe = None

    def _check_timeouts(self) -> None:
        """One timer for every call: a call older than the timeout poisons the pipeline
        (later answers would be matched to the wrong calls), so the connection is dropped."""
        pipe = self._pipe
        if pipe is not None and pipe.pending and time.monotonic() - pipe.pending[0][1] > self.timeout_s:
            pipe.abort(SchedulerUnavailableError(f"scheduler call timed out after {self.timeout_s} s"))
        self._watchdog = self.loop.call_later(self.timeout_s / 4, self._check_timeouts)

    @staticmethod
    def _frame(head: bytes, body: bytes) -> bytes:
        return b"%s%d\r\n\r\n%s" % (head, len(body), body)

    async def schedule_raw(self, body: dict[str, Any]) -> tuple[int, dict]:
        """Like SchedulerClient.schedule_raw, for calls without wait_ms."""
        pipe = self._pipe
        if pipe is None or pipe.closed:
            pipe = await self._get_pipe()
        fut = self.loop.create_future()
        if pipe.kind == "ws":
            pipe.send(b'{"op":"schedule",' + to_json(body)[1:], fut)
            status, payload = await fut
            if status == 200 or (status == 503 and isinstance(payload, dict) and payload.get("wait")):
                return status, payload
            message = _message_of(payload)
        else:
            pipe.send(self._frame(self._schedule_head, _dumps(body).encode()), fut)
            status, raw = await fut
            if status == 200:
                return status, _loads(raw)
            if status == 503:
                try:
                    payload = _loads(raw)
                except ValueError:
                    payload = None
                if isinstance(payload, dict) and payload.get("wait"):
                    return status, payload
            message = _error_message(raw)
        if status == 404:
            raise UnknownModelError(message)
        if 400 <= status < 500:
            raise SchedulerRequestError(f"scheduler answered {status}: {message}")
        raise SchedulerUnavailableError(f"scheduler answered {status}: {message}")

    def release_nowait(self, rel: dict[str, Any]) -> None:
        """Fire and forget (a lost release is covered by the scheduler's lease expiry)."""
        pipe = self._pipe
        if pipe is not None and not pipe.closed:
            pipe.send_lazy(self._release_message(pipe, rel))
        else:
            self.loop.create_task(self._release_later(rel))

    def _release_message(self, pipe: _Pipe | _WsPipe, rel: dict[str, Any]) -> bytes:
        if pipe.kind == "ws":
            return b'{"op":"release",' + to_json(rel)[1:]
        return self._frame(self._release_head, _dumps(rel).encode())

    async def _release_later(self, rel: dict[str, Any]) -> None:
        try:
            pipe = await self._get_pipe()
        except SchedulerUnavailableError:
            return
        msg = self._release_message(pipe, rel)
        if pipe.kind == "ws":
            pipe.send_lazy(msg)
        else:
            pipe.send(msg, None)

    def _orphan(self, answer: bytes | dict) -> None:
        """A decision whose caller was cancelled meanwhile (its client went away): the lease
        would otherwise count as load until it expires, so give it back at once."""
        try:
            lease_id = (_loads(answer) if isinstance(answer, bytes) else answer)["lease_id"]
        except (ValueError, KeyError, TypeError):
            return
        self.release_nowait({"lease_id": lease_id, "ok": True, "prompt_tokens": 0, "output_tokens": 0})

    def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        if self._pipe is not None:
            if not self._pipe.closed:
                self._pipe._flush()  # releases still waiting for company
            self._pipe.abort(SchedulerUnavailableError("closed"))
