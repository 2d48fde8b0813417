"""The supervisor of the local stack, against real child processes (a tiny HTTP server)."""

from __future__ import annotations

import asyncio
import re
import sys

import pytest

from deploy.processes import ServiceSpec, StartupError, Supervisor
from tests.deploy.helpers import free_port, pid_alive, wait_until

CHILD = [sys.executable, "-m", "tests.deploy.child_server"]


def spec(name: str, *flags: str, port: int | None = None) -> ServiceSpec:
    port = port or free_port()
    return ServiceSpec(name, [*CHILD, str(port), *flags], f"http://127.0.0.1:{port}/health")


def grandchild_pids(lines: list[str]) -> list[int]:
    return [int(m.group(1)) for line in lines if (m := re.search(r"grandchild pid (\d+)", line))]


async def test_stage_healthy_logs_prefixed_and_stop_all_kills_groups():
    lines: list[str] = []
    sup = Supervisor(grace_s=5.0, emit=lines.append)
    try:
        await sup.start_stage([spec("alpha"), spec("beta")], timeout_s=30)
        await sup.start_stage([spec("gamma")], timeout_s=30)
        assert [c.name for c in sup.children] == ["alpha", "beta", "gamma"]
        assert all(c.running for c in sup.children)
        assert any(line.startswith("[alpha] listening on") for line in lines)
        assert any(line.startswith("[gamma] listening on") for line in lines)
    finally:
        pids = [c.pid for c in sup.children]
        await sup.stop_all()
    grandchildren = grandchild_pids(lines)
    assert len(grandchildren) == 3
    assert wait_until(lambda: not any(pid_alive(p) for p in [*pids, *grandchildren]), 5)
    # Reverse order: the last stage (gamma) is stopped first.
    stops = [line for line in lines if "[launcher] stopping" in line]
    assert "gamma" in stops[0]


async def test_child_ignoring_sigterm_is_killed_after_grace():
    lines: list[str] = []
    sup = Supervisor(grace_s=0.5, emit=lines.append)
    try:
        await sup.start_stage([spec("stubborn", "--ignore-sigterm")], timeout_s=30)
    finally:
        await sup.stop_all()
    child = sup.children[0]
    assert child.proc.returncode == -9
    assert any("ignored SIGTERM" in line for line in lines)
    assert not pid_alive(child.pid)


async def test_child_that_exits_during_startup_is_named_with_its_last_lines():
    sup = Supervisor(grace_s=2.0, emit=lambda _line: None)
    try:
        with pytest.raises(StartupError) as info:
            await sup.start_stage([spec("crasher", "--never-healthy", "--exit-after", "0.2")], timeout_s=30)
    finally:
        await sup.stop_all()
    assert info.value.name == "crasher"
    assert "exited with code 3" in str(info.value)
    assert "exiting on purpose" in str(info.value)


async def test_child_never_healthy_times_out_with_a_clear_error():
    sup = Supervisor(grace_s=2.0, emit=lambda _line: None)
    try:
        with pytest.raises(StartupError) as info:
            await sup.start_stage([spec("ok"), spec("sulky", "--never-healthy")], timeout_s=2)
    finally:
        await sup.stop_all()
    assert info.value.name == "sulky"
    assert "not healthy after 2 s" in str(info.value)
    assert "HTTP 503" in str(info.value)
    assert not any(c.running for c in sup.children)


async def test_watch_reports_the_child_that_died():
    sup = Supervisor(grace_s=2.0, emit=lambda _line: None)
    try:
        await sup.start_stage([spec("steady"), spec("fragile", "--exit-after", "1.0")], timeout_s=30)
        stop = asyncio.Event()
        dead = await asyncio.wait_for(sup.watch(stop), 30)
        assert dead is not None and dead.name == "fragile"
        assert dead.proc.returncode == 3
    finally:
        await sup.stop_all()
    assert not any(c.running for c in sup.children)


async def test_watch_ends_with_none_when_asked_to_stop():
    sup = Supervisor(grace_s=2.0, emit=lambda _line: None)
    try:
        await sup.start_stage([spec("steady")], timeout_s=30)
        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(0.3, stop.set)
        assert await asyncio.wait_for(sup.watch(stop), 10) is None
        assert sup.children[0].running
    finally:
        await sup.stop_all()


async def test_kill_all_cuts_the_grace_period_short():
    """A second Ctrl-C: SIGKILL now instead of waiting out a stubborn child's grace period."""
    lines: list[str] = []
    sup = Supervisor(grace_s=120.0, emit=lines.append)
    try:
        await sup.start_stage([spec("stubborn", "--ignore-sigterm")], timeout_s=30)
        stopping = asyncio.create_task(sup.stop_all())
        await asyncio.sleep(0.5)
        assert not stopping.done()  # still in the grace period: SIGTERM was ignored
        sup.kill_all()
        await asyncio.wait_for(stopping, 20)
    finally:
        await sup.stop_all()
    assert sup.children[0].proc.returncode == -9
    assert any("killing stubborn" in line for line in lines)


async def test_a_child_of_an_earlier_stage_dying_fails_the_stage_being_started():
    """A worker that died while the scheduler or the gateway was starting went unnoticed until
    the launcher had announced the stack ready; the start-up must fail, naming it."""
    lines: list[str] = []
    sup = Supervisor(grace_s=2.0, emit=lines.append)
    try:
        await sup.start_stage([spec("steady"), spec("fragile", "--exit-after", "1.0")], timeout_s=30)
        # The next stage never answers /health: only the death can end its start-up early.
        with pytest.raises(StartupError) as info:
            await asyncio.wait_for(sup.start_stage([spec("slow", "--never-healthy")], timeout_s=60), 30)
    finally:
        await sup.stop_all()
    assert info.value.name == "fragile"
    assert str(info.value).startswith("fragile exited with code 3 while slow was starting")
    assert "exiting on purpose" in str(info.value)  # its last log lines
    assert not any(c.running for c in sup.children)
    assert not any("slow is healthy" in line for line in lines)


async def test_an_earlier_child_dead_before_the_stage_is_started_fails_it_at_once():
    sup = Supervisor(grace_s=2.0, emit=lambda _line: None)
    try:
        await sup.start_stage([spec("fragile", "--exit-after", "0.5")], timeout_s=30)
        await asyncio.wait_for(sup.children[0].wait_exit(), 30)
        with pytest.raises(StartupError) as info:
            await asyncio.wait_for(sup.start_stage([spec("next")], timeout_s=30), 30)
    finally:
        await sup.stop_all()
    assert info.value.name == "fragile" and "while next was starting" in str(info.value)
