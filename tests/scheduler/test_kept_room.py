"""Room kept for a large held request (scheduler/kept_room.py): freed room that smaller requests
keep taking must not starve a request that only a drained worker can hold."""

from __future__ import annotations

import asyncio
import time

from scheduler.policies import Request
from scheduler.service import Wait
from tests.scheduler.helpers import feed, make_service, worker

# 1000 blocks x 16 tokens per worker: w0 has 3,200 tokens free, w1 1,600; the guards that would
# hold a request for anything but its size are off.
BIG, SMALL = 5000, 100


def _pool(after_s: float = 5.0):
    svc = make_service(n=2, max_kv_usage=1.0, max_waiting=100, config={"keep_room_after_s": after_s})
    feed(svc, worker(svc, "w0"), running=4, kv=0.8)
    feed(svc, worker(svc, "w1"), running=4, kv=0.9)
    return svc


def _decide(svc, tokens: int, arrival: float | None = None):
    return svc.decide(Request("m", tokens, 10), time.monotonic(), arrival)


def test_smaller_requests_stay_off_the_worker_kept_for_a_large_one_until_it_is_placed():
    svc = _pool()
    arrival = time.monotonic() - 6.0  # waited past keep_room_after_s in its gateway's queue
    assert isinstance(_decide(svc, BIG, arrival), Wait)
    assert svc.kept.by_key["m"].worker is worker(svc, "w0")  # the nearest to holding it
    # The smaller ones fit w0 (the policy's favourite: less KV used) but go to w1, and wait
    # once w1 is full rather than take the room w0 frees.
    placed = [_decide(svc, SMALL) for _ in range(20)]
    assert {p["worker_id"] for p in placed if isinstance(p, dict)} == {"w1"}
    assert isinstance(placed[-1], Wait)
    feed(svc, worker(svc, "w0"), running=1, kv=0.5)  # w0's running requests end: 8,000 free
    assert isinstance(_decide(svc, SMALL), Wait)
    big = _decide(svc, BIG, arrival + 0.01)  # its next call: the same request
    assert big["worker_id"] == "w0" and big["reason"]["kept_room"] is True
    assert not svc.kept.by_key and svc.kept.placed == 1
    assert _decide(svc, SMALL)["worker_id"] == "w0"  # what it left is everyone's again


def test_without_the_keep_the_smaller_requests_take_the_room():
    """The premise of the test above: with keeps off the smaller requests go to w0."""
    svc = _pool(after_s=0)
    arrival = time.monotonic() - 6.0
    assert isinstance(_decide(svc, BIG, arrival), Wait)
    assert not svc.kept.by_key
    assert _decide(svc, SMALL)["worker_id"] == "w0"


def test_no_keep_for_a_request_that_has_not_waited_long_or_is_not_held_by_its_size():
    svc = _pool()
    assert isinstance(_decide(svc, BIG, time.monotonic() - 1.0), Wait)
    assert not svc.kept.by_key  # waited 1 s of 5
    # Every worker at its running cap: a small request waits as long, nothing passes it.
    capped = make_service(n=2, max_kv_usage=1.0, max_waiting=100, max_running=4,
                          config={"keep_room_after_s": 5.0})
    for wid in ("w0", "w1"):
        feed(capped, worker(capped, wid), running=4, kv=0.1)
    assert isinstance(_decide(capped, BIG, time.monotonic() - 6.0), Wait)
    assert not capped.kept.by_key


def test_no_keep_for_a_small_request_that_the_next_releases_will_fit():
    """Under saturation every request waits, and one a few hundred tokens over what is free is
    held by its size for a moment: keeping a worker for each such request made them take
    turns at the keep (and a large one wait for its turn). Only a tenth of a pool or more."""
    svc = _pool()
    feed(svc, worker(svc, "w0"), running=40, kv=0.95)  # 800 free
    feed(svc, worker(svc, "w1"), running=40, kv=0.96)
    assert isinstance(_decide(svc, 1000, time.monotonic() - 20.0), Wait)  # 6 % of a pool
    assert not svc.kept.by_key
    assert isinstance(_decide(svc, 1700, time.monotonic() - 20.0), Wait)  # 11 %
    assert svc.kept.by_key["m"].worker is worker(svc, "w0")


def test_a_request_too_large_for_every_pool_keeps_nothing():
    svc = _pool()
    assert "worker_id" in _decide(svc, 20_000, time.monotonic() - 6.0)  # its engine answers it
    assert not svc.kept.by_key


def test_one_keep_per_model_the_oldest_requests():
    svc = _pool()
    now = time.monotonic()
    _decide(svc, BIG, now - 9.0)
    _decide(svc, BIG + 500, now - 6.0)  # another large one, younger: no second keep
    assert len(svc.kept.by_worker) == 1 and svc.kept.by_key["m"].need == BIG


def test_a_removed_worker_is_kept_no_more():
    svc = _pool()
    _decide(svc, BIG, time.monotonic() - 6.0)
    assert svc.remove_worker("w0")
    assert not svc.kept.by_key and not svc.kept.by_worker


def test_the_keep_outlives_a_poll_that_is_asked_again_and_ends_when_the_request_leaves():
    """A long poll that runs out is asked again at once (same arrival): the worker stays kept.
    A request that leaves (its client gone, its queue timeout) frees the worker a second later."""
    svc = _pool()

    async def scenario() -> tuple[bool, bool, str]:
        waited_ms = 6000
        await svc.schedule(Request("m", BIG, 10), wait_ms=50, waited_ms=waited_ms)  # runs out
        kept_after_poll = "m" in svc.kept.by_key
        again = svc.schedule(Request("m", BIG, 10), wait_ms=5000, waited_ms=waited_ms + 60)
        call = asyncio.create_task(again)
        await asyncio.sleep(0.05)
        still_kept = "m" in svc.kept.by_key  # asked again: the same keep
        call.cancel()
        await asyncio.sleep(1.2)
        return kept_after_poll and still_kept, "m" in svc.kept.by_key, _decide(svc, SMALL)["worker_id"]

    kept, kept_after_leaving, small_to = asyncio.run(scenario())
    assert kept
    assert not kept_after_leaving
    assert small_to == "w0"


def test_a_held_large_request_is_placed_on_its_kept_worker_as_it_drains():
    """End to end through held calls: the large request is held, smaller ones are placed
    elsewhere meanwhile, and the kept worker's releases place it."""
    svc = _pool()
    leases = [_decide(svc, 1000)["lease_id"] for _ in range(2)]  # on w0: 1,200 free left unseen

    async def scenario() -> dict:
        held = asyncio.create_task(svc.schedule(Request("m", BIG, 10), wait_ms=5000, waited_ms=6000))
        await asyncio.sleep(0.01)
        assert not held.done() and svc.kept.by_key["m"].worker is worker(svc, "w0")
        assert _decide(svc, SMALL)["worker_id"] == "w1"
        feed(svc, worker(svc, "w0"), running=2, kv=0.8)  # the scrape shows both leases' KV
        for lease in leases:
            svc.release(lease, True, used_tokens=1000)
        feed(svc, worker(svc, "w0"), running=1, kv=0.6)  # 6,400 free: it fits
        return await asyncio.wait_for(held, 2.0)

    out = asyncio.run(scenario())
    assert out["worker_id"] == "w0" and out["reason"]["kept_room"] is True


def test_keeps_are_exported():
    from prometheus_client import generate_latest

    svc = _pool()
    arrival = time.monotonic() - 6.0
    _decide(svc, BIG, arrival)
    page = generate_latest(svc.metrics.registry).decode()
    assert 'scheduler_room_keeps_total{event="started"} 1.0' in page
    assert 'scheduler_worker_kept{worker="w0"} 1.0' in page
    feed(svc, worker(svc, "w0"), running=1, kv=0.5)
    _decide(svc, BIG, arrival)
    page = generate_latest(svc.metrics.registry).decode()
    assert 'scheduler_room_keeps_total{event="placed"} 1.0' in page
    assert "scheduler_worker_kept{" not in page
