"""A gateway that names itself (X-Gateway-Instance) and whose channel stays closed for
--gateway-gone-grace-s has its leases ended (scheduler/gateways.py); an unnamed gateway's (an
older one's) are kept as before, until released or expired. Against a real scheduler process
with a stand-in echo worker, spoken to with ordinary clients; and the lease table's part."""

from __future__ import annotations

import aiohttp
import httpx
import pytest
from pydantic_core import from_json, to_json

from scheduler.leases import LeaseTable
from scheduler.registry import WorkerState
from tests.router.procs import poll_until, series_value, start_echo_worker, start_scheduler

HEADER = "X-Gateway-Instance"


@pytest.fixture(scope="module")
def scheduler():
    worker, wurl = start_echo_worker()
    sched, surl = start_scheduler([wurl], "--scrape-interval-ms", "100", "--gateway-gone-grace-s", "0.5")
    try:
        yield surl
    finally:
        sched.stop()
        worker.stop()


def _leases(base: str) -> int:
    return sum(w["in_flight_leases"] for w in httpx.get(base + "/v1/workers").json()["workers"])


async def _schedule_on(ws: aiohttp.ClientWebSocketResponse, n: int) -> list[str]:
    await ws.send_bytes(to_json([{"op": "schedule", "model": "m"}] * n))
    answers = from_json((await ws.receive(timeout=5)).data)
    assert [a[0] for a in answers] == [200] * n
    return [a[1]["lease_id"] for a in answers]


async def test_a_named_gateways_leases_end_once_its_channel_stays_closed(scheduler):
    base = _leases(scheduler)
    dropped = series_value(scheduler, "scheduler_gateway_leases_dropped_total", 0)
    async with aiohttp.ClientSession() as s:
        named = await s.ws_connect(scheduler + "/v1/channel", headers={HEADER: "gw-a"})
        older = await s.ws_connect(scheduler + "/v1/channel")  # an older gateway: no name
        await _schedule_on(named, 3)
        kept = await _schedule_on(older, 2)
        # Its long-polled calls are its too (HTTP, same name).
        r = await s.post(scheduler + "/v1/schedule", json={"model": "m"}, headers={HEADER: "gw-a"})
        assert r.status == 200
        assert _leases(scheduler) == base + 6
        await named.close()
        poll_until(lambda: _leases(scheduler) == base + 2, "the named gateway's leases ended", 10)
        assert series_value(scheduler, "scheduler_gateway_leases_dropped_total") == dropped + 4
        # The older gateway's stay, and are released as usual.
        await older.send_bytes(to_json([{"op": "release", "lease_id": lid, "ok": True} for lid in kept]))
        poll_until(lambda: _leases(scheduler) == base, "the older gateway's releases", 10)
        await older.close()


@pytest.mark.parametrize("value", ["", "a b", "x" * 129, "caf\u00e9"])
def test_an_instance_that_is_no_id_is_a_400(scheduler, value):
    for method, path in (("POST", "/v1/schedule"), ("GET", "/v1/channel"), ("POST", "/v1/batch")):
        r = httpx.request(method, scheduler + path, json={"model": "m"} if method == "POST" else None,
                          headers={HEADER: value.encode()})
        assert r.status_code == 400, (path, r.text)
        assert r.json()["error"]["param"] == HEADER


def test_a_gone_gateways_handed_off_lease_stays_and_a_late_release_is_harmless():
    table = LeaseTable(600.0)
    w = WorkerState("http://127.0.0.1:1")
    running, background = table.issue(w, 0.0, 10.0), table.issue(w, 0.0, 10.0)
    for lease in (running, background):
        table.tag(lease.lease_id, "gw-a")
    table.hand_off(background.lease_id)  # goes on in the worker: a scrape ends it
    assert table.close_gateway("gw-a") == [running]
    assert w.in_flight == 1 and w.unseen == 1 and table.by_gateway == {}
    assert table.close(running.lease_id) is None  # its release, late: unknown
    assert w.unseen == 1 and w.unseen_tokens == 10.0
