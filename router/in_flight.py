"""The proxied requests a gateway is serving: a stopping gateway waits for them, then cuts what
is left itself, so that each client gets a `shutting_down` error (a last stream event, or a
503 before any byte) it can retry on, instead of a dropped connection.

aiohttp's own shutdown is no deadline to build on: it waits up to its timeout for a handler,
then cancels the request's body reader and waits up to the timeout again, so a stream that
outlives the first wait takes twice the timeout to be cut, and is cut with its connection.
"""

from __future__ import annotations

import asyncio
import contextlib

SHUTTING_DOWN = "the gateway is shutting down: send the request again"
# After the cut, how long the requests get to write their last words.
CUT_WAIT_S = 1.0


class InFlight:
    def __init__(self) -> None:
        self._tasks: set[asyncio.Task] = set()
        self._none = asyncio.Event()
        self._none.set()
        self.cutting = False  # set by cut(): a CancelledError now is the gateway's, not the client's

    @property
    def count(self) -> int:
        return len(self._tasks)

    def enter(self) -> None:
        task = asyncio.current_task()
        assert task is not None  # a request handler always runs in its own task
        self._tasks.add(task)
        self._none.clear()

    def leave(self) -> None:
        self._tasks.discard(asyncio.current_task())  # type: ignore[arg-type]
        if not self._tasks:
            self._none.set()

    async def wait_done(self, timeout_s: float) -> int:
        """Wait up to timeout_s for the last request to end; returns how many were left."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._none.wait(), timeout_s)
        return self.count

    async def cut(self) -> int:
        """Cancel what is left and give it CUT_WAIT_S to answer; returns how many were cut."""
        self.cutting = True
        left = list(self._tasks)
        for task in left:
            task.cancel()
        await self.wait_done(CUT_WAIT_S)
        return len(left)
