"""CPU accounting of the routing experiment: the /proc reader and the per-part cores table."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from benchmarks.proc_cpu import cpu_seconds, own_cpu_seconds
from benchmarks.routing_report import cpu_table


def test_cpu_seconds_counts_a_busy_child_and_not_a_sleeping_one():
    busy = subprocess.Popen([sys.executable, "-c", "import time\nt=time.time()\nwhile time.time()-t<5: pass"])
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"])
    try:
        time.sleep(0.3)  # both past interpreter start-up
        busy0, idle0 = cpu_seconds(busy.pid), cpu_seconds(idle.pid)
        time.sleep(1.0)
        assert cpu_seconds(busy.pid) - busy0 > 0.2  # a spinning process on a shared 2-core VM
        assert cpu_seconds(idle.pid) - idle0 < 0.05
    finally:
        busy.kill()
        idle.kill()
        busy.wait()
        idle.wait()
    with pytest.raises(OSError):
        cpu_seconds(busy.pid)  # reaped: gone


def test_own_cpu_seconds_grows_with_work_in_this_process():
    before = own_cpu_seconds()
    deadline = time.process_time() + 0.2
    while time.process_time() < deadline:
        pass
    assert own_cpu_seconds() - before >= 0.15
    assert abs(own_cpu_seconds() - cpu_seconds(os.getpid())) < 0.1  # the two readers agree


def test_cpu_table_gives_cores_per_part_and_router_cpu_per_request():
    cpu = {
        "baseline": {"workers": 90.0, "client": 30.0, "wall_s": 60.0},
        "llm_aware": {"workers": 90.0, "scheduler": 6.0, "gateway": 18.0, "client": 24.0, "wall_s": 60.0},
        "peer:x": {"workers": 90.0, "gateway": 3.0, "client": 24.0, "wall_s": 60.0},
        "broken": {},
    }
    results = {name: {"completed": 1000} for name in ("baseline", "llm_aware", "peer:x")}
    lines = cpu_table(cpu, results).splitlines()
    assert lines[0] == ("| policy | client run (s) | workers (cores) | scheduler (cores) | gateway (cores) "
                        "| client (cores) | router CPU per request (ms) |")
    rows = {line.split(" | ")[0].lstrip("| "): line for line in lines[2:]}
    assert set(rows) == {"baseline", "llm_aware", "peer:x"}  # no row without a measured run
    assert rows["baseline"] == "| baseline | 60.0 | 1.50 | - | - | 0.50 | - |"
    # (6 + 18) s over 1000 requests = 24 ms of router CPU each.
    assert rows["llm_aware"] == "| llm_aware | 60.0 | 1.50 | 0.10 | 0.30 | 0.40 | 24.00 |"
    assert rows["peer:x"] == "| peer:x | 60.0 | 1.50 | - | 0.05 | 0.40 | 3.00 |"
    assert cpu_table({}, results) == ""
