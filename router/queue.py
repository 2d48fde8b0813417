"""Bounded FIFO admission queue, one line per model.

A request that the scheduler cannot place yet takes a place here. Only the head of
a model's line asks the scheduler (with a long-poll `wait_ms`, so it is answered
the moment capacity frees, without a polling delay); when it is placed it leaves
and the next one becomes head at once. New arrivals for a model that already has
a line join the back of it instead of overtaking. The bound is global: past
`max_size` waiting requests, a newcomer is refused (429). A request cancelled
while waiting (its client went away) leaves the line and wakes its successor.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class QueueFull(Exception):
    """The admission queue already holds max_size requests."""


class QueueTimeout(Exception):
    """A request waited longer than the queue timeout."""


class AdmissionQueue:
    def __init__(self, max_size: int) -> None:
        self.max_size = max_size
        self._lines: dict[str, deque[asyncio.Future[None]]] = {}
        self.size = 0

    def has_waiters(self, model: str) -> bool:
        return bool(self._lines.get(model))

    @asynccontextmanager
    async def place(self, model: str) -> AsyncIterator[None]:
        """Join `model`'s line and return once at its head; leave the line on exit."""
        if self.size >= self.max_size:
            raise QueueFull
        line = self._lines.get(model)
        if line is None:
            line = self._lines[model] = deque()
        me: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        line.append(me)
        self.size += 1
        try:
            if line[0] is not me:
                await me  # resolved by the predecessor when it leaves
            yield
        finally:
            self.size -= 1
            was_head = line[0] is me
            line.remove(me)
            if was_head and line:
                nxt = line[0]
                if not nxt.done():
                    nxt.set_result(None)
            if not line and self._lines.get(model) is line:
                del self._lines[model]
