"""A request pinned to one worker (it continues a response that worker stores) waits for
that worker in a line of its own: requests any worker can take do not queue behind it. A unit
test of the gateway's Scheduling with a scripted scheduler client."""

from __future__ import annotations

import asyncio
import time

from tests.router.test_followup_pass import scheduling_over, until


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
    sched = scheduling_over(stub)
    deadline = time.monotonic() + 10
    pinned = asyncio.create_task(sched.acquire({"model": "m", "worker_id": "w0"}, [], deadline))
    await until(lambda: sched.queue.size == 1)
    others = [await asyncio.wait_for(sched.acquire({"model": "m"}, [], deadline), 1.0) for _ in range(3)]
    assert {r.worker_id for r in others} == {"w1"}
    assert not pinned.done()
    stub.room.set()
    assert (await asyncio.wait_for(pinned, 1.0)).worker_id == "w0"
