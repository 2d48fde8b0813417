"""Background answers' event logs (inference_worker/server/background.py): a replay follows
the answer until its end, and finished answers' events are kept within a byte budget, oldest
dropped first, without breaking a replay under way."""

from __future__ import annotations

import asyncio

from inference_worker.server.background import BackgroundRun, BackgroundRuns


def _finished_run(frames: list[bytes]) -> BackgroundRun:
    run = BackgroundRun({"id": "resp_x", "status": "completed"})
    for frame in frames:
        run.append(frame)
    run.finish()
    return run


def test_finished_answers_events_are_kept_within_the_budget_oldest_dropped_first() -> None:
    runs = BackgroundRuns(events_budget_bytes=100)
    frames = [b"x" * 20] * 3
    first, second, third = (_finished_run(frames) for _ in range(3))
    runs.keep_events(first)
    assert first.events == frames and runs.kept_bytes == 60
    runs.keep_events(second)  # 120 bytes > 100: the oldest goes
    assert first.events is None and second.events == frames and runs.kept_bytes == 60
    runs.keep_events(third)
    assert second.events is None and third.events == frames


async def test_a_replay_follows_the_answer_and_survives_its_events_being_dropped() -> None:
    run = BackgroundRun({"id": "resp_x", "status": "queued"})
    from_start = run.replay()  # begun before the answer's first event (a streamed POST)
    first = asyncio.ensure_future(anext(from_start))
    await asyncio.sleep(0.01)
    run.append(b"0")
    assert await first == b"0"
    run.append(b"1")
    replay = run.replay(starting_after=0)
    assert await anext(replay) == b"1"
    waiting = asyncio.ensure_future(anext(replay))
    await asyncio.sleep(0.01)
    assert not waiting.done()  # the answer has not produced event 2 yet
    run.append(b"2")
    assert await waiting == b"2"
    run.append(b"3")
    run.finish()
    BackgroundRuns(events_budget_bytes=0).keep_events(run)  # dropped at once
    assert run.events is None
    assert [frame async for frame in replay] == [b"3"]  # the replay under way still ends whole
