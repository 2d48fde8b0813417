"""Start real processes on 127.0.0.1 for the gateway tests and stop them reliably."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A child process with its output in a temp file (read it when a test fails)."""

    def __init__(self, args: list[str], name: str, env: dict | None = None,
                 python: str = sys.executable) -> None:
        self.name = name
        self.args = args
        self.log = tempfile.NamedTemporaryFile(prefix=f"{name}-", suffix=".log", delete=False)
        full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
        self.p = subprocess.Popen(
            [python, *args], cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT, env=full_env,
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.p.pid

    def output(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def alive(self) -> bool:
        return self.p.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.alive():
            self.p.send_signal(sig)
            try:
                self.p.wait(10)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(5)

    def stop(self) -> None:
        self.kill(signal.SIGTERM)
        Path(self.log.name).unlink(missing_ok=True)


def wait_http(url: str, proc: Proc | None = None, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        if proc is not None and not proc.alive():
            raise RuntimeError(f"{proc.name} exited early:\n{proc.output()[-3000:]}")
        try:
            r = httpx.get(url, timeout=2)
            if r.status_code < 500:
                return
        except httpx.HTTPError as exc:
            last = exc
        time.sleep(0.1)
    out = proc.output()[-3000:] if proc else ""
    raise TimeoutError(f"{url} not ready after {timeout_s}s ({last!r})\n{out}")


# free_port() gives a port free when asked; something else may take it before the child binds
# it (another test's listener, an outgoing connection's ephemeral port: the same range). The
# child then exits at once, and is started again on another port, a few times at most.
PORT_TRIES = 3


def _lost_port_race(proc: Proc) -> bool:
    proc.p.wait(10)
    return "address already in use" in proc.output().lower()


def start_on_free_port(args_for: Callable[[int], list[str]], name: str, port: int | None = None,
                       env: dict | None = None, timeout_s: float = 60.0) -> tuple[Proc, str]:
    """A child serving /health on 127.0.0.1: on `port`, or on a free port (another one if that
    was taken before the child bound it)."""
    for attempt in range(1, PORT_TRIES + 1):
        chosen = port or free_port()
        p = Proc(args_for(chosen), f"{name}-{chosen}", env=env)
        url = f"http://127.0.0.1:{chosen}"
        try:
            wait_http(url + "/health", p, timeout_s)
            return p, url
        except RuntimeError:
            if port is not None or attempt == PORT_TRIES or not _lost_port_race(p):
                raise
            p.stop()
    raise AssertionError("unreachable: the last attempt returns or raises")



def poll_until(pred, what: str, timeout_s: float = 30.0):
    """pred()'s first truthy value, polled every 50 ms; the test fails naming `what` past the
    timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        last = pred()
        if last:
            return last
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def scheduler_workers(scheduler: str) -> dict[str, dict]:
    """The scheduler's GET /v1/workers, by worker id."""
    return {w["worker_id"]: w for w in httpx.get(scheduler + "/v1/workers", timeout=5).json()["workers"]}


def series_value(url: str, series: str, default: float | None = None) -> float:
    """One series of the /metrics page at `url`, named as the page writes it (with its labels,
    e.g. 'router_prompt_tokens_total{model="m"}'). Absent: `default`, or the test fails."""
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    if default is None:
        raise AssertionError(f"{series} is not on {url}/metrics")
    return default

def start_echo_worker(
    model: str = "m", token_delay_ms: float = 0.0, max_running: int = 0
) -> tuple[Proc, str]:
    return start_on_free_port(
        lambda port: ["-m", "benchmarks.echo_worker", "--port", str(port), "--model", model,
                      "--token-delay-ms", str(token_delay_ms), "--max-running", str(max_running)], "echo")


def start_gateway(*args: str, env: dict | None = None) -> tuple[Proc, str]:
    return start_on_free_port(
        lambda port: ["-m", "router", "--port", str(port), "--log-stats-interval", "5", *args], "gateway",
        env=env)


def start_sim_worker(model: str = "m", *extra: str) -> tuple[Proc, str]:
    return start_sim_workers(1, model, *extra)[0]


def start_sim_workers(n: int, model: str = "m", *extra: str) -> list[tuple[Proc, str]]:
    """n sim workers started in parallel (each takes seconds to import its stack)."""
    def args_for(port: int) -> list[str]:
        return ["-m", "inference_worker", "--backend", "sim", "--sim-profile", "tiny",
                "--served-model-name", model, "--port", str(port), *extra]

    started = []
    for _ in range(n):
        port = free_port()
        started.append((Proc(args_for(port), f"sim-{port}"), f"http://127.0.0.1:{port}"))
    try:
        for i, (p, url) in enumerate(started):
            try:
                wait_http(url + "/health", p, timeout_s=120)
            except RuntimeError:
                if not _lost_port_race(p):
                    raise
                p.stop()  # its port was taken before it bound it: this one alone again
                started[i] = start_on_free_port(args_for, "sim", timeout_s=120)
    except BaseException:
        for p, _ in started:
            p.stop()
        raise
    return started


def start_scheduler(workers: list[str], *extra: str, port: int | None = None) -> tuple[Proc, str]:
    return start_on_free_port(
        lambda chosen: ["-m", "scheduler", "--port", str(chosen), "--workers", ",".join(workers), *extra],
        "scheduler", port)


@contextlib.contextmanager
def gateway_over_an_echo_worker(mode: str) -> Iterator[tuple[str, Proc]]:
    """A gateway over one echo worker (model "m"): through a scheduler ("scheduled") or as its
    static --workers ("static"). Yields the gateway's URL and process; stops all afterwards."""
    worker, worker_url = start_echo_worker()
    procs = [worker]
    try:
        if mode == "scheduled":
            scheduler, scheduler_url = start_scheduler([worker_url], "--scrape-interval-ms", "100")
            procs.append(scheduler)
            gw, url = start_gateway("--scheduler", scheduler_url)
        else:
            gw, url = start_gateway("--workers", worker_url)
        procs.append(gw)
        yield url, gw
    finally:
        for p in reversed(procs):
            p.stop()


def scheduler_over_two_echo_workers() -> Iterator[str]:
    """A scheduler (100 ms scrapes) over two echo workers, for a module fixture: yields its URL,
    stops all three afterwards."""
    w1, u1 = start_echo_worker()
    w2, u2 = start_echo_worker()
    s, su = start_scheduler([u1, u2], "--scrape-interval-ms", "100")
    try:
        yield su
    finally:
        for p in (s, w1, w2):
            p.stop()


@dataclass
class SimStack:
    workers: dict[str, Proc]  # by URL
    scheduler: str
    gateway: str
    gateway_proc: Proc


@contextlib.contextmanager
def sim_stack(n: int, *worker_flags: str, gateway_flags: tuple[str, ...] = (),
              scheduler_flags: tuple[str, ...] = ()) -> Iterator[SimStack]:
    """n sim workers serving model "m", a scheduler over them (100 ms scrapes) and a gateway
    in front; all stopped afterwards."""
    procs: list[Proc] = []
    try:
        workers = start_sim_workers(n, "m", *worker_flags)
        procs += [p for p, _ in workers]
        s, su = start_scheduler([u for _, u in workers], "--scrape-interval-ms", "100", *scheduler_flags)
        procs.append(s)
        g, gu = start_gateway("--scheduler", su, *gateway_flags)
        procs.append(g)
        yield SimStack({u: p for p, u in workers}, su, gu, g)
    finally:
        for p in procs:
            p.stop()
