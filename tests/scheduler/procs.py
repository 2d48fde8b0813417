"""Start real processes (sim workers, the scheduler) on 127.0.0.1 for integration tests."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    def __init__(self, args: list[str], name: str) -> None:
        self.args = args
        self.name = name
        self.log = tempfile.NamedTemporaryFile(prefix=f"{name}-", suffix=".log", delete=False)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        self.p = subprocess.Popen(
            [sys.executable, *args], cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT, env=env
        )

    def tail(self) -> str:
        return Path(self.log.name).read_text()[-3000:]

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGKILL)
        self.p.wait(10)

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


def get_json(url: str, timeout: float = 2.0):
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


def wait_until(pred, timeout: float, what: str, proc: Proc | None = None, step: float = 0.05):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = pred()
            if last:
                return last
        except OSError:
            pass
        if proc is not None and proc.p.poll() is not None:
            raise AssertionError(f"{proc.name} exited: {proc.tail()}")
        time.sleep(step)
    logs = f"\n{proc.tail()}" if proc else ""
    raise AssertionError(f"timed out waiting for {what} (last={last!r}){logs}")


def wait_http(url: str, proc: Proc, timeout: float = 90.0) -> None:
    def ok():
        with urllib.request.urlopen(url, timeout=1.0) as resp:
            return resp.status == 200

    wait_until(ok, timeout, url, proc, step=0.1)


def start_sim_worker(port: int, model: str, *extra: str) -> Proc:
    return Proc(["-m", "inference_worker", "--backend", "sim", "--sim-profile", "tiny",
                 "--served-model-name", model, "--port", str(port), *extra], f"worker-{port}")


def start_scheduler(port: int, *extra: str) -> Proc:
    return Proc(["-m", "scheduler", "--host", "127.0.0.1", "--port", str(port), *extra], f"scheduler-{port}")


def workers_by_id(base: str) -> dict[str, dict]:
    return {w["worker_id"]: w for w in get_json(f"{base}/v1/workers")["workers"]}
