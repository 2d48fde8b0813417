"""What a request that is being retried counts for when its client leaves: nothing a worker
served. Two small aiohttp workers in the test's own loop (one failing the request on cue, the
other busy; their /health and /metrics are the echo worker's, so a real scheduler scrapes them)
behind a real scheduler and gateway on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import aiohttp
import httpx
import pytest
from aiohttp import web

from benchmarks.echo_worker import EchoWorker
from tests.router.procs import free_port, series_value, start_gateway, start_scheduler

_FAIL = "fail me"


async def _worker(refused: set[str]) -> tuple[web.AppRunner, str]:
    """An echo worker (50 ms a token) that answers 500 to a `_FAIL` prompt the first time
    either worker sees its request id."""
    echo = EchoWorker("m", 0.05, "w")

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        rid = request.headers.get("X-Request-Id", "")
        if body.get("prompt") == _FAIL and rid not in refused:
            refused.add(rid)
            return web.json_response({"error": "boom"}, status=500)
        return await echo.completions(request)

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", echo.health)
    app.router.add_get("/metrics", echo.metrics)
    app.router.add_get("/v1/models", echo.models)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


@pytest.fixture
async def stack() -> AsyncIterator[str]:
    """Two workers of one running request each, a scheduler that knows it, a gateway."""
    refused: set[str] = set()
    runners, urls = [], []
    procs = []
    try:
        for _ in range(2):
            runner, url = await _worker(refused)
            runners.append(runner)
            urls.append(url)
        s, su = await asyncio.to_thread(start_scheduler, urls, "--scrape-interval-ms", "100",
                                        "--worker-max-running", '{"*": 1}')
        procs.append(s)
        g, gu = await asyncio.to_thread(start_gateway, "--scheduler", su, "--retry-count", "2")
        procs.append(g)
        yield gu
    finally:
        for p in procs:
            p.stop()
        for runner in runners:
            await runner.cleanup()


async def _until(check, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await asyncio.to_thread(check):
        assert time.monotonic() < deadline, "never happened"
        await asyncio.sleep(0.05)


def _tenant(gw: str, tenant: str) -> tuple[float, float]:
    return (series_value(gw, f'router_tenant_requests_total{{tenant="{tenant}"}}', 0),
            series_value(gw, f'router_tenant_tokens_total{{kind="prompt",tenant="{tenant}"}}', 0))


async def test_a_client_that_leaves_while_its_request_waits_for_a_retry_was_served_nothing(stack):
    """The request's first worker fails it (500) and the retry waits in the queue for the other,
    busy worker; the client leaves. No worker served it, as when a client leaves the queue before
    any attempt, but it used to count as served by the worker that failed it: a request and its
    prompt in the tenant's and the model's counters, and its prompt in the tenant's token turns."""
    gw = stack
    async with aiohttp.ClientSession() as s:
        busy = asyncio.ensure_future(s.post(
            gw + "/v1/completions", json={"model": "m", "prompt": "busy", "max_tokens": 40},
            headers={"x-gateway-inference-fairness-id": "busy"}))
        await _until(lambda: series_value(gw, "router_requests_in_flight") == 1)
        retried = asyncio.ensure_future(s.post(
            gw + "/v1/completions", json={"model": "m", "prompt": _FAIL, "max_tokens": 4},
            headers={"x-gateway-inference-fairness-id": "x"}))
        # Failed once, and now queued for the busy worker.
        await _until(lambda: httpx.get(gw + "/admin/state").json()["queued"] == 1)
        retried.cancel()
        await _until(lambda: httpx.get(gw + "/admin/state").json()["queued"] == 0)
        answer = await busy
        assert answer.status == 200
        answer.release()
    await _until(lambda: series_value(gw, "router_requests_in_flight") == 0)
    assert _tenant(gw, "id:busy")[0] == 1
    assert _tenant(gw, "id:x") == (0, 0)
    assert series_value(gw, 'router_requests_total{model="m",status="499",worker="-"}') == 1
    state = (await asyncio.to_thread(httpx.get, gw + "/admin/state")).json()
    ledger = state["token_counters"]["m"]["most_served"]
    assert ledger.get("id:x", 0) == 0



@contextlib.asynccontextmanager
async def _one_worker(path: str, handler) -> AsyncIterator[tuple[str, str]]:
    """A worker answering POST `path` with `handler` (and the echo worker's /health and
    /metrics), a scheduler over it and a gateway: yields (scheduler, gateway)."""
    echo = EchoWorker("m", 0.0, "w")
    app = web.Application()
    app.router.add_post(path, handler)
    app.router.add_get("/health", echo.health)
    app.router.add_get("/metrics", echo.metrics)
    app.router.add_get("/v1/models", echo.models)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    procs = []
    try:
        s, su = await asyncio.to_thread(start_scheduler, [f"http://127.0.0.1:{port}"],
                                        "--scrape-interval-ms", "100")
        procs.append(s)
        g, gw = await asyncio.to_thread(start_gateway, "--scheduler", su)
        procs.append(g)
        yield su, gw
    finally:
        for p in procs:
            p.stop()
        await runner.cleanup()


def _open_leases(scheduler: str) -> int:
    return sum(w["in_flight_leases"] for w in httpx.get(scheduler + "/v1/workers").json()["workers"])


async def test_a_stream_whose_worker_breaks_off_a_plain_answer_is_retried_and_gives_its_lease_back():
    """A streamed request its worker answers without a stream (an error, here a 400) and breaks
    off mid-body: nothing reached the client, so it is one more failed attempt. The read's error
    used to escape: the client got aiohttp's plain-text 500, the lease stayed open on the
    scheduler until its expiry, and the request counted as served."""

    async def cut_short(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(status=400, headers={"Content-Type": "application/json",
                                                       "Content-Length": "1000"})
        await resp.prepare(request)
        await resp.write(b'{"error": {"message": "bad')
        await asyncio.sleep(0.05)  # the head and the start of the body go out first
        assert request.transport is not None
        request.transport.abort()
        return resp

    async with _one_worker("/v1/completions", cut_short) as (scheduler, gw), aiohttp.ClientSession() as s:
        async with s.post(gw + "/v1/completions", json={"model": "m", "prompt": "x", "stream": True}) as r:
            assert r.status == 502 and (await r.json())["error"]["code"] == "upstream_failed"
        await _until(lambda: _open_leases(scheduler) == 0)
        assert _tenant(gw, "shared") == (0, 0)


async def test_an_answer_whose_response_id_is_not_utf8_is_passed_on_and_settles():
    """A Responses API answer whose `resp_` id is not UTF-8: learning where it is stored raised
    out of the relay, so the client got a 500 and the lease stayed open until it expired. The id
    is not learnt now (no client could send it back); any other such error gives the lease back."""

    async def odd_id(request: web.Request) -> web.Response:
        await request.read()
        body = b'{"id": "resp_\xff", "object": "response", "usage": {"input_tokens": 3, "output_tokens": 2}}'
        return web.Response(body=body, content_type="application/json")

    async with _one_worker("/v1/responses", odd_id) as (scheduler, gw), aiohttp.ClientSession() as s:
        async with s.post(gw + "/v1/responses", json={"model": "m", "input": "x"}) as r:
            assert r.status == 200
            assert (await r.read()).startswith(b'{"id": "resp_\xff"')
        await _until(lambda: _open_leases(scheduler) == 0)
        assert _tenant(gw, "shared") == (1, 3)
