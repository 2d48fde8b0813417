"""Idle kept-alive connections and the cap on connections, on a real scheduler run with
--keepalive-timeout-s 0.5 --max-connections 3: an idle connection is closed 0.5 s after its
last answer (aiohttp's default kept it an hour), one in use (a held /v1/schedule call) is not;
a 4th connection at once gets a 503 in the OpenAI error shape with Retry-After and is closed,
the held calls on the first three go on, and once one closes a new one is served; /metrics
counts the refused."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from tests.router.connection_checks import (
    FLAGS,
    REFUSED_WARNING,
    assert_idle_closed,
    check_cap,
    long_request_then_idle,
    post,
)
from tests.router.procs import Proc, series_value, start_scheduler
from tests.router.slow_senders import HOST, log_count, read_answer

HOLD_MS = 5000  # time for the checks while the held calls hold the cap


@pytest.fixture(scope="module")
def scheduler():
    # One static worker that never answers, and a long start-up grace: a model no worker serves
    # is answered 'wait' meanwhile, so a /v1/schedule call with wait_ms is held that long.
    proc, url = start_scheduler(["http://127.0.0.1:9"], "--startup-grace-s", "600", *FLAGS)
    try:
        yield proc, url
    finally:
        proc.stop()


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


async def test_an_idle_connection_is_closed_after_the_keepalive_and_a_busy_one_is_not(
    scheduler: tuple[Proc, str]
) -> None:
    _, url = scheduler
    kept = await long_request_then_idle(_port(url), post("/v1/schedule", {"model": "m", "wait_ms": 1500}))
    assert kept.status == 503 and json.loads(kept.body)["wait"] is True, kept  # held, then 'wait'
    assert_idle_closed(kept)


async def test_past_the_cap_a_connection_gets_a_503_and_the_held_calls_go_on(
    scheduler: tuple[Proc, str]
) -> None:
    proc, url = scheduler
    port = _port(url)
    sent: list[float] = []
    warnings_before = log_count(proc.output(), REFUSED_WARNING)
    refused_before = await asyncio.to_thread(series_value, url, "scheduler_connections_refused_total")

    async def held_call() -> tuple[int, bytes]:
        reader, writer = await asyncio.open_connection(HOST, port)
        try:
            writer.write(post("/v1/schedule", {"model": "m", "wait_ms": HOLD_MS}))
            await writer.drain()
            sent.append(time.monotonic())
            return await read_answer(reader, bound_s=30)
        finally:
            writer.close()

    def taken() -> int:
        """Held calls sent 0.3 s ago (their answer comes at the end: the scheduler has them)."""
        return sum(1 for t in sent if time.monotonic() - t >= 0.3)

    answers = await check_cap(port, held_call, taken)
    for status, body in answers:
        assert status == 503 and json.loads(body)["wait"] is True, body  # held its whole time
    refused_now = await asyncio.to_thread(series_value, url, "scheduler_connections_refused_total")
    assert refused_now >= refused_before + 1
    assert log_count(proc.output(), REFUSED_WARNING) == warnings_before + 1
    assert "Traceback" not in proc.output()
