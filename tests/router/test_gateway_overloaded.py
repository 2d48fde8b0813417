"""Workers that refuse as full (429, as TGI does past --max-concurrent-requests), with real
processes: echo workers with `--max-running`, a gateway with and without a scheduler.

A full worker is not a failed one: the request goes to another worker before any byte
reached the client, the full worker stays in rotation, and a client that finds every worker
full gets a 429 it can retry on, not a 502."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.router.procs import series_value, start_echo_worker, start_gateway, start_scheduler

SLOW = 25  # ms per token: a 20-token answer holds its worker for half a second


def _post(gw: str, stream: bool = False, tokens: int = 20) -> httpx.Response:
    body = {"model": "m", "prompt": "p", "max_tokens": tokens, "stream": stream}
    return httpx.post(gw + "/v1/completions", json=body, timeout=30)


def _burst(gw: str, n: int, stream: bool = False) -> list[httpx.Response]:
    with ThreadPoolExecutor(n) as ex:
        futures = []
        for _ in range(n):  # in order, so round robin deals them out in order
            futures.append(ex.submit(_post, gw, stream))
            time.sleep(0.05)
        return [f.result() for f in futures]


def _refused(worker: str) -> float:
    return series_value(worker, "echo_refused_total")


@pytest.fixture(scope="module")
def workers():
    limited, lu = start_echo_worker(token_delay_ms=SLOW, max_running=1)
    roomy, ru = start_echo_worker(token_delay_ms=SLOW)
    yield lu, ru
    limited.stop()
    roomy.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_a_full_worker_is_passed_over_not_failed(workers, stream):
    limited, roomy = workers
    g, gu = start_gateway("--workers", f"{limited},{roomy}", "--debug-headers")
    try:
        refused_before = _refused(limited)
        # Round robin deals limited, roomy, limited: the third finds `limited` busy.
        rs = _burst(gu, 3, stream)
        assert [r.status_code for r in rs] == [200, 200, 200], [r.text[:200] for r in rs]
        assert _refused(limited) == refused_before + 1  # it did refuse, and was passed over
        m = httpx.get(gu + "/metrics").text
        assert 'router_retries_total{reason="http_429"} 1.0' in m
        # Full is not failed: the next requests still go to both workers (a failure would
        # have rested `limited` for the fallback cooldown).
        seen = {_post(gu, tokens=1).headers["x-router-worker"] for _ in range(4)}
        assert seen == {limited, roomy}
    finally:
        g.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_every_worker_full_is_a_429_the_client_can_retry(stream):
    a, au = start_echo_worker(token_delay_ms=SLOW, max_running=1)
    b, bu = start_echo_worker(token_delay_ms=SLOW, max_running=1)
    g, gu = start_gateway("--workers", f"{au},{bu}")
    try:
        rs = _burst(gu, 3, stream)
        codes = sorted(r.status_code for r in rs)
        assert codes == [200, 200, 429], [r.text[:200] for r in rs]
        refused = next(r for r in rs if r.status_code == 429)
        assert int(refused.headers["Retry-After"]) >= 1
        err = refused.json()["error"]
        assert err["code"] == "workers_overloaded" and err["type"] == "rate_limit_error"
        assert "Model is overloaded" in err["message"]
    finally:
        for p in (g, a, b):
            p.stop()


def test_with_a_scheduler_a_full_worker_stays_healthy(workers):
    limited, roomy = workers
    # round_robin on the scheduler: it places by turns, so it sends to the full worker too.
    s, su = start_scheduler([limited, roomy], "--policy", "round_robin", "--scrape-interval-ms", "100")
    g, gu = start_gateway("--scheduler", su, "--debug-headers")
    try:
        refused_before = _refused(limited)
        rs = _burst(gu, 4)
        assert [r.status_code for r in rs] == [200] * 4, [r.text[:200] for r in rs]
        assert _refused(limited) > refused_before
        states = {w["url"]: w["state"] for w in httpx.get(su + "/v1/workers").json()["workers"]}
        assert states == {limited: "up", roomy: "up"}  # no failure was reported against it
    finally:
        g.stop()
        s.stop()
