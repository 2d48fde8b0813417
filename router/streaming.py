"""Streaming answers through: the first chunk decides whether a retry is still possible,
then every chunk is written to the client the moment it is read from the worker.

`StreamForwarding` is the streaming half of `router.proxy.Proxy` (kept apart to keep each
module small); it uses the proxy's session, timeouts, headers and lease bookkeeping.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable
from typing import TypeVar

import aiohttp
from aiohttp import web

from router.access_log import RequestRecord
from router.down_watch import WorkerDown, unless_down
from router.draining import says_draining
from router.errors import next_sequence_number, responses_error_event, sse_error_event
from router.in_flight import SHUTTING_DOWN, InFlight
from router.metrics import RouterMetrics
from router.scheduling import Route, Scheduling
from router.sse import StreamTap
from router.stored_responses import ResponseOwners, response_id_in
from router.upstream_errors import answer_status, read_bounded
from router.whole_as_sse import sse_of_whole
from scheduler.protocol import DRAINING, connection_refused
from scheduler.tls import PeerContext

UPSTREAM_ERRORS = (aiohttp.ClientError, TimeoutError, OSError)
# A worker's answer did not come within the read timeout (aiohttp 3.10 on; 3.9 raised one
# class for connect and read timeouts alike, and then a connect timeout reads as this too).
READ_TIMEOUT = getattr(aiohttp, "SocketTimeoutError", aiohttp.ServerTimeoutError)


# A worker's "too many requests": it is up but full (TGI answers 429 "Model is overloaded" past
# --max-concurrent-requests). Another worker may have room; nothing reached the client yet.
OVERLOADED = 429


# Streams whose first events come before any token (the Responses API sends
# `response.created` and `response.in_progress` at once): their first token is the first event
# that holds these bytes (`"type": "response.output_text.delta"`, or a reasoning or tool-call
# argument delta). TTFT and the scheduler's prefill report wait for it.
RESPONSES_STREAM = "/v1/responses"
FIRST_TOKEN_MARKERS = {RESPONSES_STREAM: b'.delta"'}


class RetryElsewhere(Exception):
    """The worker failed before any byte reached the client; another may serve.
    `overloaded`: it refused as full (429), which says nothing against its health. `refused`:
    its port refused the connection (the scheduler is told: nothing listens there, so the
    answers already on it are not hung, router/down_watch.py)."""

    def __init__(self, reason: str, detail: str = "", overloaded: bool = False,
                 refused: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.detail = detail
        self.overloaded = overloaded
        self.refused = refused

    @classmethod
    def after(cls, exc: BaseException) -> RetryElsewhere:
        """For a worker call that failed with `exc` (one of UPSTREAM_ERRORS)."""
        return cls(failure_kind(exc), repr(exc), refused=connection_refused(exc))

    @classmethod
    def answered(cls, status: int, detail: str) -> RetryElsewhere:
        """For a worker's 5xx or 429 answer (`detail`: the start of its body): the kind
        http_<status>, or "draining" for a 503 that says the worker drains (router/draining.py:
        the scheduler takes it out at once and leaves what it is finishing there)."""
        kind = DRAINING if says_draining(status, detail) else f"http_{status}"
        return cls(kind, detail, status == OVERLOADED)


_T = TypeVar("_T")


async def before_first_byte(call: Awaitable[_T], down: asyncio.Future[None] | None) -> _T:
    """`call` (a worker's answer, its head or a stream's first chunk), given up for another
    worker if the scheduler reports the worker down meanwhile (router/down_watch.py): no byte
    of the answer has reached the client, and a hung worker (connections taken, nothing
    answered) would hold it until its timeout. `down` None: no scheduler to say so (fallback)."""
    if down is None:
        return await call
    try:
        return await unless_down(call, down)
    except WorkerDown:
        raise RetryElsewhere("worker_down", "the scheduler reports the worker down") from None


def failure_kind(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, aiohttp.ClientConnectorError):
        return "connect"
    return "connection"


def stream_error_event(path: str, tap: StreamTap | None, message: str, type_: str,
                       code: int | str) -> bytes:
    """The last event of a stream that already started and fails: in the Responses API's own
    terms on its streams (an `error` event numbered after the last event relayed; its clients
    read typed events and no `[DONE]`), else chat's and completions' (`data: {"error": ...}`
    then `data: [DONE]`)."""
    if path != RESPONSES_STREAM:
        return sse_error_event(message, type_, code)
    # The last piece relayed holds whole events (the unfinished one is held back in the tap),
    # so its last number is the last the client got.
    sent = (tap.last, tap.opening) if tap is not None else ()
    name = code if isinstance(code, str) else type_
    return responses_error_event(message, name, next_sequence_number(*sent))


class ReadWatch:
    """The idle-stream timeout of a stream's reads from its worker: the task is cancelled once
    one read has waited `idle` seconds. Only reads count: time spent writing to the client
    (held back by a slow one) does not. A timer per `idle` seconds of a busy stream, not one per
    chunk (a timer cancelled and set per token cost ~9 % of the gateway's CPU): a chunk only
    notes when its read began."""

    __slots__ = ("_fired", "_handle", "_idle", "_loop", "_task", "reading_since")

    def __init__(self, loop: asyncio.AbstractEventLoop, idle: float) -> None:
        self._loop = loop
        self._idle = idle
        self._task = asyncio.current_task()
        self._fired = False
        self.reading_since: float | None = None  # None: not waiting for the worker now
        self._handle = loop.call_at(loop.time() + idle, self._check)

    def _check(self) -> None:
        since = self.reading_since
        now = self._loop.time()
        if since is None:  # writing to the client: look again soon (a read may begin at once)
            self._handle = self._loop.call_at(now + self._idle / 8, self._check)
        elif now - since >= self._idle - 0.001:  # a timer may run up to the clock's resolution early
            self._fired = True
            assert self._task is not None
            self._task.cancel()
        else:
            self._handle = self._loop.call_at(since + self._idle, self._check)

    def timed_out(self) -> bool:
        """Whether the CancelledError being handled is this watch's (then it is taken back);
        False: the task was cancelled for another reason (its client left), too."""
        if not self._fired:
            return False
        assert self._task is not None
        return self._task.uncancel() == 0

    def stop(self) -> None:
        self._handle.cancel()


class StreamForwarding:
    session: aiohttp.ClientSession
    sched: Scheduling
    worker_tls: PeerContext
    timeout: aiohttp.ClientTimeout
    idle_s: float
    owners: ResponseOwners
    in_flight: InFlight
    metrics: RouterMetrics

    # ---- stream ---------------------------------------------------------------------------
    async def _forward_stream(
        self,
        request: web.Request,
        rec: RequestRecord,
        route: Route,
        path: str,
        raw: bytes,
        headers: dict[str, str],
        strip_usage: bool,
    ) -> web.StreamResponse:
        url = route.url + path
        if request.query_string:
            url += "?" + request.query_string
        # Until its first byte, a stream whose worker the scheduler reports down goes elsewhere
        # (a hung worker took the connection and answers nothing): as a whole answer does.
        watch = contextlib.ExitStack()
        down = (None if route.fallback
                else watch.enter_context(self.sched.down_watch.watching(route.worker_id)))
        try:
            up = await before_first_byte(self.session.request(
                "POST", url, data=raw, headers=headers, timeout=self.timeout,
                ssl=self.worker_tls.request_ssl), down)
        except UPSTREAM_ERRORS as exc:
            watch.close()
            raise RetryElsewhere.after(exc) from None
        except BaseException:
            watch.close()
            raise
        complete = delivered = False
        resp: web.StreamResponse | None = None
        tap: StreamTap | None = None
        try:
            if up.status >= 500 or up.status == OVERLOADED:
                raise RetryElsewhere.answered(up.status, await self._read_some(up))
            if up.status != 200 or not up.headers.get("Content-Type", "").startswith(
                "text/event-stream"
            ):
                # An error (4xx), or a worker that answered without streaming.
                answer = await self._whole_in_stream(up, route, rec, path, strip_usage)
                complete = True
                return answer
            try:
                first = await before_first_byte(up.content.readany(), down)
            except UPSTREAM_ERRORS as exc:
                raise RetryElsewhere.after(exc) from None
            watch.close()  # from here the client has bytes: a stream is never replayed
            if not first:
                raise RetryElsewhere("empty_stream")

            def first_token() -> None:
                rec.ttft_ms = (time.perf_counter() - rec.start) * 1000
                self._prefilled(route)

            marker = FIRST_TOKEN_MARKERS.get(path)
            if marker is None:
                first_token()
            tap = StreamTap(strip_usage, marker, first_token)
            resp = web.StreamResponse(status=200, headers=self._response_headers(route, rec))
            resp.content_type = "text/event-stream"
            resp.headers["Cache-Control"] = "no-cache"
            await resp.prepare(request)
            rec.status = 200
            upstream_error = await self._pump(up, resp, tap, first)
            if upstream_error is None:
                rest = tap.flush()
                if rest:
                    await resp.write(rest)
                complete = True
            else:
                rec.error = upstream_error
                # The client's status says 200: without this, router_requests_total would be
                # all an operator sees of a worker that cut streams short.
                self.metrics.stream_failed(upstream_error)
                await resp.write(stream_error_event(
                    path, tap, f"the worker failed mid-stream ({upstream_error})", "upstream_error",
                    502))
                tap.flush()  # its unfinished last event, which the client did not get, still counts
            if tap.prompt_tokens is not None:
                rec.prompt_tokens = tap.prompt_tokens
            rec.output_tokens = (
                tap.completion_tokens if tap.completion_tokens is not None else tap.content_events
            )
            if upstream_error is None:
                # The worker stores a response (if asked to) once it is whole: where it lives
                # and its length are learnt now.
                self._learn_owner(tap, route, rec.prompt_tokens + rec.output_tokens)
            if upstream_error is not None:
                self._failed(route, upstream_error, rec)
            else:
                self._release(route, rec, ok=True)
                if route.fallback:
                    self.sched.fallback.mark_ok(route.url)
            # Every event is out ([DONE] or the error event): a client that closes now, before
            # the chunked terminator, left nothing unread, and the answer is not a 499.
            delivered = True
            await resp.write_eof()
            return resp
        except (ConnectionResetError, asyncio.CancelledError) as exc:
            if delivered:
                if isinstance(exc, asyncio.CancelledError):
                    asyncio.current_task().uncancel()  # type: ignore[union-attr]
                return resp
            # The client went away mid-stream (a write failed, or aiohttp cancelled the handler
            # when the connection dropped): closing `up` below aborts the worker's request.
            # Either way 499, though the 200 was sent: the request counter and the access log
            # then tell abandoned streams from finished ones.
            rec.error = "client_disconnected"
            rec.status = 499
            if tap is not None:
                # What the worker generated until then (no usage comes): the token counters
                # and the lease would otherwise count none of an abandoned stream's tokens.
                rec.output_tokens = tap.content_events
                if rec.detached:
                    # A background response goes on in the worker, whose store has it from
                    # the start: its client may come back for it (GET, stream=true). (Another
                    # answer cut short is not stored.)
                    self._learn_owner(tap, route, 0)
            if isinstance(exc, asyncio.CancelledError):
                if self.in_flight.cutting and resp is not None:
                    # Cut by the stopping gateway, not left by its client: a last event says
                    # so (the transport is still open; aiohttp closes it after).
                    rec.status, rec.error = 503, "shutting_down"
                    with contextlib.suppress(Exception):
                        await resp.write(stream_error_event(path, tap, SHUTTING_DOWN, "server_error",
                                                            "shutting_down"))
                        await resp.write_eof()
                raise  # the caller gives the lease back
            self._release_client_left(route, rec)
            return resp if resp is not None else web.Response(status=499)
        finally:
            watch.close()
            if complete and up.content.is_eof():
                up.release()
            else:
                up.close()  # (a client gone at [DONE] before the worker's end: unread, not kept)

    async def _whole_in_stream(self, up: aiohttp.ClientResponse, route: Route, rec: RequestRecord,
                               path: str, strip_usage: bool) -> web.Response:
        """A streamed request's answer that is no event stream: an error, or a whole answer (an
        engine that ignored `stream`, or answers some requests so). It counts as the whole
        answer it is (its usage, its status: an error in a 200's body is that error), and a
        chat or completions answer is sent as the stream its client reads. (No TTFT: its first
        token reached the client with its last, as a non-stream answer's does.)"""
        try:
            data = await (read_bounded(up) if up.status >= 400 else up.read())
        except UPSTREAM_ERRORS as exc:  # cut off mid-body: nothing reached the client yet
            raise RetryElsewhere.after(exc) from None
        status = answer_status(up.status, data)
        data, ctype = self._whole_answer(route, rec, path, status, data,
                                         up.headers.get("Content-Type", "application/json"))
        h = self._response_headers(route, rec)
        events = sse_of_whole(path, data, include_usage=not strip_usage) if status == 200 else None
        if events is not None:
            data, ctype = events, "text/event-stream"
            h["Cache-Control"] = "no-cache"
        h["Content-Type"] = ctype
        return web.Response(status=status, body=data, headers=h)

    def _learn_owner(self, tap: StreamTap, route: Route, tokens: int) -> None:
        """Where the response a stream named in its opening events lives (0 tokens: its
        length is not known yet)."""
        if tap.opening:
            self.owners.learn(response_id_in(tap.opening), route.worker_id, route.url, tokens)

    async def _pump(
        self, up: aiohttp.ClientResponse, resp: web.StreamResponse, tap: StreamTap, first: bytes
    ) -> str | None:
        """Write through until the worker ends the stream. Returns an error kind if the
        worker failed (the client's own failures raise ConnectionResetError)."""
        out = tap.feed(first)
        if out:
            await resp.write(out)
        read = up.content.readany
        loop = asyncio.get_running_loop()
        protocol = up.connection.protocol if up.connection is not None else None
        if protocol is not None:
            # From here the watch below is the stream's read timeout: aiohttp's own (the
            # first-byte timeout, re-armed on every chunk) would only repeat it, at a timer per
            # chunk. Set again for the connection's next request.
            protocol.read_timeout = None
        watch = ReadWatch(loop, self.idle_s)
        try:
            while True:
                watch.reading_since = loop.time()
                try:
                    piece = await read()
                except UPSTREAM_ERRORS as exc:
                    return failure_kind(exc)
                except asyncio.CancelledError:
                    if watch.timed_out():
                        return "idle_timeout"
                    if b"data: [DONE]" in tap.last:
                        # The client has the whole answer ([DONE] is written: this read comes
                        # after) and left before the worker's own end: a finished stream, not a
                        # 499 (JavaScript clients commonly abort at [DONE]).
                        asyncio.current_task().uncancel()  # type: ignore[union-attr]
                        return None
                    raise
                # Writing to the client is not waiting for the worker: a client that reads
                # slowly holds the stream back (TCP backpressure), and is no silence of the
                # worker's (before, it ended the stream as the worker's idle timeout).
                watch.reading_since = None
                if not piece:
                    return None if up.content.is_eof() else "connection"
                out = tap.feed(piece)
                if out:
                    await resp.write(out)
        finally:
            watch.stop()

    @staticmethod
    async def _read_some(up: aiohttp.ClientResponse) -> str:
        try:
            return (await up.content.read(200)).decode(errors="replace")
        except UPSTREAM_ERRORS:
            return ""
