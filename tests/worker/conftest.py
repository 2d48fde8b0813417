"""Shared helpers for the worker's integration tests: start a real
`python -m inference_worker` on 127.0.0.1 and talk to its /metrics.

`launch_worker(*flags)` is a context manager; tests use it from module-scoped
fixtures so each module starts its worker(s) once.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.worker.model_under_test import TEST_DEVICE_FLAGS, TEST_MODEL

REPO = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 180.0  # a cold start converts the GGUF once (~20 s); 2 busy cores can be slow

SIM_AVAILABLE = importlib.util.find_spec("inference_worker.sim") is not None
SIM_SKIP_REASON = "the sim backend (inference_worker/sim) is not importable yet"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Worker:
    base_url: str
    process: subprocess.Popen
    log_path: Path

    @property
    def api_url(self) -> str:
        return f"{self.base_url}/v1"

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metrics_text(self) -> str:
        return httpx.get(f"{self.base_url}/metrics", timeout=30).text

    def metrics(self) -> dict[tuple[str, tuple], float]:
        """Every sample as {(sample name, sorted non-base labels): value}."""
        return parse_samples(self.metrics_text())


def parse_samples(text: str) -> dict[tuple[str, tuple], float]:
    samples: dict[tuple[str, tuple], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("engine", "model_name")))
            samples[(s.name, labels)] = s.value
    return samples


def sample(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


PORT_TRIES = 3  # a port free_port() found free can be taken before the worker binds it


@contextlib.contextmanager
def launch_worker(*flags: str, model: str = "smollm2", served_as: str | None = None) -> Iterator[Worker]:
    """Start a worker with `flags`, wait for /health, stop it (SIGTERM, then SIGKILL) afterwards.
    The API names the model `served_as` (default: `model`). A worker that lost its port to
    another process before binding it is started again on another one."""
    for attempt in range(1, PORT_TRIES + 1):
        worker = _start_worker(flags, model, served_as or model)
        try:
            wait_healthy(worker)
            break
        except BaseException as exc:
            _stop(worker)
            output = worker.output()
            _forget(worker)
            if not (isinstance(exc, RuntimeError) and attempt < PORT_TRIES and lost_port_race(output)):
                raise
    try:
        yield worker
    finally:
        _stop(worker)
        _forget(worker)


def lost_port_race(log_text: str) -> bool:
    return "address already in use" in log_text.lower()


def _start_worker(flags: tuple[str, ...], model: str, served_as: str) -> Worker:
    port = free_port()
    log_fd, log_name = tempfile.mkstemp(prefix="worker-", suffix=".log")
    args = [sys.executable, "-m", "inference_worker", "--model", model, "--served-model-name", served_as]
    args += ["--host", "127.0.0.1", "--port", str(port), *flags]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    try:
        process = subprocess.Popen(args, cwd=REPO, stdout=log_fd, stderr=subprocess.STDOUT, env=env)
    finally:
        os.close(log_fd)  # the child has its own copy
    return Worker(f"http://127.0.0.1:{port}", process, Path(log_name))


def _stop(worker: Worker) -> None:
    process = worker.process
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


def _forget(worker: Worker) -> None:
    worker.log_path.unlink(missing_ok=True)


def wait_healthy(worker: Worker) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if worker.process.poll() is not None:
            raise RuntimeError(f"worker exited with {worker.process.returncode}:\n{worker.output()[-4000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{worker.base_url}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.2)
    raise TimeoutError(f"worker not healthy after {STARTUP_TIMEOUT_S}s:\n{worker.output()[-4000:]}")


def wait_for(predicate, timeout_s: float, interval_s: float = 0.05, what: str = "condition"):
    """Poll `predicate` until it returns a truthy value (returned) or time runs out."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(interval_s)


# One real-model worker (model_under_test.py: which weights, which device) shared by the server
# and metrics test modules (a torch start costs 10-30 s on a busy 2-core machine).
# --max-num-seqs 2 is what the in-flight gauge test needs; the metrics tests compare deltas, so
# the modules do not disturb each other.
SHARED_TORCH_FLAGS = ("--max-num-seqs", "2")


@pytest.fixture(scope="session")
def shared_torch_worker() -> Iterator[Worker]:
    flags = (*SHARED_TORCH_FLAGS, *TEST_DEVICE_FLAGS)
    with launch_worker(*flags, model=TEST_MODEL, served_as="smollm2") as worker:
        yield worker
