"""Cordon and uncordon (scheduler/cordons.py) with real processes on 127.0.0.1: two sim workers,
the scheduler with --admin-token and a gateway. An operator cordons one worker over the HTTP API:
every following request goes to the other, while the requests under way there finish and a
Responses API follow-up whose stored response lives there still goes there; with both cordoned
the client gets a retryable 503; uncordoned, requests spread over both again. And the API's auth:
401 without the token, 403 from a scheduler that has none."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.router.procs import (
    Proc,
    free_port,
    series_value,
    start_gateway,
    start_scheduler,
    start_sim_workers,
    wait_http,
)

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
        g, gu = start_gateway("--scheduler", su)
        procs.append(g)
        _until(lambda: all(w["healthy"] and w["models"] == ["m"] for w in _workers(su).values())
               and len(_workers(su)) == 2, "both workers in rotation")
        yield {"scheduler": su, "scheduler_proc": s, "gateway": gu, "urls": urls}
    finally:
        for p in procs:
            p.stop()


def _until(pred, what: str, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        last = pred()
        if last:
            return last
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _workers(su: str) -> dict[str, dict]:
    return {w["worker_id"]: w for w in httpx.get(su + "/v1/workers", timeout=5).json()["workers"]}


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
    assert set(_served_by(gu, 12)) == set(_workers(su))  # both serve, to start with
    # A stored response on one worker: its follow-ups can be served there only.
    created = httpx.post(gu + "/v1/responses", json={"model": "m", "input": "hi", "max_output_tokens": 4},
                         timeout=60)
    assert created.status_code == 200, created.text
    cordoned = created.headers["x-router-worker"]
    other = next(w for w in _workers(su) if w != cordoned)
    with ThreadPoolExecutor(4) as pool:
        streams = [pool.submit(_stream, gu) for _ in range(4)]
        _until(lambda: _workers(su)[cordoned]["in_flight_leases"] > 0, "a stream on the worker to cordon")
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
    view = _workers(su)[cordoned]
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
        r = _admin(su, next(iter(_workers(su))), action, token=token)
        assert r.status_code == 401, r.text
        assert r.json()["error"]["type"] == "authentication_error"
    assert not any(w["cordoned"] for w in _workers(su).values())


def test_a_scheduler_without_an_admin_token_refuses_the_admin_api(stack):
    """Fail closed: without --admin-token (SCHEDULER_ADMIN_TOKEN) nobody may cordon."""
    port = free_port()
    s = Proc(["-m", "scheduler", "--port", str(port), "--workers", ",".join(stack["urls"])],
             f"scheduler-{port}")
    try:
        su = f"http://127.0.0.1:{port}"
        wait_http(su + "/health", s)
        wid = _until(lambda: next(iter(_workers(su)), None), "a worker listed")
        for token in (None, TOKEN, "wrong"):
            r = _admin(su, wid, "cordon", token=token)
            assert r.status_code == 403, r.text
            assert r.json()["error"]["code"] == "admin_disabled"
        assert not _workers(su)[wid]["cordoned"]
    finally:
        s.stop()
