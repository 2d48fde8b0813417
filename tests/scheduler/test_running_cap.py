"""The running-request cap, learnt from a worker's scrapes or declared (config, registration;
scheduler/running_cap.py), and llm_aware keeping requests off a worker that runs as many as
its cap."""

from __future__ import annotations

import math
import time

import pytest

from scheduler.config import SchedulerConfig
from scheduler.discovery.registration import RegistrationError, register
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
        # the one waiting request is held for a LoRA budget or a KV transfer (vLLM: deferred)
        "deferred": [{"running": 2, "waiting": 1, "waiting_deferred": 1, "kv": 0.1,
                      "prompt_total": 500.0}] * 20,
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


def test_declared_caps_shape_the_first_burst_before_any_scrape_shows_a_queue():
    """Two idle workers with caps 2 and 8 (by worker id and by URL): a burst of 10 between
    scrapes puts 2 on the small one and 8 on the large one, then holds; with nothing declared
    the burst splits evenly (half of it would wait on the small one for whole answers)."""
    caps = {"w0": 2, "http://127.0.0.1:9001/": 8}
    svc = make_service(n=2, config={"worker_max_running": caps})
    picks = [decide(svc) for _ in range(11)]
    chosen = [p["worker_id"] for p in picks[:10]]
    assert (chosen.count("w0"), chosen.count("w1")) == (2, 8)
    assert isinstance(picks[10], Wait)
    assert worker(svc, "w0").view(time.monotonic())["running_cap_declared"] == 2

    svc = make_service(n=2)
    chosen = [decide(svc)["worker_id"] for _ in range(10)]
    assert (chosen.count("w0"), chosen.count("w1")) == (5, 5)


def test_a_declared_cap_the_worker_disproves_is_set_aside_until_another_is_declared():
    svc = make_service(n=1, config={"worker_max_running": {"w0": 2}})
    w = worker(svc, "w0")
    assert w.running_cap.cap == 2
    feed(svc, w, running=3)  # it runs 3: the declaration was wrong
    assert w.running_cap.cap == math.inf
    w.declare_running_cap(2)  # the same value again (a heartbeat) does not bring it back
    assert w.running_cap.cap == math.inf
    w.declare_running_cap(4)
    assert w.running_cap.cap == 4
    w.declare_running_cap(None)
    assert w.running_cap.cap == math.inf


def test_the_smaller_of_declared_and_learnt_is_in_force():
    svc = make_service(n=1, config={"worker_max_running": {"w0": 8}})
    t0 = time.monotonic() - 200.0
    t = scrapes(svc, "w0", t0, PLATEAU_S + STEP, running=2, waiting=1, kv=0.05, prompt_total=500.0)
    assert worker(svc, "w0").running_cap.cap == 2  # e.g. an engine that admits fewer than its flag
    scrapes(svc, "w0", t, TTL_S + STEP, running=2, waiting=0, kv=0.05, prompt_total=500.0)
    assert worker(svc, "w0").running_cap.cap == 8  # the learnt one expired; the declared stays


def test_registration_announces_a_cap_that_config_overrides():
    svc = make_service(n=0, config={"registration_token": "t", "worker_max_running": {"127.0.0.1:9101": 3}})
    announced, _ = register(svc, {"url": "http://127.0.0.1:9100", "models": ["m"], "max_running": 6})
    configured, _ = register(svc, {"url": "http://127.0.0.1:9101", "models": ["m"], "max_running": 6})
    assert (announced.running_cap.cap, configured.running_cap.cap) == (6, 3)
    for bad in (0, -1, 2.5, "4", True):
        with pytest.raises(RegistrationError) as err:
            register(svc, {"url": "http://127.0.0.1:9102", "max_running": bad})
        assert (err.value.status, err.value.param) == (400, "max_running")


def test_config_refuses_caps_below_one():
    with pytest.raises(ValueError, match="worker_max_running"):
        SchedulerConfig(worker_max_running={"w0": 0})


def test_a_request_the_engine_does_not_show_yet_still_takes_a_slot_under_the_cap():
    """The engine's gauges lag a request it was sent (ours update at the end of the step that
    admits it): a scrape in that gap shows one running where two are. The open leases keep
    the worker at its cap, so no third request is sent to wait there for a whole answer."""
    svc = make_service(n=1, config={"worker_max_running": {"w0": 2}})
    w = worker(svc, "w0")
    first, _second = decide(svc), decide(svc)
    t = time.monotonic() + 1.0
    feed(svc, w, running=2, kv=0.1, taken_at=t)
    assert svc.release(first["lease_id"], True, used_tokens=300)
    assert decide(svc)["worker_id"] == "w0"  # the freed slot
    # Taken after that request was sent, before the engine's gauges show it.
    feed(svc, w, running=1, kv=0.1, taken_at=t + 1.0)
    assert w.running_eff == 1 and w.in_flight == 2
    assert isinstance(decide(svc), Wait)


def test_a_pool_wide_default_cap_yields_to_a_worker_s_own_entry_and_to_its_announcement():
    """"*" declares the cap of every worker with nothing better (Kubernetes: a pool of identical
    engines whose ids are pod IPs). A worker's own entry wins over it, and so does the cap the
    worker announces itself, which heartbeats repeat without flipping the cap back."""
    caps = {"*": 4, "127.0.0.1:9101": 3}
    svc = make_service(n=0, config={"registration_token": "t", "worker_max_running": caps})
    silent, _ = register(svc, {"url": "http://127.0.0.1:9100", "models": ["m"]})
    own, _ = register(svc, {"url": "http://127.0.0.1:9101", "models": ["m"], "max_running": 6})
    announced, _ = register(svc, {"url": "http://127.0.0.1:9102", "models": ["m"], "max_running": 6})
    assert [w.running_cap.cap for w in (silent, own, announced)] == [4, 3, 6]
    register(svc, {"url": "http://127.0.0.1:9102", "models": ["m"], "max_running": 6})
    assert announced.running_cap.cap == 6
    assert svc.cfg.declared_running_cap("127.0.0.1:9100", "http://127.0.0.1:9100") is None
