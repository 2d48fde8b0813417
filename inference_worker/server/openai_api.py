"""HTTP handlers of the OpenAI API: /v1/completions, /v1/chat/completions, /v1/models,
and vLLM's /tokenize and /detokenize.

Streaming is SSE: one `data: {chunk}` event per engine output, then `data: [DONE]`.
The response headers go out with the first token: the request is started in the
engine first, so admission errors are still a clean 4xx. An error after the stream
started is sent as a `data: {"error": ...}` event followed by `data: [DONE]`
(vLLM does the same). A client that disconnects cancels the handler (the app runs
with `handler_cancellation=True`) or fails the next write; either way the engine
request is aborted and its KV blocks are freed at the next step.
`serve` also answers the Responses API (responses_api.py), which frames its events its own way.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any, Protocol

from aiohttp import web

from inference_worker.engine.types import AsyncEngineClient
from inference_worker.server.answer import answer_body, answer_chunks
from inference_worker.server.chat_protocol import DetokenizeRequest, TokenizeRequest
from inference_worker.server.errors import APIError, exception_to_api_error
from inference_worker.server.generation import Generation
from inference_worker.server.http_errors import logger as http_logger
from inference_worker.server.prepare import GenerationFactory, caller_id, prepared
from inference_worker.server.receive_timeout import read_body_within
from inference_worker.server.state import DRAIN, ENGINE, FACTORY, RECEIVE_TIMEOUT_S

SSE_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # proxies (nginx) must not buffer the stream
}
_DONE = "data: [DONE]\n\n"
# The most ids one /detokenize decodes. vLLM has no cap, but the tokenizer's decode holds the
# GIL throughout (~0.2 s per million ids here), so even in a thread a longer list would stop
# the event loop and every stream; no model's context comes near it.
MAX_DETOKENIZE_TOKENS = 1 << 20


async def read_body(request: web.Request) -> bytes:
    """Every route's request body, read with no pause of --request-receive-timeout-ms and no
    slower than a floor past it (else a 408, the connection closed: server/receive_timeout.py,
    errors.py error_middleware)."""
    return await read_body_within(request, request.app[RECEIVE_TIMEOUT_S], http_logger)


async def completions(request: web.Request) -> web.StreamResponse:
    factory: GenerationFactory = request.app[FACTORY]
    # The header's id; without a usable one, the body's request_id (prepare.py).
    id_base = caller_id(request.headers.get("X-Request-Id"))
    body = await read_body(request)
    return await serve(request, await prepared(len(body), factory.completion, body, id_base))


async def chat_completions(request: web.Request) -> web.StreamResponse:
    factory: GenerationFactory = request.app[FACTORY]
    id_base = caller_id(request.headers.get("X-Request-Id"))
    body = await read_body(request)
    return await serve(request, await prepared(len(body), factory.chat, body, id_base))


class ChunkedAnswer:
    """How chat and completions answer: answer.py's body, or its chunks as `data:` events
    ended by `data: [DONE]`. The Responses API has its own (responses_api.ResponseAnswer)."""

    done = _DONE.encode()
    whole = staticmethod(answer_body)
    events = staticmethod(answer_chunks)

    @staticmethod
    def frame(chunk: str) -> bytes:
        return f"data: {chunk}\n\n".encode()

    @staticmethod
    def error_event(err: APIError) -> bytes:
        return f"data: {json.dumps(err.body())}\n\n{_DONE}".encode()


class StreamedAnswer(Protocol):
    done: bytes

    async def whole(self, gen: Generation) -> dict[str, Any]: ...

    def events(self, gen: Generation) -> AsyncIterator[str]: ...

    def frame(self, event: str) -> bytes: ...

    def error_event(self, err: APIError) -> bytes: ...


CHUNKED = ChunkedAnswer()


async def serve(
    request: web.Request, gen: Generation, answer: StreamedAnswer = CHUNKED
) -> web.StreamResponse:
    engine: AsyncEngineClient = request.app[ENGINE]
    with request.app[DRAIN].request():  # a stopping worker refuses it (503) or finishes it
        await gen.start(engine)  # admission errors propagate to the middleware as 4xx
        try:
            if gen.stream:
                return await _stream(request, gen, answer)
            return web.json_response(await answer.whole(gen))
        finally:
            await gen.close()  # aborts in the engine unless the request already finished


async def _stream(request: web.Request, gen: Generation, answer: StreamedAnswer) -> web.StreamResponse:
    response = web.StreamResponse(status=200, headers=SSE_HEADERS)
    await response.prepare(request)
    frame = answer.frame
    try:
        async for event in answer.events(gen):
            await response.write(frame(event))
        if answer.done:
            await response.write(answer.done)
        if request.app[DRAIN].draining:
            response.force_close()  # begun before the drain: no next request on this connection
    except ConnectionError:
        return response  # the client went away; `serve` aborts the request
    except Exception as exc:
        try:
            await response.write(answer.error_event(exception_to_api_error(exc)))
        except ConnectionError:
            pass
    return response


async def models(request: web.Request) -> web.Response:
    engine: AsyncEngineClient = request.app[ENGINE]
    name = request.app[FACTORY].model_name
    return web.json_response(
        {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "inference-worker",
                    "root": name,
                    "parent": None,
                    "max_model_len": engine.max_model_len,
                    "permission": [],
                }
            ],
        }
    )


async def tokenize(request: web.Request) -> web.Response:
    """vLLM's /tokenize: `{"prompt": str}` or `{"messages": [...]}` -> tokens, count, max_model_len."""
    raw = await read_body(request)
    answer = await prepared(len(raw), _tokenize_answer, request.app[FACTORY], raw)
    return _json_answer(answer)


def _tokenize_answer(factory: GenerationFactory, raw: bytes) -> bytes:
    tokens = _tokens(factory, raw)
    length = factory.engine.max_model_len
    return _json_bytes({"count": len(tokens), "max_model_len": length, "tokens": tokens, "token_strs": None})


def _tokens(factory: GenerationFactory, raw: bytes) -> list[int]:
    body = TokenizeRequest.model_validate_json(raw)
    factory.check_model(body.model)
    tokenizer = factory.engine.tokenizer
    if body.messages is not None:
        messages = [m.as_template_message() for m in body.messages]
        return tokenizer.apply_chat_template(messages, **body.rendering())
    return tokenizer.encode(body.prompt or "", add_special_tokens=body.prompt_special_tokens())


async def detokenize(request: web.Request) -> web.Response:
    """vLLM's /detokenize: `{"tokens": [...]}` -> the text. A large list is parsed, checked and
    decoded in a thread, as vLLM does (4M ids held the loop 2.6 s here, every stream stopped)."""
    raw = await read_body(request)
    return _json_answer(await prepared(len(raw), _detokenize_answer, request.app[FACTORY], raw))


def _detokenize_answer(factory: GenerationFactory, raw: bytes) -> bytes:
    body = DetokenizeRequest.model_validate_json(raw)
    factory.check_model(body.model)
    if len(body.tokens) > MAX_DETOKENIZE_TOKENS:
        raise APIError(
            400,
            f"tokens holds {len(body.tokens)} ids; /detokenize takes at most {MAX_DETOKENIZE_TOKENS} "
            "at once (split the list)",
            param="tokens",
        )
    tokenizer = factory.engine.tokenizer
    vocab_size = getattr(tokenizer, "vocab_size", None)
    if vocab_size is not None and body.tokens and (min(body.tokens) < 0 or max(body.tokens) >= vocab_size):
        raise APIError(400, f"token ids must be in [0, {vocab_size})", param="tokens")
    # vLLM's keeps special tokens: the text tokenizes back to the same ids.
    return _json_bytes({"prompt": tokenizer.decode(body.tokens, skip_special_tokens=False)})


def _json_bytes(answer: dict[str, Any]) -> bytes:
    """Encoded where the answer is built (a thread, for a large one): megabytes of ids or
    text take a while to encode too."""
    return json.dumps(answer).encode()


def _json_answer(body: bytes) -> web.Response:
    return web.Response(body=body, content_type="application/json")
