"""The gateway's queue passing (--followup-pass-ms) against a scheduler that makes no
follow-up holds: after the first "holds_off" answer it stops asking. A unit test of the
gateway's Scheduling with a scripted scheduler client; the scheduler's side of the answer is
tested on the real service in tests/scheduler/test_reservations.py. Also: which routes the
token turns (--fair-share tokens) charge."""

from __future__ import annotations

import asyncio
import time

from router.fallback import FallbackRouter
from router.metrics import RouterMetrics
from router.queue import AdmissionQueue
from router.scheduling import Scheduling


class HoldsOffScheduler:
    """Answers as a scheduler with --followup-hold-ms 0 whose workers are all saturated until
    `room` is set; counts the reserved_only calls it gets."""

    def __init__(self) -> None:
        self.reserved_only_calls = 0
        self.room = asyncio.Event()
        self.leases = 0

    async def schedule_raw(self, body: dict, wait_ms: int) -> tuple[int, dict]:
        if body.get("reserved_only"):
            self.reserved_only_calls += 1
            return 503, {"wait": True, "retry_after_ms": 5, "reason": "holds_off"}
        if wait_ms:
            await asyncio.wait_for(self.room.wait(), wait_ms / 1000)
            self.leases += 1
            return 200, {"worker_id": "w0", "url": "http://127.0.0.1:1", "lease_id": f"l{self.leases}"}
        return 503, {"wait": True, "retry_after_ms": 5, "reason": "saturated"}


async def until(cond, timeout_s: float = 5.0) -> None:
    for _ in range(int(timeout_s / 0.001)):
        if cond():
            return
        await asyncio.sleep(0.001)
    raise AssertionError("condition not reached")


def scheduling_over(stub: object, followup_pass_s: float = 0.0, lease_renew_s: float = 0.0) -> Scheduling:
    """The gateway's Scheduling with a scripted scheduler client and a queue of 16."""
    return Scheduling(
        stub,  # type: ignore[arg-type]
        FallbackRouter([], 1.0),
        AdmissionQueue(16),
        RouterMetrics(),
        wait_schedule_timeout_s=1.0,
        try_period_s=0.1,
        probe_period_s=1.0,
        schedule_wait_ms=5000,
        workers_refresh_s=60.0,
        followup_pass_s=followup_pass_s,
        lease_renew_s=lease_renew_s,
    )


async def test_passing_stops_after_the_scheduler_says_it_holds_nothing():
    stub = HoldsOffScheduler()
    sched = scheduling_over(stub, followup_pass_s=10.0)
    deadline = time.monotonic() + 10

    def body() -> dict:
        return {"model": "m", "prompt_tokens": 100, "prefix_hashes": [1, 2]}

    head = asyncio.create_task(sched.acquire(body(), [], deadline))
    await until(lambda: sched.queue.has_waiters("m"))
    followers = []
    for queued in range(2, 7):  # one after another (a scheduler's answer takes a loop turn at least)
        followers.append(asyncio.create_task(sched.acquire(body(), [], deadline)))
        await until(lambda queued=queued: sched.queue.size == queued)
    # Five arrivals found a queue; only the first asked for held room.
    assert stub.reserved_only_calls == 1
    stub.room.set()
    routes = await asyncio.gather(head, *followers)
    assert {r.lease_id for r in routes} == {f"l{i}" for i in range(1, 7)}


class AlwaysRoom:
    async def schedule_raw(self, body: dict, wait_ms: int) -> tuple[int, dict]:
        return 200, {"worker_id": "w0", "url": "http://127.0.0.1:1", "lease_id": "l1"}


async def test_token_turns_charge_scheduled_routes_and_not_fallback_picks():
    """--fair-share tokens: a route the scheduler gave is charged to the request's flow; a
    round-robin pick while the scheduler is away is not (its model may be a name no worker
    serves, which the counters would keep)."""
    sched = Scheduling(
        AlwaysRoom(),  # type: ignore[arg-type]
        FallbackRouter(["http://127.0.0.1:2"], 1.0),
        AdmissionQueue(16, fair_share="tokens"),
        RouterMetrics(),
        wait_schedule_timeout_s=1.0, try_period_s=0.1, probe_period_s=1.0, schedule_wait_ms=5000,
        workers_refresh_s=60.0,
    )
    deadline = time.monotonic() + 10
    route = await sched.acquire({"model": "m", "prompt_tokens": 100}, [], deadline, flow="id:a")
    assert route.charge == 100 and sched.queue.ledger("m").served("id:a") == 100
    sched.fallback_active = True
    route = await sched.acquire({"model": "made-up", "prompt_tokens": 100}, [], deadline, flow="id:a")
    assert route.fallback and route.charge == 0
    assert set(sched.queue.fair_state()["token_counters"]) == {"m"}


class RecordsBodies:
    def __init__(self) -> None:
        self.bodies: list[dict] = []

    async def schedule_raw(self, body: dict, wait_ms: int) -> tuple[int, dict]:
        self.bodies.append(dict(body))
        return 200, {"worker_id": "w1", "url": "http://127.0.0.1:1", "lease_id": "l1"}


async def test_a_body_placed_again_asks_with_its_own_exclude_list_only():
    """A body placed once with workers excluded (a retry) and again with none (a WebSocket
    moved back to its cordoned worker) must not carry the first call's list into the second:
    the scheduler would refuse the very worker asked for."""
    stub = RecordsBodies()
    sched = scheduling_over(stub)
    deadline = time.monotonic() + 10
    body = {"model": "m", "prompt_tokens": 10}
    await sched.acquire(body, ["w0"], deadline)
    await sched.acquire(body, [], deadline)
    assert [b.get("exclude") for b in stub.bodies] == [["w0"], None]
