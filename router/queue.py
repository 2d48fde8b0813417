"""Bounded admission queue, one line per model, FIFO or shortest-prompt-first.

A request that the scheduler cannot place yet takes a place here. Only the head of
a model's line asks the scheduler (with a long-poll `wait_ms`, so it is answered
the moment capacity frees, without a polling delay); when it is placed it leaves
and the next one becomes head at once. New arrivals for a model that already has
a line join it instead of overtaking the head. The bound is global: past
`max_size` waiting requests, a newcomer is refused (429). A request cancelled
while waiting (its client went away) leaves the line and wakes its successor.

Order: with `ms_per_prompt_token` 0 the line is FIFO. Above 0, a request's place is
its arrival time plus its prompt length times that many milliseconds: after a burst,
short prompts go first (shortest-job-first is what minimises the mean time to first
token when the workers drain a backlog), and the delay a long prompt can suffer from
later, shorter ones is bounded by its own length times the factor (no starvation).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class QueueFull(Exception):
    """The admission queue already holds max_size requests."""


class QueueTimeout(Exception):
    """A request waited longer than the queue timeout."""


class _Line:
    """One model's waiters: a heap of (place, ticket, future) plus the current head."""

    __slots__ = ("head", "heap")

    def __init__(self) -> None:
        self.heap: list[tuple[float, int, asyncio.Future[None]]] = []
        self.head: asyncio.Future[None] | None = None

    def __bool__(self) -> bool:
        return self.head is not None or bool(self.heap)

    def promote(self) -> None:
        """The best waiter still waiting becomes head and is woken."""
        while self.heap:
            _, _, fut = heapq.heappop(self.heap)
            if not fut.done():  # a cancelled waiter's future is done: skip it
                self.head = fut
                fut.set_result(None)
                return
        self.head = None


class AdmissionQueue:
    def __init__(self, max_size: int, ms_per_prompt_token: float = 0.0) -> None:
        self.max_size = max_size
        self.s_per_prompt_token = ms_per_prompt_token / 1000.0
        self._lines: dict[str, _Line] = {}
        self._tickets = itertools.count()
        self.size = 0

    def has_waiters(self, model: str) -> bool:
        return bool(self._lines.get(model))

    @asynccontextmanager
    async def place(self, model: str, prompt_tokens: int = 0) -> AsyncIterator[None]:
        """Join `model`'s line and return once at its head; leave the line on exit."""
        if self.size >= self.max_size:
            raise QueueFull
        line = self._lines.get(model)
        if line is None:
            line = self._lines[model] = _Line()
        me: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.size += 1
        try:
            if line.head is None:
                line.head = me
            else:
                place = time.monotonic() + self.s_per_prompt_token * max(0, prompt_tokens)
                heapq.heappush(line.heap, (place, next(self._tickets), me))
                await me  # resolved by promote() when it is this waiter's turn
            yield
        finally:
            self.size -= 1
            if line.head is me:
                line.promote()
            elif not me.done():
                me.cancel()  # left before its turn: promote() will skip it
            if not line and self._lines.get(model) is line:
                del self._lines[model]
