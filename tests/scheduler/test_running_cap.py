"""The running-request cap learnt from a worker's scrapes (scheduler/running_cap.py), and
llm_aware keeping requests off a worker that runs as many as its cap."""

from __future__ import annotations

import math
import time

from scheduler.running_cap import PLATEAU_S, TTL_S
from scheduler.service import Wait
from tests.scheduler.helpers import feed, make_service, worker
from tests.scheduler.test_policies import decide

STEP = 0.1  # the scheduler's scrape interval


def scrapes(svc, wid: str, start: float, seconds: float, **load) -> float:
    """Feed one worker a scrape every STEP for `seconds`; returns the time after the last."""
    t = start
    for _ in range(round(seconds / STEP) + 1):
        feed(svc, worker(svc, wid), taken_at=t, **load)
        t += STEP
    return t


def test_cap_is_learnt_from_a_worker_queueing_with_kv_free_and_no_prompt_admitted():
    svc = make_service(n=1)
    t0 = time.monotonic() - 10.0
    stuck = {"running": 2, "waiting": 1, "kv": 0.05, "prompt_total": 500.0}
    t = scrapes(svc, "w0", t0, PLATEAU_S - 2 * STEP, **stuck)
    assert worker(svc, "w0").running_cap.cap == math.inf  # not yet: a long prefill looks alike
    scrapes(svc, "w0", t, 3 * STEP, **stuck)
    assert worker(svc, "w0").running_cap.cap == 2
    assert worker(svc, "w0").view(time.monotonic())["running_cap"] == 2


def test_cap_is_learnt_when_a_request_starts_waiting_beside_unchanged_running():
    """The usual start of a plateau: the worker ran 2 and admitted nothing for a while, then a
    request arrives and waits. Nothing but `waiting` changes between those scrapes."""
    svc = make_service(n=1)
    t0 = time.monotonic() - 10.0
    t = scrapes(svc, "w0", t0, 1.0, running=2, waiting=0, kv=0.05, prompt_total=500.0)
    scrapes(svc, "w0", t, PLATEAU_S + STEP, running=2, waiting=1, kv=0.05, prompt_total=500.0)
    assert worker(svc, "w0").running_cap.cap == 2


def test_no_cap_from_waits_that_are_not_the_cap():
    t0 = time.monotonic() - 10.0
    cases = {
        # prompts get through while others wait: the step's token budget, not the cap
        "prefill_moves": [{"running": 2, "waiting": 3, "kv": 0.1, "prompt_total": 100.0 * i}
                          for i in range(20)],
        # waiting with the KV cache nearly full: waiting for KV
        "kv_bound": [{"running": 30, "waiting": 4, "kv": 0.9, "prompt_total": 500.0}] * 20,
        # admitted one by one: running grows
        "admitting": [{"running": 2 + i, "waiting": 1, "kv": 0.1, "prompt_total": 500.0}
                      for i in range(20)],
        # an engine that does not say what it prefilled cannot tell the two apart
        "no_prompt_counter": [{"running": 2, "waiting": 1, "kv": 0.1}] * 20,
        "nothing_waits": [{"running": 2, "waiting": 0, "kv": 0.1, "prompt_total": 500.0}] * 20,
    }
    for name, loads in cases.items():
        svc = make_service(n=1)
        for i, load in enumerate(loads):
            feed(svc, worker(svc, "w0"), taken_at=t0 + i * STEP, **load)
        assert worker(svc, "w0").running_cap.cap == math.inf, name


def test_cap_is_dropped_when_disproved_and_after_its_ttl():
    svc = make_service(n=1)
    t0 = time.monotonic() - 200.0
    stuck = {"running": 2, "waiting": 1, "kv": 0.05, "prompt_total": 500.0}
    t = scrapes(svc, "w0", t0, PLATEAU_S + STEP, **stuck)
    assert worker(svc, "w0").running_cap.cap == 2
    feed(svc, worker(svc, "w0"), taken_at=t, running=3, kv=0.05, prompt_total=900.0)
    assert worker(svc, "w0").running_cap.cap == math.inf  # it ran 3: the cap was wrong

    t = scrapes(svc, "w0", t + STEP, PLATEAU_S + STEP, **stuck)
    assert worker(svc, "w0").running_cap.cap == 2
    quiet = {"running": 2, "waiting": 0, "kv": 0.05, "prompt_total": 500.0}
    t = scrapes(svc, "w0", t, TTL_S - 3 * STEP, **quiet)  # the last one: TTL_S - 2 STEP after
    assert worker(svc, "w0").running_cap.cap == 2  # kept while within its TTL
    scrapes(svc, "w0", t, 4 * STEP, **quiet)
    assert worker(svc, "w0").running_cap.cap == math.inf


def test_llm_aware_keeps_requests_off_a_worker_at_its_cap():
    """w0 runs 2 of its cap of 2, w1 runs 3 with no known cap: by count w0 would win, but a
    request sent there waits for a whole answer. Leases count toward the cap as well."""
    for use_cap, expected in ((True, "w1"), (False, "w0")):
        svc = make_service(n=2, use_running_cap=use_cap)
        t0 = time.monotonic() - PLATEAU_S - 0.5  # the last scrapes are fresh
        t = scrapes(svc, "w0", t0, PLATEAU_S + STEP, running=2, waiting=1, kv=0.05, prompt_total=500.0)
        assert worker(svc, "w0").running_cap.cap == 2
        # The waiting request was cancelled by its client: w0 runs 2, nothing waits.
        feed(svc, worker(svc, "w0"), taken_at=t, running=2, waiting=0, kv=0.05, prompt_total=500.0)
        feed(svc, worker(svc, "w1"), taken_at=t, running=3, waiting=0, kv=0.05, prompt_total=900.0)
        assert decide(svc)["worker_id"] == expected, use_cap

    svc = make_service(n=1)
    t0 = time.monotonic() - PLATEAU_S - 0.5
    t = scrapes(svc, "w0", t0, PLATEAU_S + STEP, running=3, waiting=1, kv=0.05, prompt_total=500.0)
    feed(svc, worker(svc, "w0"), taken_at=t, running=1, waiting=0, kv=0.05, prompt_total=900.0)
    picks = [decide(svc) for _ in range(3)]  # two slots free, then held until one frees
    assert [isinstance(p, Wait) for p in picks] == [False, False, True]
