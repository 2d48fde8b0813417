"""From a request body to a Generation: shared by the HTTP handlers and the WebSocket.

`GenerationFactory` validates a body, checks the model name, tokenizes and builds the
engine's `SamplingParams`; every problem raises an `APIError`/`ValidationError` before
the engine sees the request.
"""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import Callable
from functools import partial
from typing import ParamSpec, TypeVar

from inference_worker.engine.types import AsyncEngineClient, SamplingParams, TokenLogprobs
from inference_worker.server.chat_protocol import ChatCompletionRequest
from inference_worker.server.chunks import ChatChunks, CompletionChunks
from inference_worker.server.errors import invalid_request, model_not_found
from inference_worker.server.generation import Echo, Generation, Prompt
from inference_worker.server.protocol import CompletionRequest

# A caller's X-Request-Id becomes the request's id, as in vLLM (`chatcmpl-<id>`), so that a
# gateway's access log, the answer's `id` and this worker name the same request; else the body's
# `request_id` (vLLM's _base_request_id prefers the header too). Only ids of these characters:
# the id is written into every chunk's JSON as is.
_CALLER_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")

# Engine requests one API request may start (prompts of a batch x n): more is a 400.
MAX_CHOICES_PER_REQUEST = 1024


# Bodies up to this size are prepared (parsed, checked, tokenized) on the event loop: a few
# milliseconds at most. Larger ones in a thread: a prompt of megabytes takes seconds to tokenize
# (12 MB: 12 s with SmolLM2's tokenizer, which releases the GIL meanwhile), and on the loop
# every stream this worker serves would stop for as long.
INLINE_BODY_BYTES = 8 * 1024

P = ParamSpec("P")
T = TypeVar("T")


async def prepared(size: int, build: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """build(*args, **kwargs) for a body of `size` bytes: in a thread when it is large."""
    if size <= INLINE_BODY_BYTES:
        return build(*args, **kwargs)
    return await asyncio.to_thread(build, *args, **kwargs)


def caller_id(value: str | None) -> str | None:
    """`value` (an X-Request-Id header, a body's request_id) if it is usable as an id, else None."""
    return value if value is not None and _CALLER_ID.fullmatch(value) else None


def request_id_base(value: str | None) -> str:
    """The caller's id if it is usable as one, else a fresh one."""
    return caller_id(value) or uuid.uuid4().hex


class GenerationFactory:
    """Validates bodies for one served model and turns them into `Generation`s."""

    def __init__(self, engine: AsyncEngineClient, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def check_model(self, model: str | None) -> None:
        # No model named (absent, null or ""): the one served, as vLLM's _is_model_supported.
        if model and model != self.model_name:
            raise model_not_found(model)

    def completion(self, body: bytes | str, id_base: str | None = None) -> Generation:
        request = CompletionRequest.model_validate_json(body)
        return self.completion_from(request, id_base)

    def completion_from(self, request: CompletionRequest, id_base: str | None = None) -> Generation:
        self.check_model(request.model)
        texts_or_ids = request.prompts()
        if len(texts_or_ids) * request.n > MAX_CHOICES_PER_REQUEST:
            raise invalid_request(
                f"{len(texts_or_ids)} prompts x n={request.n} is more than {MAX_CHOICES_PER_REQUEST} "
                "answers in one request",
                param="prompt",
            )
        prompts = [self._completion_prompt(request, p) for p in texts_or_ids]
        request_id = f"cmpl-{id_base or request_id_base(request.request_id)}"
        choices = len(prompts) * request.n
        return Generation(
            request_id=request_id,
            prompts=prompts,
            chunks=CompletionChunks(request_id, self.model_name, request.continuous_usage, choices),
            stream=request.stream,
            include_usage=request.include_usage,
        )

    def _completion_prompt(self, request: CompletionRequest, prompt: str | list[int]) -> Prompt:
        tokenizer = self.engine.tokenizer
        if isinstance(prompt, str):
            prompt_ids = tokenizer.encode(prompt, add_special_tokens=request.add_special_tokens)
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
        echo = None
        if request.echo:
            # Special tokens kept, as vLLM echoes token ids (and as logprobs name every token):
            # the echoed text is then the prompt's tokens, text_offset counts them all.
            decode = partial(tokenizer.decode, skip_special_tokens=False)
            text = prompt if isinstance(prompt, str) else decode(prompt_ids)
            first = TokenLogprobs(decode(prompt_ids[:1]), None)
            echo = Echo(text, first, request.echo_only)
        return Prompt(prompt_ids, params, echo)

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
        tokenizer = self.engine.tokenizer
        prompt_ids = list(tokenizer.apply_chat_template(request.template_messages(), **request.rendering()))
        params = self._params(request, len(prompt_ids), "messages")
        request_id = f"chatcmpl-{id_base or request_id_base(request.request_id)}"
        echoed = request.echoed()
        echo = Echo(echoed) if echoed is not None else None
        return Generation(
            request_id=request_id,
            prompts=[Prompt(prompt_ids, params, echo)],
            chunks=ChatChunks(request_id, self.model_name, request.continuous_usage, params.n),
            stream=request.stream,
            include_usage=request.include_usage,
        )
