"""The chaos soak's failures: what is done to which process, when, and what was seen to happen.

Each fault is a signal to one process of a running `benchmarks.cluster.Cluster` at a fixed
time of the run, then its recovery:
- `kill`: SIGKILL, then the process is started again `recover_after_s` later (same command
  line, same port);
- `term`: SIGTERM (the process drains what it holds and exits), then it is started again
  `recover_after_s` after it exited;
- `stop`: SIGSTOP (a hung process: its connections open, nothing answered), then SIGCONT
  `recover_after_s` later.
The record keeps the evidence that it happened: the pid signalled, its exit status (-9 for a
SIGKILL), the process state seen while stopped, the new pid and when it served again; and,
when the injector is given a `before_signal` look, what the cluster held just before the
signal (e.g. the requests waiting in the gateways' queues when the scheduler is killed).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.cluster import Cluster, ManagedProcess

ACTIONS = {"kill": signal.SIGKILL, "term": signal.SIGTERM, "stop": signal.SIGSTOP}


@dataclass(frozen=True)
class Fault:
    at_s: float  # on the run's clock
    action: str  # kill | term | stop
    target: str  # worker<i> | scheduler | gateway<i> (0-based, as the cluster names them)
    recover_after_s: float

    @property
    def name(self) -> str:
        return f"{self.action} {self.target}"


@dataclass
class FaultRecord:
    """What was done and seen, on the run's clock (None: did not happen)."""

    fault: Fault
    pid: int | None = None
    signal_s: float | None = None
    exit_s: float | None = None
    exit_code: int | None = None
    stopped_state: str | None = None  # /proc state letter seen after SIGSTOP ("T": stopped)
    resumed_state: str | None = None  # ... and after SIGCONT
    restart_s: float | None = None
    ready_s: float | None = None  # the restarted process answered its health URL
    new_pid: int | None = None
    continued_s: float | None = None
    errors: list[str] = field(default_factory=list)
    before: dict[str, Any] | None = None  # the cluster's state just before the signal

    @property
    def recovered_s(self) -> float | None:
        """When the target was back: serving again, or continued."""
        return self.ready_s if self.fault.action != "stop" else self.continued_s

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["fault"] = {**asdict(self.fault), "name": self.fault.name}
        d["recovered_s"] = self.recovered_s
        return d


def process_of(cluster: Cluster, target: str) -> ManagedProcess:
    if target == "scheduler" and cluster.scheduler is not None:
        return cluster.scheduler
    for kind, procs in (("worker", cluster.workers), ("gateway", cluster.gateways)):
        if target.startswith(kind) and target[len(kind):].isdigit():
            index = int(target[len(kind):])
            if index < len(procs):
                return procs[index]
    raise ValueError(f"no process {target!r} in this cluster")


def proc_state(pid: int) -> str | None:
    """The state letter of /proc/<pid>/stat (R, S, T, Z, ...), None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[0]  # the name in brackets may hold spaces


class Injector:
    """Runs a schedule of faults against a cluster; `records` fills in as they happen."""

    def __init__(self, cluster: Cluster, faults: list[Fault], clock: float,
                 exit_wait_s: float = 90.0,
                 before_signal: Callable[[Fault], Awaitable[dict[str, Any] | None]] | None = None) -> None:
        self.cluster = cluster
        self.faults = faults
        self.clock = clock
        # Awaited just before each signal (its time is the look's cost: a few ms on 127.0.0.1).
        self.before_signal = before_signal
        # How long a SIGTERMed process may take to drain and exit (above every service's
        # --shutdown-timeout: the gateway's 50 s, a worker's 30 s).
        self.exit_wait_s = exit_wait_s
        self.records = [FaultRecord(f) for f in faults]
        for f in faults:
            process_of(cluster, f.target)  # a wrong target fails before the run, not during it
            if f.action not in ACTIONS:
                raise ValueError(f"unknown action {f.action!r}: choose from {sorted(ACTIONS)}")

    def now(self) -> float:
        return time.monotonic() - self.clock

    async def run(self) -> list[FaultRecord]:
        await asyncio.gather(*(self._one(r) for r in self.records))
        return self.records

    async def _one(self, rec: FaultRecord) -> None:
        await asyncio.sleep(max(0.0, rec.fault.at_s - self.now()))
        proc = process_of(self.cluster, rec.fault.target)
        try:
            if self.before_signal is not None:
                rec.before = await self.before_signal(rec.fault)
            if rec.fault.action == "stop":
                await self._hang(proc, rec)
            else:
                await self._end_and_restart(proc, rec)
        except Exception as exc:  # recorded: the run goes on, and the report says it
            rec.errors.append(f"{type(exc).__name__}: {exc}"[:500])

    async def _end_and_restart(self, proc: ManagedProcess, rec: FaultRecord) -> None:
        rec.pid = proc.send_signal(ACTIONS[rec.fault.action])
        rec.signal_s = self.now()
        rec.exit_code = await proc.wait_exit(self.exit_wait_s)
        if rec.exit_code is None:
            rec.errors.append(f"still running {self.exit_wait_s:.0f} s after the signal")
            return
        rec.exit_s = self.now()
        # A kill's pause counts from the signal, a drain's from its end.
        since = rec.signal_s if rec.fault.action == "kill" else rec.exit_s
        await asyncio.sleep(max(0.0, since + rec.fault.recover_after_s - self.now()))
        rec.restart_s = self.now()
        await self.cluster.restart(proc)
        rec.ready_s = self.now()
        rec.new_pid = proc.pid

    async def _hang(self, proc: ManagedProcess, rec: FaultRecord) -> None:
        rec.pid = proc.send_signal(signal.SIGSTOP)
        rec.signal_s = self.now()
        try:
            await asyncio.sleep(0.2)  # the kernel stops the group at once; look after a breath
            rec.stopped_state = proc_state(rec.pid)
            await asyncio.sleep(max(0.0, rec.signal_s + rec.fault.recover_after_s - self.now()))
        finally:
            # Always: a process left stopped would hold its requests until the cluster stops.
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGCONT)
                rec.continued_s = self.now()
        await asyncio.sleep(0.2)
        rec.resumed_state = proc_state(rec.pid)
