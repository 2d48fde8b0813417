"""Cordon and uncordon (scheduler/cordons.py) with real processes on 127.0.0.1: two sim workers,
the scheduler with --admin-token and a gateway. An operator cordons one worker over the HTTP API:
every following request goes to the other, while the requests under way there finish and a
Responses API follow-up whose stored response lives there still goes there; with both cordoned
the client gets a retryable 503; uncordoned, requests spread over both again. A WebSocket on a
cordoned worker finishes the answer it has there and takes its next request to the other one.
And the API's auth: 401 without the token, 403 from a scheduler that has none."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import aiohttp
import httpx
import pytest

from tests.router.procs import (
    Proc,
    free_port,
    poll_until,
    scheduler_workers,
    series_value,
    start_gateway,
    start_scheduler,
    start_sim_workers,
    wait_http,
)
from tests.router.stand_ins import open_leases, until

TOKEN = "admin-token-5d2b"
SHORT = {"model": "m", "prompt": "hello there", "max_tokens": 24, "ignore_eos": True}
LONG = {"model": "m", "prompt": "a long answer", "max_tokens": 300, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def stack() -> Iterator[dict]:
    procs: list[Proc] = []
    try:
        workers = start_sim_workers(2, "m")
        procs += [p for p, _ in workers]
        urls = [u for _, u in workers]
        s, su = start_scheduler(urls, "--scrape-interval-ms", "100", "--admin-token", TOKEN)
        procs.append(s)
        # Its view of the cordons refreshed often: a WebSocket leaves a worker once it knows.
        g, gu = start_gateway("--scheduler", su, "--workers-refresh-ms", "100")
        procs.append(g)
        poll_until(lambda: all(w["healthy"] and w["models"] == ["m"] for w in scheduler_workers(su).values())
               and len(scheduler_workers(su)) == 2, "both workers in rotation")
        yield {"scheduler": su, "scheduler_proc": s, "gateway": gu, "gateway_proc": g, "urls": urls}
    finally:
        for p in procs:
            p.stop()


def _admin(su: str, worker_id: str, action: str, token: str | None = TOKEN, **body) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    return httpx.post(f"{su}/v1/workers/{worker_id}/{action}", json=body or None, headers=headers,
                      timeout=5)


def _served_by(gu: str, n: int) -> list[str]:
    """n requests at once through the gateway: the worker of each (all must be 200)."""
    def one(_: int) -> str:
        r = httpx.post(gu + "/v1/completions", json=SHORT, timeout=60)
        assert r.status_code == 200, r.text
        return r.headers["x-router-worker"]

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


def _stream(gu: str) -> tuple[str, str]:
    """A long streamed answer: its worker and how it ended."""
    last = ""
    with httpx.stream("POST", gu + "/v1/completions", json=LONG, timeout=120) as r:
        assert r.status_code == 200
        worker = r.headers["x-router-worker"]
        for line in r.iter_lines():
            if line.startswith("data: "):
                last = line[6:]
    return worker, last


def test_a_cordoned_worker_takes_no_new_request_and_uncordoned_it_takes_its_share(stack):
    su, gu = stack["scheduler"], stack["gateway"]
    assert set(_served_by(gu, 12)) == set(scheduler_workers(su))  # both serve, to start with
    # A stored response on one worker: its follow-ups can be served there only.
    created = httpx.post(gu + "/v1/responses", json={"model": "m", "input": "hi", "max_output_tokens": 4},
                         timeout=60)
    assert created.status_code == 200, created.text
    cordoned = created.headers["x-router-worker"]
    other = next(w for w in scheduler_workers(su) if w != cordoned)
    with ThreadPoolExecutor(4) as pool:
        streams = [pool.submit(_stream, gu) for _ in range(4)]
        poll_until(lambda: scheduler_workers(su)[cordoned]["in_flight_leases"] > 0,
                   "a stream on the worker to cordon")
        r = _admin(su, cordoned, "cordon", reason="driver upgrade")
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["cordoned"] is True and body["changed"] is True and body["in_flight_leases"] > 0
        assert body["persisted"] is None  # no --cordon-file: in memory only
        # Every following request goes to the other worker.
        assert set(_served_by(gu, 12)) == {other}
        # The follow-up still goes where its conversation is stored.
        follow = httpx.post(gu + "/v1/responses", json={
            "model": "m", "input": "more", "max_output_tokens": 4,
            "previous_response_id": created.json()["id"]}, timeout=60)
        assert follow.status_code == 200, follow.text
        assert follow.headers["x-router-worker"] == cordoned
        # The streams under way on the cordoned worker finished there.
        ended = [f.result(timeout=120) for f in streams]
    assert cordoned in {w for w, _ in ended} and all(last == "[DONE]" for _, last in ended), ended
    view = scheduler_workers(su)[cordoned]
    assert view["cordoned"] is True and view["cordon_reason"] == "driver upgrade"
    assert view["healthy"] is True and view["data_age_ms"] < 2000  # still scraped
    assert series_value(su, f'scheduler_worker_cordoned{{worker="{cordoned}"}}') == 1
    assert series_value(su, f'scheduler_worker_cordoned{{worker="{other}"}}') == 0

    # Both cordoned: a retryable 503, not a 404 that tells clients the model does not exist.
    assert _admin(su, other, "cordon").status_code == 200
    r = httpx.post(gu + "/v1/completions", json=SHORT, timeout=30)
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "no_worker" and r.headers["Retry-After"]
    assert _admin(su, other, "uncordon").json()["changed"] is True

    r = _admin(su, cordoned, "uncordon")
    assert r.status_code == 200 and r.json()["cordoned"] is False and r.json()["changed"] is True
    assert _admin(su, cordoned, "uncordon").json()["changed"] is False  # idempotent
    assert set(_served_by(gu, 12)) == {cordoned, other}
    assert series_value(su, f'scheduler_worker_cordoned{{worker="{cordoned}"}}') == 0
    log = stack["scheduler_proc"].output()
    assert f"worker {cordoned} cordoned by 127.0.0.1 (driver upgrade)" in log
    assert f"worker {cordoned} uncordoned by 127.0.0.1" in log
    assert TOKEN not in log


@pytest.mark.parametrize("token", [None, "wrong"], ids=["none", "wrong"])
def test_the_admin_api_wants_the_admin_token(stack, token):
    su = stack["scheduler"]
    for action in ("cordon", "uncordon"):
        r = _admin(su, next(iter(scheduler_workers(su))), action, token=token)
        assert r.status_code == 401, r.text
        assert r.json()["error"]["type"] == "authentication_error"
    assert not any(w["cordoned"] for w in scheduler_workers(su).values())


def test_a_scheduler_without_an_admin_token_refuses_the_admin_api(stack):
    """Fail closed: without --admin-token (SCHEDULER_ADMIN_TOKEN) nobody may cordon."""
    port = free_port()
    s = Proc(["-m", "scheduler", "--port", str(port), "--workers", ",".join(stack["urls"])],
             f"scheduler-{port}")
    try:
        su = f"http://127.0.0.1:{port}"
        wait_http(su + "/health", s)
        wid = poll_until(lambda: next(iter(scheduler_workers(su)), None), "a worker listed")
        for token in (None, TOKEN, "wrong"):
            r = _admin(su, wid, "cordon", token=token)
            assert r.status_code == 403, r.text
            assert r.json()["error"]["code"] == "admin_disabled"
        assert not scheduler_workers(su)[wid]["cordoned"]
    finally:
        s.stop()


def _successes(url: str) -> float:
    """Requests a worker finished (vllm:request_success_total, every reason)."""
    return sum(float(line.rsplit(" ", 1)[1])
               for line in httpx.get(url + "/metrics", timeout=5).text.splitlines()
               if line.startswith("vllm:request_success_total"))


def _gateway_knows(gu: str, cordoned: set[str]) -> bool:
    workers = httpx.get(gu + "/admin/state", timeout=5).json()["fallback_workers"]
    return len(workers) == 2 and {w["worker_id"] for w in workers if w["cordoned"]} == cordoned


async def _answer(ws: aiohttp.ClientWebSocketResponse, tokens: int, first: dict | None = None) -> int:
    """The rest of one answer on the socket: its chunks (each one token), up to its `done`."""
    chunks = 0 if first is None else 1
    while True:
        msg = await ws.receive(timeout=60)
        assert msg.type == aiohttp.WSMsgType.TEXT, msg
        m = json.loads(msg.data)
        assert "error" not in m, m
        if m.get("type") == "done":
            assert chunks == tokens, (chunks, tokens)
            return chunks
        chunks += 1


async def _websocket_through_cordons(stack: dict) -> dict:
    su, gu = stack["scheduler"], stack["gateway"]
    by_id = {u.removeprefix("http://"): u for u in stack["urls"]}
    served = {wid: _successes(u) for wid, u in by_id.items()}

    def served_since() -> dict[str, float]:
        now = {wid: _successes(u) for wid, u in by_id.items()}
        out = {wid: now[wid] - served[wid] for wid in now}
        served.update(now)
        return out

    def ask(tokens: int) -> str:
        return json.dumps({"model": "m", "prompt": "ws", "max_tokens": tokens, "ignore_eos": True})

    out: dict = {}
    async with aiohttp.ClientSession() as session, session.ws_connect(gu + "/v1/ws") as ws:
        # A long answer under way on the socket's worker, which an operator then cordons.
        await ws.send_str(ask(400))
        first = json.loads((await ws.receive(timeout=30)).data)
        first_worker = await asyncio.to_thread(
            poll_until,
            lambda: next((w for w, v in scheduler_workers(su).items() if v["in_flight_leases"]), None),
            "the socket's request in flight")
        other = next(w for w in by_id if w != first_worker)
        assert (await asyncio.to_thread(_admin, su, first_worker, "cordon")).status_code == 200
        await until(lambda: _gateway_knows(gu, {first_worker}))
        # The next request, sent while the first streams: held until that answer ends there.
        await ws.send_str(ask(5))
        assert scheduler_workers(su)[first_worker]["in_flight_leases"] == 1  # the first's, still there
        out["in_flight"] = await _answer(ws, 400, first)
        out["next"] = await _answer(ws, 5)
        out["first_two"] = await asyncio.to_thread(served_since)
        await ws.send_str(ask(3))  # the socket stays on its new worker
        out["then"] = await _answer(ws, 3)
        out["third"] = await asyncio.to_thread(served_since)

        # An idle socket whose worker is cordoned moves at its next request. The first worker
        # is back in rotation: it goes there.
        assert (await asyncio.to_thread(_admin, su, first_worker, "uncordon")).status_code == 200
        assert (await asyncio.to_thread(_admin, su, other, "cordon")).status_code == 200
        await until(lambda: _gateway_knows(gu, {other}))
        await ws.send_str(ask(4))
        out["idle_move"] = await _answer(ws, 4)
        out["fourth"] = await asyncio.to_thread(served_since)

        # Every worker cordoned: no other can take the socket, and it stays where it is (a
        # cordoned worker still serves what is pinned to it) rather than lose its request.
        assert (await asyncio.to_thread(_admin, su, first_worker, "cordon")).status_code == 200
        await until(lambda: _gateway_knows(gu, {first_worker, other}))
        await ws.send_str(ask(6))
        out["nowhere_else"] = await _answer(ws, 6)
        out["fifth"] = await asyncio.to_thread(served_since)
        assert not ws.closed
        await until(lambda: open_leases(su) == 0)  # every answer's lease ended
    out["first_worker"], out["other"] = first_worker, other
    return out


def test_a_websocket_leaves_a_cordoned_worker_at_its_next_request(stack):
    """A cordon is a drain: a socket kept there would keep it from ending. The answer in flight
    finishes on the cordoned worker; the request sent meanwhile is held and placed afresh, on the
    other worker, whole, and the socket goes on there. A socket that is idle when its worker is
    cordoned moves at its next request; with every worker cordoned it stays."""
    su = stack["scheduler"]
    try:
        out = asyncio.run(_websocket_through_cordons(stack))
    finally:
        for wid in scheduler_workers(su):
            _admin(su, wid, "uncordon")
    first, other = out["first_worker"], out["other"]
    assert (out["in_flight"], out["next"], out["then"], out["idle_move"], out["nowhere_else"]) == (
        400, 5, 3, 4, 6)
    assert out["first_two"] == {first: 1, other: 1}  # the one in flight there, the next elsewhere
    assert out["third"] == {first: 0, other: 1}
    assert out["fourth"] == {first: 1, other: 0}
    assert out["fifth"] == {first: 1, other: 0}
    log = stack["gateway_proc"].output()
    assert f"moved from {first} (cordoned) to {other}" in log
    assert f"moved from {other} (cordoned) to {first}" in log
    assert f"no other worker than the cordoned {first} can take it now" in log
