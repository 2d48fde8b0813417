"""A scheduler whose /health says it can route while its schedule calls fail: the gateway must
not flap between round robin and scheduled routing, each return stalling requests for the whole
--wait-schedule-timeout-ms (router/flap_guard.py). Real gateway and sim worker processes; the
broken scheduler is a stand-in (its failure is the point), on 127.0.0.1."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from aiohttp import web

from router.flap_guard import FlapGuard
from tests.router.procs import free_port, series_value, start_gateway, start_sim_workers

WAIT_TIMEOUT_S = 1.5
BODY = {"model": "m", "prompt": "x", "max_tokens": 2}


class BrokenScheduler:
    """Answers /health (routable) and /v1/workers like a scheduler; fails every schedule call
    with a 500, and counts them."""

    def __init__(self, worker_url: str) -> None:
        self.worker_url = worker_url
        self.schedule_calls = 0
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    async def _health(self, _request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "routable": 1})

    async def _workers(self, _request: web.Request) -> web.Response:
        return web.json_response({"workers": [
            {"worker_id": "w0", "url": self.worker_url, "healthy": True, "models": ["m"]}]})

    async def _schedule(self, _request: web.Request) -> web.Response:
        self.schedule_calls += 1
        return web.json_response({"error": {"message": "decision failed", "type": "server_error"}},
                                 status=500)

    async def _release(self, _request: web.Request) -> web.Response:
        return web.Response(status=204)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/workers", self._workers)
        app.router.add_post("/v1/schedule", self._schedule)
        app.router.add_post("/v1/release", self._release)
        runner = web.AppRunner(app)
        self._loop.run_until_complete(runner.setup())
        self._loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port).start())
        self._ready.set()
        self._loop.run_forever()
        self._loop.run_until_complete(runner.cleanup())

    def __enter__(self) -> BrokenScheduler:
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


@pytest.fixture
def flapping() -> Iterator[tuple[str, BrokenScheduler]]:
    (worker, worker_url), = start_sim_workers(1)
    try:
        with BrokenScheduler(worker_url) as scheduler:
            g, gu = start_gateway(
                "--scheduler", scheduler.url, "--scheduler-channel", "http", "--debug-headers",
                "--wait-schedule-timeout-ms", str(int(WAIT_TIMEOUT_S * 1000)),
                "--wait-schedule-try-period-ms", "100", "--scheduler-probe-ms", "50")
            try:
                yield gu, scheduler
            finally:
                g.stop()
    finally:
        worker.stop()


def test_a_scheduler_that_answers_health_but_fails_its_calls_costs_one_wait_not_one_per_request(flapping):
    gw, scheduler = flapping
    took = []
    deadline = time.monotonic() + 20
    for _ in range(12):  # about 8 s of requests without the damping, 2 s with it
        assert time.monotonic() < deadline
        t0 = time.monotonic()
        r = httpx.post(gw + "/v1/completions", json=BODY, timeout=10)
        took.append(time.monotonic() - t0)
        assert r.status_code == 200, r.text
        assert r.headers["x-router-policy"] == "fallback_round_robin"
        time.sleep(0.2)  # past the probe period: a gateway that flaps has returned by now
    # The first request waits out the switch (the scheduler may be restarting). Each return
    # after it fails at its first call, which switches back at once: no later request waits
    # the switch out again. (Before, the probe found the scheduler routable and ended the wait
    # at every probe, so the switch never came and every request hung until its client left.)
    assert took[0] >= WAIT_TIMEOUT_S - 0.2, took
    assert max(took[1:]) < WAIT_TIMEOUT_S / 2, took
    # Damped: a return after 0, 2 and 4 s of healthy probes, not one per probe period.
    assert series_value(gw, 'router_mode_switches_total{to="fallback"}') <= 4
    calls = scheduler.schedule_calls
    # The first request's tries until the switch (one per try period), then one per return;
    # undamped, every request after a 50 ms probe would find scheduled routing back and try.
    assert calls <= WAIT_TIMEOUT_S / 0.1 + 4, calls


def test_the_guard_damps_returns_that_fail_soon_and_forgets_once_one_holds():
    guard = FlapGuard(window_s=30, first_hold_s=2, max_hold_s=10)
    assert not guard.failed(0.0)  # a first failure: the usual wait for the switch
    assert guard.may_return(100.0, 100.0)  # no hold yet: back at the first healthy probe
    guard.returned(100.0)
    assert guard.failed(101.0) and guard.hold_s == 2  # failed 1 s after the return: a flap
    assert not guard.may_return(101.0, 102.5) and guard.may_return(101.0, 103.0)
    guard.returned(103.0)
    assert guard.failed(104.0) and guard.hold_s == 4
    for t in (110.0, 120.0, 130.0):
        guard.returned(t)
        assert guard.failed(t + 1)
    assert guard.hold_s == 10  # capped
    guard.returned(200.0)
    assert not guard.failed(231.0)  # scheduled routing held past the window: not a flap
    assert guard.hold_s == 0 and guard.may_return(231.0, 231.0)
