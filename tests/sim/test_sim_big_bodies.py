"""A request body of megabytes does not stop the other streams of a real sim worker.

Parsing and tokenizing such a body takes the worker a good part of a second (seconds with the
real model's tokenizer). Done on the event loop, every stream the worker served paused for as
long: the longest pause of a stream running beside the big request was about that request's
whole time. It is compared with that time, measured in the same run, not with a fixed bound.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Awaitable, Callable

import aiohttp
import httpx
import pytest

from tests.worker.conftest import launch_worker

MODEL = "tiny-sim"
# ~700k tokens for the sim's tokenizer: ~0.5 s of work, far beyond the 512-token context.
HUGE_TEXT = "hello world " * 350_000


@pytest.fixture(scope="module")
def worker():
    with launch_worker("--backend", "sim", "--sim-profile", "tiny", model=MODEL) as w:
        yield w


async def _huge_completion(base_url: str) -> dict:
    body = json.dumps({"model": MODEL, "prompt": HUGE_TEXT, "max_tokens": 1}).encode()
    async with httpx.AsyncClient(timeout=120) as client:
        return (await client.post(f"{base_url}/v1/completions", content=body)).json()


async def _huge_chat(base_url: str) -> dict:
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": HUGE_TEXT}]}).encode()
    async with httpx.AsyncClient(timeout=120) as client:
        return (await client.post(f"{base_url}/v1/chat/completions", content=body)).json()


async def _huge_tokenize(base_url: str) -> dict:
    body = json.dumps({"model": MODEL, "prompt": HUGE_TEXT}).encode()
    async with httpx.AsyncClient(timeout=120) as client:
        return (await client.post(f"{base_url}/tokenize", content=body)).json()


async def _huge_response(base_url: str) -> dict:
    body = json.dumps({"model": MODEL, "input": [{"role": "user", "content": HUGE_TEXT}]}).encode()
    async with httpx.AsyncClient(timeout=120) as client:
        return (await client.post(f"{base_url}/v1/responses", content=body)).json()


async def _huge_over_websocket(base_url: str) -> dict:
    message = json.dumps({"model": MODEL, "prompt": HUGE_TEXT, "max_tokens": 1})
    async with aiohttp.ClientSession() as session, session.ws_connect(f"{base_url}/v1/ws") as ws:
        await ws.send_str(message)
        return json.loads((await ws.receive(timeout=120)).data)


@pytest.mark.parametrize("send_huge", [_huge_completion, _huge_chat, _huge_tokenize, _huge_response,
                                       _huge_over_websocket])
async def test_a_huge_body_does_not_pause_the_other_streams(
    worker, send_huge: Callable[[str], Awaitable[dict]]
) -> None:
    arrivals: list[float] = []

    async def stream() -> None:
        body = {"model": MODEL, "prompt": "Once", "max_tokens": 400, "ignore_eos": True, "stream": True}
        async with httpx.AsyncClient(timeout=120) as client, client.stream(
            "POST", f"{worker.base_url}/v1/completions", json=body
        ) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    arrivals.append(time.monotonic())

    streaming = asyncio.create_task(stream())
    for _ in range(200):  # until the stream is under way (bounded: 10 s)
        if len(arrivals) >= 5:
            break
        await asyncio.sleep(0.05)
    assert len(arrivals) >= 5, "the stream never started"
    start = time.monotonic()
    answer = await send_huge(worker.base_url)
    end = time.monotonic()
    await asyncio.wait_for(streaming, 60)

    # Refused for its length (tokenize counts it), after the whole text was tokenized.
    assert answer.get("count", 0) > 512 or answer["error"]["code"] == "context_length_exceeded", answer
    assert arrivals[-1] > end, "the stream ended before the big request did: nothing was measured"
    pauses = [b - a for a, b in itertools.pairwise(arrivals) if b > start and a < end]
    assert max(pauses) < (end - start) / 3, (max(pauses), end - start)
