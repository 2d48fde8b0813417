"""A stored response whose worker is lost: it died, it hangs, it restarted with an empty store,
or it left the pool. A response lives only in its worker's memory, so the gateway cannot bring
it back; what it owes the client is an answer that says so, the same for every call on the
response: GET (whole, or its replay with stream=true), cancel, DELETE, and a follow-up that
continues it (`previous_response_id`).

- Owner unreachable (dead, hung, restarting) while still in the pool: 503
  `worker_unavailable` with Retry-After, at once or as soon as the scheduler finds it down (a
  hung one held a GET for the first-byte timeout and a replay for ever).
- Owner answers that it no longer holds the response (restarted), or is unreachable and left
  the pool: 404 `response_lost`, naming the worker and the cause; remembered, so later calls
  say the same instead of a bare "not found".
- Owner left the pool but still up (draining): its responses can still be read; only a
  follow-up is refused (it cannot be placed there).

Real processes on 127.0.0.1: sim workers registered with a scheduler by hand (so that a test
can take one out of the pool), and a gateway in front."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import pytest
from openai.types.responses import ResponseErrorEvent

from tests.router.procs import (
    Proc,
    free_port,
    series_value,
    start_gateway,
    start_scheduler,
    start_sim_worker,
    start_sim_workers,
    wait_http,
)

TOKEN = "registration-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
# tiny profile at --time-scale 20: ~0.13 s a decode step, so a 400-token answer runs ~50 s
SLOW = ("--time-scale", "20")
LOOKUPS = 'router_stored_response_lookups_total{result="%s"}'


@dataclass
class Pool:
    scheduler: str
    gateway: str


@pytest.fixture(scope="module")
def pool() -> Iterator[Pool]:
    """A scheduler with no worker of its own (each test registers its one worker, and takes it
    out when done), workers found down after a second of silence, and a gateway that reads the
    worker list every 200 ms."""
    # --startup-grace-s 0: a scheduler long up, that knows its pool (for 30 s after a start a
    # worker missing from its list may not have heartbeated yet: the last test).
    s, su = start_scheduler([], "--scrape-interval-ms", "100", "--dead-after-ms", "1000",
                            "--registration-token", TOKEN, "--registration-ttl-s", "600",
                            "--startup-grace-s", "0")
    try:
        g, gu = start_gateway("--scheduler", su, "--workers-refresh-ms", "200", "--debug-headers")
        try:
            yield Pool(su, gu)
        finally:
            g.stop()
    finally:
        s.stop()


@contextmanager
def registered_worker(pool: Pool) -> Iterator[tuple[Proc, str, str]]:
    """A slow sim worker registered with the scheduler: (process, URL, worker id). Taken out of
    the pool and stopped afterwards."""
    proc, url = start_sim_worker("m", *SLOW)
    worker_id = None
    try:
        r = httpx.post(pool.scheduler + "/v1/workers", headers=AUTH, timeout=10,
                       json={"url": url, "models": ["m"], "engine": "vllm"})
        assert r.status_code == 201, r.text
        worker_id = r.json()["worker_id"]
        deadline = time.monotonic() + 30
        while True:  # until the gateway places requests on it
            r = httpx.post(pool.gateway + "/v1/responses", timeout=30,
                           json={"model": "m", "input": "ready?", "max_output_tokens": 1})
            if r.status_code == 200:
                break
            assert time.monotonic() < deadline, r.text
            time.sleep(0.1)
        yield proc, url, worker_id
    finally:
        if worker_id is not None:
            httpx.delete(f"{pool.scheduler}/v1/workers/{worker_id}", headers=AUTH, timeout=10)
        proc.stop()


def _background(gw: str) -> tuple[str, str]:
    """A background response that runs for ~50 s: (its id, its worker)."""
    r = httpx.post(gw + "/v1/responses", timeout=30, json={
        "model": "m", "input": "hello", "max_output_tokens": 400, "ignore_eos": True, "background": True})
    assert r.status_code == 200 and r.json()["status"] == "queued", r.text
    return r.json()["id"], r.headers["x-router-worker"]


def _finished(gw: str) -> tuple[str, str]:
    """A finished stored response, to continue: (its id, its worker)."""
    r = httpx.post(gw + "/v1/responses", timeout=30,
                   json={"model": "m", "input": "hi", "max_output_tokens": 2})
    assert r.status_code == 200, r.text
    return r.json()["id"], r.headers["x-router-worker"]


def _follow_up(gw: str, previous: str, stream: bool = False) -> httpx.Response:
    return httpx.post(gw + "/v1/responses", timeout=30, json={
        "model": "m", "input": "more", "max_output_tokens": 2, "previous_response_id": previous,
        "stream": stream})


def _calls(gw: str, response_id: str) -> dict[str, httpx.Response]:
    """Every call on a stored response, by name (DELETE last: it would remove a response that
    is still there)."""
    url = f"{gw}/v1/responses/{response_id}"
    return {
        "GET": httpx.get(url, timeout=30),
        "GET stream": httpx.get(url, params={"stream": "true"}, timeout=30),
        "cancel": httpx.post(url + "/cancel", timeout=30),
        "DELETE": httpx.delete(url, timeout=30),
    }


def _error(r: httpx.Response, status: int, code: str) -> dict:
    """The OpenAI error in `r`, checked for its status, shape and code."""
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json"), r.headers
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["code"] == code, error
    return error


def _unavailable(r: httpx.Response, worker_id: str) -> None:
    error = _error(r, 503, "worker_unavailable")
    assert error["type"] == "service_unavailable" and r.headers["Retry-After"] == "1"
    assert worker_id in error["message"] and "Error(" not in error["message"]  # no exception reprs


def _lost(r: httpx.Response, response_id: str, worker_id: str, cause: str,
          param: str = "response_id") -> None:
    error = _error(r, 404, "response_lost")
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert error["message"].startswith(f"Response with id '{response_id}' not found")
    assert worker_id in error["message"] and cause in error["message"], error["message"]


def test_a_dead_worker_s_responses_are_unavailable_then_lost_once_it_leaves_the_pool(pool):
    """Killed: every call is a retryable 503 while the worker is still in the pool (it may come
    back); once it left the pool (its registration lapsed, its pod was deleted), a 404 that
    says the response was lost with it."""
    with registered_worker(pool) as (proc, _, worker_id):
        running, home = _background(pool.gateway)
        done, done_home = _finished(pool.gateway)
        assert home == done_home == worker_id
        proc.kill()
        for r in [*_calls(pool.gateway, running).values(), _follow_up(pool.gateway, done),
                  _follow_up(pool.gateway, done, stream=True)]:
            _unavailable(r, worker_id)
        time.sleep(1.5)  # the scheduler has found it down: the same
        for r in [*_calls(pool.gateway, running).values(), _follow_up(pool.gateway, done)]:
            _unavailable(r, worker_id)
        r = httpx.delete(f"{pool.scheduler}/v1/workers/{worker_id}", headers=AUTH, timeout=10)
        assert r.status_code == 204
        time.sleep(0.6)  # the gateway's next worker list has it gone
        for r in _calls(pool.gateway, running).values():
            _lost(r, running, worker_id, "left the pool")
        _lost(_follow_up(pool.gateway, done), done, worker_id, "left the pool", "previous_response_id")
        _lost(_follow_up(pool.gateway, done, stream=True), done, worker_id, "left the pool",
              "previous_response_id")


def test_a_restarted_worker_s_responses_are_lost_and_every_call_says_so(pool):
    """Restarted on the same address with an empty store: the first call that reaches it learns
    the response is gone; every call after, on any path, says it was lost with the worker, not
    a bare "not found" after the gateway forgot where it was."""
    with registered_worker(pool) as (proc, url, worker_id):
        running, _ = _background(pool.gateway)
        done, _ = _finished(pool.gateway)
        proc.kill()
        port = url.rsplit(":", 1)[1]
        again = Proc(["-m", "inference_worker", "--backend", "sim", "--sim-profile", "tiny",
                      "--served-model-name", "m", "--port", port, *SLOW], f"sim-again-{port}")
        try:
            wait_http(url + "/health", again, timeout_s=120)
            # A follow-up is first: placed on the worker once the scheduler has it up again.
            deadline = time.monotonic() + 30
            while (r := _follow_up(pool.gateway, done)).status_code == 503:
                _unavailable(r, worker_id)
                assert time.monotonic() < deadline, "the restarted worker never came back"
                time.sleep(0.2)
            _lost(r, done, worker_id, "restarted", "previous_response_id")
            assert r.headers["x-router-worker"] == worker_id  # its answer, in the gateway's words
            for r in _calls(pool.gateway, running).values():
                _lost(r, running, worker_id, "restarted")
            missing = series_value(pool.gateway, LOOKUPS % "missing", 0.0)
            # Remembered as lost: the same words again, without asking every worker for it.
            for _ in range(2):
                _lost(_follow_up(pool.gateway, done, stream=True), done, worker_id, "restarted",
                      "previous_response_id")
                _lost(httpx.get(f"{pool.gateway}/v1/responses/{done}", timeout=10), done, worker_id,
                      "restarted")
            assert series_value(pool.gateway, LOOKUPS % "missing", 0.0) == missing
            assert series_value(pool.gateway, LOOKUPS % "lost") >= 4
        finally:
            again.stop()


def test_a_worker_that_left_the_pool_alive_still_serves_its_responses_until_it_dies(pool):
    """Deregistered but still up (a draining worker): its background response can still be
    polled, replayed and cancelled through the gateway; a follow-up cannot be placed there (a
    404 that says why), and that does not make the gateway forget where the response is. Once
    the worker is gone too, the response is lost."""
    with registered_worker(pool) as (proc, _, worker_id):
        running, _ = _background(pool.gateway)
        done, _ = _finished(pool.gateway)
        r = httpx.delete(f"{pool.scheduler}/v1/workers/{worker_id}", headers=AUTH, timeout=10)
        assert r.status_code == 204
        time.sleep(0.6)
        for _ in range(2):
            _lost(_follow_up(pool.gateway, done), done, worker_id, "left the pool", "previous_response_id")
            r = httpx.get(f"{pool.gateway}/v1/responses/{done}", timeout=10)
            assert r.status_code == 200 and r.json()["id"] == done, r.text
        r = httpx.get(f"{pool.gateway}/v1/responses/{running}", timeout=10)
        assert r.status_code == 200 and r.json()["status"] in ("queued", "in_progress"), r.text
        proc.kill()
        for r in _calls(pool.gateway, running).values():
            _lost(r, running, worker_id, "left the pool")


def test_calls_on_a_hung_worker_s_response_end_once_the_scheduler_finds_it_down(pool):
    """The owner hangs (its process stopped: connections taken, nothing answered). A GET held
    for the first-byte timeout (60 s) and a replay for ever; they end as soon as the scheduler
    reports the worker down, a replay under way with OpenAI's error event."""
    with registered_worker(pool) as (proc, _, worker_id):
        running, _ = _background(pool.gateway)
        events: list[tuple[str, dict]] = []
        name = ""
        try:
            t0 = time.monotonic()
            with httpx.stream("GET", f"{pool.gateway}/v1/responses/{running}", params={"stream": "true"},
                              timeout=30) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("event: "):
                        name = line[7:]
                    elif line.startswith("data: "):
                        events.append((name, json.loads(line[6:])))
                        if len(events) == 4:
                            os.kill(proc.pid, signal.SIGSTOP)
            name, last = events[-1]
            assert name == "error", events[-3:]
            error = ResponseErrorEvent.model_validate(last)
            assert error.code == "upstream_error" and worker_id in error.message
            assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
            for r in _calls(pool.gateway, running).values():
                _unavailable(r, worker_id)
            assert time.monotonic() - t0 < 20
        finally:
            os.kill(proc.pid, signal.SIGCONT)


def test_a_follow_up_across_a_scheduler_restart_waits_for_its_worker_to_register_again():
    """A restarted scheduler learns its registered workers anew, at their next heartbeats. A
    follow-up of a response stored on a worker that has not registered again yet (another one
    has) gets 503 worker_unavailable, which clients retry, not 404 response_lost: the scheduler
    says it is still learning its pool (GET /v1/workers `learning`) and the gateway takes a
    worker missing from its list then as unknown, not gone. Once it registers, it is served."""
    port = free_port()
    args = ("--scrape-interval-ms", "100", "--registration-token", TOKEN, "--registration-ttl-s", "600")
    s, su = start_scheduler([], *args, port=port)
    (a, ua), (b, ub) = start_sim_workers(2, "m")
    g = None

    def register(url: str) -> str:
        r = httpx.post(su + "/v1/workers", headers=AUTH, timeout=10,
                       json={"url": url, "models": ["m"], "engine": "vllm"})
        assert r.status_code == 201, r.text
        return r.json()["worker_id"]

    def scheduled(gw: str) -> bool:
        return series_value(gw, "router_fallback_mode") == 0 and httpx.get(
            su + "/v1/workers", timeout=10).json()["workers"] != []

    try:
        a_id = register(ua)
        g, gw = start_gateway("--scheduler", su, "--workers-refresh-ms", "200", "--debug-headers")
        deadline = time.monotonic() + 30
        while not scheduled(gw):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        response_id, worker = _finished(gw)
        assert worker == a_id
        register(ub)
        s.stop()
        s, su = start_scheduler([], *args, port=port)
        b_id = register(ub)  # b heartbeats first; a has not yet
        assert httpx.get(su + "/v1/workers", timeout=10).json()["learning"] is True
        deadline = time.monotonic() + 30
        while not scheduled(gw):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        time.sleep(0.5)  # a few more worker-list reads: each one lacks a
        assert _finished(gw)[1] == b_id  # new requests are served meanwhile
        _unavailable(_follow_up(gw, response_id), a_id)
        assert register(ua) == a_id  # the same id again: its stored responses with it
        deadline = time.monotonic() + 30
        while (r := _follow_up(gw, response_id)).status_code != 200:
            _unavailable(r, a_id)
            assert time.monotonic() < deadline, r.text
            time.sleep(0.1)
        assert r.headers["x-router-worker"] == a_id
    finally:
        if g is not None:
            g.stop()
        s.stop()
        a.stop()
        b.stop()
