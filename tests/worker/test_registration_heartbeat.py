"""The worker's heart-beat takes its interval from the scheduler's answer: an answer it cannot
use must neither end the heart-beating (the registration would lapse while the worker runs on,
healthy) nor make it a tight loop. A stand-in scheduler (a small aiohttp app on 127.0.0.1)
gives the answers."""

from __future__ import annotations

import asyncio
import math

import pytest
from aiohttp import web

from inference_worker.config import WorkerConfig
from inference_worker.registration import (
    DEFAULT_HEARTBEAT_S,
    HEARTBEAT_BOUNDS_S,
    Registrar,
    heartbeat_interval,
)


@pytest.mark.parametrize(
    ("value", "expected"),
    [(2, 2.0), (0.5, 0.5), (None, DEFAULT_HEARTBEAT_S), ("2", DEFAULT_HEARTBEAT_S),
     ([1], DEFAULT_HEARTBEAT_S), (True, DEFAULT_HEARTBEAT_S), (math.nan, DEFAULT_HEARTBEAT_S),
     (math.inf, DEFAULT_HEARTBEAT_S), (0, HEARTBEAT_BOUNDS_S[0]), (-5, HEARTBEAT_BOUNDS_S[0]),
     (1e12, HEARTBEAT_BOUNDS_S[1])],
)
def test_the_interval_is_a_bounded_number_or_the_default(value, expected):
    assert heartbeat_interval(value) == expected


async def _posts_in(interval: object, seconds: float) -> tuple[int, bool]:
    """Heart-beats a registrar sends in `seconds` to a scheduler answering `interval`, and
    whether its loop is still running then."""
    posts = 0

    async def register(_request: web.Request) -> web.Response:
        nonlocal posts
        posts += 1
        return web.json_response({"worker_id": "w0", "heartbeat_interval_s": interval}, status=200)

    app = web.Application()
    app.router.add_post("/v1/workers", register)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    registrar = Registrar(WorkerConfig(register_with=f"http://127.0.0.1:{port}"))
    try:
        await registrar.start()
        await asyncio.wait_for(registrar.registered.wait(), 5)
        await asyncio.sleep(seconds)
        running = registrar._task is not None and not registrar._task.done()
        return posts, running
    finally:
        registrar.worker_id = None  # nothing to DELETE at the stand-in
        await registrar.stop()
        await runner.cleanup()


async def test_an_interval_that_is_no_number_does_not_end_the_heart_beating():
    posts, running = await _posts_in([1], 0.3)
    assert running and posts >= 1


async def test_a_negative_interval_is_no_tight_loop():
    posts, running = await _posts_in(-1, 0.5)
    assert running and posts <= 0.5 / HEARTBEAT_BOUNDS_S[0] + 2, posts
