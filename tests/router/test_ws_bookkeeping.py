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
import httpx
import pytest
from aiohttp import web

from benchmarks.echo_worker import EchoWorker
from tests.router.procs import series_value
from tests.router.stand_ins import open_leases, stand_ins_behind_router, until

_CHUNK = json.dumps({"choices": [{"index": 0, "text": " tok"}]}, separators=(",", ":"))


_DONE = {"type": "done", "id": "x"}


class MisbehavingWorker:
    """Its /v1/ws either stalls its handshake (`stall`, set) or answers two chunks and then, by
    `mode`: closes the socket mid-answer ("close"), drops the connection without a close frame
    ("drop"), goes silent, answering no ping ("silent"), closes with 1009 as if the client's
    message were too big ("too_big"), or ends each answer once `go` is set and goes on with the
    next request ("serve")."""

    def __init__(self) -> None:
        self.stall = asyncio.Event()
        self.go = asyncio.Event()
        self.mode = "close"
        self.done = json.dumps(_DONE)  # as our worker writes it; a test may make it compact
        self.echo = EchoWorker("m", 0.0, "misbehaving")

    async def ws(self, request: web.Request) -> web.StreamResponse:
        if self.stall.is_set():
            await asyncio.sleep(30)  # the gateway's client leaves meanwhile
        # "silent": a host that died without closing the connection (no pong, no FIN).
        ws = web.WebSocketResponse(autoping=self.mode != "silent")
        await ws.prepare(request)
        async for _ in ws:
            for _ in range(2):
                await ws.send_str(_CHUNK)
            if self.mode == "serve":
                await self.go.wait()
                await ws.send_str(self.done)
                continue
            if self.mode == "silent":
                await asyncio.sleep(30)
            if self.mode == "drop":
                assert request.transport is not None
                request.transport.abort()
            elif self.mode == "too_big":
                await ws.close(code=1009, message=b"message too big")
            else:
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


def _worker_state(scheduler: str) -> str:
    return httpx.get(scheduler + "/v1/workers").json()["workers"][0]["state"]


@pytest.mark.parametrize("separators", [(", ", ": "), (",", ":")])
async def test_each_request_on_a_socket_holds_its_own_lease_and_an_idle_socket_none(stack, separators):
    """The scheduler counts a socket's requests as they come (two in flight: two leases on its
    worker) and each frees its KV as its answer ends. The socket held one lease for its whole
    life before: its second request was never counted, and an idle socket counted as a request
    for ever (least_request's load), until the lease expired with a warning after 10 minutes.
    A worker that writes its `done` compactly ends the answer too (the gateway saw no end)."""
    worker, scheduler, gw = stack
    worker.mode = "serve"
    worker.done = json.dumps(_DONE, separators=separators)
    released = series_value(scheduler, 'scheduler_lease_releases_total{outcome="ok"}', 0)
    async with aiohttp.ClientSession() as s, s.ws_connect(gw + "/v1/ws") as ws:
        for prompt in ("one", "two"):
            await ws.send_str(json.dumps({"model": "m", "prompt": prompt, "max_tokens": 8}))
        await until(lambda: open_leases(scheduler) == 2)
        worker.go.set()
        done = 0
        while done < 2:
            msg = await ws.receive(timeout=10)
            assert msg.type == aiohttp.WSMsgType.TEXT, msg
            done += json.loads(msg.data).get("type") == "done"
        await until(lambda: open_leases(scheduler) == 0)  # the socket stays open, idle
        assert not ws.closed
        await until(lambda: series_value(scheduler, 'scheduler_lease_releases_total{outcome="ok"}', 0)
                    == released + 2)


async def _told_the_worker_left(gw: str) -> None:
    """One request on a new socket, whose worker goes away mid-answer: the client is told."""
    async with aiohttp.ClientSession() as s, s.ws_connect(gw + "/v1/ws") as ws:
        await ws.send_str(json.dumps({"model": "m", "prompt": "hi", "max_tokens": 8}))
        while True:
            msg = await ws.receive(timeout=10)
            if msg.type != aiohttp.WSMsgType.TEXT or "error" in msg.data:
                break
        assert msg.type == aiohttp.WSMsgType.TEXT and "upstream_closed" in msg.data, msg


@pytest.mark.parametrize(("mode", "state"), [("drop", "down"), ("too_big", "up")])
async def test_a_worker_that_drops_a_socket_mid_answer_is_reported(stack, mode, state):
    """A worker whose connection drops with an answer owed has failed that request, as a stream
    cut mid-answer has: the gateway reports it, and the worker leaves rotation at once. A worker
    that closes over the client's message (1009: too big) failed nothing of its own: reporting
    it would let one client's messages take the pool out. The request's lease ends either way."""
    worker, scheduler, gw = stack
    worker.mode = mode
    await until(lambda: _worker_state(scheduler) == "up")
    await _told_the_worker_left(gw)
    await until(lambda: open_leases(scheduler) == 0)
    if state == "down":
        await until(lambda: _worker_state(scheduler) == "down")
    else:
        await asyncio.sleep(0.5)  # a report would have come by now
        assert _worker_state(scheduler) == "up"


async def test_the_workers_out_of_order_answers_are_given_by_the_gateway(stack):
    """The worker answers a request past the ones it queues at once, ahead of the answer it
    is streaming: the gateway took such an answer for the end of the streaming request and
    released that request's lease while it still ran. It gives that answer itself now, and
    every answer the worker sends ends the oldest request owed."""
    worker, scheduler, gw = stack
    worker.mode = "serve"
    body = json.dumps({"model": "m", "prompt": "x", "max_tokens": 8})
    async with aiohttp.ClientSession() as s, s.ws_connect(gw + "/v1/ws") as ws:
        for _ in range(65):  # 64 in flight, one too many
            await ws.send_str(body)
        while "error" not in (msg := json.loads((await ws.receive(timeout=10)).data)):
            pass
        assert msg["error"]["code"] == 429
        await until(lambda: open_leases(scheduler) == 64)  # every owed request holds its lease
        worker.go.set()
        done = 0
        while done < 64:
            done += json.loads((await ws.receive(timeout=10)).data).get("type") == "done"
        await until(lambda: open_leases(scheduler) == 0)


async def test_a_binary_message_goes_to_the_worker_in_its_turn(stack):
    """A binary message is no request, and the worker refuses it in its turn, after the
    answers owed before it. The gateway refused it at once: its error came inside the answer
    streaming, and a client pairing answers' ends with its requests in order took it for that
    answer's end (benchmarks/api_fuzz.py's WebSocket cases). Now it goes to the worker, in
    order, holding no lease; this worker answers every message alike."""
    worker, scheduler, gw = stack
    worker.mode = "serve"
    worker.go.clear()
    async with aiohttp.ClientSession() as s, s.ws_connect(gw + "/v1/ws") as ws:
        await ws.send_str(json.dumps({"model": "m", "prompt": "x", "max_tokens": 8}))
        assert json.loads((await ws.receive(timeout=10)).data) == json.loads(_CHUNK)  # it streams
        await ws.send_bytes(b"\x00")
        await until(lambda: open_leases(scheduler) == 1)  # the request's; none for the binary
        worker.go.set()
        got = [json.loads((await ws.receive(timeout=10)).data) for _ in range(2)]
        assert got == [json.loads(_CHUNK), _DONE], f"something came inside the answer: {got}"
        got = [json.loads((await ws.receive(timeout=10)).data) for _ in range(3)]
        assert got == [json.loads(_CHUNK), json.loads(_CHUNK), _DONE], got  # the worker's, to the binary
    await until(lambda: open_leases(scheduler) == 0)


async def test_a_worker_that_goes_silent_mid_answer_is_noticed_by_the_heartbeat():
    """A worker whose host died without closing the connection answers no ping: the gateway's
    pings (--ws-heartbeat-s) notice it, the client is told, the worker is reported and the
    request's lease ends. Without pings the socket hung, and the lease (renewed while its
    request was owed) counted as load on that worker for as long as the client waited."""
    worker = MisbehavingWorker()
    worker.mode = "silent"
    async with stand_ins_behind_router([([("GET", "/v1/ws", worker.ws)], worker.echo)],
                                       gateway_args=("--ws-heartbeat-s", "0.5"),
                                       handler_cancellation=True) as (scheduler, gw):
        await until(lambda: _worker_state(scheduler) == "up")
        await _told_the_worker_left(gw)
        await until(lambda: open_leases(scheduler) == 0)
        await until(lambda: _worker_state(scheduler) == "down")
