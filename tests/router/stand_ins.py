"""Worker stand-ins that misbehave on cue, in the test's own event loop, behind a real scheduler
and gateway on 127.0.0.1.

A stand-in serves the routes a test gives it, plus the echo worker's /health, /metrics and
/v1/models (benchmarks/echo_worker.py), so the real scheduler scrapes it like any worker."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
from aiohttp import web

from benchmarks.echo_worker import EchoWorker
from tests.router.procs import free_port, start_gateway, start_scheduler

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def serve_stand_in(routes: list[tuple[str, str, Handler]], echo: EchoWorker | None = None,
                         handler_cancellation: bool = False) -> tuple[web.AppRunner, str]:
    """Start one stand-in: `routes` as (method, path, handler). Returns its runner (the caller
    cleans it up) and its URL."""
    echo = echo or EchoWorker("m", 0.0, "stand-in")
    app = web.Application()
    for method, path, handler in routes:
        app.router.add_route(method, path, handler)
    app.router.add_get("/health", echo.health)
    app.router.add_get("/metrics", echo.metrics)
    app.router.add_get("/v1/models", echo.models)
    runner = web.AppRunner(app, handler_cancellation=handler_cancellation)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


# A stand-in: its routes, and the echo worker whose /health and /metrics it serves (the one its
# handlers answer with, so that the scrapes count its requests; None: a fresh one).
StandIn = tuple[list[tuple[str, str, Handler]], EchoWorker | None]


@contextlib.asynccontextmanager
async def stand_ins_behind_router(
    stand_ins: list[StandIn], gateway_args: tuple[str, ...] = (), scheduler_args: tuple[str, ...] = (),
    handler_cancellation: bool = False,
) -> AsyncIterator[tuple[str, str]]:
    """The stand-ins, a scheduler over them (scrapes every 100 ms) and a gateway: yields
    (scheduler URL, gateway URL) and stops everything after."""
    runners, urls, procs = [], [], []
    try:
        for routes, echo in stand_ins:
            runner, url = await serve_stand_in(routes, echo, handler_cancellation)
            runners.append(runner)
            urls.append(url)
        s, su = await asyncio.to_thread(start_scheduler, urls, "--scrape-interval-ms", "100", *scheduler_args)
        procs.append(s)
        g, gu = await asyncio.to_thread(start_gateway, "--scheduler", su, *gateway_args)
        procs.append(g)
        yield su, gu
    finally:
        for p in procs:
            p.stop()
        for runner in runners:
            await runner.cleanup()


async def until(check: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Poll `check` (run in a thread: it may do blocking HTTP) until true; fail after the timeout."""
    deadline = time.monotonic() + timeout_s
    while not await asyncio.to_thread(check):
        assert time.monotonic() < deadline, "never happened"
        await asyncio.sleep(0.05)


def open_leases(scheduler: str) -> int:
    """Leases the scheduler holds open over all its workers."""
    return sum(w["in_flight_leases"] for w in httpx.get(scheduler + "/v1/workers").json()["workers"])
