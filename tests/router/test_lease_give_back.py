"""A schedule call whose client leaves while the scheduler answers: the lease the scheduler
issued is given back, not left to count as load until it expires. A unit test of the gateway's
Scheduling over plain HTTP calls (no pipelined channel: --no-scheduler-pipelining, or an https
scheduler) with a scripted scheduler client."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from tests.router.test_followup_pass import scheduling_over, until


class SlowAnswers:
    """Issues a lease the moment a call arrives, as the real scheduler does once it has read the
    body, and answers when `answer` is set; records the releases it gets."""

    def __init__(self) -> None:
        self.answer = asyncio.Event()
        self.issued: list[str] = []
        self.released: list[str] = []

    async def schedule_raw(self, body: dict, wait_ms: int) -> tuple[int, dict]:
        lease_id = f"l{len(self.issued) + 1}"
        self.issued.append(lease_id)
        await self.answer.wait()
        return 200, {"worker_id": "w0", "url": "http://127.0.0.1:1", "lease_id": lease_id}

    def release_nowait(self, rel: dict[str, Any]) -> None:
        self.released.append(rel["lease_id"])


async def test_a_client_that_leaves_during_an_unheld_schedule_call_gives_its_lease_back():
    stub = SlowAnswers()
    sched = scheduling_over(stub)
    call = asyncio.create_task(sched.acquire({"model": "m", "prompt_tokens": 10}, [],
                                             time.monotonic() + 10))
    await until(lambda: stub.issued == ["l1"])
    call.cancel()  # the client went away while the (unheld) call was on the wire
    await asyncio.sleep(0)
    stub.answer.set()
    await until(lambda: stub.released == ["l1"])
