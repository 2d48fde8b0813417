"""CPU seconds used by processes, from /proc (Linux), for the benchmarks that charge each part
of a run (workers, scheduler, gateway, client) with what it cost.

On a shared machine the parts compete for the same cores, so a router's own CPU is part of
what it costs the engines behind it: the routing experiment reports it beside the latencies.
"""

from __future__ import annotations

import os
import resource
from pathlib import Path

TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """user + system CPU seconds of a process, all its threads (fields 14 and 15 of
    /proc/<pid>/stat). Raises OSError when the process is gone."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS_PER_S


def own_cpu_seconds() -> float:
    """user + system CPU seconds of this process."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def descendants(pid: int) -> list[int]:
    """Every live descendant of a process (children of each of its threads, recursively)."""
    out: list[int] = []
    stack = [pid]
    while stack:
        parent = stack.pop()
        try:
            tasks = list(Path(f"/proc/{parent}/task").iterdir())
        except OSError:
            continue
        for task in tasks:
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            out += children
            stack += children
    return out


def tree_cpu_seconds(pid: int) -> float:
    """cpu_seconds of a process and its live descendants (a vLLM server runs its engine in a
    child process; a child that already exited is not counted). Raises OSError when the
    process itself is gone."""
    total = cpu_seconds(pid)
    for child in descendants(pid):
        try:
            total += cpu_seconds(child)
        except OSError:
            pass  # exited between the listing and the read
    return total
