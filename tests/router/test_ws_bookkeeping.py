"""A gateway WebSocket that ends badly still settles its accounts: the in-flight gauge, the
request's accounting (the access log, tenant counters, token turns) and the scheduler's lease.

The worker is a small aiohttp server in the test's own loop (its WebSocket misbehaves on cue;
its /health and /metrics are the echo worker's, so a real scheduler scrapes it), in front of a
real scheduler and gateway on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from benchmarks.echo_worker import EchoWorker
from tests.router.procs import series_value
from tests.router.stand_ins import open_leases, stand_ins_behind_router, until

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
    async with stand_ins_behind_router([([("GET", "/v1/ws", worker.ws)], worker.echo)],
                                       handler_cancellation=True) as (scheduler, gateway):
        yield worker, scheduler, gateway


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
    await until(lambda: series_value(gw, "router_requests_in_flight") == 0)
    await until(lambda: series_value(gw, 'router_tenant_requests_total{tenant="shared"}', 0) == 3)
    assert open_leases(scheduler) == 0


async def test_a_client_that_leaves_while_its_worker_is_being_connected_gives_the_lease_back(stack):
    """The socket has its worker and lease, and the gateway is in the worker's WebSocket
    handshake when the client leaves: the lease was not yet the relay's, so nobody released
    it, and it counted as load on that worker until it expired (10 minutes by default)."""
    worker, scheduler, gw = stack
    worker.stall.set()
    async with aiohttp.ClientSession() as s:
        ws = await s.ws_connect(gw + "/v1/ws")
        await ws.send_str(json.dumps({"model": "m", "prompt": "hi", "max_tokens": 8}))
        await until(lambda: open_leases(scheduler) == 1)  # placed, now connecting
        assert ws._response is not None and ws._response.connection is not None
        ws._response.connection.transport.abort()
    await until(lambda: open_leases(scheduler) == 0)
    await until(lambda: series_value(gw, "router_requests_in_flight") == 0)
