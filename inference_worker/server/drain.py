"""A stopping worker's bookkeeping: the generation requests it still owes an answer.

On SIGTERM (a rolling update, a scale-down) the worker stops taking requests but finishes
the ones it has, as vLLM does with `--shutdown-timeout`: an answer cut off mid-stream is
lost to its client (a router cannot replay a stream that has started), while a request
refused before any byte is retried on another worker. The HTTP handlers and the WebSocket
sessions `hold()` one unit per request they have taken and `release()` it when the answer
is written; the shutdown code waits for none to be left.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

from inference_worker.server.errors import shutting_down


class Drain:
    def __init__(self) -> None:
        self.draining = False
        self.begun = asyncio.Event()
        self._owed = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def owed(self) -> int:
        """Requests taken and not yet answered."""
        return self._owed

    def begin(self) -> None:
        """From now on new requests are refused (503 `shutting_down`)."""
        self.draining = True
        self.begun.set()

    def admit(self) -> None:
        """Raise the 503 a new request gets once the worker is draining."""
        if self.draining:
            raise shutting_down()

    def hold(self) -> None:
        self._owed += 1
        self._idle.clear()

    def release(self, count: int = 1) -> None:
        self._owed -= count
        if self._owed <= 0:
            self._owed = 0
            self._idle.set()

    @contextlib.contextmanager
    def request(self) -> Iterator[None]:
        """Admit one request and owe it an answer until the block ends."""
        self.admit()
        self.hold()
        try:
            yield
        finally:
            self.release()

    async def wait_answered(self, limit_s: float, give_up: asyncio.Event | None = None) -> bool:
        """Wait until every request taken is answered; False if `limit_s` seconds passed first
        or `give_up` was set (a second Ctrl-C)."""
        waits = [asyncio.ensure_future(self._idle.wait())]
        if give_up is not None:
            waits.append(asyncio.ensure_future(give_up.wait()))
        try:
            await asyncio.wait(waits, timeout=limit_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        return self._idle.is_set()
