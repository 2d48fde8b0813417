"""A started Generation's answer, whole or as chunks: shared by SSE and the WebSocket.

`answer_chunks` yields the JSON chunks of a stream in order (each choice's opening chunk,
then one chunk per engine output that carries text or logprobs, each choice's last
chunk with its finish reason, then the usage chunk when asked for); `answer_body` waits
for every choice and builds the non-stream body. An engine failure raises an APIError
(a 500) from either: before any byte, the client gets it as the response; mid-stream,
as an error event.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from inference_worker.engine.types import FinishReason, RequestOutput, TokenLogprobs
from inference_worker.server.chunks import UsageTally
from inference_worker.server.errors import APIError
from inference_worker.server.generation import Generation


def engine_error(out: RequestOutput) -> APIError:
    return APIError(500, f"The engine failed while generating request {out.request_id}.", type="server_error")


async def answer_chunks(gen: Generation) -> AsyncIterator[str]:
    """gen: started."""
    chunks = gen.chunks
    tally = gen.usage_tally()
    for index in range(gen.num_choices):
        opening = chunks.first(index, tally)
        if opening:
            yield opening
    async for index, out in gen.outputs():
        chunk = _chunk(gen, index, out, tally)
        if chunk:
            yield chunk
    if gen.include_usage:
        yield chunks.usage(tally)


def _chunk(gen: Generation, index: int, out: RequestOutput, tally: UsageTally) -> str | None:
    tally.update(index, out)
    text, logprobs = _content(gen, index, out)
    if out.finished:
        if out.finish_reason is FinishReason.ERROR:
            raise engine_error(out)
        return gen.chunks.delta(text, out.finish_reason, logprobs, index, tally)
    # A step can yield no text (an incomplete UTF-8 sequence, or what may begin a stop
    # string, is held back); its token's logprobs still go out.
    if text or logprobs:
        return gen.chunks.delta(text, None, logprobs, index, tally)
    return None


def _content(
    gen: Generation, index: int, out: RequestOutput
) -> tuple[str, list[TokenLogprobs] | None]:
    """An output's text and logprobs as the answer shows them: with echo, a choice's first
    output (the one that carries prompt_logprobs, when asked) begins with its prompt."""
    echo = gen.prompt_of(index).echo
    if echo is None:
        return out.text, out.logprobs
    text, logprobs = ("", None) if echo.only else (out.text, out.logprobs)
    if out.num_output_tokens == 1 and out.token_ids:  # the choice's first token
        text = echo.text + text
        if out.prompt_logprobs is not None and echo.first_token is not None:
            logprobs = [echo.first_token, *out.prompt_logprobs, *(logprobs or ())]
    return text, logprobs


async def answer_body(gen: Generation) -> dict[str, Any]:
    count = gen.num_choices
    texts: list[list[str]] = [[] for _ in range(count)]
    logprobs: list[list[TokenLogprobs]] = [[] for _ in range(count)]
    lasts: list[RequestOutput | None] = [None] * count
    prompt_logprobs: list[list[TokenLogprobs]] = [[] for _ in range(count)]
    async for index, out in gen.outputs():
        text, lps = _content(gen, index, out)
        texts[index].append(text)
        logprobs[index].extend(lps or ())
        lasts[index] = out
        if out.prompt_logprobs is not None:
            prompt_logprobs[index] = out.prompt_logprobs
    ended = [last for last in lasts if last is not None]  # all of them: outputs() ran to the end
    for last in ended:
        if last.finish_reason is FinishReason.ERROR:
            raise engine_error(last)
    wanted = gen.prompts[0].params.logprobs is not None
    texts_joined = ["".join(t) for t in texts]
    body = gen.chunks.full(texts_joined, ended, gen.usage_tally(), logprobs if wanted else None)
    if gen.prompts[0].params.prompt_logprobs is not None:
        gen.chunks.add_prompt_logprobs(body, prompt_logprobs)
    return body
