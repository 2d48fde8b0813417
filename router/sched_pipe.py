"""A pipelined HTTP/1.1 channel to the scheduler for the two calls on every request's path:
`POST /v1/schedule` without a long-poll, and `POST /v1/release`.

Why: a request through the gateway makes two scheduler calls. With a general-purpose
HTTP client each costs more CPU than the rest of the gateway's work together, mostly
per-call client machinery and one send() system call per call. Here calls made in the
same event-loop iteration are written together with one send() on one persistent
connection (HTTP/1.1 pipelining; the scheduler's aiohttp server answers in order), and
answers are parsed with a few bytes operations. A schedule call never waits to be
batched (it goes out at the end of the current iteration); a release may wait up to
2 ms to ride along with the next schedule call.

Long-polls (wait_ms > 0) must not hold up the pipeline, so they, /v1/workers, health
probes and failure reports keep using `scheduler.client.SchedulerClient`.
Errors mean the same as there: UnknownModelError (404), SchedulerRequestError (other
4xx), SchedulerUnavailableError (connection failure, timeout, 5xx other than "wait").
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections import deque
from typing import Any
from urllib.parse import urlsplit

from scheduler.client import SchedulerRequestError, SchedulerUnavailableError, UnknownModelError

_dumps = json.JSONEncoder(separators=(",", ":")).encode
_loads = json.loads
# How long a release may wait to share a send() with the next schedule call. The lease
# is returned that much later at worst, far below the scheduler's scrape interval.
RELEASE_DELAY_S = 0.002


def _error_message(raw: bytes) -> str:
    try:
        return str(_loads(raw)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return raw[:200].decode(errors="replace")


class _Pipe(asyncio.Protocol):
    """One connection; answers are matched to calls in order."""

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
    def __init__(self, base_url: str, *, timeout_s: float = 2.0) -> None:
        u = urlsplit(base_url)
        if u.scheme != "http" or not u.hostname:
            raise ValueError(f"the pipelined channel needs an http:// scheduler URL, got {base_url!r}")
        self.host, self.port = u.hostname, u.port or 80
        prefix = u.path.rstrip("/")
        self.timeout_s = timeout_s
        host_hdr = f"{self.host}:{self.port}".encode()
        self._schedule_head = (
            b"POST " + prefix.encode() + b"/v1/schedule HTTP/1.1\r\nHost: " + host_hdr
            + b"\r\nContent-Type: application/json\r\nContent-Length: "
        )
        self._release_head = self._schedule_head.replace(b"/v1/schedule", b"/v1/release")
        self.loop = asyncio.get_running_loop()
        self._pipe: _Pipe | None = None
        self._connecting: asyncio.Future | None = None
        self._watchdog: asyncio.TimerHandle | None = None

    async def _get_pipe(self) -> _Pipe:
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

    async def _connect(self) -> _Pipe:
        try:
            async with asyncio.timeout(self.timeout_s):
                _, pipe = await self.loop.create_connection(lambda: _Pipe(self), self.host, self.port)
        except (OSError, TimeoutError) as exc:
            raise SchedulerUnavailableError(f"scheduler {self.host}:{self.port}: {exc!r}") from exc
        self._pipe = pipe
        if self._watchdog is None:
            self._watchdog = self.loop.call_later(self.timeout_s / 4, self._check_timeouts)
        return pipe

    def _lost(self, pipe: _Pipe) -> None:
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
        pipe = await self._get_pipe()
        fut = self.loop.create_future()
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
            raise SchedulerUnavailableError(f"scheduler answered 503: {_error_message(raw)}")
        if status == 404:
            raise UnknownModelError(_error_message(raw))
        if 400 <= status < 500:
            raise SchedulerRequestError(f"scheduler answered {status}: {_error_message(raw)}")
        raise SchedulerUnavailableError(f"scheduler answered {status}: {_error_message(raw)}")

    def release_nowait(self, rel: dict[str, Any]) -> None:
        """Fire and forget (a lost release is covered by the scheduler's lease expiry)."""
        pipe = self._pipe
        frame = self._frame(self._release_head, _dumps(rel).encode())
        if pipe is not None and not pipe.closed:
            pipe.send_lazy(frame)
        else:
            self.loop.create_task(self._release_later(frame))

    async def _release_later(self, frame: bytes) -> None:
        try:
            pipe = await self._get_pipe()
        except SchedulerUnavailableError:
            return
        pipe.send(frame, None)

    def _orphan(self, raw: bytes) -> None:
        """A decision whose caller was cancelled meanwhile (its client went away): the lease
        would otherwise count as load until it expires, so give it back at once."""
        try:
            lease_id = _loads(raw)["lease_id"]
        except (ValueError, KeyError, TypeError):
            return
        self.release_nowait({"lease_id": lease_id, "ok": True, "prompt_tokens": 0, "output_tokens": 0})

    def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        if self._pipe is not None:
            self._pipe.abort(SchedulerUnavailableError("closed"))
