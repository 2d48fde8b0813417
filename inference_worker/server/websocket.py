"""`GET /v1/ws`: the completions and chat APIs over one WebSocket.

Framing (every frame is a JSON text message):

Client -> server
  * A request: a /v1/completions or /v1/chat/completions body. The optional field
    `"endpoint"` picks the API (`"completions"` or `"chat.completions"`, the paths
    `"/v1/completions"` and `"/v1/chat/completions"` work too); without it, a body
    with `"messages"` is chat and any other body is completions. Answers are always
    streamed (`"stream"` is ignored); `"stream_options": {"include_usage": true}`
    adds the usage chunk as over SSE.
  * `{"type": "cancel"}`: abort the request being answered (its KV blocks are freed).
  * A binary message is no request: it is answered, in its turn, with an error.
Requests on one socket are answered one after the other, in order; requests sent
while one is being answered wait their turn (at most 64 queued). One more than that is
answered at once with a 429 error, out of its turn (it may come inside the answer
streaming): the bound that keeps a socket's memory bounded; a client that keeps at most 64
requests in flight never meets it.
Closing the socket aborts the request being answered.
A worker that is shutting down answers the requests a socket has already sent, refuses
new ones (error `shutting_down`), and then closes the socket with code 1001 (going away):
the client reconnects, through a router to another worker. Each refusal comes in its
turn, after the answers owed before it (at once when none is owed); one past the 64
queued comes at once, as the 429 does.

Server -> client, for each request, in order
  * the chunk objects of the SSE stream, one per message (`chat.completion.chunk`
    or `text_completion` objects, the usage chunk last when asked for);
  * then exactly one terminal message:
      `{"type": "done", "id": "<request id>"}` after the last chunk, or
      `{"type": "done", "id": "<request id>", "cancelled": true}` after a cancel, or
      an OpenAI error object `{"error": {"message", "type", "param", "code"}}`
      (bad JSON, validation errors, unknown model, prompt too long, engine failure).
The socket stays open and usable after an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import dataclass

from aiohttp import WSCloseCode, WSMsgType, web
from pydantic_core import from_json

from inference_worker.engine.types import AsyncEngineClient
from inference_worker.server.answer import answer_chunks
from inference_worker.server.chat_protocol import ChatCompletionRequest
from inference_worker.server.clip import clip_repr
from inference_worker.server.drain import Drain
from inference_worker.server.errors import APIError, exception_to_api_error, invalid_request, shutting_down
from inference_worker.server.generation import Generation
from inference_worker.server.prepare import GenerationFactory, prepared
from inference_worker.server.protocol import CompletionRequest
from inference_worker.server.state import DRAIN, ENGINE, FACTORY

logger = logging.getLogger("inference_worker.server")

MAX_QUEUED_REQUESTS = 64
_CHAT = {"chat.completions", "chat", "/v1/chat/completions", "v1/chat/completions"}
_COMPLETIONS = {"completions", "/v1/completions", "v1/completions"}


def generation_from_message(factory: GenerationFactory, text: str) -> Generation:
    """Parse one client message into a streamed Generation (raises APIError / ValidationError)."""
    try:
        # The parser the HTTP path validates with (pydantic's): json.loads took a lone surrogate
        # ("\\ud800"), which then failed in the tokenizer ("'utf-8' codec can't encode ..."),
        # or looked a model name up; and met deep nesting with a RecursionError.
        body = from_json(text)
    except ValueError as exc:
        raise invalid_request(f"Invalid JSON message: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise invalid_request("a message must be a JSON object (a completions or chat request body)")
    endpoint = body.get("endpoint")
    if endpoint is None:
        endpoint = "chat.completions" if "messages" in body else "completions"
    body["stream"] = True
    if not isinstance(endpoint, str):
        raise invalid_request("endpoint must be 'completions' or 'chat.completions'", param="endpoint")
    if endpoint in _CHAT:
        return factory.chat_from(ChatCompletionRequest.model_validate(body))
    if endpoint in _COMPLETIONS:
        return factory.completion_from(CompletionRequest.model_validate(body))
    raise invalid_request(
        f"unknown endpoint {clip_repr(endpoint)}: use 'completions' or 'chat.completions'", param="endpoint"
    )


@dataclass(slots=True)
class _Current:
    task: asyncio.Task[None] | None = None
    request_id: str | None = None
    cancel_requested: bool = False
    # Messages queued and not yet fully answered (the one being answered included, until its
    # terminal is out): a refusal goes out at once only when this is 0, else in its turn.
    owed: int = 0


# What the socket's queue holds: a request's text, a binary message (refused in its turn),
# or a refusal decided when the message came (the worker was draining), sent in its turn.
_Queued = str | bytes | APIError


async def websocket_handler(request: web.Request) -> web.WebSocketResponse:
    ws = web.WebSocketResponse(heartbeat=30.0, max_msg_size=16 * 1024 * 1024)
    await ws.prepare(request)
    queue: asyncio.Queue[_Queued] = asyncio.Queue(maxsize=MAX_QUEUED_REQUESTS)
    current = _Current()
    drain = request.app[DRAIN]
    worker = asyncio.create_task(_answer_in_order(request.app, ws, queue, current))
    try:
        async for msg in ws:
            if msg.type not in (WSMsgType.TEXT, WSMsgType.BINARY):
                await _send_error(ws, invalid_request("send JSON text messages, not binary ones"))
                continue
            # A binary message is refused in its turn, as a request (_answer): refused at once,
            # its error came inside the answer streaming then, and a client that pairs each
            # answer's end with its requests in order took it for that answer's end.
            if msg.type is WSMsgType.TEXT and _is_cancel(msg.data):
                if current.task is not None and not current.task.done():
                    current.cancel_requested = True
                    current.task.cancel()
                continue
            item: _Queued = msg.data
            if drain.draining:
                # Refused in its turn, after the answers owed before it: refused at once, its
                # error came inside the answer streaming, and a client pairing each answer's
                # end with its requests in order took it for that answer's end. Held in the
                # drain as a request is, so the worker does not stop before it is out.
                item = shutting_down()
                if current.owed == 0 or queue.full():
                    await _send_error(ws, item)  # nothing owed before it; or past the bound
                    continue
            try:
                queue.put_nowait(item)
            except asyncio.QueueFull:
                await _send_error(
                    ws, APIError(429, f"more than {MAX_QUEUED_REQUESTS} requests queued on this socket")
                )
            else:
                current.owed += 1
                drain.hold()
    finally:
        worker.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await worker
    return ws


def _is_cancel(text: str) -> bool:
    # Cheap pre-check: request bodies are never this short and never start with {"type".
    if len(text) > 64 or '"cancel"' not in text:
        return False
    try:
        body = json.loads(text)
    except json.JSONDecodeError:
        return False
    return isinstance(body, dict) and body.get("type") == "cancel" and len(body) == 1


async def _answer_in_order(
    app: web.Application, ws: web.WebSocketResponse, queue: asyncio.Queue[_Queued], current: _Current
) -> None:
    drain = app[DRAIN]
    try:
        while True:
            text = await _next_request(queue, drain)
            if text is None:  # the worker is stopping and this socket has nothing left to answer
                await ws.close(code=WSCloseCode.GOING_AWAY, message=b"the worker is shutting down")
                return
            try:
                current.cancel_requested = False
                current.request_id = None
                current.task = asyncio.create_task(_answer(app, ws, text, current))
                # wait() (not await) so cancelling this worker does not hand the cancel to the
                # request twice; the finally below cancels it once.
                await asyncio.wait({current.task})
                if current.task.cancelled() and current.cancel_requested and not ws.closed:
                    done = {"type": "done", "id": current.request_id, "cancelled": True}
                    await ws.send_str(json.dumps(done))
            finally:
                current.owed -= 1
                drain.release()
    finally:
        drain.release(queue.qsize())  # the socket closed with these still queued
        if current.task is not None and not current.task.done():
            current.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await current.task


async def _next_request(queue: asyncio.Queue[_Queued], drain: Drain) -> _Queued | None:
    """The socket's next request; None once the worker drains and none is queued."""
    if not queue.empty():
        return queue.get_nowait()
    if drain.draining:
        return None
    getter = asyncio.ensure_future(queue.get())
    begun = asyncio.ensure_future(drain.begun.wait())
    try:
        await asyncio.wait({getter, begun}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        begun.cancel()
        if not getter.done():
            getter.cancel()
    if getter.done() and not getter.cancelled():
        return getter.result()
    return None if queue.empty() else queue.get_nowait()


async def _answer(
    app: web.Application, ws: web.WebSocketResponse, text: _Queued, current: _Current
) -> None:
    engine: AsyncEngineClient = app[ENGINE]
    gen: Generation | None = None
    if isinstance(text, APIError):  # a refusal waiting for its turn
        await _send_error(ws, text)
        return
    try:
        if isinstance(text, bytes):
            raise invalid_request("send JSON text messages, not binary ones")
        gen = await prepared(len(text), generation_from_message, app[FACTORY], text)
        current.request_id = gen.request_id
        await gen.start(engine)
        async for chunk in answer_chunks(gen):
            await ws.send_str(chunk)
        await ws.send_str(json.dumps({"type": "done", "id": gen.request_id}))
    except ConnectionError:
        return  # the socket is gone; the finally aborts the request
    except Exception as exc:
        await _send_error(ws, exception_to_api_error(exc))
    finally:
        if gen is not None:
            await gen.close()


async def _send_error(ws: web.WebSocketResponse, err: APIError) -> None:
    if ws.closed:
        return
    with contextlib.suppress(ConnectionError):
        await ws.send_str(json.dumps(err.body()))
