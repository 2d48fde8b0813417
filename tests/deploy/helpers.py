"""Small helpers shared by the deploy tests (ports, pids, polling, the measured policy config)."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
# llm_aware's settings measured in benchmarks/RESULTS.md, which the deploy configs must carry.
MEASURED = yaml.safe_load((REPO / "benchmarks" / "configs" / "llm_aware.yaml").read_text())["policy_params"]
# What the deploy configs set for llm_aware: the engine-bound prefill cap (the rest are code defaults).
DEPLOY_PARAMS = {"max_prefill_backlog": MEASURED["max_prefill_backlog"]}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def free_ports(n: int) -> list[int]:
    """n distinct free ports (held open together so they differ)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def consecutive_free_ports(n: int, attempts: int = 50) -> int:
    """A base port b such that b .. b+n-1 are all free (the launcher numbers workers this way)."""
    for _ in range(attempts):
        base = free_port()
        if base + n > 65535:
            continue
        socks = []
        try:
            for port in range(base, base + n):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError(f"no {n} consecutive free ports found")


def pid_alive(pid: int) -> bool:
    """True if the process exists and is not a zombie (a killed, not yet reaped process is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    state = stat.rsplit(")", 1)[1].split()[0]
    return state not in ("Z", "X")


def wait_until(predicate: Callable[[], bool], timeout_s: float, interval_s: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()


def stop_process(proc: subprocess.Popen, timeout_s: float = 15) -> None:
    """SIGTERM, then SIGKILL if it has not gone within timeout_s."""
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
