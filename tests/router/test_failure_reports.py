"""What a worker's failed request does to its place in rotation, end to end: two small aiohttp
workers in the test's own loop (the echo worker's /health and /metrics, so a real scheduler
scrapes them) behind a real scheduler and gateway on 127.0.0.1.

A request the engines cannot serve (here a prompt both workers answer with a 500) fails on
every worker it is retried on. The gateway reports each failure; one such report used to take
the worker out of rotation at once, so one bad request took the whole pool out and the next
clients got 503s. Now only a streak does (or a connection failure at once)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import httpx
import pytest
from aiohttp import web

from benchmarks.echo_worker import EchoWorker
from tests.router.stand_ins import StandIn, stand_ins_behind_router

_POISON = "poison"


def _poisoned() -> StandIn:
    """An echo worker that answers 500 to every `_POISON` prompt."""
    echo = EchoWorker("m", 0.01, "w")

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if body.get("prompt") == _POISON:
            return web.json_response({"error": {"message": "cannot serve this"}}, status=500)
        return await echo.completions(request)

    return [("POST", "/v1/completions", completions)], echo


@pytest.fixture
async def stack() -> AsyncIterator[tuple[str, str]]:
    async with stand_ins_behind_router([_poisoned(), _poisoned()],
                                       gateway_args=("--retry-count", "2")) as (scheduler, gateway):
        yield scheduler, gateway


def _states(scheduler: str) -> list[str]:
    return sorted(w["state"] for w in httpx.get(scheduler + "/v1/workers").json()["workers"])


async def test_one_request_every_worker_fails_does_not_take_the_pool_out(stack):
    scheduler, gw = stack
    async with aiohttp.ClientSession() as s:
        async with s.post(gw + "/v1/completions", json={"model": "m", "prompt": _POISON,
                                                        "max_tokens": 4}) as r:
            assert r.status == 502  # tried on both workers, both failed it
            await r.read()
        assert await asyncio.to_thread(_states, scheduler) == ["up", "up"]
        # The next clients are served at once, not told no worker is there.
        for _ in range(4):
            async with s.post(gw + "/v1/completions", json={"model": "m", "prompt": "hi",
                                                            "max_tokens": 4}) as r:
                assert r.status == 200, await r.text()
                await r.read()


async def test_a_worker_that_fails_request_after_request_goes_out(stack):
    """The streak (3 by default) counts reports in a row for one worker: poison requests keep
    failing on both, so both go out, and the scheduler says why."""
    scheduler, gw = stack
    async with aiohttp.ClientSession() as s:
        for _ in range(3):
            async with s.post(gw + "/v1/completions", json={"model": "m", "prompt": _POISON,
                                                            "max_tokens": 4}) as r:
                await r.read()
    workers = (await asyncio.to_thread(httpx.get, scheduler + "/v1/workers")).json()["workers"]
    # Out of rotation (down; or already half open for a trial, as its scrapes answer).
    assert all(w["state"] in ("down", "half_open") for w in workers), workers
    assert all(w["last_error"] == "gateway: http_500" for w in workers), workers
