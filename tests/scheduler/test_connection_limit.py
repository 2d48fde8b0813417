"""scheduler/connection_limit.py and its worker twin, in process: the open-file limit raised to
the hard one, the default cap drawn from it, the cap's counts, its WARNING at most once per
interval, its metrics; and --keepalive-timeout-s / --max-connections in the three services'
configurations. (The services themselves: the test_connection_hygiene.py modules.)"""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
import time

import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest

from inference_worker.config import load_worker_config
from inference_worker.server import connection_limit as worker_connection_limit
from inference_worker.server import http_errors as worker_http_errors
from router.config import load_router_config
from scheduler import connection_limit as scheduler_connection_limit
from scheduler import http_errors as scheduler_http_errors
from scheduler.app import connection_error
from scheduler.config import load_scheduler_config
from tests.router.procs import REPO

TWINS = [scheduler_connection_limit, worker_connection_limit]
twins = pytest.mark.parametrize("mod", TWINS, ids=["scheduler", "worker"])


@twins
@pytest.mark.parametrize(("fd_limit", "per_connection", "cap"), [
    (20_000, 1, 20_000 - 256),
    (20_000, 2, (20_000 - 256) // 2),  # the gateway: one upstream connection per client request
    (1024, 1, 768),
    (1024, 2, 384),
    (256, 1, 192),  # a small limit keeps a quarter, not all of it
    (-1, 2, 0),  # unlimited: no cap
])
def test_the_default_cap_leaves_room_for_the_services_own_descriptors(mod, fd_limit, per_connection, cap):
    assert mod.default_max_connections(fd_limit, per_connection) == cap


@twins
def test_the_soft_open_file_limit_is_raised_to_the_hard_one(mod):
    # In a child: this process's limit is left alone.
    code = (
        "import json, resource\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, hard, 256), hard))\n"
        f"from {mod.__name__} import raise_fd_limit\n"
        "print(json.dumps([raise_fd_limit(), resource.getrlimit(resource.RLIMIT_NOFILE), hard]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    got, now, hard = json.loads(out.stdout)
    if hard == -1:  # unlimited: the soft limit stays
        assert got == [256, 256], out.stdout
    else:
        assert got == [min(256, hard), hard] and now == [hard, hard], out.stdout


class _FakeResource:
    """A stand-in for the resource module where the hard open-file limit is unlimited (macOS's
    default), which an unprivileged process on Linux cannot set up: a soft limit over `maximum`
    (the kernel's own per-process bound) is refused, as setrlimit refuses it there."""

    RLIMIT_NOFILE = 7
    RLIM_INFINITY = -1

    def __init__(self, soft: int, maximum: int) -> None:
        self.limits = (soft, self.RLIM_INFINITY)
        self.maximum = maximum

    def getrlimit(self, which: int) -> tuple[int, int]:
        assert which == self.RLIMIT_NOFILE
        return self.limits

    def setrlimit(self, which: int, limits: tuple[int, int]) -> None:
        assert which == self.RLIMIT_NOFILE and limits[1] == self.RLIM_INFINITY  # the hard one kept
        if limits[0] > self.maximum:
            raise ValueError("current limit exceeds maximum limit")
        self.limits = limits


@twins
@pytest.mark.parametrize(("maximum", "raised"), [(10_240, 10_240), (100_000, 65_536), (2_000_000, 1 << 20)])
def test_under_an_unlimited_hard_limit_the_soft_one_is_raised_as_far_as_the_system_takes(
        mod, monkeypatch, maximum, raised):
    fake = _FakeResource(256, maximum)
    monkeypatch.setattr(mod, "resource", fake)
    assert mod.raise_fd_limit() == (256, raised)
    assert fake.limits == (raised, fake.RLIM_INFINITY)
    # A soft limit already above every try, or a system that takes none of them: left as it is.
    monkeypatch.setattr(mod, "resource", _FakeResource(2_000_000, 10**9))
    assert mod.raise_fd_limit() == (2_000_000, 2_000_000)
    stuck = _FakeResource(256, 1024)
    monkeypatch.setattr(mod, "resource", stuck)
    assert mod.raise_fd_limit() == (256, 256) and stuck.limits == (256, stuck.RLIM_INFINITY)


@twins
def test_the_start_up_cap_is_the_given_one_or_drawn_from_the_raised_limit(mod, monkeypatch):
    monkeypatch.setattr(mod, "raise_fd_limit", lambda: (1024, 4096))
    drawn = mod.connection_budget(None, 2)
    assert drawn.max_connections == (4096 - 256) // 2
    assert drawn.describe() == ("open-file limit 4096 (raised from 1024); serving at most 1920 client "
                                "connections at once (by default; --max-connections sets it)")
    given = mod.connection_budget(7, 2)
    assert given.max_connections == 7
    assert "at most 7 client connections at once (--max-connections)" in given.describe()
    assert "any number of" in mod.connection_budget(0, 2).describe()
    monkeypatch.setattr(mod, "raise_fd_limit", lambda: (-1, -1))
    assert mod.connection_budget(None, 1).describe().startswith("open-file limit none; ")


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@twins
def test_the_cap_counts_open_and_refused_and_warns_once_an_interval(mod, monkeypatch, caplog):
    clock = _Clock()
    monkeypatch.setattr(mod, "time", clock)
    log = logging.getLogger("test.connection_limit")
    cap = mod.ConnectionCap(2, log)
    with caplog.at_level(logging.WARNING, logger=log.name):
        assert cap.admit() and cap.admit()
        assert [cap.admit() for _ in range(50)] == [False] * 50  # a flood: one line
        assert (cap.open, cap.refused) == (2, 50)
        clock.now += mod.REFUSED_LOG_INTERVAL_S
        assert not cap.admit()  # an interval later: the next line, with the count since
        cap.release()
        assert cap.admit()  # one closed: room for one
        assert not cap.admit()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert "(1 refused since the last such line, 0 dropped in all)" in lines[0]
    assert "(50 refused since the last such line, 0 dropped in all)" in lines[1]
    assert (cap.open, cap.refused) == (2, 52)


@twins
def test_no_cap_admits_every_connection(mod):
    cap = mod.ConnectionCap(0, logging.getLogger("test.connection_limit"))
    assert all(cap.admit() for _ in range(10_000))
    assert (cap.open, cap.refused) == (10_000, 0)


@twins
def test_the_metrics_read_the_cap(mod):
    cap = mod.ConnectionCap(3, logging.getLogger("test.connection_limit"))
    for _ in range(5):
        cap.admit()
    registry = CollectorRegistry()
    registry.register(cap.collector("svc"))
    page = generate_latest(registry).decode()
    for line in ("svc_connections_open 3.0", "svc_connections_max 3.0", "svc_connections_refused_total 2.0"):
        assert line in page.splitlines(), page


def _runner(mod, app: web.Application, **kwargs) -> web.AppRunner:
    if mod is scheduler_connection_limit:
        return scheduler_http_errors.OpenAIErrorAppRunner(
            app, answer=connection_error, log=logging.getLogger("test.connection_limit"), **kwargs)
    return worker_http_errors.OpenAIErrorAppRunner(app, **kwargs)


async def _serve_one_connection(mod) -> tuple[web.AppRunner, int]:
    """A runner serving `GET /` on 127.0.0.1 with a cap of one connection (the receive timeout
    and keep-alive long), and its port."""

    async def ok(_request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/", ok)
    runner = _runner(mod, app, max_connections=1, receive_timeout_s=60.0, keepalive_timeout=60.0)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]


@twins
async def test_a_refused_connection_that_sends_nothing_is_not_waited_for_long(mod, monkeypatch):
    """The receive timeout (60 s here) is for a served connection's head; one beyond the cap
    gets REFUSED_HEAD_TIMEOUT_S (0.3 s here), so a flood of silent connections does not hold
    descriptors past the cap for a minute."""
    monkeypatch.setattr(mod, "REFUSED_HEAD_TIMEOUT_S", 0.3)
    runner, port = await _serve_one_connection(mod)
    served_r, served_w = await asyncio.open_connection("127.0.0.1", port)
    refused_r, refused_w = await asyncio.open_connection("127.0.0.1", port)
    try:
        start = time.monotonic()
        assert await asyncio.wait_for(refused_r.read(), 10) == b""  # closed, nothing said
        assert 0.2 <= time.monotonic() - start <= 5, time.monotonic() - start
        served_w.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")  # the served one waited on
        assert (await asyncio.wait_for(served_r.readuntil(b"\r\n\r\n"), 10)).startswith(b"HTTP/1.1 200")
        assert (runner.connections.open, runner.connections.refused) == (1, 1)
    finally:
        served_w.close()
        refused_w.close()
        await runner.cleanup()


@twins
async def test_refusals_answered_at_once_are_bounded_and_past_them_a_connection_is_dropped(mod):
    """A refused connection may hold its descriptor a few seconds while it is answered: past
    max_refusing of them at once, a new one is dropped unanswered, so a flood of refused
    connections cannot take the descriptors the cap keeps; the answers resume as they end."""
    runner, port = await _serve_one_connection(mod)
    cap = runner.connections
    cap.max_refusing = 2
    opened: list[asyncio.StreamWriter] = []

    async def connect() -> asyncio.StreamReader:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        opened.append(writer)
        return reader

    try:
        await connect()  # served: the cap
        silent = [await connect() for _ in range(2)]  # refused, waiting for a head (2 s)
        for _ in range(100):  # bounded: until the server has seen both
            if cap.refusing == 2:
                break
            await asyncio.sleep(0.02)
        assert (cap.open, cap.refusing, cap.dropped) == (1, 2, 0)
        dropped = await connect()
        start = time.monotonic()
        try:
            said = await asyncio.wait_for(dropped.read(), 5)
        except ConnectionResetError:
            said = b""
        assert said == b"" and time.monotonic() - start < 1.5  # at once, not after a head's wait
        assert (cap.refused, cap.dropped) == (3, 1)
        for reader in silent:  # their heads' time runs out: closed, and no longer being answered
            assert await asyncio.wait_for(reader.read(), 10) == b""
        for _ in range(100):
            if cap.refusing == 0:
                break
            await asyncio.sleep(0.02)
        answered = await connect()  # answered again
        opened[-1].write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await asyncio.wait_for(answered.readuntil(b"\r\n\r\n"), 10)).startswith(b"HTTP/1.1 503")
        assert cap.dropped == 1
    finally:
        for writer in opened:
            writer.close()
        await runner.cleanup()
    assert (cap.open, cap.refusing) == (0, 0)


LOADERS = {
    "gateway": (load_router_config, ["--workers", "http://127.0.0.1:1"], "ROUTER_"),
    "scheduler": (load_scheduler_config, [], "SCHEDULER_"),
    "worker": (load_worker_config, [], "WORKER_"),
}
loaders = pytest.mark.parametrize("service", list(LOADERS))


@loaders
def test_the_settings_default_and_parse(service, monkeypatch):
    load, base, env = LOADERS[service]
    cfg = load(base)
    assert (cfg.keepalive_timeout_s, cfg.max_connections) == (75.0, None)  # None: from the limit
    cfg = load([*base, "--keepalive-timeout-s", "0.5", "--max-connections", "3"])
    assert (cfg.keepalive_timeout_s, cfg.max_connections) == (0.5, 3)
    monkeypatch.setenv(env + "MAX_CONNECTIONS", "0")  # no cap
    monkeypatch.setenv(env + "KEEPALIVE_TIMEOUT_S", "120")
    cfg = load(base)
    assert (cfg.keepalive_timeout_s, cfg.max_connections) == (120.0, 0)


@loaders
@pytest.mark.parametrize(("argv", "field", "why"), [
    (["--max-connections", "-1"], "max-connections", "greater than or equal to 0"),
    (["--max-connections", "many"], "max-connections", "valid integer"),
    (["--keepalive-timeout-s", "-1"], "keepalive-timeout-s", "greater than 0"),
    # aiohttp's 0 answers keep-alive and closes right after: refused, not taken as "off".
    (["--keepalive-timeout-s", "0"], "keepalive-timeout-s", "greater than 0"),
    (["--keepalive-timeout-s", "inf"], "keepalive-timeout-s", "finite"),
])
def test_bad_values_are_refused_naming_the_field(service, argv, field, why):
    load, base, _ = LOADERS[service]
    with pytest.raises(SystemExit) as exc:
        load([*base, *argv])
    message = str(exc.value)
    assert message.startswith(f"error: invalid value for {field}: ") and why in message, message
