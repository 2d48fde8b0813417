"""The worker tests' launch_worker (tests/worker/conftest.py) starts a worker on a port
free_port() found free a moment before; one taken meanwhile (another test's listener, an
outgoing connection's ephemeral port) made the worker exit at start-up and failed every test of
the module that asked for it. It now starts the worker again on another port."""

from __future__ import annotations

import httpx
import pytest

import tests.worker.conftest as worker_conftest
from tests.taken_port import handed_out_first, taken_port


@pytest.fixture
def first_port_taken(monkeypatch):
    """free_port() hands out a port something already listens on, once, then real ones."""
    with taken_port() as port:
        monkeypatch.setattr(worker_conftest, "free_port", handed_out_first(port, worker_conftest.free_port))
        yield port


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
