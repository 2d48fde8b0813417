"""The deploy tests' start_ready_stack (tests/deploy/stack.py) starts the launcher on ports
free_ports() found free a moment before; one taken meanwhile (another test's listener, an
outgoing connection's ephemeral port) stopped the launcher and failed the test. It now starts
the stack again on other ports."""

from __future__ import annotations

import httpx
import pytest

import tests.deploy.stack as stack_module
from tests.taken_port import taken_port

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def gateway_port_taken(monkeypatch):
    """The first gateway port handed out is one something already listens on."""
    real = stack_module.free_ports
    first = [True]
    with taken_port() as port:

        def free_ports(n: int) -> list[int]:
            ports = real(n)
            if first.pop() if first else False:
                ports[0] = port
            return ports

        monkeypatch.setattr(stack_module, "free_ports", free_ports)
        yield port


def counted_starts(monkeypatch) -> list[tuple]:
    starts: list[tuple] = []
    real_start = stack_module.start_stack
    monkeypatch.setattr(stack_module, "start_stack", lambda *a: starts.append(a) or real_start(*a))
    return starts


def test_a_port_taken_before_the_launcher_binds_it_costs_a_restart(gateway_port_taken, monkeypatch):
    starts = counted_starts(monkeypatch)
    stack = stack_module.start_ready_stack(workers=1)
    try:
        assert len(starts) == 2  # the launcher refused the taken port; the second start served
        assert stack.gateway_port != gateway_port_taken
        body = {"model": "smollm2", "prompt": "hi", "max_tokens": 2}
        r = httpx.post(stack.gateway + "/v1/completions", json=body, timeout=60, trust_env=False)
        assert r.status_code == 200, r.text
    finally:
        stack_module.stop_stack(stack)


def test_a_launcher_that_fails_for_another_reason_is_not_started_again(monkeypatch):
    starts = counted_starts(monkeypatch)
    with pytest.raises(AssertionError, match="launcher exited"):
        stack_module.start_ready_stack(workers=1, extra=("--sim-profile", "no-such-profile"))
    assert len(starts) == 1
