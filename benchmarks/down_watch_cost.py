"""What router/down_watch.py's unless_down() adds to one awaited call, against the task-and-wait
form it replaced.

Every request the gateway sends to a worker through the scheduler waits in unless_down(): a
whole answer once, a stream twice (its head and its first chunk). The call measured here is
the smallest that suspends: a future resolved on the next loop turn, as a socket read is.
Three loops of the same count, one run: the bare await, the earlier form (the call in a task
of its own, asyncio.wait() on it and the down future), and unless_down() (the call in the
caller's task, cancelled from the down future's callback). Microseconds per call, on the
default loop and on uvloop (the gateway's).

    python -m benchmarks.down_watch_cost --calls 50000 --repeat 3
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

from router.down_watch import WorkerDown, unless_down


async def task_and_wait(call: Awaitable[Any], down: asyncio.Future[None]) -> Any:
    """The form unless_down() had until 2026-11-27: a task per call and asyncio.wait()."""
    task = asyncio.ensure_future(call)
    await asyncio.wait((task, down), return_when=asyncio.FIRST_COMPLETED)
    if not task.done():
        task.cancel()
        raise WorkerDown
    return task.result()


async def next_turn_answer() -> int:
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    loop.call_soon(fut.set_result, 1)
    return await fut


async def bare(call: Awaitable[Any], down: asyncio.Future[None]) -> Any:
    return await call


FORMS: dict[str, Callable[[Awaitable[Any], asyncio.Future[None]], Awaitable[Any]]] = {
    "bare await": bare,
    "task and wait (before)": task_and_wait,
    "unless_down (now)": unless_down,
}


async def per_call_us(form: Callable[[Awaitable[Any], asyncio.Future[None]], Awaitable[Any]],
                      calls: int) -> float:
    down: asyncio.Future[None] = asyncio.get_running_loop().create_future()  # never resolved
    start = time.perf_counter()
    for _ in range(calls):
        await form(next_turn_answer(), down)
    return (time.perf_counter() - start) / calls * 1e6


async def measure(calls: int, repeat: int) -> dict[str, float]:
    runs: dict[str, list[float]] = {name: [] for name in FORMS}
    for _ in range(repeat):  # interleaved, so a busy moment of the machine hits every form
        for name, form in FORMS.items():
            runs[name].append(await per_call_us(form, calls))
    return {name: statistics.median(us) for name, us in runs.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=50_000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    loops: dict[str, Callable[[Any], Any]] = {"asyncio": asyncio.run}
    try:
        import uvloop
        loops["uvloop"] = uvloop.run
    except ImportError:
        pass
    print("| loop | form | us per call | added to the bare await (us) |")
    print("|---|---|---|---|")
    for loop_name, run in loops.items():
        medians = run(measure(args.calls, args.repeat))
        for name, us in medians.items():
            added = "" if name == "bare await" else f"{us - medians['bare await']:.2f}"
            print(f"| {loop_name} | {name} | {us:.2f} | {added} |")


if __name__ == "__main__":
    main()
