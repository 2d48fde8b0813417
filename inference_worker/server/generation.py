"""From a request body to engine outputs: shared by the HTTP handlers and the WebSocket.

`prepare_*` validates a body, checks the model name, tokenizes and builds the engine's
`SamplingParams`; every problem raises an `APIError`/`ValidationError` before the
engine sees the request. `Generation.start()` then starts the request in the engine
(one engine request per choice) and waits for its first output, so errors the engine
raises on admission (a `ValueError` subclass) still reach the client as a 4xx before
any byte of a stream was sent. `Generation.outputs()` then yields every choice's outputs.
`Generation.close()` aborts the request in the engine when the consumer stops early
(client disconnect, WebSocket cancel); it is a no-op once finished.
"""

from __future__ import annotations

import asyncio
import re
import uuid
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

from inference_worker.engine.errors import DuplicateRequestError
from inference_worker.engine.types import (
    AsyncEngineClient,
    ParallelSampling,
    RequestOutput,
    SamplingParams,
    TokenLogprobs,
)
from inference_worker.server.chunks import ChatChunks, CompletionChunks
from inference_worker.server.errors import invalid_request, model_not_found
from inference_worker.server.protocol import ChatCompletionRequest, CompletionRequest


@dataclass(frozen=True, slots=True)
class Echo:
    """Completions' echo: the prompt goes before each choice's answer."""

    text: str
    # The prompt's first token, in the logprobs (nothing predicts it: its logprob is None).
    first_token: TokenLogprobs
    # max_tokens 0: the prompt is the whole answer; the engine's one token is dropped.
    only: bool = False


@dataclass(slots=True)
class Generation:
    """One request on its way through the engine: one engine request per choice (n of them,
    as vLLM fans a request with n > 1 out into n child requests)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    chunks: CompletionChunks | ChatChunks
    stream: bool
    include_usage: bool
    echo: Echo | None = None
    _outputs: list[AsyncIterator[RequestOutput]] = field(default_factory=list, repr=False)
    _pending: dict[asyncio.Future[RequestOutput], int] = field(default_factory=dict, repr=False)
    _parallel: ParallelSampling | None = field(default=None, repr=False)
    # Outputs taken from the engine and not yet handed on, as (choice index, output).
    _ready: deque[tuple[int, RequestOutput]] = field(default_factory=deque, repr=False)

    @property
    def n(self) -> int:
        return self.params.n

    def _child(self, index: int) -> tuple[str, SamplingParams]:
        """The engine id and params of choice `index`: with n > 1, vLLM's `<index>_<id>` and a
        seed of its own (seed + index), so that seeded choices differ yet reproduce."""
        if self.n == 1:
            return self.request_id, self.params
        seed = None if self.params.seed is None else self.params.seed + index
        return f"{index}_{self.request_id}", replace(self.params, seed=seed, parallel=self._parallel)

    async def start(self, engine: AsyncEngineClient) -> RequestOutput:
        """Submit every choice and wait for the first output of any: the engine's admission
        errors are raised here (every choice aborted), before an answer's headers go out.
        Returns that output (it tells the prompt's size)."""
        try:
            return await self._start(engine)
        except DuplicateRequestError:
            # A caller reused an X-Request-Id still in flight: the engine's id must be unique,
            # the answer keeps the caller's (its chunks were made with it).
            await self.close()
            self.request_id = f"{self.request_id}-{uuid.uuid4().hex[:8]}"
            return await self._start(engine)

    async def _start(self, engine: AsyncEngineClient) -> RequestOutput:
        self._parallel = ParallelSampling(self.n, self.n) if self.n > 1 else None
        self._outputs = []
        self._ready.clear()  # a retry under a new id starts afresh
        for index in range(self.n):
            engine_id, params = self._child(index)
            self._outputs.append(engine.generate(engine_id, self.prompt_token_ids, params))
        try:
            if self.n == 1:
                first = await anext(self._outputs[0])
                self._ready.append((0, first))
                return first
            # Every choice at once: their prompts are prefilled together. Not all of them need
            # to have started: with few free sequence slots the later ones wait their turn.
            self._pending = {asyncio.ensure_future(anext(o)): i for i, o in enumerate(self._outputs)}
            done, _ = await asyncio.wait(self._pending, return_when=asyncio.FIRST_COMPLETED)
            self._take(done)
            return self._ready[0][1]
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
        if self.n == 1:
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


# A caller's X-Request-Id becomes the request's id, as in vLLM (`chatcmpl-<id>`), so that a
# gateway's access log, the answer's `id` and this worker name the same request. Only ids of
# these characters: the id is written into every chunk's JSON as is.
_CALLER_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def request_id_base(header: str | None) -> str:
    """The caller's id if it is usable as one, else a fresh one."""
    if header is not None and _CALLER_ID.fullmatch(header):
        return header
    return uuid.uuid4().hex


class GenerationFactory:
    """Validates bodies for one served model and turns them into `Generation`s."""

    def __init__(self, engine: AsyncEngineClient, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise model_not_found(model)

    def completion(self, body: bytes | str, id_base: str | None = None) -> Generation:
        request = CompletionRequest.model_validate_json(body)
        return self.completion_from(request, id_base)

    def completion_from(self, request: CompletionRequest, id_base: str | None = None) -> Generation:
        self.check_model(request.model)
        prompt = request.prompt_text_or_ids()
        tokenizer = self.engine.tokenizer
        if isinstance(prompt, str):
            prompt_ids = tokenizer.encode(prompt)
        else:
            prompt_ids = list(prompt)
            # An id outside the vocabulary would crash the model's embedding lookup.
            vocab_size = getattr(tokenizer, "vocab_size", None)
            if vocab_size is not None and max(prompt_ids) >= vocab_size:
                raise invalid_request(
                    f"prompt holds token id {max(prompt_ids)}, outside the vocabulary (size {vocab_size})",
                    param="prompt",
                )
        params = self._params(request, len(prompt_ids), "prompt")
        request_id = f"cmpl-{id_base or uuid.uuid4().hex}"
        echo = None
        if request.echo:
            text = prompt if isinstance(prompt, str) else tokenizer.decode(prompt_ids)
            first = TokenLogprobs(tokenizer.decode(prompt_ids[:1]), None)
            echo = Echo(text, first, request.echo_only)
        return Generation(
            request_id=request_id,
            prompt_token_ids=prompt_ids,
            params=params,
            chunks=CompletionChunks(request_id, self.model_name, request.continuous_usage, params.n),
            stream=request.stream,
            include_usage=request.include_usage,
            echo=echo,
        )

    def _params(
        self, request: CompletionRequest | ChatCompletionRequest, prompt_len: int, prompt_param: str
    ) -> SamplingParams:
        params = request.sampling_params(prompt_len, self.engine.max_model_len, prompt_param)
        vocab_size = getattr(self.engine.tokenizer, "vocab_size", None)
        if vocab_size is not None and any(t >= vocab_size for t, _ in params.logit_bias):
            raise invalid_request(
                f"logit_bias names a token id outside the vocabulary (size {vocab_size})",
                param="logit_bias",
            )
        return params

    def chat(self, body: bytes | str, id_base: str | None = None) -> Generation:
        request = ChatCompletionRequest.model_validate_json(body)
        return self.chat_from(request, id_base)

    def chat_from(self, request: ChatCompletionRequest, id_base: str | None = None) -> Generation:
        self.check_model(request.model)
        prompt_ids = self.engine.tokenizer.apply_chat_template(request.template_messages())
        params = self._params(request, len(prompt_ids), "messages")
        request_id = f"chatcmpl-{id_base or uuid.uuid4().hex}"
        return Generation(
            request_id=request_id,
            prompt_token_ids=list(prompt_ids),
            params=params,
            chunks=ChatChunks(request_id, self.model_name, request.continuous_usage, params.n),
            stream=request.stream,
            include_usage=request.include_usage,
        )
