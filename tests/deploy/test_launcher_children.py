"""`python -m deploy.local` and its children after start-up: a Ctrl-C while a client streams.
Real processes (sim workers) on 127.0.0.1."""

from __future__ import annotations

import json
import signal
import time

import httpx
import pytest

from tests.deploy.stack import start_stack, stop_stack, wait_ready

pytestmark = pytest.mark.timeout(240)


def long_stream_body(max_tokens: int = 400) -> dict:
    return {"model": "smollm2", "stream": True, "max_tokens": max_tokens, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Write a long story."}]}


def test_ctrl_c_during_a_stream_ends_it_with_an_error_event_not_a_dropped_connection():
    """The gateway drained for its own --shutdown-timeout (50 s) and the launcher SIGKILLed it
    after its grace period (here 5 s): the client's stream was cut with no error and no [DONE]."""
    # Stretched time: the 400-token answer (about 50 s) takes far longer than the grace period.
    stack = start_stack(workers=1, extra=("--time-scale", "20"))
    try:
        wait_ready(stack)
        events: list[str] = []
        with httpx.Client(trust_env=False, timeout=httpx.Timeout(60)) as client:
            with client.stream("POST", f"{stack.gateway}/v1/chat/completions",
                               json=long_stream_body()) as resp:
                assert resp.status_code == 200
                lines = resp.iter_lines()
                for line in lines:
                    if line.startswith("data: "):
                        events.append(line[6:])
                        break
                stack.proc.send_signal(signal.SIGINT)
                started = time.monotonic()
                for line in lines:  # raised RemoteProtocolError: the gateway was killed mid-stream
                    if line.startswith("data: "):
                        events.append(line[6:])
        took = time.monotonic() - started
        assert stack.proc.wait(30) == 0
        out = stack.output()
        assert "ignored SIGTERM" not in out, out[-3000:]
        last = [e for e in events if e != "[DONE]"][-1]
        assert json.loads(last)["error"]["code"] == "shutting_down", events[-3:]
        assert took < 5 + 1, took  # within the launcher's grace period
    finally:
        stop_stack(stack)

