"""A streamed request (stream: true) that a worker answers with a plain JSON 200 instead of an
event stream (an engine that ignores the flag, or answers some requests or errors so).

The client gets the stream it asked for (an OpenAI SDK reads the answer, not an empty stream),
and the gateway counts it as the answer it is: its tokens from the worker's usage, its status
(an error in a 200's body is that error, in the OpenAI shape). A stand-in worker answers; the
gateway runs as a real process in front of it (round robin over --workers, no scheduler)."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from aiohttp import web

from tests.router.procs import series_value, start_gateway
from tests.router.stand_ins import serve_stand_in

USAGE = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}
COMPLETION = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
              "choices": [{"index": 0, "text": " a b c", "logprobs": None, "finish_reason": "stop"}],
              "usage": USAGE}
CHAT = {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
        "choices": [{"index": 0, "finish_reason": "tool_calls", "logprobs": None, "message": {
            "role": "assistant", "content": "a b c", "tool_calls": [{
                "id": "call_1", "type": "function",
                "function": {"name": "f", "arguments": "{\"x\": 1}"}}]}}],
        "usage": USAGE}
ERROR_IN_200 = {"object": "error", "message": "prompt too long", "type": "BadRequestError",
                "param": None, "code": 400}


async def _completion(request: web.Request) -> web.Response:
    body = await request.json()
    return web.json_response(ERROR_IN_200 if body["prompt"] == "fail" else COMPLETION)


async def _chat(_request: web.Request) -> web.Response:
    return web.json_response(CHAT)


@pytest.fixture
async def gateway():
    worker, url = await serve_stand_in([("POST", "/v1/completions", _completion),
                                        ("POST", "/v1/chat/completions", _chat)])
    g, gu = await asyncio.to_thread(start_gateway, "--workers", url)
    try:
        yield gu, url
    finally:
        g.stop()
        await worker.cleanup()


def _counted(gw: str, worker: str) -> dict[str, float]:
    return {
        "ok": series_value(gw, f'router_requests_total{{model="m",status="200",worker="{worker}"}}', 0),
        "bad": series_value(gw, f'router_requests_total{{model="m",status="400",worker="{worker}"}}', 0),
        "prompt": series_value(gw, 'router_prompt_tokens_total{model="m"}', 0),
        "output": series_value(gw, 'router_generation_tokens_total{model="m"}', 0),
    }


async def test_a_whole_answer_to_a_stream_is_streamed_and_counted(gateway):
    gw, worker = gateway
    async with httpx.AsyncClient(timeout=30) as client:
        r = await client.post(gw + "/v1/completions", json={"model": "m", "prompt": "x", "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [line[len("data: "):] for line in r.text.split("\n\n") if line]
    assert events[-1] == "[DONE]" and len(events) == 2  # no usage chunk: the client asked none
    assert '"text":" a b c"' in events[0] and '"usage"' not in events[0]
    assert _counted(gw, worker) == {"ok": 1, "bad": 0, "prompt": 7, "output": 3}


async def test_an_openai_client_reads_a_whole_chat_answer_as_its_stream(gateway):
    gw, _ = gateway
    client = openai.AsyncOpenAI(base_url=gw + "/v1", api_key="unused", max_retries=0)
    chunks = [chunk async for chunk in await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], stream=True,
        stream_options={"include_usage": True})]
    assert chunks[0].object == "chat.completion.chunk"
    delta = chunks[0].choices[0].delta
    assert delta.content == "a b c" and delta.tool_calls[0].index == 0
    assert delta.tool_calls[0].function.arguments == '{"x": 1}'
    assert chunks[0].choices[0].finish_reason == "tool_calls"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3


async def test_an_error_in_a_200_reaches_a_stream_as_that_error_and_counts_so(gateway):
    gw, worker = gateway
    async with httpx.AsyncClient(timeout=30) as client:
        r = await client.post(gw + "/v1/completions",
                              json={"model": "m", "prompt": "fail", "stream": True})
    assert r.status_code == 400
    assert r.json() == {"error": {"message": "prompt too long", "type": "BadRequestError",
                                  "param": None, "code": 400}}
    counted = _counted(gw, worker)
    assert counted["bad"] == 1 and counted["ok"] == 0
