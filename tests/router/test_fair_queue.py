"""Tenants take turns in the gateway's queue, with real processes: one sim worker that runs
two requests at most (declared to the scheduler), the scheduler, and the gateway.

Tenant A (by its API key) floods the queue with 12 requests; tenant B (by the fairness
header) sends one after them. With fair queueing (the default), B's request is taken at
A's next turn's end, not after A's whole backlog."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import httpx
import pytest

from tests.router.procs import series_value, start_gateway, start_scheduler, start_sim_worker

SLOW = ("--time-scale", "5", "--max-num-seqs", "2")  # tiny profile: ~32 ms per decode step


@pytest.fixture(scope="module")
def cluster():
    worker, worker_url = start_sim_worker("m", *SLOW)
    sched, sched_url = start_scheduler([worker_url], "--scrape-interval-ms", "100",
                                       "--worker-max-running", '{"*": 2}')
    try:
        yield sched_url
    finally:
        sched.stop()
        worker.stop()


async def _finish_order(gateway: str) -> tuple[list[str], float]:
    """Which tenant's requests ended in which order, and how many tenants the gateway showed
    waiting (router_queued_flows) once B's request had joined the queue."""
    order: list[str] = []

    async def one(client: httpx.AsyncClient, who: str, headers: dict[str, str]) -> None:
        body = {"model": "m", "prompt": "tenant", "max_tokens": 20, "ignore_eos": True}
        r = await client.post(gateway + "/v1/completions", json=body, headers=headers)
        assert r.status_code == 200, r.text
        order.append(who)

    async with httpx.AsyncClient(timeout=60) as client:
        flood = [asyncio.ensure_future(one(client, "A", {"Authorization": "Bearer tenant-a"}))
                 for _ in range(12)]
        await asyncio.sleep(0.3)  # A's backlog is queued in the gateway
        late = asyncio.ensure_future(one(client, "B", {"x-gateway-inference-fairness-id": "tenant-b"}))
        await asyncio.sleep(0.1)
        flows = await asyncio.to_thread(series_value, gateway, "router_queued_flows")
        await asyncio.gather(*flood, late)
    return order, flows


def test_a_tenants_request_is_not_queued_behind_anothers_flood(cluster):
    fair, fair_url = start_gateway("--scheduler", cluster)
    try:
        order, flows = asyncio.run(_finish_order(fair_url))
    finally:
        fair.stop()
    # Two of A's run when B arrives; B takes the next turn: it ends among the first four.
    assert order.index("B") <= 3, order
    assert flows == 2
    one_line, one_line_url = start_gateway("--scheduler", cluster, "--no-fair-queueing")
    try:
        order, flows = asyncio.run(_finish_order(one_line_url))
    finally:
        one_line.stop()
    assert order.index("B") >= 10, order  # one line: behind (nearly) all of A's backlog
    assert flows == 1


async def _statuses_with_a_full_queue(gateway: str) -> dict[str, list[int]]:
    """A's flood of 12 against a queue of 4 (two run, four wait, the rest are refused), then
    B's one request: every status, by tenant."""
    statuses: dict[str, list[int]] = {"A": [], "B": []}

    async def one(client: httpx.AsyncClient, who: str, headers: dict[str, str]) -> None:
        body = {"model": "m", "prompt": "tenant", "max_tokens": 20, "ignore_eos": True}
        r = await client.post(gateway + "/v1/completions", json=body, headers=headers)
        statuses[who].append(r.status_code)

    async with httpx.AsyncClient(timeout=60) as client:
        flood = [asyncio.ensure_future(one(client, "A", {"Authorization": "Bearer tenant-a"}))
                 for _ in range(12)]
        await asyncio.sleep(0.3)
        late = asyncio.ensure_future(one(client, "B", {"x-gateway-inference-fairness-id": "tenant-b"}))
        await asyncio.gather(*flood, late)
    return statuses


def test_a_full_queue_refuses_the_flooding_tenant_not_the_newcomer(cluster):
    proc, url = start_gateway("--scheduler", cluster, "--max-queue-size", "4")
    try:
        statuses = asyncio.run(_statuses_with_a_full_queue(url))
        displaced = series_value(url, 'router_rejected_requests_total{reason="displaced"}', 0.0)
    finally:
        proc.stop()
    assert statuses["B"] == [200]
    # Two ran at once, four waited: one of those gave its place to B.
    assert sorted(statuses["A"]) == [200] * 5 + [429] * 7
    assert displaced == 1


async def _small_tenants_last_place(gateway: str, small_gateway: str | None = None) -> tuple[int, list[str]]:
    """Tenant A floods the queue with 10 requests of ~400-token prompts and 30-token answers;
    tenant B then sends 6 of a few tokens each (through `small_gateway` if given: each tenant's
    connections landed on its own replica). Where B's last request ends in the order."""
    order: list[str] = []

    async def one(client: httpx.AsyncClient, via: str, who: str, prompt: str, max_tokens: int) -> None:
        body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
        r = await client.post(via + "/v1/completions", json=body,
                              headers={"x-gateway-inference-fairness-id": who})
        assert r.status_code == 200, r.text
        order.append(who)

    async with httpx.AsyncClient(timeout=120) as client:
        flood = [asyncio.ensure_future(one(client, gateway, "A", "long text " * 150, 30)) for _ in range(10)]
        await asyncio.sleep(0.3)
        small = [asyncio.ensure_future(one(client, small_gateway or gateway, "B", "hi", 3))
                 for _ in range(6)]
        await asyncio.gather(*flood, *small)
    return max(i for i, who in enumerate(order) if who == "B"), order


def test_token_turns_put_a_tenant_of_small_requests_ahead_of_a_heavy_one(cluster):
    """--fair-share tokens (the default), through the gateway (charged as requests get their worker, settled
    with the usage they report): B's six small requests cost less together than one of A's, so
    they all go before A's next; by requests they alternate with A's."""
    by_tokens, url = start_gateway("--scheduler", cluster, "--fair-share", "tokens")
    try:
        last_b, order = asyncio.run(_small_tenants_last_place(url))
        state = httpx.get(url + "/admin/state").json()
        served = {t: series_value(url, f'router_tenant_requests_total{{tenant="id:{t}"}}', 0.0)
                  for t in "AB"}
        b_output = series_value(url, 'router_tenant_tokens_total{kind="output",tenant="id:B"}', 0.0)
    finally:
        by_tokens.stop()
    assert served == {"A": 10, "B": 6} and b_output == 6 * 3  # what the dashboard shows per tenant
    # What an operator sees of the counters: both tenants, A (10 x ~300 prompt tokens and 30
    # answer tokens) above B, which started level with A's first three requests (the lift)
    # and used a few tokens more.
    assert state["fair_share"] == "tokens"
    counters = state["token_counters"]["m"]["most_served"]
    assert list(counters) == ["id:A", "id:B"] and counters["id:A"] > 2 * counters["id:B"], counters
    # A's two running and its one asking when B came end first at most, then B's six.
    assert last_b <= 9, order
    by_requests, url = start_gateway("--scheduler", cluster, "--fair-share", "requests")
    try:
        last_b, order = asyncio.run(_small_tenants_last_place(url))
    finally:
        by_requests.stop()
    assert last_b >= 11, order


def test_token_turns_hold_across_gateway_replicas(cluster):
    """Each replica's queue holds one tenant here, so only the scheduler can give turns: it hands
    freed room to the held call of the flow served fewest tokens over both replicas' traffic.
    Without flows (--fair-share requests) it goes in arrival order: the replicas' heads alternate."""
    def counters() -> dict[str, float]:  # what the scheduler counted, per tenant
        state = httpx.get(cluster + "/v1/workers").json()["fair_share"]
        return state["m"]["most_served"] if state else {}

    for mode, check in (("tokens", lambda last: last <= 9), ("requests", lambda last: last >= 11)):
        before = counters()
        heavy, heavy_url = start_gateway("--scheduler", cluster, "--fair-share", mode)
        small, small_url = start_gateway("--scheduler", cluster, "--fair-share", mode)
        try:
            last_b, order = asyncio.run(_small_tenants_last_place(heavy_url, small_url))
        finally:
            heavy.stop()
            small.stop()
        assert check(last_b), (mode, order)
        if mode == "tokens":
            after = counters()
            # Both counted there (B's counter also lifted to A's as it arrived: no banked credit).
            assert all(after[f"id:{t}"] > before.get(f"id:{t}", 0.0) for t in "AB"), (before, after)


def test_the_longest_fairness_id_a_client_can_send_reaches_the_scheduler(cluster):
    """128 bytes that are not UTF-8 (each spelled out by the gateway) make the longest flow id;
    the scheduler takes it with the schedule call instead of refusing the call (a 400 to the
    client)."""
    proc, url = start_gateway("--scheduler", cluster)
    try:
        r = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2},
                       headers={"x-gateway-inference-fairness-id": b"\xff" * 200}, timeout=30)
    finally:
        proc.stop()
    assert r.status_code == 200, r.text
    counters = httpx.get(cluster + "/v1/workers").json()["fair_share"]["m"]["most_served"]
    assert any(len(flow) > 700 for flow in counters), list(counters)


async def _ws_tenant_counter(gateway: str) -> float:
    """Three answers of 20 tokens on one WebSocket, then the tenant's counter while the socket
    is still open."""
    headers = {"x-gateway-inference-fairness-id": "ws"}
    async with aiohttp.ClientSession() as s, s.ws_connect(gateway + "/v1/ws", headers=headers) as ws:
        for _ in range(3):
            await ws.send_str(json.dumps({"model": "m", "prompt": "hi", "max_tokens": 20,
                                          "ignore_eos": True}))
            while True:
                msg = json.loads((await ws.receive(timeout=30)).data)
                if msg.get("type") == "done" or "error" in msg:
                    break
            assert msg.get("type") == "done", msg
        async with s.get(gateway + "/admin/state") as r:
            state = await r.json()
    return state["token_counters"]["m"]["most_served"]["id:ws"]


def test_a_websocket_tenant_is_counted_as_its_answers_end(cluster):
    """A socket is placed (and charged) once, but can carry a tenant's requests for hours: each
    answer's tokens count as it ends, not when the socket closes."""
    proc, url = start_gateway("--scheduler", cluster)
    try:
        counter = asyncio.run(_ws_tenant_counter(url))
    finally:
        proc.stop()
    assert counter >= 2 * 3 * 20  # three answers of 20 output tokens, weighing 2 each
