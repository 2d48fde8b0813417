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

A worker that left the list is not down: a draining one (deregistered, its pod terminating)
finishes what it holds. A dead process needs none of this: its connections fail at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import aiohttp

DOWN = "down"  # the scheduler's circuit state for a worker it took out (WorkerView.state)

_T = TypeVar("_T")


class WorkerDown(Exception):
    """The scheduler reported the worker down while a call waited on it."""


async def unless_down(call: Awaitable[_T], down: asyncio.Future[None]) -> _T:
    """`call`'s result, or WorkerDown once `down` (DownWatch.watching) resolves first: a hung
    worker (connections taken, nothing answered) would hold the call until its timeout (the
    request timeout, 30 minutes by default; for ever, for a stored response's replay)."""
    task = asyncio.ensure_future(call)
    try:
        await asyncio.wait((task, down), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the client left
        task.cancel()
        if task.done() and not task.cancelled() and task.exception() is None:
            result = task.result()
            if isinstance(result, aiohttp.ClientResponse):  # opened just now: not left open
                result.close()
        raise
    if not task.done():
        task.cancel()
        raise WorkerDown
    return task.result()


class DownWatch:
    def __init__(self) -> None:
        self._watchers: dict[str, set[asyncio.Future[None]]] = {}

    @contextmanager
    def watching(self, worker_id: str) -> Iterator[asyncio.Future[None]]:
        """A future resolved when the scheduler reports `worker_id` down (never, if it is not)."""
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

    def update(self, states: Iterable[tuple[str, str | None]]) -> None:
        """(worker_id, state) of every worker the scheduler lists: wake the watchers of those
        it reports down."""
        if not self._watchers:
            return
        for worker_id, state in states:
            if state == DOWN:
                for fut in self._watchers.pop(worker_id, ()):
                    if not fut.done():
                        fut.set_result(None)
