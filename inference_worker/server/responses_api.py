"""`POST /v1/responses`: OpenAI's Responses API over the chat engine path, in vLLM's shapes.

Non-stream: one `response` object whose output is one assistant message. Stream: SSE with an
`event:` line per event, in vLLM's order: `response.created`, `response.in_progress`,
`response.output_item.added`, `response.content_part.added`, one
`response.output_text.delta` per engine output that carries text, `response.output_text.done`,
`response.content_part.done`, `response.output_item.done`, `response.completed` (whose
response holds the usage). As in vLLM, an answer cut by `max_output_tokens` is
`"status": "incomplete"` with `incomplete_details.reason` and still ends with
`response.completed`. An error after the stream started is an `error` event.

A finished response is stored when the request says `store` (the default) and the worker
keeps a store: `previous_response_id` continues it, `GET /v1/responses/{id}` returns it.
With `background` the answer is generated apart from the request (server/background.py):
`GET /v1/responses/{id}?stream=true` replays its events, and
`POST /v1/responses/{id}/cancel` stops it. As in vLLM, a synchronous response cannot be
cancelled (400) and an unknown one is a 404. `DELETE /v1/responses/{id}` forgets a response
(OpenAI's API), stopping it first if it still runs.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from inference_worker.engine.types import FinishReason, RequestOutput
from inference_worker.server.answer import engine_error
from inference_worker.server.background import LIVE_STATUSES, BackgroundRun
from inference_worker.server.clip import clip_repr
from inference_worker.server.errors import APIError, invalid_request
from inference_worker.server.generation import Generation
from inference_worker.server.openai_api import SSE_HEADERS, read_body, serve
from inference_worker.server.prepare import GenerationFactory, prepared, request_id_base
from inference_worker.server.response_store import ResponseStore, StoredResponse
from inference_worker.server.responses_protocol import ResponsesRequest, parse_request
from inference_worker.server.state import BACKGROUND, DRAIN, ENGINE, FACTORY, RESPONSES


async def responses(request: web.Request) -> web.StreamResponse:
    raw = await read_body(request)
    body = await prepared(len(raw), parse_request, raw)  # a large body in a thread (prepare.py)
    store = request.app[RESPONSES]
    if body.background and store.max_size <= 0:
        raise invalid_request("This worker keeps no responses (--responses-store-size 0), so it cannot "
                              "run background responses.", param="background")
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        history = store.get(body.previous_response_id, "previous_response_id").conversation()
    messages = body.conversation(history)  # what is stored: the instructions do not carry over
    id_base = request_id_base(request.headers.get("X-Request-Id"))
    factory = request.app[FACTORY]
    # Tokenized in a thread when large: a long stored conversation too, however small the body.
    size = len(raw) + sum(len(m["content"]) for m in history)
    gen = await prepared(size, _generation, factory, body, messages, id_base)
    # Unique whatever the caller's X-Request-Id (which names the engine request, for tracing):
    # a stored response's id must not be reused, and vLLM's ignores the header too.
    answer = ResponseAnswer(f"resp_{uuid.uuid4().hex}", factory.model_name, body)
    if body.background:
        return await _background(request, gen, answer, messages)
    if body.store:
        answer.keep_in(store, messages)
    return await serve(request, gen, answer)


def _generation(factory: GenerationFactory, body: ResponsesRequest, conversation: list[dict[str, Any]],
                id_base: str) -> Generation:
    """The chat generation that answers `body` (streams when the body asks to)."""
    chat = body.to_chat(body.messages(conversation))
    try:
        return factory.chat_from(chat, id_base)
    except APIError as err:
        raise _in_responses_terms(err) from None


# The chat request's names for the Responses fields it was built from: the client's 400 about
# its output length or its input names what it sent.
_RESPONSES_PARAMS = {"max_tokens": "max_output_tokens", "messages": "input"}


def _in_responses_terms(err: APIError) -> APIError:
    if err.param in _RESPONSES_PARAMS:
        err.param = _RESPONSES_PARAMS[err.param]
    # A Responses body has no max_tokens (responses_protocol drops one): any is its max_output_tokens.
    err.message = err.message.replace("max_tokens", "max_output_tokens")
    return err


async def _background(request: web.Request, gen: Generation, answer: ResponseAnswer,
                      messages: list[dict[str, Any]]) -> web.StreamResponse:
    """Store the response queued and generate it in a task of its own; answer with the queued
    response, or (`stream`) with its events while the client stays."""
    engine = request.app[ENGINE]
    request.app[DRAIN].admit()  # a stopping worker takes no new work (503)
    gen.validate(engine.max_model_len)  # a prompt the engine refuses is the client's 400 now
    run = BackgroundRun(answer.response("queued"))
    answer.keep_in(request.app[RESPONSES], messages, run)
    request.app[BACKGROUND].start(run, gen, answer, engine)
    if not gen.stream:
        return web.json_response(run.response)
    return await _replay(request, run, None)


async def _replay(request: web.Request, run: BackgroundRun, starting_after: int | None) -> web.StreamResponse:
    """A background response's events over SSE; a client that leaves does not stop it. A
    stopping worker owes the client the rest of the stream, as any other (drain)."""
    drain = request.app[DRAIN]
    response = web.StreamResponse(status=200, headers=SSE_HEADERS)
    drain.hold()
    try:
        await response.prepare(request)
        async for frame in run.replay(starting_after):
            await response.write(frame)
    except ConnectionError:
        pass
    finally:
        drain.release()
    return response


async def retrieve(request: web.Request) -> web.StreamResponse:
    """GET /v1/responses/{id}: the stored response; with `stream=true` (background responses
    only, as in vLLM) its events after `starting_after`, following it until it ends."""
    entry = request.app[RESPONSES].get(request.match_info["response_id"])
    if not _stream_query(request):
        return web.json_response(entry.response)
    if entry.run is None:
        raise invalid_request("Only background responses can be streamed again (stream=true).",
                              param="stream")
    if entry.run.events is None:
        raise invalid_request(f"The events of response '{entry.response['id']}' are no longer kept; "
                              "GET it without stream=true.", param="stream")
    return await _replay(request, entry.run, _starting_after(request))


# What vLLM's `stream: bool` query parameter takes (pydantic's words for a bool), any case.
_QUERY_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_QUERY_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})


def _stream_query(request: web.Request) -> bool:
    """`?stream=`: anything but "false" or "0" was taken for true, so `stream=no` replayed the
    events and `stream=maybe` was answered as a replay; vLLM refuses what is not a bool."""
    raw = request.query.get("stream")
    if raw is None or raw.lower() in _QUERY_FALSE:
        return False
    if raw.lower() in _QUERY_TRUE:
        return True
    raise invalid_request(f"stream must be true or false, got {clip_repr(raw)}", param="stream")


def _starting_after(request: web.Request) -> int | None:
    raw = request.query.get("starting_after")
    if raw is None:
        return None
    try:
        value: int | None = int(raw)
    except ValueError:
        value = None
    if value is None or value < -1:
        raise invalid_request(f"starting_after must be an event's sequence number, got {clip_repr(raw)}",
                              param="starting_after")
    return value


async def cancel(request: web.Request) -> web.Response:
    """POST /v1/responses/{id}/cancel: stops a background response that has not ended."""
    entry = request.app[RESPONSES].get(request.match_info["response_id"])  # a 404 when unknown
    if entry.run is None:
        raise APIError(400, "Cannot cancel a synchronous response.", param="response_id")
    if entry.response["status"] not in LIVE_STATUSES:
        raise APIError(400, f"Cannot cancel a response whose status is {entry.response['status']!r}.",
                       param="response_id")
    await entry.run.cancel()
    return web.json_response(entry.response)


async def delete(request: web.Request) -> web.Response:
    """DELETE /v1/responses/{id} (OpenAI's API; vLLM has none): the response is forgotten, and
    one still running in the background is stopped first, since nobody could retrieve it."""
    store = request.app[RESPONSES]
    response_id = request.match_info["response_id"]
    entry = store.get(response_id)  # a 404 when unknown
    if entry.run is not None and entry.response["status"] in LIVE_STATUSES:
        await entry.run.cancel()
    store.delete(response_id)  # after the cancel: an answer that ended meanwhile stored itself
    return web.json_response({"id": response_id, "object": "response", "deleted": True})


class ResponseAnswer:
    """Builds one request's response object and stream events (openai_api.StreamedAnswer)."""

    done = b""  # the Responses stream ends with response.completed, no [DONE]

    def __init__(self, response_id: str, model: str, request: ResponsesRequest) -> None:
        self.response_id = response_id
        self.item_id = f"msg_{uuid.uuid4().hex[:16]}"
        self.model = model
        self.request = request
        self.created_at = int(time.time())
        self._sequence = 0
        self._store: ResponseStore | None = None
        self._messages: list[dict[str, Any]] = []
        self._run: BackgroundRun | None = None

    def keep_in(self, store: ResponseStore, messages: list[dict[str, Any]],
                run: BackgroundRun | None = None) -> None:
        """Store the finished response, with the conversation it answered (and a background
        response from now on, queued)."""
        self._store = store
        self._messages = messages
        self._run = run
        if run is not None:
            store.put(StoredResponse(run.response, messages, run))

    def _finished(self, response: dict[str, Any]) -> dict[str, Any]:
        if self._store is not None:
            self._store.put(StoredResponse(response, self._messages, self._run))
        return response

    def response(self, status: str, text: str | None = None, last: RequestOutput | None = None,
                 prompt_tokens: int = 0) -> dict[str, Any]:
        """The response object: in progress (no output yet), or ended by `last`."""
        incomplete = last is not None and last.finish_reason is FinishReason.LENGTH
        output = [] if text is None else [self.message(text, "completed")]
        usage = None
        if last is not None:
            usage = {
                "input_tokens": prompt_tokens,
                "input_tokens_details": {"cached_tokens": last.num_cached_tokens},
                "output_tokens": last.num_output_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": prompt_tokens + last.num_output_tokens,
            }
        return {
            "id": self.response_id,
            "created_at": self.created_at,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "model": self.model,
            "object": "response",
            "output": output,
            **self.request.echoed_fields(),
            "status": "incomplete" if incomplete else status,
            "usage": usage,
        }

    def message(self, text: str, status: str) -> dict[str, Any]:
        content = [] if status == "in_progress" else [self.text_part(text)]
        return {"id": self.item_id, "content": content, "role": "assistant", "status": status,
                "type": "message"}

    @staticmethod
    def text_part(text: str) -> dict[str, Any]:
        return {"annotations": [], "text": text, "type": "output_text", "logprobs": None}

    async def whole(self, gen: Generation) -> dict[str, Any]:
        texts: list[str] = []
        last: RequestOutput | None = None
        async for _, out in gen.outputs():
            texts.append(out.text)
            last = out
        assert last is not None  # a started generation ends with a finished output
        _check(last)
        return self._finished(self.response("completed", "".join(texts), last, gen.prompt_tokens))

    async def events(self, gen: Generation) -> AsyncIterator[str]:
        yield self._event("response.created", response=self.response("in_progress"))
        yield self._event("response.in_progress", response=self.response("in_progress"))
        where = {"item_id": self.item_id, "output_index": 0}
        yield self._event("response.output_item.added", item=self.message("", "in_progress"), output_index=0)
        yield self._event("response.content_part.added", content_index=0, **where, part=self.text_part(""))
        texts: list[str] = []
        last: RequestOutput | None = None
        async for _, out in gen.outputs():
            last = out
            _check(out)
            if out.text:
                texts.append(out.text)
                yield self._event("response.output_text.delta", content_index=0, delta=out.text,
                                  **where, logprobs=[])
        assert last is not None
        text = "".join(texts)
        yield self._event("response.output_text.done", content_index=0, **where, logprobs=[], text=text)
        yield self._event("response.content_part.done", content_index=0, **where, part=self.text_part(text))
        yield self._event("response.output_item.done", item=self.message(text, "completed"), output_index=0)
        final = self._finished(self.response("completed", text, last, gen.prompt_tokens))
        yield self._event("response.completed", response=final)

    @staticmethod
    def frame(event: str) -> bytes:
        return event.encode()  # events() writes whole SSE events

    def error_event(self, err: APIError) -> bytes:
        """OpenAI's `error` event: `type` "error" (an SDK picks the event's model by it, so the
        error's own type must not take its place), the stream's next sequence number, and a
        string code (the error's type when it has no code)."""
        return self._event("error", code=err.code or err.type, message=err.message,
                           param=err.param).encode()

    def _event(self, kind: str, **fields: Any) -> str:
        data = {**fields, "sequence_number": self._sequence, "type": kind}
        self._sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'), ensure_ascii=False)}\n\n"


def _check(out: RequestOutput) -> None:
    if out.finished and out.finish_reason is FinishReason.ERROR:
        raise engine_error(out)
