"""Session affinity with real processes on 127.0.0.1: three sim workers, one scheduler (llm_aware,
the default) and two gateways with `--session-header x-session-id`, one on the WebSocket channel
to the scheduler and one on pipelined HTTP. A session's requests, whose prompts share no text,
land on one worker through either gateway, and a WebSocket carrying the header goes there too;
other sessions spread; once an operator cordons the session's worker, the session moves, and
stays moved after the uncordon."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import aiohttp
import httpx
import pytest

from tests.router.procs import poll_until, scheduler_workers, series_value, sim_stack, start_gateway

TOKEN = "admin-token-3e1f"
HEADER = "x-session-id"


@pytest.fixture(scope="module")
def stack() -> Iterator[dict]:
    """3 sim workers, a scheduler, and two gateways naming sessions by HEADER, one on each
    scheduler channel."""
    flags = ("--session-header", HEADER, "--debug-headers")
    with sim_stack(3, scheduler_flags=("--admin-token", TOKEN),
                   gateway_flags=(*flags, "--scheduler-channel", "ws")) as sim:
        su = sim.scheduler
        second, second_url = start_gateway("--scheduler", su, *flags, "--scheduler-channel", "http")
        try:
            poll_until(lambda: len(scheduler_workers(su)) == 3
                       and all(w["healthy"] for w in scheduler_workers(su).values()),
                       "every worker in rotation")
            yield {"scheduler": su, "gateways": [sim.gateway, second_url], "urls": list(sim.workers)}
        finally:
            second.stop()


def _admin(su: str, worker_id: str, action: str) -> None:
    r = httpx.post(f"{su}/v1/workers/{worker_id}/{action}", headers={"Authorization": f"Bearer {TOKEN}"},
                   timeout=5)
    assert r.status_code == 200, r.text


def _ask(gu: str, session: str | None, prompt: str, max_tokens: int = 8) -> tuple[str, str | None]:
    """One request through gateway `gu`: the worker that served it and the session outcome its
    decision names (--debug-headers)."""
    headers = {HEADER: session} if session is not None else {}
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    r = httpx.post(gu + "/v1/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    reason = json.loads(r.headers["x-router-reason"])
    return r.headers["x-router-worker"], reason.get("session")


def _turns(stack: dict, session: str, n: int, tag: str) -> list[tuple[str, str | None]]:
    """n turns of a session, alternating the two gateways; no two prompts share a first word."""
    gateways = stack["gateways"]
    return [_ask(gateways[i % 2], session, f"{tag}{i} {session} turn {i}") for i in range(n)]


def _successes(url: str) -> float:
    """Requests a worker finished (vllm:request_success_total)."""
    return sum(float(line.rsplit(" ", 1)[1])
               for line in httpx.get(url + "/metrics", timeout=5).text.splitlines()
               if line.startswith("vllm:request_success_total"))


async def _ws_turn(gu: str, session: str) -> None:
    """One request on a WebSocket opened with the session's header, answered to its end."""
    async with (aiohttp.ClientSession() as client,
                client.ws_connect(gu + "/v1/ws", headers={HEADER: session}) as ws):
        await ws.send_str(json.dumps({"model": "m", "prompt": "over a socket", "max_tokens": 4,
                                      "ignore_eos": True}))
        while True:
            m = json.loads((await ws.receive(timeout=60)).data)
            assert "error" not in m, m
            if m.get("type") == "done":
                return


def test_a_sessions_requests_stay_on_one_worker_through_both_gateways(stack):
    su = stack["scheduler"]
    turns = _turns(stack, "alpha", 8, "a")
    home = turns[0][0]
    assert turns == [(home, "new")] + [(home, "kept")] * 7, turns
    # A WebSocket opened with the header is placed by its first request as a session's request.
    by_id = {u.removeprefix("http://"): u for u in stack["urls"]}
    before = {wid: _successes(u) for wid, u in by_id.items()}
    kept = series_value(su, 'scheduler_session_affinity_total{outcome="kept"}')
    asyncio.run(_ws_turn(stack["gateways"][0], "alpha"))
    served = {wid: _successes(u) - before[wid] for wid, u in by_id.items()}
    assert served == {wid: 1.0 if wid == home else 0.0 for wid in by_id}, served
    assert series_value(su, 'scheduler_session_affinity_total{outcome="kept"}') == kept + 1


def test_other_sessions_spread_over_the_workers(stack):
    gateways = stack["gateways"]

    def first_turn(i: int) -> tuple[str, str | None]:
        # Long enough answers that they overlap: each new session goes to the least loaded.
        return _ask(gateways[i % 2], f"spread-{i}", f"s{i} another conversation", max_tokens=64)

    with ThreadPoolExecutor(9) as pool:
        firsts = list(pool.map(first_turn, range(9)))
    assert {outcome for _, outcome in firsts} == {"new"}
    assert len({worker for worker, _ in firsts}) == 3, firsts


def test_a_session_moves_off_its_cordoned_worker_and_stays_moved(stack):
    su = stack["scheduler"]
    home = _turns(stack, "beta", 2, "b")[0][0]
    moved_before = series_value(su, 'scheduler_session_affinity_total{outcome="moved"}')
    _admin(su, home, "cordon")
    try:
        after = _turns(stack, "beta", 4, "c")
    finally:
        _admin(su, home, "uncordon")
    new_home = after[0][0]
    assert new_home != home
    assert after == [(new_home, "moved")] + [(new_home, "kept")] * 3, after
    # Back in rotation, the old worker does not take the session back: it stays where it went.
    assert _turns(stack, "beta", 4, "d") == [(new_home, "kept")] * 4
    assert series_value(su, 'scheduler_session_affinity_total{outcome="moved"}') == moved_before + 1
    assert series_value(su, "scheduler_sessions") >= 2
