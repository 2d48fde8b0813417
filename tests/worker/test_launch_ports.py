"""The worker tests' launch_worker (tests/worker/conftest.py) starts a worker on a port
free_port() found free a moment before; one taken meanwhile (another test's listener, an
outgoing connection's ephemeral port) made the worker exit at start-up and failed every test of
the module that asked for it. It now starts the worker again on another port."""

from __future__ import annotations

import socket

import httpx
import pytest

import tests.worker.conftest as worker_conftest


@pytest.fixture
def first_port_taken(monkeypatch):
    """free_port() hands out a port something already listens on, once, then real ones."""
    taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    real = worker_conftest.free_port
    handed = iter([port])
    monkeypatch.setattr(worker_conftest, "free_port", lambda: next(handed, None) or real())
    yield port
    taken.close()


def test_a_port_taken_before_the_worker_binds_it_costs_a_restart_not_the_test(first_port_taken):
    with worker_conftest.launch_worker("--backend", "sim", "--sim-profile", "tiny", model="m") as w:
        assert w.base_url != f"http://127.0.0.1:{first_port_taken}"
        body = {"model": "m", "prompt": "hi", "max_tokens": 2}
        r = httpx.post(w.api_url + "/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text


def test_a_worker_that_fails_for_another_reason_is_not_started_again(monkeypatch):
    starts = []
    real_start = worker_conftest._start_worker
    monkeypatch.setattr(worker_conftest, "_start_worker", lambda *a: starts.append(a) or real_start(*a))
    with pytest.raises(RuntimeError, match="exited"), \
            worker_conftest.launch_worker("--backend", "sim", "--sim-profile", "no-such-profile", model="m"):
        pass
    assert len(starts) == 1
