"""Background responses (`"background": true` on `POST /v1/responses`), as vLLM runs them.

The POST answers at once with the response `queued` (or, with `stream`, with the events as
they come); the answer is generated in a task of its own that outlives the client's
connection. The stored response moves through `queued` -> `in_progress` -> `completed`
(`incomplete`, `failed`, or `cancelled` by `POST /v1/responses/{id}/cancel`), and
`GET /v1/responses/{id}` shows where it is. Every event the answer produced is kept, so
`GET /v1/responses/{id}?stream=true&starting_after=N` replays the stream from event N + 1 and
follows it to its end: a client whose stream broke picks it up where it left off. A finished
answer's events are kept within a byte budget (EVENTS_BUDGET_BYTES over all finished ones,
the oldest dropped first; vLLM keeps them all, for ever): a long answer's events take some
hundred bytes per token, and 1024 stored answers of 4k tokens would hold over a gigabyte.
Past the budget the response itself is still there (GET without `stream`).

A stopping worker owes an answer to the clients streaming a background response (they hold
the drain, like any stream) and fails it once the drain time is out. One nobody streams is
cancelled when the worker stops: with the worker gone nobody could retrieve it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from inference_worker.engine.types import AsyncEngineClient
from inference_worker.server.errors import exception_to_api_error
from inference_worker.server.generation import Generation

if TYPE_CHECKING:
    from inference_worker.server.openai_api import StreamedAnswer

log = logging.getLogger(__name__)

# A background response can be cancelled while in one of these.
LIVE_STATUSES = frozenset({"queued", "in_progress"})
# The events of finished background answers kept for replays, in bytes, over all of them.
EVENTS_BUDGET_BYTES = 64 * 1024 * 1024


class BackgroundRun:
    """One background answer: its task and the stream events it produced so far (each one a
    whole SSE frame; an event's index is its `sequence_number`)."""

    def __init__(self, response: dict[str, Any]) -> None:
        # The response object that GET returns until the answer is whole (then the store holds
        # the finished one); its `status` is updated in place.
        self.response = response
        self.events: list[bytes] | None = []  # None: dropped (the budget, see above)
        self.size = 0  # bytes of events
        self.done = False
        self.task: asyncio.Task[None] | None = None
        self._grown = asyncio.Event()

    def append(self, frame: bytes) -> None:
        assert self.events is not None  # dropped only once finished
        self.events.append(frame)
        self.size += len(frame)
        self._wake()

    def finish(self) -> None:
        self.done = True
        self._wake()

    def _wake(self) -> None:
        self._grown.set()
        self._grown = asyncio.Event()  # waiters hold the old one, which stays set

    async def replay(self, starting_after: int | None = None) -> AsyncIterator[bytes]:
        """The events after `starting_after` (all with None), then each new one until the end.
        (Check `events` first: None once dropped.)"""
        # A replay under way keeps the list if it is dropped meanwhile (an empty one is the
        # run's own, still to fill).
        events = self.events if self.events is not None else []
        index = 0 if starting_after is None else starting_after + 1
        while True:
            while index < len(events):
                yield events[index]
                index += 1
            if self.done:
                return
            await self._grown.wait()

    async def cancel(self) -> None:
        """Stop the answer: the engine request is aborted and its KV freed."""
        self.response["status"] = "cancelled"
        if self.task is not None and not self.task.done():
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task


class BackgroundRuns:
    """The worker's background answers still running (to stop them when the app stops)."""

    def __init__(self, events_budget_bytes: int = EVENTS_BUDGET_BYTES) -> None:
        self._running: set[BackgroundRun] = set()
        self.events_budget_bytes = events_budget_bytes
        self._kept: OrderedDict[BackgroundRun, int] = OrderedDict()  # finished, oldest first
        self.kept_bytes = 0

    def __len__(self) -> int:
        return len(self._running)

    def keep_events(self, run: BackgroundRun) -> None:
        """A finished run's events join the kept ones; the oldest go past the budget."""
        self._kept[run] = run.size
        self.kept_bytes += run.size
        while self.kept_bytes > self.events_budget_bytes and self._kept:
            old, size = self._kept.popitem(last=False)
            old.events = None
            self.kept_bytes -= size

    def start(self, run: BackgroundRun, gen: Generation, answer: StreamedAnswer,
              engine: AsyncEngineClient) -> None:
        """Generate `answer` in a task of its own."""
        self._running.add(run)
        run.task = asyncio.create_task(self._run(run, gen, answer, engine))

        def ended(_: asyncio.Task[None]) -> None:
            self._running.discard(run)
            run.finish()
            self.keep_events(run)

        run.task.add_done_callback(ended)

    @staticmethod
    async def _run(run: BackgroundRun, gen: Generation, answer: StreamedAnswer,
                   engine: AsyncEngineClient) -> None:
        try:
            await gen.start(engine)
            if run.response["status"] == "queued":
                run.response["status"] = "in_progress"
            async for event in answer.events(gen):
                run.append(answer.frame(event))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the engine failed it, or the worker stopped before its end
            err = exception_to_api_error(exc)
            run.response["status"] = "failed"
            run.response["error"] = {"code": err.code or err.type, "message": err.message}
            run.append(answer.error_event(err))
        finally:
            await gen.close()  # aborts in the engine unless the request already finished

    async def stop_all(self) -> None:
        """Cancel what still runs (the worker stops: see the module's text)."""
        if self._running:
            log.info("cancelling %d background responses still running", len(self._running))
        for run in list(self._running):
            await run.cancel()
