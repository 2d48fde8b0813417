"""A gateway killed with requests in flight: its leases end once it is gone (its channel closed
for --gateway-gone-grace-s), not at --lease-ttl-s (scheduler/gateways.py). Before, they stayed
open for the TTL (10 minutes): each worker's open leases counted against its running cap, so a
pool whose caps the dead gateway's requests had filled stayed saturated with nothing running,
and the gateway started in its place placed nothing.

And a gateway whose channel is only cut (a reset connection) or which stalls briefly (SIGSTOP)
keeps its leases: it opens its channel again at once (router/sched_pipe.py), and its releases
end them as usual. Cut off for longer than the grace, its leases end; the releases that come
when it is back are answered as for expired leases, and free nothing twice.

Real echo workers, scheduler and gateways on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
from urllib.parse import urlsplit

import httpx
import pytest

from tests.router.cut_proxy import cut_proxy
from tests.router.procs import (
    poll_until,
    scheduler_workers,
    series_value,
    start_echo_worker,
    start_gateway,
    start_scheduler,
)

GRACE_S = 1.0
DROPPED = "scheduler_gateway_leases_dropped_total"


class Streams:
    """`n` streamed completions of `max_tokens` tokens through `gateway`, from a thread of their
    own (the test's blocking calls do not stall them). `ended`: how many got every token."""

    def __init__(self, gateway: str, n: int, max_tokens: int) -> None:
        self.gateway, self.n, self.max_tokens = gateway, n, max_tokens
        self.ended = 0
        self.statuses: list[int] = []
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self._thread.start()

    async def _one(self, client: httpx.AsyncClient) -> None:
        body = {"model": "m", "prompt": "x", "max_tokens": self.max_tokens, "stream": True}
        try:
            async with client.stream("POST", self.gateway + "/v1/completions", json=body) as r:
                self.statuses.append(r.status_code)
                async for line in r.aiter_lines():
                    if line == "data: [DONE]":
                        self.ended += 1
        except httpx.HTTPError:
            pass  # its gateway was killed under it

    async def _run(self) -> None:
        async with httpx.AsyncClient(timeout=httpx.Timeout(120, connect=10),
                                     limits=httpx.Limits(max_connections=None)) as client:
            await asyncio.gather(*(self._one(client) for _ in range(self.n)))

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), "streams still running"


def open_leases(scheduler: str) -> int:
    return sum(w["in_flight_leases"] for w in scheduler_workers(scheduler).values())


@pytest.fixture
def pool():
    """Two echo workers (100 ms a token) and a scheduler over them, each worker's running cap
    declared at 30; yields (scheduler URL, its processes to stop)."""
    procs = []
    try:
        workers = [start_echo_worker(token_delay_ms=100) for _ in range(2)]
        procs += [p for p, _ in workers]
        sched, surl = start_scheduler([u for _, u in workers], "--scrape-interval-ms", "100",
                                      "--worker-max-running", json.dumps({"*": 30}),
                                      "--gateway-gone-grace-s", str(GRACE_S))
        procs.append(sched)
        yield surl, procs
    finally:
        for p in procs:
            p.stop()


def test_a_killed_gateways_leases_end_within_the_grace_and_its_successor_is_served(pool):
    surl, procs = pool
    gw_a, url_a = start_gateway("--scheduler", surl)
    procs.append(gw_a)
    streams = Streams(url_a, 60, 600)  # a minute each
    poll_until(lambda: open_leases(surl) == 60, "60 leases open", 60)
    poll_until(lambda: all(w["saturated"] == "running_cap" for w in scheduler_workers(surl).values()),
               "both workers at their cap", 10)
    gw_a.kill()  # SIGKILL: no release, no goodbye
    killed = time.monotonic()
    gw_b, url_b = start_gateway("--scheduler", surl)
    procs.append(gw_b)
    # Well under the TTL (600 s): the grace, a scrape, and two processes' start on a busy host.
    bound_s = 15.0
    poll_until(lambda: open_leases(surl) == 0, "the dead gateway's leases ended",
               bound_s - (time.monotonic() - killed))
    workers = scheduler_workers(surl).values()
    assert all(w["saturated"] is None and w["unseen_leases"] == 0 for w in workers), workers
    assert series_value(surl, DROPPED) == 60
    r = httpx.post(url_b + "/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 3},
                   timeout=bound_s)
    assert r.status_code == 200, r.text
    assert time.monotonic() - killed < bound_s
    streams.join(30)
    assert streams.ended == 0  # cut with their gateway


@pytest.mark.parametrize("fault", ["cut", "stop"])
def test_a_gateway_whose_channel_is_cut_or_which_stalls_briefly_keeps_its_leases(pool, fault):
    surl, procs = pool
    with cut_proxy(urlsplit(surl).port) as proxy:
        gw, gurl = start_gateway("--scheduler", proxy.url)
        procs.append(gw)
        streams = Streams(gurl, 20, 100)  # 10 s each
        poll_until(lambda: open_leases(surl) == 20, "20 leases open", 30)
        if fault == "cut":
            assert proxy.cut() >= 2  # the channel, both ends
        else:
            gw.p.send_signal(signal.SIGSTOP)
            time.sleep(2 * GRACE_S)
            gw.p.send_signal(signal.SIGCONT)
        time.sleep(2 * GRACE_S)  # past the grace
        assert series_value(surl, DROPPED, 0) == 0
        assert open_leases(surl) == 20
        streams.join(60)
        assert streams.ended == 20
        ok = 'scheduler_lease_releases_total{outcome="ok"}'
        poll_until(lambda: series_value(surl, ok, 0) == 20, "every lease released", 10)
        assert open_leases(surl) == 0


def test_releases_of_leases_ended_while_the_gateway_was_cut_off_free_nothing_twice(pool):
    surl, procs = pool
    with cut_proxy(urlsplit(surl).port) as proxy:
        gw, gurl = start_gateway("--scheduler", proxy.url)
        procs.append(gw)
        streams = Streams(gurl, 20, 50)  # 5 s each
        poll_until(lambda: open_leases(surl) == 20, "20 leases open", 30)
        proxy.refusing = True
        proxy.cut()
        poll_until(lambda: series_value(surl, DROPPED, 0) == 20, "its leases ended", 10)
        proxy.refusing = False  # back: the requests went on meanwhile
        streams.join(60)
        assert streams.ended == 20
        unknown = 'scheduler_lease_releases_total{outcome="unknown"}'
        poll_until(lambda: series_value(surl, unknown, 0) == 20, "the late releases answered", 15)
        workers = scheduler_workers(surl).values()
        assert all(w["in_flight_leases"] == 0 and w["unseen_leases"] == 0 for w in workers), workers
        # Its accounting intact: the next requests are placed and released as usual.
        for _ in range(4):
            r = httpx.post(gurl + "/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 2},
                           timeout=30)
            assert r.status_code == 200, r.text
        ok = 'scheduler_lease_releases_total{outcome="ok"}'
        poll_until(lambda: series_value(surl, ok, 0) == 4, "the new requests released", 10)
        assert open_leases(surl) == 0
