"""The two wire forms of the gateway's scheduler channel, as asyncio protocols on one
connection each (router/sched_pipe.py explains why and picks one):
- `_WsPipe`: the scheduler's WebSocket batch channel (scheduler/channel.py). Client frames
  are written by hand with a zero mask key (RFC 6455 allows it; masking is then the
  identity), server frames parsed with a few bytes operations.
- `_Pipe`: HTTP/1.1 pipelining of POST /v1/schedule and /v1/release.
Both batch the calls of one event-loop iteration into one send(); a release may wait
RELEASE_DELAY_S for company. A connection opened with a TLS context that a reload has since
replaced is retired (`retire()`): nothing new is written on it, and it closes once the calls
in flight on it are answered.
"""

from __future__ import annotations

import abc
import asyncio
import json
import socket
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from pydantic_core import from_json

from scheduler.client import SchedulerAuthError, SchedulerUnavailableError
from scheduler.clip import MAX_SHOWN_CHARS, clip

if TYPE_CHECKING:
    from router.sched_pipe import SchedulerPipe

_loads = json.loads
# How long a release may wait to share a send() with the next schedule call. The lease
# is returned that much later at worst, far below the scheduler's scrape interval.
RELEASE_DELAY_S = 0.002
# Operations per channel message at most: with at most 64 prefix fingerprints an operation
# is under 1.5 kB, so a message stays far below the scheduler's 4 MiB message limit.
MAX_BATCH_OPS = 256
# Lease operations a channel keeps until the scheduler's next answer confirms them read, at
# most (_WsPipe.unconfirmed); past it the oldest go (their leases expire in the scheduler).
UNCONFIRMED_MAX = 10_000


def _error_message(raw: bytes) -> str:
    """The scheduler's error message, cut when long (as scheduler/client.py's): the gateway
    quotes it to its client, and a scheduler of before scheduler/clip.py quoted a client's
    model name whole."""
    try:
        return clip(str(_loads(raw)["error"]["message"]), 4 * MAX_SHOWN_CHARS)
    except (ValueError, KeyError, TypeError):
        return raw[:200].decode(errors="replace")


def _message_of(payload: Any) -> str:
    """A channel answer's error message, cut as _error_message cuts it."""
    try:
        return clip(str(payload["error"]["message"]), 4 * MAX_SHOWN_CHARS)
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


class _ChannelProtocol(asyncio.Protocol, metaclass=abc.ABCMeta):
    """What both scheduler channels share: the connection, the flush timers, delivering an
    answer to its call's future, and tearing the connection down."""

    kind = ""

    def __init__(self, owner: SchedulerPipe) -> None:
        self.owner = owner
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.flush_scheduled = False
        self.lazy_timer: asyncio.TimerHandle | None = None
        self.closed = False
        # The PeerContext.current this connection was opened with (its owner sets it): once a
        # TLS reload has put another there, the connection is retired.
        self.opened_with: Any = None
        # Retired: its owner writes nothing new on it; closed once no call awaits an answer.
        self.retiring = False

    def connection_made(self, transport) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        # Each channel's abort() fails the calls it still owes an answer.
        self.abort(SchedulerUnavailableError(f"scheduler connection lost: {exc!r}"))

    def _cancel_lazy_timer(self) -> None:
        if self.lazy_timer is not None:
            self.lazy_timer.cancel()
            self.lazy_timer = None

    def _close_transport(self) -> None:
        if not self.closed:
            self.closed = True
            self._cancel_lazy_timer()
            if self.transport is not None:
                self.transport.abort()

    def retire(self) -> None:
        """Its owner opened another connection (a TLS reload): what this event-loop iteration
        gave it goes out now, and it closes (_close_retired) once every call sent on it has its
        answer."""
        self.retiring = True
        self._flush()
        if not self.pending:
            self._close_retired()

    @abc.abstractmethod
    def _flush(self) -> None:
        """Write what waits to go out on the connection, as one send."""

    @abc.abstractmethod
    def _close_retired(self) -> None:
        """Close a retired connection, no call awaiting an answer (each form its own way)."""

    def _deliver(self, fut: asyncio.Future | None, answer: tuple[int, Any]) -> None:
        """Hand an answer to its call; a schedule call whose caller left gives its lease back."""
        if fut is None:
            return
        if not fut.done():
            fut.set_result(answer)
        elif fut.cancelled() and answer[0] == 200:
            self.owner._orphan(answer[1])


class _WsPipe(_ChannelProtocol):
    """The scheduler's WebSocket channel on one connection; answer messages are matched to
    the batches that contained a schedule call, in order."""

    kind = "ws"

    def __init__(self, owner: SchedulerPipe, upgrade: bytes) -> None:
        super().__init__(owner)
        self.upgrade = upgrade
        self.handshake: asyncio.Future = owner.loop.create_future()
        # Batches awaiting an answer: (one future or None per operation, time sent).
        self.pending: deque[tuple[list[asyncio.Future | None], float]] = deque()
        self.ops: list[bytes] = []
        self.futs: list[asyncio.Future | None] = []
        self.has_schedule = False
        # Releases, first-token reports and renewals written but not yet known to be read:
        # (message number, operation). The scheduler answers the messages with a schedule call
        # in order, so an answer confirms every operation written up to its message. Those
        # left when the connection is aborted (a hung scheduler: the watchdog) may be lost
        # with it: a scheduler that resumes and finds the connection closed drops what it had
        # not read, so they go again on the next connection (again is harmless: the second
        # release of a lease is a 404).
        self.sent = 0
        self.schedule_msgs: deque[int] = deque()  # message numbers of `pending`, in order
        self.unconfirmed: deque[tuple[int, bytes]] = deque(maxlen=UNCONFIRMED_MAX)

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        transport.write(self.upgrade)

    def send(self, op: bytes, fut: asyncio.Future) -> None:
        self.ops.append(op)
        self.futs.append(fut)
        self.has_schedule = True
        if not self.pending or len(self.ops) >= MAX_BATCH_OPS:
            # Nothing in flight (concurrency 1): no reason to wait for company, send now.
            # Otherwise the answer of the batch in flight is not here yet anyway, and the
            # calls of this loop iteration go out together at its end.
            self._flush()
        elif not self.flush_scheduled:
            self.flush_scheduled = True
            self.owner.loop.call_soon(self._flush)

    def send_lazy(self, op: bytes) -> None:
        self.ops.append(op)
        self.futs.append(None)
        if len(self.ops) >= MAX_BATCH_OPS:
            self._flush()
        elif not self.flush_scheduled and self.lazy_timer is None:
            self.lazy_timer = self.owner.loop.call_later(RELEASE_DELAY_S, self._flush)

    def _flush(self) -> None:
        self.flush_scheduled = False
        self._cancel_lazy_timer()
        if not self.ops or self.closed:
            return
        payload = b"[" + b",".join(self.ops) + b"]"
        self.sent += 1
        n = self.sent
        self.unconfirmed.extend((n, op) for op, fut in zip(self.ops, self.futs, strict=True) if fut is None)
        self.ops = []
        if self.has_schedule:
            self.pending.append((self.futs, time.monotonic()))
            self.schedule_msgs.append(n)
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
                # 401/403: our token refused. Not "no channel": pipelined HTTP would be refused
                # too, and the gateway must say why it cannot schedule (router/scheduling.py).
                cls = (SchedulerAuthError if status in (401, 403)
                       else _NoChannel if 400 <= status < 500 else SchedulerUnavailableError)
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
        upto = self.schedule_msgs.popleft() if self.schedule_msgs else self.sent
        unconfirmed = self.unconfirmed
        while unconfirmed and unconfirmed[0][0] <= upto:
            unconfirmed.popleft()
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
            self._deliver(fut, answer)
        if self.retiring and not self.pending:
            self._close_retired()

    def _close_retired(self) -> None:
        """A close frame, then the TCP (TLS) close after what was written: the scheduler reads
        every message sent before it (the releases not answered too), in order, so nothing
        written is left to send again."""
        if self.closed:
            return
        self.closed = True
        self._cancel_lazy_timer()
        self.unconfirmed.clear()
        if self.transport is not None:
            self.transport.write(ws_frame(b"\x03\xe8", 0x88))  # close, 1000 (normal)
            self.transport.close()

    def abort(self, exc: Exception) -> None:
        self._close_transport()
        if not self.handshake.done():
            self.handshake.set_exception(exc)
        unsent, self.futs = self.futs, []
        ops, self.ops = self.ops, []
        batches = [futs for futs, _ in self.pending]
        self.pending.clear()
        for futs in (*batches, unsent):
            for fut in futs:
                if fut is not None and not fut.done():
                    fut.set_exception(exc)
        written = [op for _, op in self.unconfirmed]
        self.unconfirmed.clear()
        self.schedule_msgs.clear()
        self.owner._lost(self, written + [op for op, fut in zip(ops, unsent, strict=True) if fut is None])


class _Pipe(_ChannelProtocol):
    """HTTP/1.1 pipelining on one connection (schedulers without /v1/channel); answers are
    matched to calls in order."""

    kind = "http"

    def __init__(self, owner: SchedulerPipe) -> None:
        super().__init__(owner)
        # Since when no call awaits an answer (its owner closes the connection idle too long,
        # before the scheduler's keep-alive does): the connection's start, then the last answer.
        self.idle_since = time.monotonic()
        # (future or None for fire-and-forget, time sent)
        self.pending: deque[tuple[asyncio.Future | None, float]] = deque()
        self.out: list[bytes] = []
        # The fire-and-forget calls of `pending` (its None entries), in order: those not yet
        # answered when the connection is aborted (a hung scheduler: the watchdog) may be lost
        # with it, unread by a scheduler that resumes, so they go again on the next connection
        # (again is harmless: the second release of a lease is a 404).
        self.lazy: deque[bytes] = deque()

    def send(self, data: bytes, fut: asyncio.Future | None) -> None:
        self.out.append(data)
        self.pending.append((fut, time.monotonic()))
        if fut is None:
            self.lazy.append(data)
        if not self.flush_scheduled:
            self.flush_scheduled = True
            self.owner.loop.call_soon(self._flush)

    def send_lazy(self, data: bytes) -> None:
        """A fire-and-forget call that may wait up to RELEASE_DELAY_S to share a send()
        with the next urgent call (under load it always does)."""
        self.out.append(data)
        self.pending.append((None, time.monotonic()))
        self.lazy.append(data)
        if not self.flush_scheduled and self.lazy_timer is None:
            self.lazy_timer = self.owner.loop.call_later(RELEASE_DELAY_S, self._flush)

    def _flush(self) -> None:
        self.flush_scheduled = False
        self._cancel_lazy_timer()
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
            if fut is None and self.lazy:
                self.lazy.popleft()
            self._deliver(fut, (status, body))
            if b"\r\nconnection: close" in head:
                self.abort(SchedulerUnavailableError("scheduler closed the connection"))
                return
            if not self.pending:
                if self.retiring:
                    self.close_idle()
                    return
                self.idle_since = time.monotonic()

    def _close_retired(self) -> None:
        self.close_idle()

    def close_idle(self) -> None:
        """Close the connection, no call awaiting an answer: gracefully (a FIN, not a reset),
        so the scheduler reads a client that left, not an error."""
        if not self.closed:
            self.closed = True
            self._cancel_lazy_timer()
            if self.transport is not None:
                self.transport.close()

    def abort(self, exc: Exception) -> None:
        self._close_transport()
        # Fire-and-forget calls not answered, written or not: they go on the next connection.
        lazy = list(self.lazy)
        self.lazy.clear()
        self.out = []
        while self.pending:
            fut, _ = self.pending.popleft()
            if fut is not None and not fut.done():
                fut.set_exception(exc)
        self.owner._lost(self, lazy)
