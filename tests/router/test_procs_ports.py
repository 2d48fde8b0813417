"""The process tests' helpers (tests/router/procs.py) start a child on a port free_port() found
free a moment before; one taken meanwhile (another test's listener, an outgoing connection's
ephemeral port) made the child exit at start-up and failed the test that asked for it. The
helpers now start it again on another port."""

from __future__ import annotations

import httpx
import pytest

import tests.router.procs as procs
from tests.taken_port import handed_out_first, taken_port


@pytest.fixture
def first_port_taken(monkeypatch):
    """free_port() hands out a port something already listens on, once, then real ones."""
    with taken_port() as port:
        monkeypatch.setattr(procs, "free_port", handed_out_first(port, procs.free_port))
        yield port


@pytest.mark.parametrize("start", ["echo", "sim"])
def test_a_port_taken_before_the_child_binds_it_costs_a_restart_not_the_test(first_port_taken, start):
    p, url = procs.start_echo_worker() if start == "echo" else procs.start_sim_worker()
    try:
        assert url != f"http://127.0.0.1:{first_port_taken}"
        body = {"model": "m", "prompt": "hi", "max_tokens": 2}
        r = httpx.post(url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
    finally:
        p.stop()
