"""What a request that is being retried counts for when its client leaves: nothing a worker
served. Two small aiohttp workers in the test's own loop (one failing the request on cue, the
other busy; their /health and /metrics are the echo worker's, so a real scheduler scrapes them)
behind a real scheduler and gateway on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
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


async def test_a_stream_whose_worker_breaks_off_a_plain_answer_is_retried_and_gives_its_lease_back():
    """A streamed request its worker answers without a stream (an error, here a 400) and breaks
    off mid-body: nothing reached the client, so it is one more failed attempt. The read's error
    used to escape: the client got aiohttp's plain-text 500, the lease stayed open on the
    scheduler until its expiry, and the request counted as served."""
    echo = EchoWorker("m", 0.0, "w")

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

    app = web.Application()
    app.router.add_post("/v1/completions", cut_short)
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
        async with aiohttp.ClientSession() as session, session.post(
            gw + "/v1/completions", json={"model": "m", "prompt": "x", "stream": True}
        ) as r:
            assert r.status == 502 and (await r.json())["error"]["code"] == "upstream_failed"

        def open_leases() -> int:
            return sum(w["in_flight_leases"] for w in httpx.get(su + "/v1/workers").json()["workers"])

        await _until(lambda: open_leases() == 0)
        assert _tenant(gw, "shared") == (0, 0)
    finally:
        for p in procs:
            p.stop()
        await runner.cleanup()
