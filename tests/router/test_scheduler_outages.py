"""The gateway while its scheduler hangs or dies and comes back, with real processes: the switch
to round robin on time (DESIGN.md, "Gateway behaviour": past --wait-schedule-timeout-ms),
and the way back."""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from router.sched_wire import ws_frame
from tests.router.procs import (
    Proc,
    free_port,
    series_value,
    start_gateway,
    start_scheduler,
    start_sim_workers,
)

WAIT_TIMEOUT_S = 3.0  # --wait-schedule-timeout-ms of the gateways here
BODY = {"model": "m", "prompt": "x", "max_tokens": 2}


@pytest.fixture
def stack() -> Iterator[dict]:
    """Two sim workers, a scheduler on a port kept for a restart, a gateway with a 3 s switch."""
    procs: list[Proc] = []
    try:
        workers = start_sim_workers(2)
        procs += [p for p, _ in workers]
        urls = [u for _, u in workers]
        port = free_port()
        s, su = start_scheduler(urls, "--scrape-interval-ms", "100", port=port)
        procs.append(s)
        g, gu = start_gateway(
            "--scheduler", su, "--debug-headers",
            "--wait-schedule-timeout-ms", str(int(WAIT_TIMEOUT_S * 1000)),
            "--wait-schedule-try-period-ms", "200",
            "--scheduler-timeout-ms", "2000",
        )
        procs.append(g)
        yield {"gw": gu, "scheduler": s, "scheduler_url": su, "port": port, "urls": urls, "procs": procs}
    finally:
        for p in procs:
            if p.alive():
                os.kill(p.pid, signal.SIGCONT)  # a stopped process cannot act on SIGTERM
            p.stop()


def _call(gw: str) -> tuple[float, httpx.Response]:
    t0 = time.monotonic()
    r = httpx.post(gw + "/v1/completions", json=BODY, timeout=30)
    return time.monotonic() - t0, r


def test_a_hung_scheduler_is_left_for_round_robin_at_the_wait_timeout_not_later(stack):
    """A stopped scheduler (its port accepts connections, nothing answers) made the first
    request wait the scheduler call's timeout (2 s) before the fallback clock even started,
    and then until a held long poll timed out too: 9.5 s for a 5 s --wait-schedule-timeout-ms."""
    gw = stack["gw"]
    took, r = _call(gw)
    assert r.status_code == 200 and r.headers["x-router-policy"] == "llm_aware"
    os.kill(stack["scheduler"].pid, signal.SIGSTOP)
    took, r = _call(gw)
    assert r.status_code == 200, r.text
    assert r.headers["x-router-policy"] == "fallback_round_robin"
    # Not before the timeout (the gateway keeps trying the scheduler until then), and not much
    # after it: the margin covers a busy machine, far less than the 2 s call timeout.
    assert WAIT_TIMEOUT_S - 0.3 <= took <= WAIT_TIMEOUT_S + 1.2, took
    assert httpx.get(gw + "/health").json()["mode"] == "fallback"
    assert series_value(gw, "router_fallback_mode") == 1
    took, r = _call(gw)  # in fallback mode nothing waits for the hung scheduler
    assert r.status_code == 200 and r.headers["x-router-policy"] == "fallback_round_robin"
    assert took < 1.0, took

    os.kill(stack["scheduler"].pid, signal.SIGCONT)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and httpx.get(gw + "/health").json()["mode"] != "scheduled":
        time.sleep(0.05)
    _, r = _call(gw)
    assert r.status_code == 200 and r.headers["x-router-policy"] == "llm_aware"
    assert series_value(gw, "router_fallback_mode") == 0


def test_a_restarted_scheduler_that_knows_no_worker_yet_leaves_round_robin_serving(stack):
    """A scheduler restarted with discovery (self-registration, Kubernetes) answers /health at
    once but knows no worker until they register again (their heartbeat: seconds). The gateway
    went back to scheduled routing on that first answer, and its clients got 404
    model_not_found (and 503 no_worker) until the workers were back in the scheduler's pool."""
    gw, port, urls = stack["gw"], stack["port"], stack["urls"]
    stack["scheduler"].kill()
    deadline = time.monotonic() + WAIT_TIMEOUT_S + 5
    while time.monotonic() < deadline and httpx.get(gw + "/health").json()["mode"] != "fallback":
        _call(gw)
        time.sleep(0.05)
    assert httpx.get(gw + "/health").json()["mode"] == "fallback"

    # The same port, no static workers: what a registration-based scheduler is on restart.
    s2, su = start_scheduler([], "--registration-token", "t", "--scrape-interval-ms", "100", port=port)
    stack["procs"].append(s2)
    assert httpx.get(su + "/health").json()["routable"] == 0
    t_end = time.monotonic() + 1.5  # fifteen probe periods of the gateway's (100 ms)
    policies: list[str] = []
    while time.monotonic() < t_end:
        _, r = _call(gw)
        assert r.status_code == 200, r.text
        policies.append(r.headers["x-router-policy"])
        time.sleep(0.05)
    assert set(policies) == {"fallback_round_robin"}, policies
    assert httpx.get(gw + "/health").json()["mode"] == "fallback"

    # The workers register again (as their heartbeats would): scheduled routing resumes.
    for url in urls:
        r = httpx.post(su + "/v1/workers", json={"url": url, "models": ["m"]},
                       headers={"Authorization": "Bearer t"})
        assert r.status_code in (200, 201), r.text
    deadline = time.monotonic() + 10
    policy = ""
    while time.monotonic() < deadline and policy != "llm_aware":
        _, r = _call(gw)
        assert r.status_code == 200, r.text
        policy = r.headers["x-router-policy"]
        time.sleep(0.05)
    assert policy == "llm_aware"
    assert httpx.get(gw + "/health").json()["mode"] == "scheduled"


def test_an_idle_gateway_notices_its_scheduler_gone_and_serves_its_next_request_at_once(stack):
    """With no request asking, the gateway's periodic worker-list refresh is what sees the
    scheduler gone. It started no fallback clock: /health said "scheduled" and
    router_fallback_mode 0 for as long as the scheduler was away, and the first requests to
    come then each waited out the whole switch."""
    gw = stack["gw"]
    stack["scheduler"].kill()
    # The refresh every 2 s (--workers-refresh-ms' default) sees it, then the switch's 3 s.
    deadline = time.monotonic() + 2.0 + WAIT_TIMEOUT_S + 3.0
    while time.monotonic() < deadline and httpx.get(gw + "/health").json()["mode"] != "fallback":
        time.sleep(0.1)
    assert httpx.get(gw + "/health").json()["mode"] == "fallback"
    assert series_value(gw, "router_fallback_mode") == 1
    took, r = _call(gw)
    assert r.status_code == 200 and r.headers["x-router-policy"] == "fallback_round_robin"
    assert took < WAIT_TIMEOUT_S / 2, took  # it did not wait out the switch


_UPGRADE = (b"GET /v1/channel HTTP/1.1\r\nHost: s\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n")


@pytest.mark.parametrize("wire", ["http", "channel", "channel_opened_while_stopped"])
def test_calls_a_stopped_scheduler_reads_after_their_gateway_gave_up_hold_no_lease(wire):
    """A stopped scheduler's port still takes the gateway's calls; the gateway gives up on
    them at its timeout (its channel connection aborted, a long poll's closed) and serves
    elsewhere. Resumed, the scheduler read them and issued a lease for each, to nobody: each
    counted as load on its worker until it expired (10 minutes), so after a hang of seconds
    under load the scheduler saw its workers full and held or skewed the traffic."""
    procs: list[Proc] = []
    socks: list[socket.socket] = []
    try:
        [(w, wu)] = start_sim_workers(1)
        procs.append(w)
        s, su = start_scheduler([wu], "--scrape-interval-ms", "100")
        procs.append(s)
        port = int(su.rsplit(":", 1)[1])
        body = json.dumps({"model": "m", "prompt_tokens": 8}).encode()
        for _ in range(5):  # the channels are open before the scheduler stops, as the gateway's are
            c = socket.create_connection(("127.0.0.1", port), timeout=5)
            socks.append(c)
            if wire == "channel":
                c.sendall(_UPGRADE)
                assert b" 101 " in c.recv(4096)
        os.kill(s.pid, signal.SIGSTOP)
        for c in socks:
            if wire == "channel_opened_while_stopped":  # its upgrade is read late too
                c.sendall(_UPGRADE + ws_frame(b'[{"op":"schedule",' + body[1:] + b"]"))
            elif wire == "channel":
                c.sendall(ws_frame(b'[{"op":"schedule",' + body[1:] + b"]"))
            else:
                c.sendall(b"POST /v1/schedule HTTP/1.1\r\nHost: s\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        for c in socks:
            c.close()  # the gateway's timeout: it gives up on them
        os.kill(s.pid, signal.SIGCONT)
        r = httpx.post(su + "/v1/schedule", json={"model": "m", "prompt_tokens": 8}, timeout=10)
        assert r.status_code == 200, r.text  # it has read and decided everything before this
        httpx.post(su + "/v1/release", json={"lease_id": r.json()["lease_id"], "ok": True}, timeout=10)
        time.sleep(0.5)  # a stale call read late is decided by now (a leaked lease stays 10 minutes)
        [view] = httpx.get(su + "/v1/workers", timeout=10).json()["workers"]
        assert view["in_flight_leases"] == 0, view
        # A late upgrade was answered into a closed connection: an ERROR with a traceback.
        assert "Traceback" not in s.output()
    finally:
        for c in socks:
            c.close()
        for p in procs:
            if p.alive():
                os.kill(p.pid, signal.SIGCONT)
            p.stop()


@pytest.mark.parametrize("channel", ["ws", "http"])
def test_releases_made_while_the_scheduler_hangs_reach_it_when_it_resumes(channel):
    """Requests leased before the scheduler hung end during the hang. Their releases were lost
    two ways: written on the channel the gateway then aborted (its schedule call timed out),
    which the resumed scheduler drops unread; or made after that, when no connection could be
    had (the handshake hangs), and dropped. Each left its lease counted as load on its worker
    until it expired, 10 minutes after the hang."""
    procs: list[Proc] = []
    streams: list[tuple[httpx.Client, Any, Iterator[str]]] = []
    try:
        workers = start_sim_workers(2, "m", "--time-scale", "10")  # streams of seconds
        procs += [p for p, _ in workers]
        s, su = start_scheduler([u for _, u in workers], "--scrape-interval-ms", "100")
        procs.append(s)
        g, gu = start_gateway("--scheduler", su, "--scheduler-channel", channel, "--debug-headers",
                              "--scheduler-timeout-ms", "1000", "--wait-schedule-timeout-ms", "1000",
                              "--wait-schedule-try-period-ms", "100")
        procs.append(g)
        body = {"model": "m", "prompt": "x", "max_tokens": 400, "stream": True}
        for _ in range(4):
            c = httpx.Client(timeout=30)
            cm = c.stream("POST", gu + "/v1/completions", json=body)
            r = cm.__enter__()
            assert r.status_code == 200 and r.headers["x-router-policy"] == "llm_aware"
            lines = r.iter_lines()  # kept: a generator dropped closes the stream
            next(lines)  # it runs on its worker, leased
            streams.append((c, cm, lines))
        leases = sum(w["in_flight_leases"] for w in httpx.get(su + "/v1/workers").json()["workers"])
        assert leases == 4

        def leave(n: int) -> None:  # n clients leave: their requests end, their leases go back
            for _ in range(n):
                c, cm, _ = streams.pop()
                cm.__exit__(None, None, None)
                c.close()

        os.kill(s.pid, signal.SIGSTOP)
        leave(2)  # written on the channel still open
        time.sleep(0.3)
        _, r = _call(gu)  # its schedule call times out: the gateway aborts the channel
        assert r.status_code == 200 and r.headers["x-router-policy"] == "fallback_round_robin"
        leave(2)  # no connection to be had now
        time.sleep(1.5)  # the connection tried for them times out (1 s) before the scheduler resumes
        os.kill(s.pid, signal.SIGCONT)
        deadline = time.monotonic() + 10
        policy = ""
        while time.monotonic() < deadline and policy != "llm_aware":
            _, r = _call(gu)
            policy = r.headers["x-router-policy"]
            time.sleep(0.05)
        assert policy == "llm_aware"
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            leases = sum(w["in_flight_leases"] for w in httpx.get(su + "/v1/workers").json()["workers"])
            if leases == 0:
                break
            time.sleep(0.1)
        assert leases == 0
    finally:
        for c, cm, _ in streams:
            cm.__exit__(None, None, None)
            c.close()
        for p in procs:
            if p.alive():
                os.kill(p.pid, signal.SIGCONT)
            p.stop()
