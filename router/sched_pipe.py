"""The gateway's channel to the scheduler for the calls on every request's path: a schedule
call without a long-poll, the first-token report, and the lease release.

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
  with 404); answers are matched to calls in order. Idle for IDLE_CLOSE_S, the connection is
  closed here, and the next call opens another: the scheduler closes an idle kept-alive
  connection itself (--keepalive-timeout-s, 75 s), and a call written as it did so failed.
  The channel is not closed when idle: a WebSocket is no kept-alive HTTP connection, the
  scheduler's keep-alive never closes it.
`channel="auto"` (the default; `--scheduler-channel` / ROUTER_SCHEDULER_CHANNEL choose
one, e.g. for A/B measurements) tries "ws" and falls back to "http".

A TLS reload (scheduler/tls_reload.py: a renewed --scheduler-ca-file or client certificate)
puts a new context in the PeerContext this channel reads. The connection open, made with the
old one, is then retired at the next call: nothing new is written on it, the next calls go on
a new connection made with the new context, and the old one closes once the calls in flight
on it are answered (none lost). So a CA taken out of the bundle stops vouching for the
scheduler at once, though the channel is never closed when idle. The check on each call is
one identity comparison of contexts.

The gateway names itself (`instance`: an id per process, router/app.py) in the header
X-Gateway-Instance on the upgrade and on every HTTP call: the scheduler ends the leases of a
gateway that has had no channel open for its --gateway-gone-grace-s (a crash, scheduler/
gateways.py). So a channel that is lost (cut, reset, aborted by the watchdog) is opened again
at once (and then after RECONNECT_DELAYS_S), not at the next call: a gateway whose long
requests run with no call to make would otherwise have its leases ended while it lives.

Long-polls (wait_ms > 0) must not hold up the pipeline, so they, /v1/workers, health
probes and failure reports keep using `scheduler.client.SchedulerClient`.
Errors mean the same as there: UnknownModelError (404), SchedulerAuthError (401/403: the
token refused, on a call or at the channel's upgrade), SchedulerRequestError (other 4xx),
SchedulerUnavailableError (connection failure, timeout, 5xx other than "wait").
With a token (--scheduler-token), every request written here carries it: the header is part
of the prebuilt request heads, so it costs nothing per call.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import ssl
import time
from collections import deque
from typing import Any
from urllib.parse import urlsplit

from pydantic_core import to_json

from router.sched_wire import (
    RELEASE_DELAY_S,
    _error_message,
    _message_of,
    _NoChannel,
    _Pipe,
    _WsPipe,
    ws_frame,
)
from scheduler.client import (
    SchedulerRequestError,
    SchedulerUnavailableError,
    UnknownModelError,
    raise_for_auth,
)
from scheduler.gateways import GATEWAY_INSTANCE_HEADER
from scheduler.protocol import CLIENT_LEFT
from scheduler.tls import PeerContext

log = logging.getLogger("router.sched_pipe")

_dumps = json.JSONEncoder(separators=(",", ":")).encode
_loads = json.loads
CHANNELS = ("auto", "ws", "http")


# Lease operations held while no connection to the scheduler can be made, at most: about
# 150 bytes each, 15 MB at most; past it the oldest go (their leases expire in the scheduler).
MAX_HELD_LAZY = 100_000
# Seconds a pipelined HTTP connection may stay idle (no call awaiting its answer) before it is
# closed here. The scheduler closes an idle kept-alive connection after --keepalive-timeout-s
# (75 s); a call written just as it does is lost with the connection (a failed schedule call:
# its request retried, or sent round robin). Closing first, the client never writes on a
# connection the server is closing. 30 s, as the gateway's pool of connections to workers: far
# below 75 s, and below any keep-alive the scheduler should have (above load balancers' 60 s).
IDLE_CLOSE_S = 30.0
# Waits before the attempts to open a lost channel again (the last repeated until one is made or
# the pipe is closed): the first attempts well within the scheduler's --gateway-gone-grace-s.
RECONNECT_DELAYS_S = (0.0, 0.2, 0.5, 1.0, 2.0)


def orphan_release(lease_id: str) -> dict:
    """The release of a lease nobody took (its caller left before the decision came back): ok,
    since no worker failed anything, nothing held, and marked as a client that left, which says
    nothing about the worker (a half-open worker's trial stays open)."""
    return {"lease_id": lease_id, "ok": True, "prompt_tokens": 0, "output_tokens": 0, "error": CLIENT_LEFT}


class SchedulerPipe:
    def __init__(self, base_url: str, *, timeout_s: float = 2.0, channel: str = "auto",
                 token: str | None = None, tls: PeerContext | None = None,
                 idle_close_s: float = IDLE_CLOSE_S, instance: str | None = None) -> None:
        u = urlsplit(base_url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"the pipelined channel needs an http(s):// scheduler URL, got {base_url!r}")
        if channel not in CHANNELS:
            raise ValueError(f"scheduler channel must be one of {CHANNELS}, got {channel!r}")
        self.channel = channel
        self.host, self.port = u.hostname, u.port or (443 if u.scheme == "https" else 80)
        # https://: the same connection in TLS, the certificate checked as SchedulerClient checks
        # it (the gateway's --scheduler-ca-file, else the system's CAs) and for this host name.
        # The context is read for each connection made (_ssl): a reload (scheduler/tls_reload.py)
        # swaps it, and the connection open is retired (_retire).
        self._https = u.scheme == "https"
        self._tls = tls if tls is not None else PeerContext()
        self._system_cas = ssl.create_default_context() if self._https and self._tls.current is None else None
        prefix = u.path.rstrip("/").encode()
        self.timeout_s = timeout_s
        self.idle_close_s = idle_close_s
        # The watchdog's period: a call past its timeout is noticed within a quarter of it, an
        # idle HTTP connection closed within a quarter of IDLE_CLOSE_S past it (still far from
        # the scheduler's keep-alive, however long the calls' timeout).
        self._tick_s = min(timeout_s, idle_close_s) / 4
        # An IPv6 literal goes in brackets in Host, as in the URL (RFC 9110).
        host = f"[{self.host}]" if ":" in self.host else self.host
        host_hdr = f"{host}:{self.port}".encode()
        # UTF-8, as the scheduler reads it (aiohttp decodes header bytes as UTF-8).
        auth = b"\r\nAuthorization: Bearer " + token.encode() if token else b""
        self.instance = instance
        if instance:
            auth += b"\r\n" + GATEWAY_INSTANCE_HEADER.encode() + b": " + instance.encode()

        def head(path: bytes) -> bytes:
            return (b"POST " + prefix + path + b" HTTP/1.1\r\nHost: " + host_hdr + auth
                    + b"\r\nContent-Type: application/json\r\nContent-Length: ")

        self._schedule_head = head(b"/v1/schedule")
        self._release_head = head(b"/v1/release")
        self._prefilled_head = head(b"/v1/prefilled")
        self._renew_head = head(b"/v1/renew")
        key = base64.b64encode(os.urandom(16))
        self._upgrade = (
            b"GET "
            + prefix
            + b"/v1/channel HTTP/1.1\r\nHost: "
            + host_hdr
            + auth
            + b"\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: "
            + key
            + b"\r\nSec-WebSocket-Version: 13\r\n\r\n"
        )
        self.loop = asyncio.get_running_loop()
        self._pipe: _Pipe | _WsPipe | None = None
        # Connections opened with a context a reload replaced, still owing answers.
        self._retiring: set[_Pipe | _WsPipe] = set()
        self._connecting: asyncio.Future | None = None
        self._watchdog: asyncio.TimerHandle | None = None
        self._closed = False
        self._reconnecting: asyncio.Task | None = None
        # Releases, first-token reports and renewals that found no connection to be had (the
        # scheduler hung: its port takes connections and never answers the handshake), sent
        # on the next connection made. Dropped, a release left its lease counted as load on
        # its worker until it expired (10 minutes) once the scheduler resumed; a restarted
        # scheduler answers them 404, which is harmless. Entries: (kind, encoded message) for
        # messages already written in one wire form, or (None, op, head, body).
        self._held: deque[tuple] = deque(maxlen=MAX_HELD_LAZY)

    @property
    def kind(self) -> str | None:
        """The wire form in use: "ws", "http", or None before the first connection."""
        return self._pipe.kind if self._pipe is not None else None

    def _ssl(self, current: ssl.SSLContext | None) -> ssl.SSLContext | None:
        """The context of a connection made now (`current`: the PeerContext's); None: plain
        TCP (http://)."""
        if not self._https:
            return None
        return current if current is not None else self._system_cas

    async def _get_pipe(self) -> _Pipe | _WsPipe:
        pipe = self._pipe
        if pipe is not None and not pipe.closed:
            if pipe.opened_with is self._tls.current:
                return pipe
            self._retire(pipe)
        if self._connecting is None:
            self._connecting = self.loop.create_task(self._connect())
        try:
            return await asyncio.shield(self._connecting)
        finally:
            if self._connecting is not None and self._connecting.done():
                self._connecting = None

    def _retire(self, pipe: _Pipe | _WsPipe) -> None:
        """`pipe` was opened with a context a TLS reload has replaced: the next calls go on a new
        connection, and it closes once its calls in flight are answered (the watchdog still
        times them out)."""
        self._pipe = None
        log.info("scheduler channel: TLS context reloaded; new calls go on a new connection, "
                 "the old one closes once its %d call(s) in flight are answered", len(pipe.pending))
        pipe.retire()
        if not pipe.closed:
            self._retiring.add(pipe)

    async def _connect(self) -> _Pipe | _WsPipe:
        pipe: _Pipe | _WsPipe | None = None
        # Read once: a reload during the handshake leaves this connection marked with the
        # context it was made with, retired at the next call.
        current = self._tls.current
        try:
            async with asyncio.timeout(self.timeout_s):
                if self.channel != "http":
                    _, ws = await self.loop.create_connection(
                        lambda: _WsPipe(self, self._upgrade), self.host, self.port, ssl=self._ssl(current)
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
                    _, pipe = await self.loop.create_connection(lambda: _Pipe(self), self.host, self.port,
                                                                ssl=self._ssl(current))
        except (OSError, TimeoutError) as exc:
            raise SchedulerUnavailableError(f"scheduler {self.host}:{self.port}: {exc!r}") from exc
        pipe.opened_with = current
        self._pipe = pipe
        if self._watchdog is None:
            self._watchdog = self.loop.call_later(self._tick_s, self._check_timeouts)
        if self._held:
            self._send_held(pipe)
        return pipe

    def _send_held(self, pipe: _Pipe | _WsPipe) -> None:
        held, self._held = self._held, deque(maxlen=MAX_HELD_LAZY)
        for entry in held:
            if entry[0] is None:
                _, op, head, body = entry
                pipe.send_lazy(self._lazy_message(pipe, op, head, body))
            elif entry[0] == pipe.kind:  # else written in the other wire form: expiry covers it
                pipe.send_lazy(entry[1])
        pipe._flush()  # at once; again only if this connection is aborted too before an answer

    def _lost(self, pipe: _Pipe | _WsPipe, unsent: list[bytes]) -> None:
        """A connection ended. `unsent`: its releases and first-token reports that were waiting
        for company and never went out, and on the channel those written that no answer showed
        read yet; they go on the next connection (a lost release would count its request as
        load on the worker until the lease expired, 10 minutes)."""
        if self._pipe is pipe:
            self._pipe = None
            if pipe.kind == "ws" and self.instance and not self._closed and self._reconnecting is None:
                self._reconnecting = self.loop.create_task(self._reconnect())
        self._retiring.discard(pipe)
        if unsent and not self._closed:
            self.loop.create_task(self._send_again(pipe.kind, unsent))

    async def _reconnect(self) -> None:
        """The channel is the scheduler's sign that this gateway lives (see above): open it
        again, until one is open or the pipe is closed."""
        attempt = 0
        try:
            while not self._closed and (self._pipe is None or self._pipe.closed):
                await asyncio.sleep(RECONNECT_DELAYS_S[min(attempt, len(RECONNECT_DELAYS_S) - 1)])
                attempt += 1
                try:
                    await self._get_pipe()
                except SchedulerUnavailableError as exc:
                    log.debug("scheduler channel: reconnect failed (%s)", exc)
        finally:
            self._reconnecting = None

    async def _send_again(self, kind: str, unsent: list[bytes]) -> None:
        try:
            pipe = await self._get_pipe()
        except SchedulerUnavailableError:
            self._held.extend((kind, data) for data in unsent)  # for the next connection
            return
        if pipe.kind != kind:
            return  # written in the other wire form (the scheduler changed): expiry covers them
        for data in unsent:
            pipe.send_lazy(data)
        pipe._flush()  # at once; again only if this connection is aborted too before an answer

    def _check_timeouts(self) -> None:
        """One timer for every call: a call older than the timeout poisons the pipeline
        (later answers would be matched to the wrong calls), so the connection is dropped.
        And an HTTP connection idle for idle_close_s is closed before the scheduler closes it."""
        pipe = self._pipe
        now = time.monotonic()
        for old in list(self._retiring):  # retired after a TLS reload, answers still owed
            self._abort_if_late(old, now)
        if pipe is not None and not self._abort_if_late(pipe, now):
            if isinstance(pipe, _Pipe) and not pipe.pending and now - pipe.idle_since >= self.idle_close_s:
                self._pipe = None
                pipe.close_idle()  # the next call opens another
        self._watchdog = self.loop.call_later(self._tick_s, self._check_timeouts)

    def _abort_if_late(self, pipe: _Pipe | _WsPipe, now: float) -> bool:
        """Drop the connection when its oldest unanswered call is past the timeout."""
        if pipe.pending and now - pipe.pending[0][1] > self.timeout_s:
            pipe.abort(SchedulerUnavailableError(f"scheduler call timed out after {self.timeout_s} s"))
            return True
        return False

    @staticmethod
    def _frame(head: bytes, body: bytes) -> bytes:
        return b"%s%d\r\n\r\n%s" % (head, len(body), body)

    async def schedule_raw(self, body: dict[str, Any]) -> tuple[int, dict]:
        """Like SchedulerClient.schedule_raw, for calls without wait_ms."""
        pipe = self._pipe
        # The identity check: a TLS reload retires the connection (_get_pipe).
        if pipe is None or pipe.closed or pipe.opened_with is not self._tls.current:
            pipe = await self._get_pipe()
        fut = self.loop.create_future()
        if pipe.kind == "ws":
            pipe.send(b'{"op":"schedule",' + to_json(body)[1:], fut)
            status, payload = await self._answer(fut)
            if status == 200 or (status == 503 and isinstance(payload, dict) and payload.get("wait")):
                return status, payload
            message = _message_of(payload)
        else:
            pipe.send(self._frame(self._schedule_head, _dumps(body).encode()), fut)
            status, raw = await self._answer(fut)
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
        raise_for_auth(status, message)
        if 400 <= status < 500:
            raise SchedulerRequestError(f"scheduler answered {status}: {message}")
        raise SchedulerUnavailableError(f"scheduler answered {status}: {message}")

    async def _answer(self, fut: asyncio.Future) -> Any:
        try:
            return await fut
        except asyncio.CancelledError:
            # Cancelled after the answer came but before this task resumed: the future was
            # not cancelled, so the pipe did not give the lease back; do it here.
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                status, answer = fut.result()
                if status == 200:
                    self._orphan(answer)
            raise

    def release_nowait(self, rel: dict[str, Any]) -> None:
        """Fire and forget (a lost release is covered by the scheduler's lease expiry)."""
        self._send_lazy(b"release", self._release_head, rel)

    def prefilled_nowait(self, lease_id: str) -> None:
        """Fire and forget: the lease's first token came back (a lost report is covered by
        the worker's prompt counter at the next scrape)."""
        self._send_lazy(b"prefilled", self._prefilled_head, {"lease_id": lease_id})

    def renew_nowait(self, lease_id: str) -> None:
        """Fire and forget: the lease's request still runs (a lost renewal: the next one)."""
        self._send_lazy(b"renew", self._renew_head, {"lease_id": lease_id})

    def _send_lazy(self, op: bytes, head: bytes, body: dict[str, Any]) -> None:
        pipe = self._pipe
        if pipe is not None and not pipe.closed and pipe.opened_with is self._tls.current:
            pipe.send_lazy(self._lazy_message(pipe, op, head, body))
        else:
            self.loop.create_task(self._send_later(op, head, body))

    def _lazy_message(self, pipe: _Pipe | _WsPipe, op: bytes, head: bytes, body: dict[str, Any]) -> bytes:
        if pipe.kind == "ws":
            return b'{"op":"%s",%s' % (op, to_json(body)[1:])
        return self._frame(head, _dumps(body).encode())

    async def _send_later(self, op: bytes, head: bytes, body: dict[str, Any]) -> None:
        try:
            pipe = await self._get_pipe()
        except SchedulerUnavailableError:
            if not self._closed:
                self._held.append((None, op, head, body))  # for the next connection
            return
        msg = self._lazy_message(pipe, op, head, body)
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
        self.release_nowait(orphan_release(lease_id))

    def close(self) -> None:
        self._closed = True
        if self._reconnecting is not None:
            self._reconnecting.cancel()
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        if self._pipe is not None:
            if not self._pipe.closed:
                self._pipe._flush()  # releases still waiting for company
            self._pipe.abort(SchedulerUnavailableError("closed"))
        for old in list(self._retiring):
            old.abort(SchedulerUnavailableError("closed"))


__all__ = ["CHANNELS", "IDLE_CLOSE_S", "RELEASE_DELAY_S", "SchedulerPipe", "_Pipe", "_WsPipe", "ws_frame"]
