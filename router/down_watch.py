"""Requests waiting on a worker the scheduler has since found down.

A non-stream answer comes whole, when its generation ends (vLLM sends nothing before), so its
wait is bounded only by --request-timeout-ms (30 min): long generations are normal, and a
first-byte timeout there cut them and retried them on other workers (the same minutes again,
twice) while reporting a healthy worker failed. A worker that hangs (its process stopped, a
stuck GPU: connections accepted, nothing answered) would then hold its requests for as long.
So such a request also ends when the scheduler reports its worker down (it stopped answering
its scrapes and health probes: `--dead-after-ms`), seen at the gateway's next worker-list
refresh, and is retried elsewhere: no byte of it has reached the client. So does a stream
until its first byte (router/streaming.py, before_first_byte): it would wait out
--first-byte-timeout-ms (60 s) on a hung worker; once it has sent a byte it is never moved.

Only a worker that may be hung, though: one the scheduler reports down for its silence (its
scrapes timed out, requests got no answer) or for connections reset or never made. A worker
whose port REFUSES connections (the scheduler's down cause "refused") is not hung: nothing
listens there. Either it drains (SIGTERM: it closed its listener and finishes what it holds,
for up to its --shutdown-timeout), or its process is gone, and the requests it held failed
on their own connections already (a dead process's are reset). Giving its answers up would
only generate them again elsewhere, seconds later, on GPU time already spent: a static worker
(--workers) that drains stays listed, and is soon reported down, refused.

A worker that left the list is not down: a draining one (deregistered, its pod terminating)
finishes what it holds.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from scheduler.protocol import DRAINING, REFUSED

DOWN = "down"  # the scheduler's circuit state for a worker it took out (WorkerView.state)
# WorkerView.down_cause: the answers on a worker down for this cause are left to finish (None:
# unknown, e.g. from a scheduler older than causes, is taken for hung, as before).
NOT_HUNG = frozenset({REFUSED, DRAINING})  # DRAINING: it answers 503 "shutting down" (router/draining.py)

_T = TypeVar("_T")


class WorkerDown(Exception):
    """The scheduler reported the worker down while a call waited on it."""


async def unless_down(call: Awaitable[_T], down: asyncio.Future[None]) -> _T:
    """`call`'s result, or WorkerDown once `down` (DownWatch.watching) resolves first: a hung
    worker (connections taken, nothing answered) would hold the call until its timeout (the
    request timeout, 30 minutes by default; for ever, for a stored response's replay).

    `call` runs in the caller's own task, which `down` cancels, as asyncio.timeout() does: no
    task of its own and no asyncio.wait() per call (a stream waits twice, for its head and its
    first chunk, on every request). The cancel is counted (Task.cancelling), so the caller's
    other cancels (the client left, a timeout around this) still reach it as before."""
    if down.done() and not down.cancelled():
        if asyncio.iscoroutine(call):
            call.close()  # never started: no "never awaited" warning
        raise WorkerDown
    task = asyncio.current_task()
    assert task is not None
    state = _Watch(task)
    down.add_done_callback(state.on_down)
    try:
        return await call
    except asyncio.CancelledError:
        if state.take_back():
            raise WorkerDown from None
        raise
    finally:
        # A done future's callbacks are already scheduled, so removing on_down may come late:
        # `active` keeps a late one from cancelling whatever the task awaits next.
        state.active = False
        down.remove_done_callback(state.on_down)
        state.take_back()


class _Watch:
    """One unless_down() wait: whether `down` cancelled the task, and taking that cancel back."""

    __slots__ = ("active", "fired", "task")

    def __init__(self, task: asyncio.Task[object]) -> None:
        self.task = task
        self.active = True
        self.fired = False

    def on_down(self, fut: asyncio.Future[None]) -> None:
        # A cancelled `down` is DownWatch.watching's end, not a worker down.
        if self.active and not self.fired and not fut.cancelled():
            self.fired = True
            self.task.cancel()

    def take_back(self) -> bool:
        """Withdraw this wait's cancel, once: True when it was the task's only one (the call
        ended by it alone), False when there was none or another cancel is pending too."""
        if not self.fired:
            return False
        self.fired = False
        return self.task.uncancel() == 0


class DownWatch:
    def __init__(self) -> None:
        self._watchers: dict[str, set[asyncio.Future[None]]] = {}

    @contextmanager
    def watching(self, worker_id: str) -> Iterator[asyncio.Future[None]]:
        """A future resolved when the scheduler reports `worker_id` down, and not for a refused
        port (never, if it is not)."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        watchers = self._watchers.setdefault(worker_id, set())
        watchers.add(fut)
        try:
            yield fut
        finally:
            watchers.discard(fut)
            if not watchers and self._watchers.get(worker_id) is watchers:
                del self._watchers[worker_id]
            if not fut.done():
                fut.cancel()

    def update(self, states: Iterable[tuple[str, str | None, str | None]]) -> None:
        """(worker_id, state, down_cause) of every worker the scheduler lists: wake the
        watchers of those it reports down and possibly hung (any cause but "refused")."""
        if not self._watchers:
            return
        for worker_id, state, cause in states:
            if state == DOWN and cause not in NOT_HUNG:
                for fut in self._watchers.pop(worker_id, ()):
                    if not fut.done():
                        fut.set_result(None)
