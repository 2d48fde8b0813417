"""A non-stream request whose worker hangs (its process stopped: connections accepted, nothing
answered) is retried elsewhere once the scheduler reports the worker down, not held until the
request timeout (router/down_watch.py). Real echo workers, scheduler and gateway on 127.0.0.1."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.router.procs import series_value, start_echo_worker, start_gateway, start_scheduler


def _leased_worker(scheduler: str, deadline_s: float = 10.0) -> str:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        for w in httpx.get(scheduler + "/v1/workers").json()["workers"]:
            if w["in_flight_leases"]:
                return w["url"]
        time.sleep(0.02)
    raise AssertionError("the request never got a lease")



def _worker_id(scheduler: str, url: str) -> str:
    return next(w["worker_id"] for w in httpx.get(scheduler + "/v1/workers").json()["workers"]
                if w["url"] == url)


@contextlib.contextmanager
def _two_workers(token_delay_ms: float) -> Iterator[tuple[str, str, Callable[[], str]]]:
    """Two echo workers, a scheduler that finds a silent one down after a second, a gateway
    that refreshes its worker list every 200 ms: (scheduler, gateway, hang), where hang()
    SIGSTOPs the worker holding the request in flight and returns the other one's URL. A
    stopped worker is continued at the end, then everything stopped."""
    workers = [start_echo_worker(token_delay_ms=token_delay_ms) for _ in range(2)]
    procs = [p for p, _ in workers]
    by_url = {u: p for p, u in workers}
    stopped: list = []

    try:
        s, su = start_scheduler(list(by_url), "--scrape-interval-ms", "100", "--dead-after-ms", "1000")
        procs.append(s)
        g, gu = start_gateway("--scheduler", su, "--workers-refresh-ms", "200")
        procs.append(g)

        def hang() -> str:
            hung = _leased_worker(su)
            stopped.append(by_url[hung])
            os.kill(by_url[hung].pid, signal.SIGSTOP)
            [other] = [u for u in by_url if u != hung]
            return other

        yield su, gu, hang
    finally:
        for p in stopped:
            os.kill(p.pid, signal.SIGCONT)
        for p in procs:
            p.stop()

def test_a_non_stream_request_on_a_hung_worker_is_retried_once_the_scheduler_finds_it_down():
    with _two_workers(token_delay_ms=100) as (su, gu, hang):
        body = {"model": "m", "prompt": "p", "max_tokens": 30}  # 3 s of generation
        with ThreadPoolExecutor(1) as ex:
            t0 = time.monotonic()
            answer = ex.submit(httpx.post, gu + "/v1/completions", json=body, timeout=25)
            other = hang()
            r = answer.result()
            took = time.monotonic() - t0
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 30
        assert r.headers["x-router-worker"] == _worker_id(su, other)
        assert series_value(gu, 'router_retries_total{reason="worker_down"}') == 1
        # Found down after about a second of silence, then served whole elsewhere: far from
        # the 60 s a first-byte timeout took, or the 30 min of the request timeout.
        assert took < 15, took


def test_a_stream_on_a_hung_worker_before_its_first_byte_is_retried_once_the_scheduler_finds_it_down():
    """As a whole answer: nothing of it has reached the client, so it is not held until the
    first-byte timeout (60 s) but moved once the scheduler reports its worker down, and the
    client reads a whole stream from the other worker."""
    with _two_workers(token_delay_ms=2000) as (su, gu, hang):  # a first chunk after 2 s
        body = {"model": "m", "prompt": "p", "max_tokens": 2, "stream": True}

        def stream() -> tuple[httpx.Response, str]:
            with httpx.stream("POST", gu + "/v1/completions", json=body, timeout=40) as r:
                return r, "".join(r.iter_text())

        with ThreadPoolExecutor(1) as ex:
            t0 = time.monotonic()
            answer = ex.submit(stream)
            other = hang()  # before its first chunk, 2 s after the request
            r, text = answer.result()
            took = time.monotonic() - t0
        assert r.status_code == 200
        assert text.count('"text":" tok"') == 2 and text.rstrip().endswith("data: [DONE]"), text
        assert r.headers["x-router-worker"] == _worker_id(su, other)
        assert series_value(gu, 'router_retries_total{reason="worker_down"}') == 1
        assert took < 20, took  # found down after about a second of silence; not the 60 s timeout
