"""Each request on a gateway WebSocket, and the lease it holds on the socket's worker.

The scheduler counts a socket's requests as they come and frees each one's KV as its answer
ends, as for HTTP requests; an idle socket holds no lease. A request goes to the worker at once
and its lease is asked for beside it (ScheduleRequest.attach, router/scheduling.py): a slow or
hung scheduler never delays a socket's requests, and the lease is matched to its request when
it comes back. A request moved to another worker while its lease was being asked for (its
worker stopped), cancelled, or ended meanwhile gets the lease given back then.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from scheduler.protocol import CLIENT_LEFT

if TYPE_CHECKING:
    from router.access_log import RequestRecord
    from router.proxy import Proxy
    from router.scheduling import Route

log = logging.getLogger("router.ws")


class WsTurn:
    """One request on a socket, from the client's message to its answer's end."""

    __slots__ = ("answering", "answers", "binding", "data", "ended", "first_s", "output_tokens",
                 "prompt_tokens", "route", "sched_body", "start", "then", "worker_id")

    def __init__(self, data: str | bytes, sched_body: dict[str, Any] | None = None,
                 prompt_tokens: int = 0, answers: int = 1) -> None:
        self.data = data
        # Its latencies are the client's: from its message (queueing and placing included) to
        # its first token and to its answer's end. `answers`: n (the TPOT is per answer).
        self.start = time.perf_counter()
        self.first_s: float | None = None
        self.answers = answers
        # What the scheduler is told of it; None for a message that is no request (the worker
        # answers it with an error), which takes no lease.
        self.sched_body = sched_body
        self.prompt_tokens = prompt_tokens  # the estimate, times its choices
        self.output_tokens = 0
        self.answering = False  # the worker's first token for it came
        self.route: Route | None = None  # its lease (lease_id None: unleased)
        self.worker_id: str | None = None  # the worker it is bound for, leased or not
        # Bumped at every binding and unbinding: a lease that comes back for an older binding
        # is given back.
        self.binding = 0
        self.ended: tuple[bool, str | None] | None = None  # (ok, error) once its answer ended
        # The gateway's own refusals of requests sent after this one (it drains, the key was
        # revoked): each goes to the client right after this answer's end, in its turn
        # (router/ws_relay.py refuse). No worker sees them; they hold no lease.
        self.then: list[str] | None = None


class TurnLeases:
    """Binds a socket's requests to its worker, and ends their leases."""

    def __init__(self, proxy: Proxy, rec: RequestRecord) -> None:
        self.proxy = proxy
        self.rec = rec
        self._asking: set[asyncio.Task] = set()

    def give(self, turn: WsTurn, route: Route) -> None:
        """The lease the socket was placed with is this request's."""
        self.unbind(turn)
        turn.worker_id, turn.route = route.worker_id, route

    def bind(self, turn: WsTurn, bound: Route) -> None:
        """The request goes to `bound`'s worker: its lease there is asked for in the background."""
        self.unbind(turn)
        turn.worker_id = bound.worker_id
        if turn.sched_body is None or not self.proxy.sched.leasing:
            return
        binding = turn.binding
        task = asyncio.ensure_future(self.proxy.sched.attach(turn.sched_body, bound, self.rec.flow))
        self._asking.add(task)
        task.add_done_callback(lambda t: self._leased(turn, binding, t))

    def _leased(self, turn: WsTurn, binding: int, task: asyncio.Task) -> None:
        self._asking.discard(task)
        if task.cancelled():
            return  # the pipe gives back a decision whose call was cancelled
        if task.exception() is not None:
            log.warning("ws id=%s lease call failed: %r", self.rec.id, task.exception())
            return
        route = task.result()
        if route is None:
            return
        if turn.binding != binding:  # moved, refused or cancelled meanwhile: nothing held
            self.proxy.release_lease(route, True, 0, 0, error=CLIENT_LEFT)
            return
        turn.route = route
        if turn.ended is not None:  # its answer ended before its lease came back
            self._release(turn)
        elif turn.answering:
            self.proxy._prefilled(route)

    def unbind(self, turn: WsTurn) -> None:
        """The request's lease goes back holding nothing: no worker took it (it was refused, or
        its socket is moving), or it was cancelled before it was sent."""
        turn.binding += 1
        if turn.route is not None:
            self.proxy.release_lease(turn.route, True, 0, 0, error=CLIENT_LEFT)
        turn.route = turn.worker_id = None

    def first_token(self, turn: WsTurn) -> None:
        """Its first token came: its prompt is prefilled."""
        turn.answering = True
        if turn.route is not None:
            self.proxy._prefilled(turn.route)

    def end(self, turn: WsTurn, ok: bool = True, error: str | None = None) -> None:
        """The request's answer ended (or will not come): its lease frees what it held, now or
        when it comes back. The first end counts."""
        if turn.ended is not None:
            return
        turn.ended = (ok, error)
        if turn.route is not None:
            self._release(turn)

    def _release(self, turn: WsTurn) -> None:
        assert turn.route is not None and turn.ended is not None
        ok, error = turn.ended
        self.proxy.release_lease(turn.route, ok, turn.prompt_tokens, turn.output_tokens, error=error)
