"""A request that runs longer than the scheduler's lease TTL keeps its lease: the gateway renews
it while the request runs. Without renewals the scheduler expired it mid-answer ("expired without
release"), counted the request's slot free while it still ran, and the release came back
unknown. Real echo worker, scheduler and gateway processes on 127.0.0.1, with a 1 s TTL."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from scheduler.protocol import WorkerList
from tests.router.procs import series_value, start_echo_worker, start_gateway, start_scheduler
from tests.router.test_followup_pass import scheduling_over


@pytest.mark.parametrize(("renew_ms", "outcome", "channel"), [
    (300, "ok", "--scheduler-pipelining"),
    (300, "ok", "--no-scheduler-pipelining"),  # one HTTP call per renewal
    (0, "unknown", "--scheduler-pipelining"),
])
def test_a_stream_longer_than_the_lease_ttl_keeps_its_lease_while_renewed(renew_ms, outcome, channel):
    procs = []
    try:
        worker, wurl = start_echo_worker(token_delay_ms=100)
        procs.append(worker)
        sched, surl = start_scheduler([wurl], "--lease-ttl-s", "1", "--scrape-interval-ms", "100")
        procs.append(sched)
        gw, gurl = start_gateway("--scheduler", surl, "--lease-renew-ms", str(renew_ms), channel)
        procs.append(gw)
        body = {"model": "m", "prompt": "a long answer", "max_tokens": 30, "stream": True}
        with httpx.stream("POST", gurl + "/v1/completions", json=body, timeout=30) as r:
            assert r.status_code == 200
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and len(events) == 31  # 3 s of tokens
        release = f'scheduler_lease_releases_total{{outcome="{outcome}"}}'
        for _ in range(50):
            if series_value(surl, release, 0) == 1:
                break
            httpx.get(surl + "/health")  # the release is on its way
        assert series_value(surl, release, 0) == 1
        renewed = series_value(surl, 'scheduler_lease_renewals_total{outcome="ok"}', 0)
        assert (renewed >= 5) if renew_ms else renewed == 0
    finally:
        for p in procs:
            p.stop()


class Renewals:
    """A scripted scheduler client: grants every call a lease and records the renewals."""

    def __init__(self) -> None:
        self.issued = 0
        self.renewed: list[str] = []

    async def schedule_raw(self, body: dict, wait_ms: int) -> tuple[int, dict]:
        self.issued += 1
        return 200, {"worker_id": "w0", "url": "http://127.0.0.1:1", "lease_id": f"l{self.issued}"}

    def renew_nowait(self, lease_id: str) -> None:
        self.renewed.append(lease_id)

    def release_nowait(self, rel: dict) -> None:
        pass

    async def workers(self) -> WorkerList:
        return WorkerList(workers=[])


async def test_only_leases_whose_request_still_holds_its_route_are_renewed():
    """A released lease is not renewed, and neither is one whose request dropped its route
    without releasing it (a gateway bug): the scheduler's expiry still ends that one."""
    sched = scheduling_over(Renewals(), lease_renew_s=0.04)
    stub = sched.client
    sched.start()
    try:
        deadline = time.monotonic() + 5
        running = await sched.acquire({"model": "m"}, [], deadline)
        released = await sched.acquire({"model": "m"}, [], deadline)
        await sched.acquire({"model": "m"}, [], deadline)  # dropped at once, never released
        released.released = True  # as Proxy.release_lease marks it
        await asyncio.sleep(0.2)
        assert set(stub.renewed) == {"l1"} and len(stub.renewed) >= 2
        assert running.lease_id == "l1"
    finally:
        await sched.stop()
