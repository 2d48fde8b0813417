"""`python -m deploy.local` and its children after start-up: a Ctrl-C while a client streams, a
worker that dies. Real processes (sim workers) on 127.0.0.1."""

from __future__ import annotations

import json
import os
import re
import signal
import time

import httpx
import pytest

from tests.deploy.helpers import pid_alive, wait_until
from tests.deploy.stack import start_ready_stack, stop_stack

pytestmark = pytest.mark.timeout(240)


def long_stream_body(max_tokens: int = 400) -> dict:
    return {"model": "smollm2", "stream": True, "max_tokens": max_tokens, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Write a long story."}]}


def test_ctrl_c_during_a_stream_ends_it_with_an_error_event_not_a_dropped_connection():
    """The gateway drained for its own --shutdown-timeout (50 s) and the launcher SIGKILLed it
    after its grace period (here 5 s): the client's stream was cut with no error and no [DONE]."""
    # Stretched time: the 400-token answer (about 50 s) takes far longer than the grace period.
    stack = start_ready_stack(workers=1, extra=("--time-scale", "20"))
    try:
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


def busy_worker(stack) -> str:
    """The URL of the worker the scheduler shows serving a request (waits for one)."""
    found: list[str] = []

    def look() -> bool:
        workers = httpx.get(f"{stack.scheduler}/v1/workers", timeout=5, trust_env=False).json()["workers"]
        found[:] = [w["url"] for w in workers
                    if w["in_flight_leases"] or (w["snapshot"] or {}).get("running")]
        return bool(found)

    assert wait_until(look, 30)
    return found[0]


def healthy_workers(stack) -> set[str]:
    workers = httpx.get(f"{stack.scheduler}/v1/workers", timeout=5, trust_env=False).json()["workers"]
    return {w["url"] for w in workers if w["healthy"]}


def test_a_worker_that_dies_is_started_again_and_the_others_keep_serving():
    """One worker's crash stopped the whole stack: the gateway cut the stream a healthy worker
    was serving, and the launcher exited."""
    stack = start_ready_stack(workers=2, extra=("--time-scale", "20"))
    try:
        pids = stack.child_pids()
        events: list[str] = []
        with httpx.Client(trust_env=False, timeout=httpx.Timeout(60)) as client:
            with client.stream("POST", f"{stack.gateway}/v1/chat/completions",
                               json=long_stream_body(60)) as resp:
                assert resp.status_code == 200
                serving = busy_worker(stack)
                victim = f"worker-{1 - stack.workers.index(serving)}"
                os.kill(pids[victim], signal.SIGKILL)
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
        assert events[-1] == "[DONE]", events[-3:]
        assert not any('"error"' in e for e in events), [e for e in events if '"error"' in e]
        assert stack.wait_for_line(f"[launcher] {victim} exited with code -9; starting it again", 10)
        assert stack.proc.poll() is None, stack.output()[-3000:]
        assert stack.wait_for_line(f"[launcher] {victim} is healthy again", 60), stack.output()[-3000:]
        new_pid = stack.child_pids()[victim]
        assert new_pid != pids[victim] and pid_alive(new_pid)
        assert wait_until(lambda: healthy_workers(stack) == set(stack.workers), 30)
        # The restarted worker is stopped with the others.
        stack.proc.send_signal(signal.SIGINT)
        assert stack.proc.wait(60) == 0
        assert wait_until(lambda: not any(pid_alive(p) for p in stack.child_pids().values()), 10)
    finally:
        stop_stack(stack)


def test_a_worker_that_dies_again_soon_after_its_restart_stops_the_stack():
    """A crash loop is not restarted forever: the launcher stops and says so."""
    stack = start_ready_stack(workers=1)
    try:
        os.kill(stack.child_pids()["worker-0"], signal.SIGKILL)
        assert stack.wait_for_line("[launcher] worker-0 is healthy again", 60), stack.output()[-3000:]
        os.kill(stack.child_pids()["worker-0"], signal.SIGKILL)
        assert stack.proc.wait(60) == 1
        assert re.search(r"\[launcher\] error: worker-0 exited with code -9 again \d+ s after its restart; "
                         r"stopping the rest", stack.output()), stack.output()[-3000:]
        assert wait_until(lambda: not any(pid_alive(p) for p in stack.child_pids().values()), 10)
    finally:
        stop_stack(stack)
