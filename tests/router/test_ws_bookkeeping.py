"""A gateway WebSocket that ends badly still settles its accounts: the in-flight gauge, the
request's accounting (the access log, tenant counters, token turns) and the scheduler's lease.

The worker is a small aiohttp server in the test's own loop (its WebSocket misbehaves on cue;
its /health and /metrics are the echo worker's, so a real scheduler scrapes it), in front of a
real scheduler and gateway on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

import aiohttp
import httpx
import pytest
from aiohttp import web

from benchmarks.echo_worker import EchoWorker
from tests.router.procs import free_port, series_value, start_gateway, start_scheduler

_CHUNK = json.dumps({"choices": [{"index": 0, "text": " tok"}]}, separators=(",", ":"))


class MisbehavingWorker:
    """Its /v1/ws either stalls its handshake (`stall`, set) or answers two chunks and then
    closes the socket mid-answer."""

    def __init__(self) -> None:
        self.stall = asyncio.Event()
        self.echo = EchoWorker("m", 0.0, "misbehaving")

    async def ws(self, request: web.Request) -> web.StreamResponse:
        if self.stall.is_set():
            await asyncio.sleep(30)  # the gateway's client leaves meanwhile
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        async for _ in ws:
            for _ in range(2):
                await ws.send_str(_CHUNK)
            await ws.close()  # gone mid-answer
            break
        return ws


@pytest.fixture
async def stack() -> AsyncIterator[tuple[MisbehavingWorker, str, str]]:
    worker = MisbehavingWorker()
    app = web.Application()
    app.router.add_get("/v1/ws", worker.ws)
    app.router.add_get("/health", worker.echo.health)
    app.router.add_get("/metrics", worker.echo.metrics)
    app.router.add_get("/v1/models", worker.echo.models)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    procs = []
    try:
        s, su = await asyncio.to_thread(start_scheduler, [f"http://127.0.0.1:{port}"],
                                        "--scrape-interval-ms", "100")
        procs.append(s)
        g, gu = await asyncio.to_thread(start_gateway, "--scheduler", su)
        procs.append(g)
        yield worker, su, gu
    finally:
        for p in procs:
            p.stop()
        await runner.cleanup()


def _open_leases(scheduler: str) -> int:
    return sum(w["in_flight_leases"] for w in httpx.get(scheduler + "/v1/workers").json()["workers"])


async def _until(check, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await asyncio.to_thread(check):
        assert time.monotonic() < deadline, "never settled"
        await asyncio.sleep(0.05)


async def test_a_client_that_drops_instead_of_answering_the_close_still_leaves_the_gauge(stack):
    """The worker leaves mid-answer; the gateway tells the client and closes its socket, and the
    client drops the connection instead of answering the close frame. That cancelled the
    gateway's handler inside its closing handshake, skipping the rest of its cleanup: the
    in-flight gauge stayed up for ever and the socket was never counted."""
    _, scheduler, gw = stack
    async with aiohttp.ClientSession() as s:
        for _ in range(3):
            ws = await s.ws_connect(gw + "/v1/ws", autoclose=False)
            await ws.send_str(json.dumps({"model": "m", "prompt": "hi", "max_tokens": 8}))
            while True:
                msg = await ws.receive(timeout=10)
                if msg.type != aiohttp.WSMsgType.TEXT or "error" in msg.data:
                    break
            msg = await ws.receive(timeout=10)  # the gateway's close frame
            assert msg.type == aiohttp.WSMsgType.CLOSE, msg
            assert ws._response is not None and ws._response.connection is not None
            ws._response.connection.transport.abort()  # no close frame back
    await _until(lambda: series_value(gw, "router_requests_in_flight") == 0)
    await _until(lambda: series_value(gw, 'router_tenant_requests_total{tenant="shared"}', 0) == 3)
    assert _open_leases(scheduler) == 0


async def test_a_client_that_leaves_while_its_worker_is_being_connected_gives_the_lease_back(stack):
    """The socket has its worker and lease, and the gateway is in the worker's WebSocket
    handshake when the client leaves: the lease was not yet the relay's, so nobody released
    it, and it counted as load on that worker until it expired (10 minutes by default)."""
    worker, scheduler, gw = stack
    worker.stall.set()
    async with aiohttp.ClientSession() as s:
        ws = await s.ws_connect(gw + "/v1/ws")
        await ws.send_str(json.dumps({"model": "m", "prompt": "hi", "max_tokens": 8}))
        await _until(lambda: _open_leases(scheduler) == 1)  # placed, now connecting
        assert ws._response is not None and ws._response.connection is not None
        ws._response.connection.transport.abort()
    await _until(lambda: _open_leases(scheduler) == 0)
    await _until(lambda: series_value(gw, "router_requests_in_flight") == 0)
