"""`python -m deploy.local` when something goes wrong: a busy port, a child that cannot
start, a child that dies later. Real processes (sim workers) on 127.0.0.1."""

from __future__ import annotations

import contextlib
import os
import pty
import re
import select
import signal
import socket
import subprocess
import sys
import time

import pytest

from deploy import local
from deploy.processes import port_is_free
from tests.deploy.helpers import REPO, consecutive_free_ports, free_ports, pid_alive, wait_until
from tests.deploy.stack import start_ready_stack, start_stack, stop_stack

pytestmark = pytest.mark.timeout(240)


def run_launcher(*flags: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deploy.local", "--backend", "sim",
                           "--admin-token-file", os.devnull, *flags], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout_s)


def test_busy_port_is_named_before_anything_starts():
    gateway, scheduler, worker = free_ports(3)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", gateway))
        sock.listen()
        out = run_launcher("--workers", "1", "--gateway-port", str(gateway), "--scheduler-port",
                           str(scheduler), "--base-worker-port", str(worker))
    assert out.returncode == 2
    assert f"port {gateway} (gateway) is already in use" in out.stdout
    assert "started" not in out.stdout


def test_a_port_whose_connections_linger_in_time_wait_is_free():
    """A stack stopped a moment ago leaves its served connections in TIME_WAIT for a minute;
    `make run` again must not call its ports busy (the services bind with SO_REUSEADDR)."""
    (port,) = free_ports(1)
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as asyncio's servers do
        listener.bind(("127.0.0.1", port))
        listener.listen()
        client = socket.create_connection(("127.0.0.1", port))
        served, _ = listener.accept()
        served.close()  # the server closes first: its side of the connection goes to TIME_WAIT
        client.recv(1)  # the server's FIN has arrived
        client.close()
        assert not port_is_free(port)  # listening: busy
    time.sleep(0.1)  # the client's FIN acknowledged
    assert port_is_free(port)


def test_bad_flags_are_refused_by_the_launcher():
    out = run_launcher("--workers", "0")
    assert out.returncode == 2 and "--workers must be at least 1" in out.stderr
    out = subprocess.run([sys.executable, "-m", "deploy.local", "--time-scale", "2"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "need --backend sim" in out.stderr


@pytest.mark.parametrize(("flags", "message"), [
    # A port out of range was an OverflowError traceback; 0 waited for /health on port 0.
    (["--gateway-port", "70000"], "--gateway-port must be from 1 to 65535"),
    (["--scheduler-port", "0"], "--scheduler-port must be from 1 to 65535"),
    (["--base-worker-port", "65535", "--workers", "2"], "leaves no room for 2 workers"),
    # nan passed every comparison: SIGKILL at once, every stage failed with no reason given.
    (["--grace-period", "nan"], "--grace-period must be a finite number"),
    (["--startup-timeout", "nan"], "--startup-timeout must be a finite number"),
    (["--time-scale", "inf"], "--time-scale must be a finite number"),
])
def test_bad_numbers_are_one_message_before_anything_starts(flags, message):
    out = run_launcher(*flags, timeout_s=60)
    assert out.returncode == 2 and message in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and "started" not in out.stdout


def test_a_bad_admin_token_file_is_one_message_before_anything_starts(tmp_path):
    out = run_launcher("--admin-token-file", str(tmp_path / "missing"), timeout_s=60)
    assert out.returncode == 2 and "--admin-token-file: cannot read" in out.stderr, out.stderr
    two = tmp_path / "two"
    two.write_text("token-one\ntoken-two\n")  # Prometheus would send both lines as one token
    out = run_launcher("--admin-token-file", str(two), timeout_s=60)
    assert out.returncode == 2 and "must hold one token" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and "started" not in out.stdout


def test_an_admin_token_in_the_environment_must_be_the_files(tmp_path):
    """The gateway inherits ROUTER_ADMIN_TOKEN, while Prometheus sends the file's token: two
    different tokens were a 401 at every scrape. One source: the file."""
    token = tmp_path / "token"
    token.write_text("file-token\n")
    env = {**os.environ, "ROUTER_ADMIN_TOKEN": "shell-token"}
    out = subprocess.run([sys.executable, "-m", "deploy.local", "--backend", "sim", "--admin-token-file",
                          str(token)], cwd=REPO, capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 2 and "ROUTER_ADMIN_TOKEN is set but" in out.stderr, out.stderr
    assert "shell-token" not in out.stderr + out.stdout and "file-token" not in out.stderr + out.stdout


def test_a_child_that_cannot_start_is_named_with_its_last_log_lines():
    gateway, scheduler, worker = free_ports(3)
    out = run_launcher("--workers", "1", "--sim-profile", "no-such-profile", "--gateway-port", str(gateway),
                       "--scheduler-port", str(scheduler), "--base-worker-port", str(worker))
    assert out.returncode == 1
    assert "[launcher] error: worker-0 failed to start: exited with code" in out.stdout
    assert "last log lines of worker-0:" in out.stdout
    assert "no-such-profile" in out.stdout.split("last log lines of worker-0:")[1]
    assert "started scheduler" not in out.stdout  # later stages never start


def test_a_child_dying_stops_the_rest_and_fails_the_launcher():
    stack = start_ready_stack(workers=1)
    try:
        pids = stack.child_pids()
        assert set(pids) == {"worker-0", "scheduler", "gateway"}
        subprocess.run(["kill", "-KILL", str(pids["scheduler"])], check=True)
        assert stack.proc.wait(60) == 1
        assert "[launcher] error: scheduler exited with code -9; stopping the rest" in stack.output()
        assert wait_until(lambda: not any(pid_alive(p) for p in pids.values()), 10)
    finally:
        stop_stack(stack)


def test_a_worker_dying_while_a_later_stage_starts_fails_the_start_up():
    """It printed "ready" over a stack that had lost a worker while the scheduler started, and
    only then noticed; it must fail the start-up naming the worker, and stop the rest."""
    stack = start_stack(workers=1)
    try:
        assert stack.wait_for_line("[launcher] started scheduler", 150), stack.output()[-3000:]
        pids = stack.child_pids()
        # The scheduler (then the gateway) takes a Python start-up or more to answer /health.
        subprocess.run(["kill", "-KILL", str(pids["worker-0"])], check=True)
        assert stack.proc.wait(60) == 1
        out = stack.output()
        assert re.search(r"\[launcher\] error: worker-0 exited with code -9 while (scheduler|gateway) "
                         r"was starting", out), out[-3000:]
        assert "last log lines of worker-0:" in out
        assert "LLM router ready" not in out
        assert wait_until(lambda: not any(pid_alive(p) for p in stack.child_pids().values()), 10)
    finally:
        stop_stack(stack)


def test_sigterm_stops_the_stack_like_ctrl_c():
    stack = start_ready_stack(workers=1)
    try:
        pids = stack.child_pids()
        stack.proc.send_signal(signal.SIGTERM)
        assert stack.proc.wait(60) == 0
        assert wait_until(lambda: not any(pid_alive(p) for p in pids.values()), 10)
    finally:
        stop_stack(stack)


def read_pty_until(fd: int, needle: str, timeout_s: float) -> str:
    """What the launcher wrote to its terminal, up to `needle` (or the deadline, or its exit)."""
    out = b""
    deadline = time.monotonic() + timeout_s
    while needle.encode() not in out and time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.5)
        if not ready:
            continue
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # EIO: the launcher exited and closed the terminal
            break
        if not chunk:
            break
        out += chunk
    return out.decode(errors="replace")


def test_closing_the_terminal_stops_every_child():
    """`make run` in a terminal that is closed (or an ssh session that ends): the launcher is
    hung up (SIGHUP, then EIO on every write to the terminal) and must still stop its children,
    which run in their own sessions and get no SIGHUP of their own."""
    gateway, scheduler = free_ports(2)
    base = consecutive_free_ports(1)
    argv = [sys.executable, "-m", "deploy.local", "--backend", "sim", "--workers", "1",
            "--gateway-port", str(gateway), "--scheduler-port", str(scheduler),
            "--base-worker-port", str(base), "--startup-timeout", "120", "--grace-period", "5",
            "--admin-token-file", os.devnull]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    pid, fd = pty.fork()  # the launcher's controlling terminal is this pty, as in a real terminal
    if pid == 0:  # the child: become the launcher (never returns)
        os.chdir(REPO)
        os.execve(sys.executable, argv, env)
    pids: dict[str, int] = {}
    try:
        out = read_pty_until(fd, "LLM router ready", 150)
        started = re.finditer(r"\[launcher\] started (\S+) \(pid (\d+)\)", out)
        pids = {m.group(1): int(m.group(2)) for m in started}
        assert "LLM router ready" in out and set(pids) == {"worker-0", "scheduler", "gateway"}, out[-3000:]
        os.close(fd)  # the terminal goes away: the kernel hangs up its session
        fd = -1
        assert wait_until(lambda: os.waitpid(pid, os.WNOHANG)[0] == pid, 60), "the launcher did not exit"
        assert wait_until(lambda: not any(pid_alive(p) for p in pids.values()), 10), \
            {name: p for name, p in pids.items() if pid_alive(p)}
    finally:
        if fd >= 0:
            os.close(fd)
        for child in [pid, *pids.values()]:  # safety net: nothing of this test outlives it
            if pid_alive(child):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)


def test_a_launcher_killed_outright_takes_its_children_with_it():
    """SIGKILL (or the OOM killer) runs no cleanup in the launcher: the kernel's parent-death
    signal must stop the children, or their ports stay taken for the next `make run`."""
    stack = start_ready_stack(workers=1)
    try:
        pids = stack.child_pids()
        assert set(pids) == {"worker-0", "scheduler", "gateway"}
        stack.proc.kill()
        stack.proc.wait(10)
        # SIGTERM: the idle worker drains nothing and exits at once; 45 s covers a slow machine.
        assert wait_until(lambda: not any(pid_alive(p) for p in pids.values()), 45), \
            {name: p for name, p in pids.items() if pid_alive(p)}
        ports = [stack.gateway_port, stack.scheduler_port, *stack.worker_ports]
        assert all(port_is_free(port) for port in ports)
    finally:
        stop_stack(stack)


@pytest.mark.parametrize("env", ["ROUTER_API_KEYS", "ROUTER_API_KEY_FILE"])
def test_the_banner_examples_send_a_key_when_the_gateway_wants_one(monkeypatch, env):
    """The gateway inherits the launcher's environment: with API keys set there, the examples
    as pasted got a 401."""
    args = local.parse_args([])
    monkeypatch.delenv("ROUTER_API_KEYS", raising=False)
    monkeypatch.delenv("ROUTER_API_KEY_FILE", raising=False)
    plain = local.banner(args)
    assert 'api_key="unused"' in plain and "Authorization" not in plain
    monkeypatch.setenv(env, "k1")
    keyed = local.banner(args)
    assert 'Authorization: Bearer $API_KEY' in keyed
    assert 'import os; from openai import OpenAI' in keyed and 'api_key=os.environ["API_KEY"]' in keyed
