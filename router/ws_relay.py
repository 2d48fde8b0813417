"""One client WebSocket relayed to a worker's /v1/ws, and moved to another worker when its
worker stops.

Messages are copied both ways untouched. The relay keeps, in order, the requests it sent that
have no answer's end yet (a `done` message or an error). A stopping worker answers the
requests it has taken, refuses the ones that come after (error `shutting_down`) and closes with
1001. The relay does not pass those refusals on: it holds every request from the first
refusal on, and when the worker says 1001 it places the socket again (scheduler, another
worker), sends the requests still unanswered there, in order, and goes on. The client sees
its answers, not the rolling update. A worker refuses in its turn, after the answers before
(one of an older version at once, as it reads the request, while an earlier answer may still
stream): either way the refusals are for the newest requests, the answers before them end in
order, and what is still unanswered at the 1001 is what was refused (mixed versions during a
rolling update are moved alike). An answer cut at the worker's drain limit ends with its
error, which goes to the client, as over SSE.
A cancel is for the request being answered, the oldest unanswered: the worker gets it when
that request is in the worker; one that is held here is dropped and answered as the worker
would (`done`, `cancelled`), since no worker has started it.

A socket stays on its worker to keep its conversation's prefix cache warm there, but not on a
worker an operator cordoned (scheduler/cordons.py; the gateway learns it from the scheduler's
worker list, router/fallback.py is_cordoned): a cordon is a drain, and a socket that stayed
would keep it from ever ending. The socket's next request is held, as a stopping worker's
refusals are, and once the worker has ended the answers it owes (the request in flight
finishes there) the socket is moved the same way. A cordoned worker still serves: when no
other worker can take the socket, it goes back there, pinned, rather than lose its requests.

A TLS reload (scheduler/tls_reload.py: a renewed --worker-ca-file or client certificate) does
not cut a socket's conversation, as proxies leave the connections open at a configuration
change; but a CA taken out of the bundle must not vouch for a worker forever. So the upstream
WebSocket opened under a context a reload has since replaced is opened again at the socket's
next request, a turn boundary, as a cordoned worker's is left: the request is held, the answers
owed end on the old connection, and the socket is placed again, on the same worker first (its
prefix cache), with the context in force; where that worker no longer passes the check, on
another, else the socket is closed (1001). A socket that sends nothing keeps its connection.

Each request holds a lease of its own on the socket's worker, from its message to its answer's
end (router/ws_leases.py; the first one's is the lease the socket was placed with). A worker
that drops the connection with answers owed is reported, as a stream cut mid-answer is. The
worker's own out-of-order answer (to one request more than it queues) is given here instead,
so that every answer the worker sends ends the oldest request owed; a binary message goes to
the worker, which refuses it in its turn.

The gateway's own refusals (`shutting_down` while it drains, router/ws_sessions.py; the key
revoked since the socket opened) go out in their turn too: each waits after the newest request
owed when it came (WsTurn.then) and follows that answer's end, or the `cancelled` of a held
one; at once when nothing is owed. Sent at once, it came inside the answer streaming, and a
client pairing each answer's end with its requests in order took it for that answer's end. They
hold no lease, reach no worker and are not counted as answers (as before). A socket owes at most
64 answers and refusals waiting (memory stays bounded however fast its client sends); a message
past that is answered at once, out of its turn: a refusal as such, a request with a 429.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import Mapping
from typing import Any

import aiohttp
from aiohttp import WSCloseCode, web

from router.access_log import RequestRecord
from router.proxy import Proxy
from router.queue import QueueDisplaced, QueueFull, QueueTimeout
from router.scheduling import NoWorkerError, PinnedWorkerGone, Route
from router.sse import ROLE_OPENING
from router.tokens import answers_of, schedule_request_off_loop
from router.ws_leases import TurnLeases, WsTurn
from router.ws_sessions import SHUTTING_DOWN, WsSession, WsSessions, ws_error
from scheduler.client import SchedulerError, SchedulerRequestError, UnknownModelError
from scheduler.protocol import CLIENT_LEFT, connection_refused

log = logging.getLogger("router.ws")

# A chunk with a choice in it (not a usage chunk, a terminal message or an error): the
# worker's chunks are compact JSON. Counted as one output token each, the stand-in the SSE
# path uses when a stream ends without usage (the socket's usage chunks are the client's).
_CHOICE_CHUNK = '"choices":[{'
# A chat answer's opening chunk of each choice (its role, no text) is no token, as over SSE.
_ROLE_OPENING = re.compile(ROLE_OPENING.pattern.decode())
# The worker's messages that end a request's answer (its websocket.py): `done`, or an error;
# as json.dumps writes them, or compact (as the echo worker and other servers do).
_DONE_PREFIXES = ('{"type": "done"', '{"type":"done"')
_TERMINAL_PREFIXES = (*_DONE_PREFIXES, '{"error"')
# How a stopping worker refuses a request it did not take (the worker's errors.shutting_down:
# "send the request to another one"). An answer cut at its drain limit ends with another
# shutting_down message, which goes to the client.
_REFUSAL = "send the request to another one"
_UPSTREAM_SEND_ERRORS = (ConnectionError, aiohttp.ClientError)
# What the worker answers a cancel with (its websocket.py), for a request cancelled while held
# here: no worker gave it an id.
_CANCELLED_HERE = json.dumps({"type": "done", "id": None, "cancelled": True})
# Close codes a worker sends about the client's message (not its own failure): unsupported
# data, invalid payload, policy, too big. Reporting them would let one client's messages take
# workers out of rotation.
_CLIENTS_FAULT = frozenset({1003, 1007, 1008, 1009})
# Requests a socket may have owed at once: the worker queues 64 besides the one it answers and
# answers one more at once, out of order (its MAX_QUEUED_REQUESTS). 64 in all, because between
# an answer's end and its taking the next request the worker may still count 64 queued. The
# gateway's refusals waiting their turn count too (they bound the memory a socket holds).
_MAX_OWED = 64
_TOO_MANY = ws_error(f"more than {_MAX_OWED} requests in flight on this socket", 429)
KEY_REVOKED = ws_error("the API key this socket was opened with is no longer accepted",
                       "invalid_api_key", "authentication_error")


class WsRelay:
    def __init__(self, proxy: Proxy, request: web.Request, rec: RequestRecord, session: WsSession,
                 sessions: WsSessions, sched_body: dict[str, Any], priority: int,
                 answers: int = 0) -> None:
        self.proxy = proxy
        self.request = request
        self.rec = rec
        self.session = session
        self.client = session.client
        self.sessions = sessions
        self.sched_body = sched_body  # the first request's: places the socket when none is owed
        self.priority = priority
        # The placement of the socket on its worker (its lease is the turn's it was placed for).
        self.route: Route | None = None
        self.upstream: aiohttp.ClientWebSocketResponse | None = None
        # Requests wait in session.pending instead of going upstream: the worker refuses
        # (it is stopping), or the socket is being placed again.
        self.held = False
        # The socket's worker is cordoned: it moves once the worker owes no answer.
        self.leaving = False
        # The worker_tls.current the upstream was opened with; a reload replaced it: the
        # upstream is opened again (reopen: it "leaves" for the same worker first).
        self.opened_with: Any = None
        self.reopen = False
        # How many of the newest requests in session.pending no worker has (refused, or held).
        self.outside = 0
        self.leases = TurnLeases(proxy, rec)
        # Answers ended on this socket, each with its access-log line (refused placements
        # before this relay's included: they were answers too).
        self.answers = answers
        # Answers' ends and the refusals owed after them go to the client one at a time: a
        # refusal decided at once (nothing owed any more) waits for those being sent.
        self._in_turn = asyncio.Lock()

    def _answer_ended(self, turn: WsTurn, status: int, error: str | None,
                      model: str | None = None, queue_ms: float = 0.0) -> None:
        """Each answer counts in router_requests_total with its own status, as an HTTP request
        does: counted once per socket (101), a WebSocket's failed answers were in no error
        rate or alert. And one access-log line per request (DESIGN.md), a socket's too: each
        answer's line as it ends, `id=<socket's id>.<n>`; the socket's own line (status 101,
        its totals) comes at its close."""
        rec = self.rec
        self.proxy.metrics.request_done(model or rec.model, status, turn.worker_id or "-")
        access_log = self.proxy.access_log
        if access_log is None and rec.spans is None:
            return
        self.answers += 1
        line = RequestRecord(f"{rec.id}.{self.answers}", "WS", self.request.path)
        line.start, line.model, line.flow, line.trace = turn.start, rec.model, rec.flow, rec.trace
        line.worker, line.stream = turn.worker_id or "-", True
        line.prompt_tokens, line.output_tokens = turn.prompt_tokens, turn.output_tokens
        line.ttft_ms = turn.first_s * 1000 if turn.first_s is not None else None
        line.status, line.error, line.queue_ms = status, error, queue_ms
        if access_log is not None:
            access_log.add(line)
        if rec.spans is not None and self.proxy.tracing is not None:
            self.proxy.tracing.publish_answer(rec.spans, line)

    def refused(self, turn: WsTurn, failed: str) -> None:
        """The socket's first request could not be placed (`failed`, the error the client got:
        unknown model, no worker, full queue, ...): it is one answer, counted and logged as
        the others (router_requests_total under its status, with the model as a refused HTTP
        request's is labelled; its own access-log line with its wait in the queue), and the
        socket stays open, unplaced, for the next request (router/ws_proxy.py)."""
        rec = self.rec
        status, error = answer_status(failed)
        self._answer_ended(turn, status, error, self.proxy.model_label(rec), rec.queue_ms)
        # Its flow's charge for a placement that reached no worker (a worker acquired, then
        # unreachable) goes back, as at a refused HTTP request's end.
        self.proxy.settle_fair(rec)

    # ---- placing ----------------------------------------------------------------------
    async def place(self, exclude: list[str], pin: Route | None = None) -> str | None:
        """Lease a worker for the oldest request owed and connect to it (pin's worker only, when
        given); None, or the error message to send the client."""
        proxy, rec = self.proxy, self.rec
        owed = self.session.pending
        turn = next((t for t in owed if t.sched_body is not None), None)
        body = turn.sched_body if turn is not None else self.sched_body
        if pin is not None:
            body = {**body, "worker_id": pin.worker_id}
        deadline = time.monotonic() + proxy.cfg.queue_timeout_ms / 1000
        for _ in range(proxy.cfg.retry_count + 1):
            try:
                route = await proxy._acquire(rec, body, exclude, deadline,
                                             pinned_url=pin.url if pin is not None else None,
                                             priority=self.priority)
            except (QueueFull, QueueTimeout) as exc:
                # Counted as the HTTP path counts them: router_rejected_requests_total missed
                # every socket refused so.
                reason = ("queue_timeout" if isinstance(exc, QueueTimeout)
                          else "displaced" if isinstance(exc, QueueDisplaced) else "queue_full")
                proxy.metrics.rejected.labels(reason).inc()
                rec.status = 429
                return ws_error("no worker available, retry later", 429)
            except (SchedulerError, NoWorkerError, PinnedWorkerGone) as exc:
                if isinstance(exc, UnknownModelError) or getattr(exc, "unknown_model", False):
                    rec.status = 404
                elif isinstance(exc, SchedulerRequestError):
                    rec.status = 400  # the scheduler found the request malformed
                elif exclude:  # the workers tried failed it, and no other is left: as below
                    break
                else:
                    # The model is served, but no worker of it is healthy now (or the scheduler
                    # refused the request): the HTTP path's 503 no_worker, not a 404 that told
                    # the operator (and the client) of a model nobody serves.
                    proxy.metrics.rejected.labels("no_worker").inc()
                    rec.status = 503
                return ws_error(str(exc), rec.status)
            headers = proxy._upstream_headers(self.request, rec.id, "/v1/ws", rec.spans)
            if rec.spans is not None:  # the worker's parent span is this connection's
                headers["traceparent"] = rec.spans.attempt(route.worker_id, route.url + "/v1/ws")
            opened_with = proxy.worker_tls.current
            try:
                self.upstream = await proxy.session.ws_connect(
                    route.url + "/v1/ws",
                    headers=headers,
                    timeout=aiohttp.ClientWSTimeout(ws_receive=None, ws_close=5.0),
                    max_msg_size=0,
                    # A worker whose host died without closing the connection is noticed (its
                    # owed requests' leases would otherwise be renewed while the client waits).
                    heartbeat=proxy.cfg.ws_heartbeat_s,
                    ssl=opened_with if opened_with is not None else True,  # request_ssl's
                )
            except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                if rec.spans is not None:
                    rec.spans.attempt_failed("connect")
                proxy.report_failed(route, "connect", connection_refused(exc))
                proxy.release_lease(route, False, 0, 0, error="connect")  # it held nothing
                exclude.append(route.worker_id)
                log.info("ws id=%s worker %s unreachable (%r); retrying", rec.id, route.worker_id, exc)
                continue
            except asyncio.CancelledError:
                # The client left while the worker's handshake was under way: the lease is not
                # yet the relay's to give back (close() releases self.route), and unreleased it
                # would count as load on that worker until it expired.
                proxy._release(route, rec, ok=True, error=CLIENT_LEFT, held_kv=False)
                raise
            self.route = route
            self.opened_with = opened_with
            rec.worker = route.worker_id
            if turn is not None and turn in owed:
                self.leases.give(turn, route)
            else:  # nothing owed (a socket moved while idle), or it was cancelled meanwhile
                proxy.release_lease(route, True, 0, 0, error=CLIENT_LEFT)
            return None
        rec.status = 502
        return ws_error("every worker attempt failed", 502)

    async def _move(self, leaving: bool = False) -> bool:
        """The socket goes to another worker with what it still owes: the worker said 1001, or
        (leaving) it is cordoned and has ended every answer it owed. A cordoned worker still
        serves: when no other worker can take the socket, it goes back there. Or (reopen) its
        connection was opened under a TLS context since reloaded: to the same worker first."""
        self.held = True
        self.leaving = False  # from here requests sent meanwhile join the move
        reopen, self.reopen = self.reopen and leaving, False  # (a worker's 1001: elsewhere)
        old = self.route
        assert old is not None and self.upstream is not None
        await self.upstream.close()
        pending = self.session.pending
        # What is owed at the 1001, the stopping worker did not answer: it refused it, or it
        # came after the worker's close frame and was dropped. All of it goes to the next one.
        for turn in pending:
            self.leases.unbind(turn)
        self.outside = len(pending)
        self.route = self.upstream = None
        status = self.rec.status
        failed = await self.place([], pin=old) if reopen else None
        if failed is not None or not reopen:
            failed = await self.place([old.worker_id])
        if failed is not None and leaving and not reopen:
            # No other worker can take it now (each is cordoned, down or full): the cordoned
            # one, as requests pinned there still go, rather than a socket cut.
            log.info("ws id=%s: no other worker than the cordoned %s can take it now (%s); "
                     "back to it", self.rec.id, old.worker_id, failed)
            failed = await self.place([], pin=old)
        self.rec.status = status  # it was served until now (a failed try above set another)
        if failed is not None:
            return False
        why = " (TLS context reloaded)" if reopen else " (cordoned)" if leaving else ""
        log.info("ws id=%s moved from %s%s to %s with %d request(s) owed", self.rec.id,
                 old.worker_id, why, self.route.worker_id, len(pending))
        while self.outside:  # requests the client sends meanwhile join the end
            turn = pending[len(pending) - self.outside]
            if turn.worker_id != self.route.worker_id:
                self.leases.bind(turn, self.route)
            # Counted in the worker before the send: a cancel sent meanwhile goes there too.
            self.outside -= 1
            if not await self.send_upstream(turn.data):
                return False
        self.held = False
        return True

    # ---- relaying ---------------------------------------------------------------------
    async def refuse(self, refusal: str) -> None:
        """The gateway refuses a request (it drains, the key was revoked), in its turn: after the
        answer of the newest request owed, or at once when none is owed (or past _MAX_OWED)."""
        session = self.session
        pending = session.pending
        if pending and len(pending) + session.refusals < _MAX_OWED:
            turn = pending[-1]
            if turn.then is None:
                turn.then = []
            turn.then.append(refusal)
            session.refusals += 1
            return
        async with self._in_turn:
            await self.client.send_str(refusal)

    async def _answer_ended_out(self, data: str, ended: WsTurn | None) -> None:
        """An answer's end to the client, then the refusals owed after it."""
        async with self._in_turn:
            await self.client.send_str(data)
            if ended is None or not ended.then:
                return
            then, ended.then = ended.then, None
            for refusal in then:
                await self.client.send_str(refusal)
                self.session.refusals -= 1  # after it is out: a drain's going_away waits for it

    async def send_upstream(self, data: str | bytes) -> bool:
        assert self.upstream is not None
        try:
            if isinstance(data, str):
                await self.upstream.send_str(data)
            else:
                await self.upstream.send_bytes(data)
        except _UPSTREAM_SEND_ERRORS:
            return False  # it is still pending: the next worker gets it, or the socket ends
        return True

    async def send_request(self, turn: WsTurn) -> None:
        pending = self.session.pending
        pending.append(turn)
        if not self.held and self.route is not None:
            if self.proxy.sched.fallback.is_cordoned(self.route.worker_id):
                self.held = self.leaving = True  # cordoned: this request goes to another worker
            elif self.opened_with is not self.proxy.worker_tls.current:
                self.held = self.leaving = self.reopen = True  # TLS reloaded: a new connection
        if self.held:
            self.outside += 1
            if self.leaving and len(pending) == self.outside and self.upstream is not None:
                # The worker owes nothing: the close ends _down's read, and _down moves it.
                await self.upstream.close()
            return
        assert self.route is not None
        self.leases.bind(turn, self.route)
        await self.send_upstream(turn.data)

    async def cancel(self, data: str) -> None:
        """The client's cancel, of the oldest request not answered yet (if any)."""
        pending = self.session.pending
        if len(pending) > self.outside:  # a worker has it
            if self.upstream is not None and not self.upstream.closed:
                await self.send_upstream(data)
        elif pending:  # held here: no worker started it
            turn = pending.popleft()
            self.leases.unbind(turn)
            self.outside -= 1
            await self._answer_ended_out(_CANCELLED_HERE, turn)
            if self.sessions.closing:  # the gateway stops: that was what the socket waited for
                await self.session.going_away_if_idle()

    async def run(self) -> None:
        """Relay until either side ends."""
        down = asyncio.ensure_future(self._down())
        up = asyncio.ensure_future(self._up())
        try:
            await asyncio.wait({down, up}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (down, up):
                t.cancel()
            await asyncio.gather(down, up, return_exceptions=True)

    async def _up(self) -> None:
        """The client's messages: requests, and cancels of the one being answered."""
        async for msg in self.client:
            if msg.type in (aiohttp.WSMsgType.TEXT, aiohttp.WSMsgType.BINARY):
                if msg.type == aiohttp.WSMsgType.TEXT and is_cancel(msg.data):
                    await self.cancel(msg.data)
                elif self.sessions.closing:
                    await self.refuse(SHUTTING_DOWN)
                elif not self.proxy.keys.allows(self.session.authorization):
                    # Revoked since the socket opened: its answers owed still come, as an HTTP
                    # stream accepted under it goes on; a new request is refused as over HTTP.
                    await self.refuse(KEY_REVOKED)
                elif len(self.session.pending) + self.session.refusals >= _MAX_OWED:
                    await self.client.send_str(_TOO_MANY)  # at once, out of its turn (the bound)
                elif msg.type == aiohttp.WSMsgType.BINARY:
                    # No request (no lease): the worker refuses it in its turn, after the answers
                    # owed before it. Refused here at once, its error came inside the answer
                    # streaming then, and the client took it for that answer's end.
                    await self.send_request(WsTurn(msg.data))
                else:
                    turn, prompt = await turn_of(self.proxy, self.rec.model, msg.data, self.request.headers)
                    self.rec.prompt_tokens += prompt
                    await self.send_request(turn)
            else:
                return

    async def _down(self) -> None:
        """The worker's messages, through every worker the socket is placed on."""
        client, pending = self.client, self.session.pending
        while True:
            assert self.upstream is not None and self.route is not None
            async for msg in self.upstream:
                if msg.type == aiohttp.WSMsgType.TEXT:
                    data = msg.data
                    turn = pending[0] if pending else None  # the request being answered
                    terminal, ended = False, None
                    if _CHOICE_CHUNK in data and not ('"role"' in data and _ROLE_OPENING.search(data)):
                        self.rec.output_tokens += 1
                        if turn is not None:
                            turn.output_tokens += 1
                            if not turn.answering:
                                turn.first_s = time.perf_counter() - turn.start
                                self.leases.first_token(turn)
                    elif data.startswith(_TERMINAL_PREFIXES):
                        if _REFUSAL in data and not self.sessions.closing:
                            self.held = True  # the worker stops: this request, and the rest, wait
                            self.outside += 1
                            continue
                        terminal = True
                        if turn is not None:
                            status, error = answer_status(data)
                            self._answer_ended(turn, status, error)
                            if status == 200:  # done, and not cancelled
                                self.proxy.observe_answer(self.rec.model, turn.first_s,
                                                          time.perf_counter() - turn.start,
                                                          turn.output_tokens, turn.answers)
                                if turn.first_s is not None:  # the stats line's mean TTFT too
                                    self.proxy.stats.add_ttft(turn.first_s * 1000)
                            ended = pending.popleft()
                            self.leases.end(ended)
                        self.proxy.settle_fair(self.rec)
                    if terminal:
                        await self._answer_ended_out(data, ended)
                    else:
                        await client.send_str(data)
                    if self.sessions.closing and await self.session.going_away_if_idle():
                        return  # the last answer owed is out: the client reconnects elsewhere
                    if self.leaving and len(pending) == self.outside:
                        break  # its worker is cordoned and has answered what it had: move
                elif msg.type == aiohttp.WSMsgType.BINARY:
                    await client.send_bytes(msg.data)
                else:
                    break
            if client.closed:
                return
            if self.leaving and len(pending) == self.outside:
                if await self._move(leaving=True):
                    continue
                await client.close(code=WSCloseCode.GOING_AWAY, message=b"no worker can take it")
                return
            if self.upstream.close_code == WSCloseCode.GOING_AWAY and not self.sessions.closing:
                if await self._move():
                    continue
                # Nowhere to go: pass the goodbye on, so the client reconnects later.
                await client.close(code=WSCloseCode.GOING_AWAY, message=b"the worker is shutting down")
                return
            # The worker went away while the client is still connected: say so before closing
            # (a request it was answering is not replayed elsewhere, like SSE).
            self._worker_left()
            await client.send_str(ws_error("the worker closed the connection", "upstream_closed"))
            return

    def _worker_left(self) -> None:
        """The worker closed the socket (not for a rolling update it could be moved through):
        the answers it owed failed there. Reported as a stream cut mid-answer is: a dropped
        connection ("connection", out at once), a close it chose with answers owed
        ("upstream_closed", one failure of the streak); nothing for a close about the client's
        message, a graceful stop (1001, while this gateway stops too), or with nothing owed."""
        pending = self.session.pending
        owed = list(pending)[: len(pending) - self.outside]  # the ones the worker had
        if not owed or self.route is None:
            return
        code = self.upstream.close_code if self.upstream is not None else None
        if code in _CLIENTS_FAULT or code == WSCloseCode.GOING_AWAY:
            for turn in owed:
                self.leases.end(turn, error=CLIENT_LEFT)
            return
        reason = "connection" if code in (None, WSCloseCode.ABNORMAL_CLOSURE) else "upstream_closed"
        self.proxy.report_failed(self.route, reason)
        self.proxy.metrics.stream_failed(reason)  # once per socket: its answer being streamed
        for turn in owed:
            self.leases.end(turn, ok=False, error=reason)

    async def close(self) -> None:
        # The leases first: the close below waits for the worker, and a cancel meanwhile (the
        # client dropped the connection) would skip what comes after it. What is still owed,
        # the worker aborts as the socket closes: its KV is freed, and no failure of the worker's.
        for turn in self.session.pending:
            self.leases.end(turn, error=CLIENT_LEFT)
        if self.upstream is not None:
            await self.upstream.close()


def answer_status(terminal: str) -> tuple[int, str | None]:
    """The HTTP status and error an answer's last message stands for, for its log line."""
    if terminal.startswith(_DONE_PREFIXES):
        return (499, "cancelled") if '"cancelled"' in terminal else (200, None)
    try:
        error = json.loads(terminal)["error"]
        code, kind = error.get("code"), error.get("type")
    except (ValueError, TypeError, KeyError, AttributeError):
        return 502, "upstream_error"
    if isinstance(code, int) and not isinstance(code, bool) and 400 <= code < 600:
        return code, str(kind or code)
    return (400 if kind == "invalid_request_error" else 502), str(code or kind or "error")


async def turn_of(proxy: Proxy, model: str, data: str, headers: Mapping[str, str] | None = None
                  ) -> tuple[WsTurn, int]:
    """One more request on the socket, with what the scheduler is told of it (under the socket's
    model: its worker is the one it goes to; with `headers`, the socket's handshake's, its session,
    router/sessions.py), and its prompt estimate, as the HTTP path counts a request without
    usage. A message that is no JSON object takes no lease and counts no prompt: the worker
    answers it with an error."""
    try:
        body = json.loads(data)
    except (ValueError, RecursionError):  # the last: nested too deeply (the worker says so)
        return WsTurn(data), 0
    if not isinstance(body, dict):
        return WsTurn(data), 0
    # A long prompt is counted in a thread (--tokenizer): on the loop, a message of megabytes
    # paused every stream the gateway relays while it was tokenized.
    sched_body, prompt, choices = await schedule_request_off_loop(proxy.tokens, model, body)
    if headers is not None:
        proxy.note_session(sched_body, headers, body)
    return WsTurn(data, sched_body, prompt * choices, answers_of(body)), prompt


def is_cancel(text: str) -> bool:
    """The worker's cancel message (`{"type": "cancel"}`): it ends the request being answered.
    Exactly as the worker tells it (its websocket.py): a message with more fields is a request
    to it, answered with an error, and counted as a cancel here that answer ended the wrong
    request in the list of those owed (a stopping gateway then sent the socket away mid-answer)."""
    if len(text) > 64 or '"cancel"' not in text:
        return False
    try:
        body = json.loads(text)
    except ValueError:
        return False
    return isinstance(body, dict) and body.get("type") == "cancel" and len(body) == 1
