"""Session affinity while the scheduler is away, with real processes on 127.0.0.1: three echo
workers, a scheduler over them, and two gateways with `--session-header x-session-id`: one that
had the scheduler's worker list until the scheduler was killed, and one that never had a
scheduler (its --workers, listed in another order). A session's requests land on one worker
through either gateway (rendezvous hashing by URL, router/fallback.py), sessions spread, requests
without one still go round robin, and when a worker dies only its sessions move, both gateways
sending each to the same new worker. And, with a scheduler of its own: sessions the scheduler
placed keep their workers when it is killed (the fallback's rendezvous pick is the scheduler's
first placement, scheduler/rendezvous.py) and when a fresh one, its session table empty, takes
its port."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator

import httpx
import pytest

from tests.router.procs import (
    Proc,
    free_port,
    poll_until,
    scheduler_workers,
    start_echo_worker,
    start_gateway,
    start_scheduler,
)

HEADER = "x-session-id"
SESSIONS = [f"conversation-{i}" for i in range(12)]  # all on one of 3 workers: p = 3 / 3**12


@pytest.fixture(scope="module")
def stack() -> Iterator[dict]:
    procs: list[Proc] = []
    try:
        workers = [start_echo_worker() for _ in range(3)]
        procs += [p for p, _ in workers]
        urls = [u for _, u in workers]
        s, su = start_scheduler(urls, "--scrape-interval-ms", "100")
        procs.append(s)
        flags = ("--session-header", HEADER, "--debug-headers")
        ga, gau = start_gateway("--scheduler", su, *flags, "--workers-refresh-ms", "100",
                                "--wait-schedule-timeout-ms", "1000", "--wait-schedule-try-period-ms", "100",
                                "--scheduler-timeout-ms", "1000")
        procs.append(ga)
        gb, gbu = start_gateway("--workers", ",".join(reversed(urls)), *flags)
        procs.append(gb)
        # Gateway A holds the scheduler's list of the three (their ids are not their URLs), then
        # loses the scheduler.
        listed = poll_until(lambda: len(ws := _fallback_workers(gau)) == 3 and ws, "gateway A's worker list")
        assert _ask(gau, None)[1] == "llm_aware"
        s.kill()
        url_of = {w["worker_id"]: w["url"] for w in listed} | {u: u for u in urls}
        assert len(url_of) == 6  # ids are not URLs: the test maps them
        poll_until(lambda: _ask(gau, None)[1] == "fallback_round_robin", "gateway A in fallback mode")
        yield {"gateways": [gau, gbu], "url_of": url_of,
               "workers": {u: p for p, u in workers}}
    finally:
        for p in procs:
            if p.alive():
                os.kill(p.pid, signal.SIGCONT)
            p.stop()


def _fallback_workers(gu: str) -> list[dict]:
    """The workers gateway `gu` would fall back to (its /admin/state)."""
    return httpx.get(gu + "/admin/state", timeout=5).json()["fallback_workers"]


def _answer(gu: str, session: str | None) -> httpx.Response:
    headers = {HEADER: session} if session is not None else {}
    r = httpx.post(gu + "/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 2},
                   headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    return r


def _ask(gu: str, session: str | None) -> tuple[str, str]:
    """One completion through gateway `gu`: the worker that served it (as the gateway names
    it: a scheduler's id or a --workers URL) and the gateway's policy."""
    r = _answer(gu, session)
    return r.headers["x-router-worker"], r.headers["x-router-policy"]


def _homes(stack: dict, turns: int) -> dict[str, set[str]]:
    """Each session's turns, alternating the two gateways: the worker URLs that served them."""
    out: dict[str, set[str]] = {}
    for session in SESSIONS:
        for i in range(turns):
            worker, policy = _ask(stack["gateways"][i % 2], session)
            assert policy == "fallback_session"
            out.setdefault(session, set()).add(stack["url_of"][worker])
    return out


def test_a_sessions_requests_stay_on_one_worker_through_both_gateways(stack):
    homes = _homes(stack, 4)
    assert all(len(h) == 1 for h in homes.values()), homes
    assert len(set().union(*homes.values())) >= 2, homes  # sessions spread over the workers
    # Without a session: round robin, three requests on three workers.
    served = [_ask(stack["gateways"][1], None) for _ in range(3)]
    assert {p for _, p in served} == {"fallback_round_robin"}
    assert len({stack["url_of"][w] for w, _ in served}) == 3, served


def test_only_a_dead_workers_sessions_move_and_both_gateways_agree_where(stack):
    before = {s: h.pop() for s, h in _homes(stack, 2).items()}
    dead = before[SESSIONS[0]]
    stack["workers"][dead].kill()  # refused connections: each gateway retries and rests it
    after = _homes(stack, 4)
    assert all(len(h) == 1 for h in after.values()), after
    after_one = {s: next(iter(h)) for s, h in after.items()}
    assert all(after_one[s] == before[s] for s in SESSIONS if before[s] != dead), (before, after_one)
    assert all(after_one[s] != dead for s in SESSIONS)


def test_sessions_keep_their_workers_when_the_scheduler_goes_away_and_when_a_fresh_one_is_back():
    """8 sessions over 3 workers, placed by the scheduler one at a time on idle workers: each
    starts on its rendezvous worker, so the gateway's fallback sends it to the same one after
    the scheduler is killed, and a scheduler started anew on its port (an empty session table)
    places it there again. Placed by load alone they would all tie and most would differ."""
    sessions = [f"chat-{i}" for i in range(8)]
    procs: list[Proc] = []
    try:
        workers = [start_echo_worker() for _ in range(3)]
        procs += [p for p, _ in workers]
        urls = [u for _, u in workers]
        sport = free_port()
        sched_flags = ("--scrape-interval-ms", "100")
        s, su = start_scheduler(urls, *sched_flags, port=sport)
        procs.append(s)
        g, gu = start_gateway("--scheduler", su, "--session-header", HEADER, "--debug-headers",
                              "--workers-refresh-ms", "100", "--wait-schedule-timeout-ms", "1000",
                              "--wait-schedule-try-period-ms", "100", "--scheduler-timeout-ms", "1000")
        procs.append(g)
        poll_until(lambda: len(scheduler_workers(su)) == 3
                   and all(w["healthy"] for w in scheduler_workers(su).values()), "3 healthy workers")

        def place(expect_policy: str) -> dict[str, str]:
            out = {}
            for session in sessions:
                r = _answer(gu, session)
                assert r.headers["x-router-policy"] == expect_policy, r.headers
                out[session] = r.headers["x-router-worker"]
            return out

        first = place("llm_aware")
        assert len(set(first.values())) >= 2, first  # spread, not all on one
        assert place("llm_aware") == first  # kept
        poll_until(lambda: len(_fallback_workers(gu)) == 3, "the gateway's copy of the worker list")

        s.kill()
        poll_until(lambda: _ask(gu, None)[1] == "fallback_round_robin", "the gateway in fallback mode")
        assert place("fallback_session") == first

        s2, _ = start_scheduler(urls, *sched_flags, port=sport)
        procs.append(s2)
        poll_until(lambda: all(w["healthy"] for w in scheduler_workers(su).values())
                   and len(scheduler_workers(su)) == 3, "the fresh scheduler's 3 healthy workers")
        poll_until(lambda: _ask(gu, None)[1] == "llm_aware", "the gateway back on the scheduler")
        again = {}
        for session in sessions:
            r = _answer(gu, session)
            assert r.headers["x-router-policy"] == "llm_aware"
            assert json.loads(r.headers["x-router-reason"])["session"] == "new"  # an empty table
            again[session] = r.headers["x-router-worker"]
        assert again == first
    finally:
        for p in procs:
            p.stop()
