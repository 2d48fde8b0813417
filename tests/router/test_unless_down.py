"""unless_down (router/down_watch.py): a call on a worker the scheduler reports down ends with
WorkerDown, and nothing else about the caller's task changes: its result when the worker is
fine, the client's cancel, a timeout around it, and no cancel left behind for what it awaits
next."""

from __future__ import annotations

import asyncio

import pytest

from router.down_watch import DownWatch, WorkerDown, unless_down


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


def test_worker_down_ends_the_wait_and_the_task_goes_on():
    async def main():
        down = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_later(0.02, down.set_result, None)
        with pytest.raises(WorkerDown):
            await unless_down(asyncio.sleep(30), down)
        task = asyncio.current_task()
        assert task.cancelling() == 0  # the cancel was taken back
        await asyncio.sleep(0.01)  # and nothing cancels what it awaits next
        return "went on"

    assert run(main()) == "went on"


def test_result_when_the_worker_answers_first_and_no_late_cancel():
    async def main():
        down = asyncio.get_running_loop().create_future()

        async def answer():
            await asyncio.sleep(0)
            down.set_result(None)  # reported down in the same loop turn the answer comes
            return 42

        assert await unless_down(answer(), down) == 42
        # down's callback runs after the answer was returned: it must not cancel this sleep.
        await asyncio.sleep(0.02)
        return asyncio.current_task().cancelling()

    assert run(main()) == 0


def test_answer_in_time_is_returned():
    async def main():
        down = asyncio.get_running_loop().create_future()

        async def answer():
            await asyncio.sleep(0.01)
            return "answer"

        got = await unless_down(answer(), down)
        down.set_result(None)  # the worker found down later: no effect on this task
        await asyncio.sleep(0.02)
        return got

    assert run(main()) == "answer"


def test_down_already_reported_never_starts_the_call():
    started = []

    async def call():
        started.append(1)

    async def main():
        down = asyncio.get_running_loop().create_future()
        down.set_result(None)
        with pytest.raises(WorkerDown):
            await unless_down(call(), down)

    run(main())
    assert not started


def test_the_clients_cancel_still_cancels():
    async def main():
        down = asyncio.get_running_loop().create_future()
        task = asyncio.ensure_future(unless_down(asyncio.sleep(30), down))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(main())


def test_client_cancel_and_worker_down_together_is_a_cancel():
    async def main():
        down = asyncio.get_running_loop().create_future()
        task = asyncio.ensure_future(unless_down(asyncio.sleep(30), down))
        await asyncio.sleep(0.01)
        # In one loop turn: the worker found down, then the client left. Both cancels reach
        # the task; the client's is the one it ends with.
        down.set_result(None)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(main())


def test_a_timeout_around_it_is_still_a_timeout():
    async def main():
        down = asyncio.get_running_loop().create_future()
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.02):
                await unless_down(asyncio.sleep(30), down)
        assert asyncio.current_task().cancelling() == 0

    run(main())


def test_the_watch_ending_is_not_a_worker_down():
    async def main():
        watch = DownWatch()
        with watch.watching("w1") as down:
            pass  # DownWatch cancels the future at the end of its block
        assert down.cancelled()

        async def answer():
            await asyncio.sleep(0.01)
            return "ok"

        return await unless_down(answer(), down)

    assert run(main()) == "ok"

