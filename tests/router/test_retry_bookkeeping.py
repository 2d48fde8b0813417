"""What a request that is being retried counts for when its client leaves: nothing a worker
served. Two small aiohttp workers in the test's own loop (one failing the request on cue, the
other busy; their /health and /metrics are the echo worker's, so a real scheduler scrapes them)
behind a real scheduler and gateway on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import httpx
import pytest
from aiohttp import web

from benchmarks.echo_worker import EchoWorker
from tests.router.procs import series_value
from tests.router.stand_ins import StandIn, open_leases, stand_ins_behind_router, until

_FAIL = "fail me"


def _failing_once(refused: set[str]) -> StandIn:
    """An echo worker (50 ms a token) that answers 500 to a `_FAIL` prompt the first
    time either worker sees its request id."""
    echo = EchoWorker("m", 0.05, "w")

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        rid = request.headers.get("X-Request-Id", "")
        if body.get("prompt") == _FAIL and rid not in refused:
            refused.add(rid)
            return web.json_response({"error": "boom"}, status=500)
        return await echo.completions(request)

    return [("POST", "/v1/completions", completions)], echo


@pytest.fixture
async def stack() -> AsyncIterator[str]:
    """Two workers of one running request each, a scheduler that knows it, a gateway."""
    refused: set[str] = set()
    async with stand_ins_behind_router([_failing_once(refused), _failing_once(refused)],
                                       gateway_args=("--retry-count", "2"),
                                       scheduler_args=("--worker-max-running", '{"*": 1}'),
                                       handler_cancellation=True) as (_, gw):
        yield gw


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
        await until(lambda: series_value(gw, "router_requests_in_flight") == 1)
        retried = asyncio.ensure_future(s.post(
            gw + "/v1/completions", json={"model": "m", "prompt": _FAIL, "max_tokens": 4},
            headers={"x-gateway-inference-fairness-id": "x"}))
        # Failed once, and now queued for the busy worker.
        await until(lambda: httpx.get(gw + "/admin/state").json()["queued"] == 1)
        retried.cancel()
        await until(lambda: httpx.get(gw + "/admin/state").json()["queued"] == 0)
        answer = await busy
        assert answer.status == 200
        answer.release()
    await until(lambda: series_value(gw, "router_requests_in_flight") == 0)
    assert _tenant(gw, "id:busy")[0] == 1
    assert _tenant(gw, "id:x") == (0, 0)
    assert series_value(gw, 'router_requests_total{model="m",status="499",worker="-"}') == 1
    state = (await asyncio.to_thread(httpx.get, gw + "/admin/state")).json()
    ledger = state["token_counters"]["m"]["most_served"]
    assert ledger.get("id:x", 0) == 0



def _one_worker(path: str, handler):
    """A worker answering POST `path` with `handler`, a scheduler over it and a gateway:
    enters as (scheduler, gateway)."""
    return stand_ins_behind_router([([("POST", path, handler)], None)])


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
        await until(lambda: open_leases(scheduler) == 0)
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
        await until(lambda: open_leases(scheduler) == 0)
        assert _tenant(gw, "shared") == (1, 3)
