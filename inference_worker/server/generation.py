"""A request on its way through the engine: one engine request per choice, merged back.

A request has one prompt (chat) or several (a completions batch), and n choices per prompt
(vLLM fans n > 1 out into n child requests); choice `index` is choice `index % n` of prompt
`index // n`, as in vLLM's answers. `Generation.start()` starts every choice in the engine
and waits for a first output, so errors the engine raises on admission (a `ValueError`
subclass) still reach the client as a 4xx before any byte of a stream was sent.
`Generation.outputs()` then yields every choice's outputs as they come.
`Generation.close()` aborts what has not finished when the consumer stops early (client
disconnect, WebSocket cancel); it is a no-op once finished.
(server/prepare.py builds Generations from request bodies.)
"""

from __future__ import annotations

import asyncio
import uuid
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

from inference_worker.engine.errors import DuplicateRequestError
from inference_worker.engine.llm_engine import validate_request
from inference_worker.engine.types import (
    AsyncEngineClient,
    ParallelSampling,
    RequestOutput,
    SamplingParams,
    TokenLogprobs,
)
from inference_worker.server.chunks import ChatChunks, CompletionChunks, UsageTally


@dataclass(frozen=True, slots=True)
class Echo:
    """Echo: text that goes before each choice's answer (completions: the prompt; chat: the
    last assistant message the answer continues)."""

    text: str
    # Completions: the prompt's first token, in the logprobs (nothing predicts it: its
    # logprob is None). Chat echoes no logprobs.
    first_token: TokenLogprobs | None = None
    # max_tokens 0: the prompt is the whole answer; the engine's one token is dropped.
    only: bool = False


@dataclass(frozen=True, slots=True)
class Prompt:
    """One prompt of a request, with its params (prompts of a batch differ only in the
    default max_tokens) and, for completions' echo, what goes before its answers."""

    token_ids: list[int]
    params: SamplingParams
    echo: Echo | None = None


@dataclass(slots=True)
class Generation:
    """One API request in the engine: prompts x n engine requests (see the module's text)."""

    request_id: str
    prompts: list[Prompt]
    chunks: CompletionChunks | ChatChunks
    stream: bool
    include_usage: bool
    _outputs: list[AsyncIterator[RequestOutput]] = field(default_factory=list, repr=False)
    _pending: dict[asyncio.Future[RequestOutput], int] = field(default_factory=dict, repr=False)
    _parallel: list[ParallelSampling] = field(default_factory=list, repr=False)
    # Outputs taken from the engine and not yet handed on, as (choice index, output).
    _ready: deque[tuple[int, RequestOutput]] = field(default_factory=deque, repr=False)

    @property
    def n(self) -> int:
        """Choices per prompt."""
        return self.prompts[0].params.n

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p.token_ids) for p in self.prompts)

    def prompt_of(self, index: int) -> Prompt:
        return self.prompts[index // self.n]

    def usage_tally(self) -> UsageTally:
        return UsageTally(self.prompt_tokens, self.num_choices, self.n)

    def _child(self, index: int) -> tuple[str, SamplingParams]:
        """The engine id and params of choice `index`: vLLM's `<index>_<id>` when there are
        several, and with n > 1 a seed of its own (seed + choice), so that seeded choices
        differ yet reproduce."""
        params = self.prompt_of(index).params
        if self.num_choices == 1:
            return self.request_id, params
        engine_id = f"{index}_{self.request_id}"
        if self.n == 1:
            return engine_id, params
        seed = None if params.seed is None else params.seed + index % self.n
        return engine_id, replace(params, seed=seed, parallel=self._parallel[index // self.n])

    def validate(self, max_model_len: int) -> None:
        """Raise now what the engine would refuse on admission: for an answer generated later
        (a background response), whose client must still get the 400."""
        for prompt in self.prompts:
            validate_request(prompt.token_ids, prompt.params, max_model_len)

    async def start(self, engine: AsyncEngineClient) -> None:
        """Submit every choice and wait for the first output of any: the engine's admission
        errors are raised here (every choice aborted), before an answer's headers go out."""
        try:
            await self._start(engine)
        except DuplicateRequestError:
            # A caller reused an X-Request-Id still in flight: the engine's id must be unique,
            # the answer keeps the caller's (its chunks were made with it).
            await self.close()
            self.request_id = f"{self.request_id}-{uuid.uuid4().hex[:8]}"
            await self._start(engine)

    async def _start(self, engine: AsyncEngineClient) -> None:
        n = self.n
        self._parallel = [ParallelSampling(n, n) for _ in self.prompts] if n > 1 else []
        self._outputs = []
        self._ready.clear()  # a retry under a new id starts afresh
        for index in range(self.num_choices):
            engine_id, params = self._child(index)
            self._outputs.append(engine.generate(engine_id, self.prompt_of(index).token_ids, params))
        try:
            if self.num_choices == 1:
                self._ready.append((0, await anext(self._outputs[0])))
                return
            # Every choice at once: their prompts are prefilled together. Not all of them need
            # to have started: with few free sequence slots the later ones wait their turn.
            self._pending = {asyncio.ensure_future(anext(o)): i for i, o in enumerate(self._outputs)}
            done, _ = await asyncio.wait(self._pending, return_when=asyncio.FIRST_COMPLETED)
            self._take(done)
        except BaseException:
            await self.close()
            raise

    def _take(self, done: set[asyncio.Future[RequestOutput]]) -> None:
        """Move finished anext()s to the ready outputs; start the next one of each choice."""
        for future in sorted(done, key=self._pending.__getitem__):
            index = self._pending.pop(future)
            out = future.result()  # an engine error is raised here
            if not out.finished:
                self._pending[asyncio.ensure_future(anext(self._outputs[index]))] = index
            self._ready.append((index, out))

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Every output of every choice, as (choice index, output), in the order they come."""
        assert self._outputs, "start() first"
        if self.num_choices == 1:
            index, out = self._ready.popleft()
            yield index, out
            if not out.finished:
                async for out in self._outputs[0]:
                    yield 0, out
            return
        while self._ready or self._pending:
            while self._ready:
                yield self._ready.popleft()
            if self._pending:
                done, _ = await asyncio.wait(self._pending, return_when=asyncio.FIRST_COMPLETED)
                self._take(done)

    async def close(self) -> None:
        """Abort whatever choice has not finished (a no-op for finished ones)."""
        pending, self._pending = self._pending, {}
        for future in pending:
            future.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        outputs, self._outputs = self._outputs, []
        for out in outputs:
            aclose = getattr(out, "aclose", None)
            if aclose is not None:
                await aclose()
