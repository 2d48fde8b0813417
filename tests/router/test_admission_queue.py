"""The admission queue's own bookkeeping (router/queue.py) on the paths where a waiter leaves
other than by its turn: its deadline, displacement, its client going away."""

from __future__ import annotations

import asyncio
import time

import pytest

from router.queue import AdmissionQueue, QueueTimeout


async def test_a_waiter_behind_those_asking_is_refused_at_its_deadline():
    """The queue timeout holds for every waiter, not only the one asking the scheduler: a
    waiter behind a head that keeps asking (or behind later requests of a better priority)
    gets its 429 when its time is up, not when its turn finally comes."""
    q = AdmissionQueue(max_size=4)
    release = asyncio.Event()
    placed: list[str] = []

    async def asker() -> None:
        async with q.place("m"):
            placed.append("head")
            await release.wait()

    head = asyncio.create_task(asker())
    await asyncio.sleep(0)
    assert placed == ["head"] and q.size == 1

    async def late(deadline_s: float) -> float:
        t0 = time.monotonic()
        with pytest.raises(QueueTimeout):
            async with q.place("m", priority=5, flow="a", deadline=t0 + deadline_s):
                placed.append("late")
        return time.monotonic() - t0

    # Bounded: without the deadline in the line the wait ends only when the head leaves.
    waited = await asyncio.wait_for(late(0.05), timeout=5)
    assert waited >= 0.05
    # Its place is free again, and no flow is left counted as waiting.
    assert q.size == 1 and q.waiting_flows == 0 and placed == ["head"]
    release.set()
    await asyncio.wait_for(head, timeout=5)
    assert q.size == 0 and not q.has_waiters("m")


async def test_a_waiter_whose_turn_comes_before_its_deadline_is_not_refused_later():
    """The deadline's timer goes with the wait: a waiter that became an asker is not refused by
    it (it checks its deadline itself, between its scheduler calls)."""
    q = AdmissionQueue(max_size=4)
    release = asyncio.Event()

    async def asker() -> None:
        async with q.place("m"):
            await release.wait()

    head = asyncio.create_task(asker())
    await asyncio.sleep(0)
    got_turn = asyncio.Event()
    leave = asyncio.Event()

    async def waiter() -> None:
        async with q.place("m", deadline=time.monotonic() + 0.1):
            got_turn.set()
            await leave.wait()

    second = asyncio.create_task(waiter())
    await asyncio.sleep(0)
    release.set()
    await asyncio.wait_for(got_turn.wait(), timeout=5)
    await asyncio.sleep(0.15)  # past its deadline, while it asks
    leave.set()
    await asyncio.wait_for(asyncio.gather(head, second), timeout=5)  # no QueueTimeout raised
    assert q.size == 0 and not q.has_waiters("m")
