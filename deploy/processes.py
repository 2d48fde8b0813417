"""Supervise a handful of child processes for the local stack.

Each child runs in its own process group (its own session), so a Ctrl-C in the
terminal reaches only the launcher, which then stops the children in order;
and stopping a child signals its whole group, so nothing it spawned survives.
The children's stdout/stderr are forwarded line by line with a `[name]` prefix,
and the last lines are kept so a start-up failure can show why.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import socket
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

TAIL_LINES = 40
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_launcher(launcher_pid: int) -> Callable[[], None] | None:
    """A preexec_fn that has the kernel SIGTERM the child when the launcher dies (Linux).

    A launcher that is killed outright (SIGKILL, the OOM killer) runs no cleanup, and its
    children, each in its own session, got no signal at all: they kept running with their
    ports held, and the next `make run` found every port in use. The death signal is tied to
    the thread that forks, the event loop's (the main) thread, which lives as long as the
    launcher does.
    """
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)  # loaded here: the forked child only calls it

    def preexec() -> None:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != launcher_pid:  # the launcher died before prctl: no signal will come
            os._exit(1)

    return preexec


class StartupError(RuntimeError):
    """The stack did not come up: a child did not become healthy, or one already healthy died
    while a later stage started. The message names it and shows its last log lines."""

    def __init__(self, name: str, why: str, tail: list[str], headline: str | None = None):
        self.name = name
        self.why = why
        self.tail = tail
        shown = "\n".join(f"    {line}" for line in tail[-20:]) or "    (no output)"
        headline = headline or f"{name} failed to start: {why}"
        super().__init__(f"{headline}\n  last log lines of {name}:\n{shown}")


@dataclass
class ServiceSpec:
    name: str
    argv: list[str]
    health_url: str
    env: dict[str, str] = field(default_factory=dict)


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # As the services' own listeners do (asyncio sets it): connections of a stack stopped
        # moments ago linger in TIME_WAIT and must not count as "in use"; a listener still does.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


class ManagedProcess:
    """One child: started in its own process group, logs forwarded, stoppable as a group."""

    def __init__(self, spec: ServiceSpec, emit: Callable[[str], None]):
        self.spec = spec
        self._emit = emit
        self.proc: asyncio.subprocess.Process | None = None
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self._reader: asyncio.Task | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    async def start(self) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.spec.env}
        self.proc = await asyncio.create_subprocess_exec(
            *self.spec.argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env=env,
            start_new_session=True,  # own process group: terminal signals skip it
            preexec_fn=die_with_launcher(os.getpid()),
        )
        self._reader = asyncio.create_task(self._forward_logs(), name=f"logs-{self.name}")

    async def _forward_logs(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        prefix = f"[{self.name}] "
        while True:
            try:
                raw = await self.proc.stdout.readline()
            except ValueError:  # a line longer than the stream limit: skip the rest of it
                continue
            if not raw:
                return
            line = raw.decode(errors="replace").rstrip()
            self.tail.append(line)
            self._emit(prefix + line)

    async def wait_exit(self) -> int:
        """Wait for the child itself to exit. Not `proc.wait()`: that also waits until the
        output pipe closes, which never happens while a grandchild still holds it."""
        assert self.proc is not None
        while self.proc.returncode is None:  # noqa: ASYNC110 (asyncio has no exit-only event)
            await asyncio.sleep(0.1)
        return self.proc.returncode

    async def wait(self) -> int:
        code = await self.wait_exit()
        if self._reader is not None:
            # The pipe closes when the last holder exits; don't wait on grandchildren forever.
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._reader), 2.0)
        return code

    async def wait_healthy(self, client: httpx.AsyncClient, timeout_s: float) -> None:
        """Poll the health URL until it answers 200; fail fast if the child exits."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        last_error = "no answer yet"
        while time.monotonic() < deadline:
            if self.proc.returncode is not None:
                await self.wait()
                raise StartupError(self.name, f"exited with code {self.proc.returncode}", list(self.tail))
            try:
                resp = await client.get(self.spec.health_url, timeout=2.0)
                if resp.status_code == 200:
                    return
                last_error = f"{self.spec.health_url} answered HTTP {resp.status_code}"
            except httpx.HTTPError as exc:
                last_error = f"{self.spec.health_url}: {type(exc).__name__}"
            await asyncio.sleep(0.2)
        raise StartupError(
            self.name, f"not healthy after {timeout_s:.0f} s (last: {last_error})", list(self.tail)
        )

    def signal_group(self, sig: signal.Signals) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    async def stop(self, grace_s: float) -> None:
        """SIGTERM the child's group, then SIGKILL it if the child outlives the grace period."""
        if self.proc is None:
            return
        if self.proc.returncode is None:
            self.signal_group(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.wait_exit(), grace_s)
            except TimeoutError:
                self._emit(f"[launcher] {self.name} ignored SIGTERM for {grace_s:.0f} s; sending SIGKILL")
        # Also reap any grandchild left in the group (the child itself may already be gone).
        self.signal_group(signal.SIGKILL)
        await self.wait()


def print_line(line: str) -> None:
    try:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()
    except (OSError, ValueError):
        # Our reader went away: a closed pipe (`| head`), or a hung-up terminal (EIO), where the
        # launcher still has to stop its children. Keep supervising.
        pass


class Supervisor:
    """Starts stages of children in order, watches them, stops all of them on the way out."""

    def __init__(self, grace_s: float = 10.0, emit: Callable[[str], None] = print_line):
        self.grace_s = grace_s
        self.emit = emit
        self.stages: list[list[ManagedProcess]] = []

    @property
    def children(self) -> list[ManagedProcess]:
        return [child for stage in self.stages for child in stage]

    async def start_stage(self, specs: list[ServiceSpec], timeout_s: float) -> None:
        """Start the specs together and wait until every one is healthy (or raise StartupError)."""
        stage = [ManagedProcess(spec, self.emit) for spec in specs]
        self.stages.append(stage)  # before starting, so a cancelled start-up still gets cleaned up
        for child in stage:
            await child.start()
            self.emit(f"[launcher] started {child.name} (pid {child.pid}): {' '.join(child.spec.argv)}")
        # The children of earlier stages are watched too: a worker that died while the scheduler
        # or the gateway started went unnoticed until after the "ready" banner, which then
        # announced a stack that had already lost a part.
        earlier = [child for child in self.children if child not in stage]
        async with httpx.AsyncClient(trust_env=False) as client:
            checks = [asyncio.create_task(child.wait_healthy(client, timeout_s)) for child in stage]
            deaths = [asyncio.create_task(self._died_during(child, stage)) for child in earlier]
            # gather() ends at the stage's first failure (or once all are healthy); a death never
            # ends well, so it is waited beside it rather than in it.
            healthy = asyncio.ensure_future(asyncio.gather(*checks))
            try:
                # The first failure wins; the other checks are cancelled, not left polling.
                done, _ = await asyncio.wait([healthy, *deaths], return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    task.result()
            finally:
                for task in [*checks, *deaths]:
                    task.cancel()
                await asyncio.gather(healthy, *checks, *deaths, return_exceptions=True)
        # One whose exit was seen just after the stage's last check answered counts too.
        for child in earlier:
            if not child.running:
                await self._died_during(child, stage)
        for child in stage:
            self.emit(f"[launcher] {child.name} is healthy at {child.spec.health_url}")

    @staticmethod
    async def _died_during(child: ManagedProcess, stage: list[ManagedProcess]) -> None:
        """Wait for an earlier stage's child to exit, then fail the stage that was starting."""
        code = await child.wait()
        starting = ", ".join(c.name for c in stage)
        raise StartupError(
            child.name, f"exited with code {code}", list(child.tail),
            headline=f"{child.name} exited with code {code} while {starting} was starting",
        )

    async def watch(self, stop: asyncio.Event) -> ManagedProcess | None:
        """Block until `stop` is set (returns None) or a child exits (returns that child)."""
        waits = {asyncio.create_task(child.wait()): child for child in self.children}
        stopper = asyncio.create_task(stop.wait())
        done, _ = await asyncio.wait([*waits, stopper], return_when=asyncio.FIRST_COMPLETED)
        for task in [*waits, stopper]:
            if task not in done:
                task.cancel()
        dead = [waits[t] for t in done if t in waits]
        return dead[0] if dead else None

    async def restart(self, child: ManagedProcess) -> None:
        """Start an exited child again, in its place (it is stopped with its stage)."""
        await child.wait()
        await child.start()
        self.emit(f"[launcher] started {child.name} (pid {child.pid}): {' '.join(child.spec.argv)}")

    def kill_all(self) -> None:
        """SIGKILL every child's group now (a second Ctrl-C: the user does not want to wait)."""
        for child in self.children:
            if child.running:
                self.emit(f"[launcher] killing {child.name} (pid {child.pid})")
            child.signal_group(signal.SIGKILL)

    async def stop_all(self) -> None:
        """Stop stage by stage in reverse order (front door first, so no new work reaches
        dying workers); the children of one stage stop together."""
        for stage in reversed(self.stages):
            for child in stage:
                if child.running:
                    self.emit(f"[launcher] stopping {child.name} (pid {child.pid})")
            await asyncio.gather(*(child.stop(self.grace_s) for child in stage))
