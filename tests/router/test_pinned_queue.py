"""A request pinned to one worker (it continues a response that worker stores) waits for
that worker in a line of its own: requests any worker can take do not queue behind it. A unit
test of the gateway's Scheduling with a scripted scheduler client."""

from __future__ import annotations

import asyncio
import time

from router.fallback import FallbackRouter
from router.metrics import RouterMetrics
from router.queue import AdmissionQueue
from router.scheduling import Scheduling
from tests.router.test_followup_pass import until


class OneFullWorker:
    """w0 is full until `room` is set; w1 has room."""

    def __init__(self) -> None:
        self.room = asyncio.Event()
        self.leases = 0

    async def schedule_raw(self, body: dict, wait_ms: int) -> tuple[int, dict]:
        if body.get("worker_id") == "w0":
            if not wait_ms:
                return 503, {"wait": True, "retry_after_ms": 5, "reason": "saturated"}
            await asyncio.wait_for(self.room.wait(), wait_ms / 1000)
            worker = "w0"
        else:
            worker = "w1"
        self.leases += 1
        url = f"http://127.0.0.1:1/{worker}"
        return 200, {"worker_id": worker, "url": url, "lease_id": f"l{self.leases}"}


async def test_a_pinned_request_waits_for_its_worker_without_holding_back_the_others():
    stub = OneFullWorker()
    sched = Scheduling(
        stub,  # type: ignore[arg-type]
        FallbackRouter([], 1.0),
        AdmissionQueue(16),
        RouterMetrics(),
        wait_schedule_timeout_s=1.0,
        try_period_s=0.1,
        probe_period_s=1.0,
        schedule_wait_ms=5000,
        workers_refresh_s=60.0,
    )
    deadline = time.monotonic() + 10
    pinned = asyncio.create_task(sched.acquire({"model": "m", "worker_id": "w0"}, [], deadline))
    await until(lambda: sched.queue.size == 1)
    others = [await asyncio.wait_for(sched.acquire({"model": "m"}, [], deadline), 1.0) for _ in range(3)]
    assert {r.worker_id for r in others} == {"w1"}
    assert not pinned.done()
    stub.room.set()
    assert (await asyncio.wait_for(pinned, 1.0)).worker_id == "w0"
