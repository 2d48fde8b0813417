"""A client that reads its stream slower than its worker writes it, through a real scheduler and
gateway on 127.0.0.1 (the worker is a stand-in that writes a 24 MB chat stream at once): the
gateway holds back (TCP backpressure) and the stream arrives whole. The idle-stream timeout
is about the worker going silent; a client that pauses is no failure of the worker's."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
from aiohttp import web

from tests.router.stand_ins import open_leases, stand_ins_behind_router, until

CHUNKS = 400
CONTENT = "x" * 60_000  # 400 of these: far more than the sockets between client and worker buffer


async def _fast_stream(request: web.Request) -> web.StreamResponse:
    await request.read()
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for _ in range(CHUNKS):
        chunk = {"id": "c", "object": "chat.completion.chunk",
                 "choices": [{"index": 0, "delta": {"content": CONTENT}}]}
        await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
    await resp.write(b"data: [DONE]\n\n")
    return resp


def _read_with_a_pause(gateway: str, pause_s: float) -> bytes:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    with httpx.stream("POST", gateway + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        pieces = r.iter_raw()
        got = [next(pieces)]
        time.sleep(pause_s)  # the client stops reading: everything in between backs up
        got += list(pieces)
    return b"".join(got)


def _last_error(scheduler: str) -> str | None:
    return httpx.get(scheduler + "/v1/workers", timeout=10).json()["workers"][0]["last_error"]


async def test_a_client_that_pauses_longer_than_the_idle_timeout_gets_its_whole_stream():
    stand_in = ([("POST", "/v1/chat/completions", _fast_stream)], None)
    async with stand_ins_behind_router([stand_in], ("--idle-stream-timeout-ms", "1000")) as (sched, gw):
        text = await asyncio.to_thread(_read_with_a_pause, gw, 3.0)
        events = [e for e in text.split(b"\n\n") if e]
        assert events[-1] == b"data: [DONE]", events[-1][:300]
        assert len(events) == CHUNKS + 1 and not [e for e in events if b'"error"' in e]
        await until(lambda: open_leases(sched) == 0)
        assert await asyncio.to_thread(_last_error, sched) is None  # no failure reported
