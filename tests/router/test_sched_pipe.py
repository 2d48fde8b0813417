"""The gateway's pipelined scheduler channel: against the real scheduler process (with
stand-in echo workers), plus its failure modes (refused, silent peer) and its parser."""

from __future__ import annotations

import asyncio
import socket

import httpx
import pytest

from router.sched_pipe import SchedulerPipe, _Pipe
from scheduler.client import SchedulerUnavailableError, UnknownModelError
from tests.router.procs import free_port, start_echo_worker, start_scheduler


@pytest.fixture(scope="module")
def scheduler():
    w1, u1 = start_echo_worker()
    w2, u2 = start_echo_worker()
    s, su = start_scheduler([u1, u2], "--scrape-interval-ms", "100")
    yield su
    for p in (s, w1, w2):
        p.stop()


async def test_concurrent_calls_share_one_connection_and_leases_are_released(scheduler):
    pipe = SchedulerPipe(scheduler, timeout_s=5)
    try:
        results = await asyncio.gather(
            *(pipe.schedule_raw({"model": "m", "prompt_tokens": 10}) for _ in range(40))
        )
        assert all(status == 200 for status, _ in results)
        leases = {p["lease_id"] for _, p in results}
        assert len(leases) == 40
        async with httpx.AsyncClient() as c:
            workers = (await c.get(scheduler + "/v1/workers")).json()["workers"]
        assert sum(w["in_flight_leases"] for w in workers) >= 40
        for lease in leases:
            pipe.release_nowait({"lease_id": lease, "ok": True, "prompt_tokens": 10, "output_tokens": 1})
        with pytest.raises(UnknownModelError):
            await pipe.schedule_raw({"model": "no-such-model"})  # answered after every release above
        async with httpx.AsyncClient() as c:
            workers = (await c.get(scheduler + "/v1/workers")).json()["workers"]
        assert sum(w["in_flight_leases"] for w in workers) == 0
    finally:
        pipe.close()


async def test_refused_connection_is_scheduler_unavailable():
    pipe = SchedulerPipe(f"http://127.0.0.1:{free_port()}", timeout_s=1)
    with pytest.raises(SchedulerUnavailableError):
        await pipe.schedule_raw({"model": "m"})
    pipe.close()


async def test_silent_scheduler_times_out():
    # A listening socket that never answers (a hung peer).
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        pipe = SchedulerPipe(f"http://127.0.0.1:{srv.getsockname()[1]}", timeout_s=0.2)
        with pytest.raises(SchedulerUnavailableError):
            await asyncio.wait_for(pipe.schedule_raw({"model": "m"}), 5)
        pipe.close()


async def test_parser_handles_answers_split_anywhere():
    pipe = SchedulerPipe("http://127.0.0.1:9", timeout_s=1)
    proto = _Pipe(pipe)
    loop = asyncio.get_running_loop()
    futs = [loop.create_future() for _ in range(3)]
    for f in futs:
        proto.pending.append((f, 0.0))
    proto.pending.insert(1, (None, 0.0))  # a fire-and-forget release in between
    answers = (
        b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n{"a":"one"}'
        b"HTTP/1.1 204 No Content\r\nServer: x\r\n\r\n"
        b'HTTP/1.1 503 Service Unavailable\r\ncontent-length: 13\r\n\r\n{"wait":true}'
        b"HTTP/1.1 404 Not Found\r\nContent-Length: 2\r\n\r\n{}"
    )
    for i in range(0, len(answers), 5):
        proto.data_received(answers[i : i + 5])
    assert [f.result() for f in futs] == [(200, b'{"a":"one"}'), (503, b'{"wait":true}'), (404, b"{}")]
    assert not proto.pending and not proto.buf


async def test_decision_for_a_cancelled_call_is_given_back(scheduler):
    pipe = SchedulerPipe(scheduler, timeout_s=5)
    try:
        await pipe.schedule_raw({"model": "m"})  # connect first
        async with httpx.AsyncClient() as c:

            async def leases() -> int:
                return sum(
                    w["in_flight_leases"]
                    for w in (await c.get(scheduler + "/v1/workers")).json()["workers"]
                )

            base = await leases()
            task = asyncio.ensure_future(pipe.schedule_raw({"model": "m"}))
            for _ in range(3):  # the call is written, its answer not read yet
                await asyncio.sleep(0)
            task.cancel()
            await asyncio.sleep(0.2)
            assert await leases() == base
    finally:
        pipe.close()
