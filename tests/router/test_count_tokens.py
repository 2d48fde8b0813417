"""The Anthropic Messages API's `POST /v1/messages/count_tokens` (vLLM serves it beside
/v1/messages) generates nothing: like /tokenize it goes to a worker of the model without a
lease (router/tokenizer_calls.py), so it is answered at once while the pool is saturated and
requests queue. It took a lease and stood in the queue behind the generations."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.router.procs import start_echo_worker, start_gateway, start_scheduler

SLOW = {"model": "m", "prompt": "hold the pool", "max_tokens": 150}  # 3 s at 20 ms a token
COUNT = {"model": "m", "messages": [{"role": "user", "content": "How many tokens is this?"}]}


@pytest.fixture(scope="module")
def pool():
    worker, worker_url = start_echo_worker(token_delay_ms=20)
    scheduler, scheduler_url = start_scheduler([worker_url], "--scrape-interval-ms", "100",
                                               "--policy-params", '{"max_running": 1}')
    gateway, gateway_url = start_gateway("--scheduler", scheduler_url, "--max-queue-size", "4")
    try:
        yield {"gw": gateway_url, "scheduler": scheduler_url}
    finally:
        for p in (gateway, scheduler, worker):
            p.stop()


def _leases(scheduler: str) -> int:
    return sum(w["in_flight_leases"] for w in httpx.get(scheduler + "/v1/workers").json()["workers"])


def _queued(gw: str) -> int:
    return httpx.get(gw + "/admin/state").json()["queued"]


def _wait(cond, what: str, timeout_s: float = 15) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"never saw {what}"
        time.sleep(0.02)


def test_count_tokens_is_answered_at_once_while_the_pool_is_saturated(pool):
    gw, scheduler = pool["gw"], pool["scheduler"]
    with ThreadPoolExecutor(2) as ex:
        running = ex.submit(httpx.post, gw + "/v1/completions", json=SLOW, timeout=60)
        _wait(lambda: _leases(scheduler) == 1, "the slow request leased")
        queued = ex.submit(httpx.post, gw + "/v1/completions", json=SLOW, timeout=60)
        _wait(lambda: _queued(gw) == 1, "a request queued")
        r = httpx.post(gw + "/v1/messages/count_tokens", json=COUNT, timeout=10)
        assert r.status_code == 200 and r.json()["input_tokens"] > 0, r.text
        # It took no lease and never stood in the queue: the pool is as it was.
        assert _leases(scheduler) == 1 and _queued(gw) == 1
        assert not running.done() and not queued.done()
        assert [f.result().status_code for f in (running, queued)] == [200, 200]
