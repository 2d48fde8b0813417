"""AsyncEngine: the LLMEngine's step loop on a background thread, streamed to asyncio.

The event loop never blocks on the model: `generate()` hands the request to the engine
thread through an inbox and awaits an asyncio.Queue; after every step the thread hands
all of that step's outputs to the loop in ONE `call_soon_threadsafe` callback.
Closing or cancelling a `generate()` iterator before its final output aborts the
request; the engine frees its blocks at its next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractContextManager

from inference_worker.engine.errors import (
    DuplicateRequestError,
    EngineDeadError,
    EngineRequestError,
    EngineShutdownError,
)
from inference_worker.engine.llm_engine import LLMEngine, validate_request
from inference_worker.engine.stats import CacheConfigInfo, StatLogger
from inference_worker.engine.types import RequestOutput, SamplingParams, WorkerTokenizer

log = logging.getLogger(__name__)


class AsyncEngine:
    """Implements engine.types.AsyncEngineClient."""

    def __init__(
        self,
        engine: LLMEngine,
        model_name: str,
        log_stats_interval: float = 5.0,
        gpu_memory_fn=None,
        step_context: Callable[[], AbstractContextManager] = contextlib.nullcontext,
    ) -> None:
        """step_context wraps the engine thread's whole loop: torch.inference_mode for a real model;
        the sim's default keeps torch out of the process (it costs ~1 s of start-up per worker)."""
        self.engine = engine
        self.model_name = model_name
        self.log_stats_interval = log_stats_interval
        self._gpu_memory_fn = gpu_memory_fn
        self._step_context = step_context
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._cond = threading.Condition()
        # Adds (request id, prompt, params, arrival) and aborts (request id), in the order they
        # were posted: an abort posted for a request the engine has just finished must not reach
        # a new request under the same id posted after it, as it would if adds went first.
        self._inbox: list[tuple[str, list[int], SamplingParams, float] | str] = []
        self._stop = False
        self._error: BaseException | None = None
        self._queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        # Aborts posted per request id and not yet applied by the engine thread, and a future
        # per id for a new request under it to wait on (_wait_for_aborts).
        self._aborting: dict[str, int] = {}
        self._aborts_done: dict[str, asyncio.Future[None]] = {}

    # ---- AsyncEngineClient ----------------------------------------------------------------
    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def max_num_seqs(self) -> int:
        return self.engine.scheduler.max_num_seqs

    @property
    def tokenizer(self) -> WorkerTokenizer:
        return self.engine.tokenizer

    @property
    def cache_info(self) -> CacheConfigInfo:
        return self.engine.cache_info

    @property
    def is_healthy(self) -> bool:
        return self._error is None and (self._thread is None or self._thread.is_alive())

    def add_stat_logger(self, logger: StatLogger) -> None:
        self.engine.add_stat_logger(logger)

    def gpu_memory(self) -> tuple[int, int] | None:
        """(used, total) bytes of the accelerator the model runs on, or None on CPU."""
        return self._gpu_memory_fn() if self._gpu_memory_fn is not None else None

    async def start(self) -> None:
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        thread = self._thread
        if thread is None:
            return
        with self._cond:
            self._stop = True
            self._cond.notify()
        await asyncio.to_thread(thread.join, 30)
        self._thread = None
        self._release_abort_waiters()

    def clock(self) -> float:
        """The engine clock (monotonic seconds; simulated seconds for the sim backend)."""
        return self.engine.clock()

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs. arrival_time (engine clock, see `clock()`) lets the server
        start TTFT/e2e when the HTTP request arrived, before tokenization, as vLLM does;
        by default they start at this call."""
        validate_request(prompt_token_ids, params, self.max_model_len)
        await self._wait_for_aborts(request_id)
        if request_id in self._queues:
            raise DuplicateRequestError(f"request id {request_id!r} is already in flight")
        if self._error is not None:
            raise EngineDeadError("the engine loop has died") from self._error
        await self.start()
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._queues[request_id] = queue
        with self._cond:
            arrival = self.engine.clock() if arrival_time is None else arrival_time
            self._inbox.append((request_id, list(prompt_token_ids), params, arrival))
            self._cond.notify()
        finished = False
        try:
            while True:
                out = await queue.get()
                if isinstance(out, EngineRequestError | EngineShutdownError):
                    raise out
                if isinstance(out, BaseException):
                    raise EngineDeadError("the engine loop has died") from out
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self._post_abort(request_id)

    async def abort(self, request_id: str) -> None:
        self._post_abort(request_id)

    def fail_all(self, exc: EngineShutdownError) -> int:
        """End every open request with `exc` (its caller's handler answers it) and abort it in
        the engine; returns how many there were. For a worker whose drain time ran out."""
        request_ids = list(self._queues)
        for request_id in request_ids:
            self._fail_one(request_id, exc)
        return len(request_ids)

    # ---- engine thread ----------------------------------------------------------------------
    def _post_abort(self, request_id: str) -> None:
        self._aborting[request_id] = self._aborting.get(request_id, 0) + 1
        with self._cond:
            self._inbox.append(request_id)
            self._cond.notify()

    async def _wait_for_aborts(self, request_id: str) -> None:
        """Until the aborts posted for `request_id` are applied. A request whose client left is
        aborted at the engine's next step, and its outputs of the step before are still on
        their way to the loop: a new request under its id (a client retrying with the same
        X-Request-Id, at once, on a connection of its own) would be handed those outputs as its
        own (its answer cut short, or ended by the old one's abort), and the engine's
        DuplicateRequestError for it would come after. So it waits here, a step at most."""
        # (No engine thread: the aborts wait in the inbox, ahead of this request's add.)
        while (request_id in self._aborting and self._thread is not None and self._error is None
               and not self._stop):
            done = self._aborts_done.get(request_id)
            if done is None:
                done = self._aborts_done[request_id] = asyncio.get_running_loop().create_future()
            await asyncio.shield(done)

    def _aborts_applied(self, request_ids: list[str]) -> None:
        """The engine thread applied these aborts (the step that frees them has run, and its
        outputs were dispatched before this)."""
        for request_id in request_ids:
            left = self._aborting.get(request_id, 0) - 1
            if left > 0:
                self._aborting[request_id] = left
                continue
            self._aborting.pop(request_id, None)
            done = self._aborts_done.pop(request_id, None)
            if done is not None and not done.done():
                done.set_result(None)

    def _release_abort_waiters(self) -> None:
        """The engine thread stopped or died: no abort will be applied, nobody waits for one."""
        self._aborting.clear()
        for done in self._aborts_done.values():
            if not done.done():
                done.set_result(None)
        self._aborts_done.clear()

    def _run(self) -> None:
        engine = self.engine
        next_log = time.monotonic() + self.log_stats_interval
        idle_reported = True
        try:
            with self._step_context():
                while True:
                    with self._cond:
                        while not (self._stop or self._inbox or engine.has_unfinished):
                            if not idle_reported:
                                engine.record_idle()
                                idle_reported = True
                            timeout = next_log - time.monotonic()
                            if timeout <= 0:
                                break
                            self._cond.wait(timeout)
                        if self._stop:
                            return
                        inbox, self._inbox = self._inbox, []
                    aborted: list[str] = []
                    for item in inbox:
                        if isinstance(item, str):
                            engine.abort_request(item)
                            aborted.append(item)
                            continue
                        request_id, prompt, params, arrival = item
                        try:
                            engine.add_request(request_id, prompt, params, arrival_time=arrival)
                        except EngineRequestError as exc:  # e.g. an id reused before its abort landed
                            self._loop.call_soon_threadsafe(self._fail_one, request_id, exc)
                    if engine.has_unfinished:
                        outputs = engine.step()
                        idle_reported = False
                        if outputs:
                            self._loop.call_soon_threadsafe(self._dispatch, outputs)
                    if aborted:  # after this step's outputs: the step applied the aborts
                        self._loop.call_soon_threadsafe(self._aborts_applied, aborted)
                    now = time.monotonic()
                    if now >= next_log:
                        next_log = now + self.log_stats_interval
                        engine.log_stats()
        except BaseException as exc:  # the model raised: fail every open request, stay unhealthy
            log.exception("engine loop died")
            self._error = exc
            self._loop.call_soon_threadsafe(self._fail_all, exc)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        queues = self._queues
        for out in outputs:
            queue = queues.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)

    def _fail_one(self, request_id: str, exc: BaseException) -> None:
        queue = self._queues.get(request_id)
        if queue is not None:
            queue.put_nowait(exc)

    def _fail_all(self, exc: BaseException) -> None:
        for queue in self._queues.values():
            queue.put_nowait(exc)
        self._release_abort_waiters()
