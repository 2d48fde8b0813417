"""The scheduler's gateway token (--gateway-token / --scheduler-token), with real processes on
127.0.0.1: the decision API refuses callers without it, a gateway with it routes through the
scheduler on every wire form, and a gateway with a wrong one says so once and serves by round
robin."""

from __future__ import annotations

import time
from collections.abc import Iterator

import aiohttp
import httpx
import pytest

from tests.router.procs import Proc, free_port, series_value, start_echo_worker, start_gateway, wait_http

TOKEN = "gw-token-7f3a"
BODY = {"model": "m", "prompt": "x", "max_tokens": 2}
# Every decision route, with a body it would take (a lease that does not exist: 404 past the check).
DECISIONS = [
    ("/v1/schedule", {"model": "m", "prompt_tokens": 1}),
    ("/v1/release", {"lease_id": "nope", "ok": True}),
    ("/v1/prefilled", {"lease_id": "nope"}),
    ("/v1/renew", {"lease_id": "nope"}),
    ("/v1/batch", []),
    ("/v1/workers/127.0.0.1:1/failure", {"error": "connect"}),
]


@pytest.fixture(scope="module")
def stack() -> Iterator[dict]:
    """Two echo workers and a scheduler whose token comes from the environment as a Secret made
    from a file gives it (a trailing newline, which must be trimmed)."""
    procs: list[Proc] = []
    try:
        urls = []
        for _ in range(2):
            p, u = start_echo_worker()
            procs.append(p)
            urls.append(u)
        port = free_port()
        s = Proc(["-m", "scheduler", "--port", str(port), "--workers", ",".join(urls),
                  "--scrape-interval-ms", "100"], f"scheduler-{port}",
                 env={"SCHEDULER_GATEWAY_TOKEN": TOKEN + "\n"})
        procs.append(s)
        su = f"http://127.0.0.1:{port}"
        wait_http(su + "/health", s)
        yield {"scheduler": su, "scheduler_proc": s, "urls": urls}
    finally:
        for p in procs:
            p.stop()


def _auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.mark.parametrize("headers", [{}, _auth("wrong"), {"Authorization": TOKEN}],
                         ids=["none", "wrong", "no-scheme"])
def test_every_decision_route_refuses_a_call_without_the_token(stack, headers):
    su = stack["scheduler"]
    for path, body in DECISIONS:
        r = httpx.post(su + path, json=body, headers=headers, timeout=5)
        assert r.status_code == 401, (path, r.status_code, r.text)
        assert r.json()["error"]["type"] == "authentication_error", path
        assert TOKEN not in r.text
    # Nothing was done: the failure report above did not take a worker out.
    workers = httpx.get(su + "/v1/workers", timeout=5).json()["workers"]
    assert all(w["in_flight_leases"] == 0 for w in workers)


async def _upgrade_status(url: str, headers: dict[str, str]) -> int:
    async with aiohttp.ClientSession() as s:
        try:
            async with s.ws_connect(url, headers=headers, timeout=aiohttp.ClientWSTimeout(ws_close=5)):
                return 101
        except aiohttp.WSServerHandshakeError as exc:
            return exc.status


async def test_the_channel_refuses_the_upgrade_without_the_token(stack):
    url = stack["scheduler"] + "/v1/channel"
    assert await _upgrade_status(url, {}) == 401
    assert await _upgrade_status(url, _auth("wrong")) == 401
    assert await _upgrade_status(url, _auth(TOKEN)) == 101


def test_the_token_opens_the_decision_api_and_read_only_routes_need_none(stack):
    su = stack["scheduler"]
    for path, body in DECISIONS:
        r = httpx.post(su + path, json=body, headers=_auth(TOKEN), timeout=5)
        assert r.status_code != 401, (path, r.text)
        if path == "/v1/schedule":  # a lease: given back, so that the tests below start with none
            assert r.status_code == 200, r.text
            released = httpx.post(su + "/v1/release", json={"lease_id": r.json()["lease_id"], "ok": True},
                                  headers=_auth(TOKEN), timeout=5)
            assert released.status_code == 204, released.text
    # The scheme name in any case (RFC 7235).
    assert httpx.post(su + "/v1/batch", content=b"[]", headers={"Authorization": f"bearer {TOKEN}"},
                      timeout=5).status_code == 200
    for path in ("/v1/workers", "/health", "/metrics"):
        assert httpx.get(su + path, timeout=5).status_code == 200, path
    assert TOKEN not in stack["scheduler_proc"].output()


@pytest.mark.parametrize("wire", [("--scheduler-channel", "ws"), ("--scheduler-channel", "http"),
                                  ("--no-scheduler-pipelining",)], ids=["ws", "http", "client"])
def test_a_gateway_with_the_token_routes_through_the_scheduler(stack, wire):
    su = stack["scheduler"]
    g, gu = start_gateway("--scheduler", su, "--debug-headers", *wire,
                          env={"ROUTER_SCHEDULER_TOKEN": TOKEN + "\n"})
    try:
        for _ in range(4):
            r = httpx.post(gu + "/v1/completions", json=BODY, timeout=30)
            assert r.status_code == 200, r.text
            assert r.headers["x-router-policy"] == "llm_aware", r.headers
        # The releases carried the token too: no lease is left open (bounded wait).
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            workers = httpx.get(su + "/v1/workers", timeout=5).json()["workers"]
            if all(w["in_flight_leases"] == 0 for w in workers):
                break
            time.sleep(0.1)
        assert all(w["in_flight_leases"] == 0 for w in workers), workers
        assert series_value(gu, "router_fallback_mode") == 0
        assert "ERROR" not in g.output()
    finally:
        g.stop()


@pytest.mark.parametrize("wire", [("--scheduler-channel", "auto"), ("--no-scheduler-pipelining",)],
                         ids=["auto", "client"])
def test_a_gateway_with_a_wrong_token_says_so_once_and_serves_by_round_robin(stack, wire):
    g, gu = start_gateway("--scheduler", stack["scheduler"], "--workers", ",".join(stack["urls"]),
                          "--debug-headers", "--wait-schedule-timeout-ms", "300",
                          "--wait-schedule-try-period-ms", "100", "--scheduler-probe-ms", "50", *wire,
                          env={"ROUTER_SCHEDULER_TOKEN": "not-the-token"})
    try:
        policies = []
        # Spread over ~2 s: many probe periods, so a probe that took /health's answer for the
        # way back (it takes no token) would have flapped to scheduled routing and back.
        for _ in range(10):
            r = httpx.post(gu + "/v1/completions", json=BODY, timeout=30)
            assert r.status_code == 200, r.text  # not the 400 every request got before
            policies.append(r.headers["x-router-policy"])
            time.sleep(0.2)
        assert set(policies) == {"fallback_round_robin"}, policies
        assert series_value(gu, "router_fallback_mode") == 1
        out = g.output()
        errors = [line for line in out.splitlines() if " ERROR " in line]
        assert len(errors) == 1, out[-3000:]
        assert "401" in errors[0] and "--scheduler-token" in errors[0]
        assert "not-the-token" not in out
        assert "fallback mode OFF" not in out, out[-3000:]
    finally:
        g.stop()
