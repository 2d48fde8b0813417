"""Run `python -m deploy.local` as a real process and read what it prints."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.deploy.helpers import REPO, consecutive_free_ports, free_ports, pid_alive, wait_until

READY = "LLM router ready"
# A port free_ports() found free can be taken before the launcher's child binds it (another
# test's listener, an outgoing connection's ephemeral port): the stack is started again.
PORT_TRIES = 3


@dataclass
class LocalStack:
    proc: subprocess.Popen
    gateway_port: int
    scheduler_port: int
    worker_ports: list[int]
    lines: list[str] = field(default_factory=list)
    ok_requests: int = 0  # successful requests sent through the gateway by the tests
    completion_tokens: int = 0  # sum of usage.completion_tokens those requests returned
    admin_token: str = ""  # the gateway's, from the launcher's --admin-token-file ("" for none)
    pump: threading.Thread | None = None  # reads the launcher's output into lines

    @property
    def gateway(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}"

    @property
    def scheduler(self) -> str:
        return f"http://127.0.0.1:{self.scheduler_port}"

    @property
    def workers(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.worker_ports]

    def output(self) -> str:
        return "\n".join(self.lines)

    def child_pids(self) -> dict[str, int]:
        """{name: pid} from the launcher's "started <name> (pid N)" lines."""
        pids = {}
        for line in list(self.lines):
            if m := re.match(r"\[launcher\] started (\S+) \(pid (\d+)\)", line):
                pids[m.group(1)] = int(m.group(2))
        return pids

    def wait_for_line(self, needle: str, timeout_s: float) -> bool:
        return wait_until(lambda: any(needle in line for line in list(self.lines)), timeout_s)


def start_stack(workers: int = 2, extra: tuple[str, ...] = (),
                admin_token_file: str = os.devnull, scheduler_token: str = "") -> LocalStack:
    """The launcher on free ports. Its admin token comes from `admin_token_file` (none by default),
    never from the developer's deploy/prometheus/gateway-admin-token or ROUTER_ADMIN_TOKEN; its
    scheduler's gateway token is `scheduler_token` ("" for none), never one of the developer's."""
    gateway_port, scheduler_port = free_ports(2)
    base = consecutive_free_ports(workers)
    argv = [sys.executable, "-m", "deploy.local", "--backend", "sim", "--workers", str(workers),
            "--gateway-port", str(gateway_port), "--scheduler-port", str(scheduler_port),
            "--base-worker-port", str(base), "--startup-timeout", "120", "--grace-period", "5",
            "--admin-token-file", admin_token_file, *extra]
    inherited = ("ROUTER_ADMIN_TOKEN", "SCHEDULER_GATEWAY_TOKEN", "ROUTER_SCHEDULER_TOKEN")
    env = {k: v for k, v in os.environ.items() if k not in inherited}
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**env, "HF_HUB_OFFLINE": "1", "SCHEDULER_GATEWAY_TOKEN": scheduler_token})
    stack = LocalStack(proc, gateway_port, scheduler_port, list(range(base, base + workers)),
                       admin_token=Path(admin_token_file).read_text().strip())

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            stack.lines.append(line.rstrip("\n"))

    stack.pump = threading.Thread(target=pump, daemon=True)
    stack.pump.start()
    return stack


def start_ready_stack(workers: int = 2, extra: tuple[str, ...] = (), admin_token_file: str = os.devnull,
                      scheduler_token: str = "", timeout_s: float = 150) -> LocalStack:
    """start_stack, then wait_ready. A launcher that stopped because one of its ports was taken
    after free_ports() chose it is started again on other ports, not the test failed."""
    for attempt in range(1, PORT_TRIES + 1):
        stack = start_stack(workers, extra, admin_token_file, scheduler_token)
        try:
            wait_ready(stack, timeout_s)
            return stack
        except BaseException:
            exited = stack.proc.poll() is not None
            stop_stack(stack)
            if stack.pump is not None:
                stack.pump.join(5)  # the launcher's last lines, which say why it stopped
            if not (exited and attempt < PORT_TRIES and lost_port_race(stack.output())):
                raise
    raise AssertionError("unreachable: the last attempt returns or raises")


def lost_port_race(launcher_output: str) -> bool:
    """The launcher's own check ("port N (gateway) is already in use") or a child's bind error
    ("address already in use", in the child's last log lines the launcher prints)."""
    return "already in use" in launcher_output.lower()


def wait_ready(stack: LocalStack, timeout_s: float = 150) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(READY in line for line in list(stack.lines)):
            return
        if stack.proc.poll() is not None:
            raise AssertionError(f"launcher exited with {stack.proc.returncode}:\n{stack.output()[-4000:]}")
        time.sleep(0.2)
    raise AssertionError(f"stack not ready after {timeout_s} s:\n{stack.output()[-4000:]}")


def stop_stack(stack: LocalStack) -> None:
    """Safety net for fixtures: SIGINT, then SIGKILL anything (and any group) still alive."""
    if stack.proc.poll() is None:
        stack.proc.send_signal(signal.SIGINT)
        try:
            stack.proc.wait(30)
        except subprocess.TimeoutExpired:
            stack.proc.kill()
            stack.proc.wait(10)
    for pid in stack.child_pids().values():
        if pid_alive(pid):
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
