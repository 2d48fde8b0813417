"""benchmarks/api_fuzz.py's processes: two sim workers, a scheduler over them and a gateway on
127.0.0.1, their logs kept when the run failed."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
MODEL = "m"
REGISTRATION_TOKEN = "fuzz-registration-token"
# More than any answer here (9 MB of prompt tokenizes to 14 MB of ids): past it, not read on.
MAX_STREAM_BYTES = 64 << 20


# ---- the processes ---------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Proc:
    """A child process, its output kept in a temp file (read for tracebacks at the end)."""

    name: str
    url: str
    p: subprocess.Popen
    log: Path

    @classmethod
    def start(cls, name: str, module: str, *args: str) -> Proc:
        """`python -m module --port P args` with this project's Python."""
        return cls.launch(name, [sys.executable, "-m", module], list(args))

    @classmethod
    def launch(cls, name: str, command: list[str], args: list[str], env: dict[str, str] | None = None
               ) -> Proc:
        """`command --port P args` (another Python's server too: vLLM's), `env` added."""
        port = _free_port()
        log = Path(tempfile.mkstemp(prefix=f"fuzz-{name}-", suffix=".log")[1])
        full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
        with log.open("wb") as out:
            p = subprocess.Popen([*command, "--port", str(port), *args], cwd=REPO, stdout=out,
                                 stderr=subprocess.STDOUT, env=full_env, start_new_session=True)
        return cls(name, f"http://127.0.0.1:{port}", p, log)

    def alive(self) -> bool:
        return self.p.poll() is None

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_ready(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"{self.name} exited at start:\n{self.output()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=2).status_code < 500:
                    return
            time.sleep(0.1)
        raise TimeoutError(f"{self.name} not ready:\n{self.output()[-3000:]}")

    def stop(self) -> None:
        if self.alive():
            self.p.terminate()
            try:
                self.p.wait(10)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(5)


@dataclass
class Stack:
    workers: list[Proc]
    scheduler: Proc
    gateway: Proc

    @property
    def procs(self) -> list[Proc]:
        return [*self.workers, self.scheduler, self.gateway]


@contextlib.contextmanager
def sim_stack(start_timeout_s: float = 120.0, keep_logs: Callable[[], bool] = lambda: False
              ) -> Iterator[Stack]:
    """Two sim workers (tiny profile) serving MODEL, a scheduler over them, a gateway in front.
    Their logs are deleted after, unless keep_logs() says otherwise then."""
    procs: list[Proc] = []
    try:
        deadline = time.monotonic() + start_timeout_s
        workers = [Proc.start(f"worker{i}", "inference_worker", "--backend", "sim", "--sim-profile",
                              "tiny", "--served-model-name", MODEL) for i in range(2)]
        procs += workers
        for w in workers:
            w.wait_ready(deadline)
        sched = Proc.start("scheduler", "scheduler", "--workers", ",".join(w.url for w in workers),
                           "--scrape-interval-ms", "100", "--registration-token", REGISTRATION_TOKEN)
        procs.append(sched)
        sched.wait_ready(deadline)
        # Sessions by header and fair queueing on: their headers are read, and fuzzed too.
        gw = Proc.start("gateway", "router", "--scheduler", sched.url, "--session-header", "x-session-id",
                        "--fair-queueing")
        procs.append(gw)
        gw.wait_ready(deadline)
        yield Stack(workers, sched, gw)
    finally:
        for p in procs:
            p.stop()
        if keep_logs():
            print("process logs kept: " + ", ".join(f"{p.name} {p.log}" for p in procs))
        else:
            for p in procs:
                p.log.unlink(missing_ok=True)
