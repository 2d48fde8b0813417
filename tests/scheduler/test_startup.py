"""The scheduler's first seconds (scheduler/startup.py): an unknown model is "no healthy worker"
(the gateway's retryable 503) until the pool is learnt, "no such model" (404) after."""

from __future__ import annotations

import time

from scheduler.config import SchedulerConfig
from scheduler.policies import Request
from scheduler.registry import WorkerState
from scheduler.service import UNKNOWN_MODEL, SchedulerService, Wait
from scheduler.startup import StartupGrace


def test_a_static_worker_whose_models_were_never_read_keeps_unknown_models_waiting():
    svc = SchedulerService(SchedulerConfig())
    w = svc.add_worker(WorkerState("http://127.0.0.1:9000", worker_id="w0"))
    now = time.monotonic()
    out = svc.decide(Request("m", 10, 10), now)
    assert isinstance(out, Wait) and out.reason == "no_routable_worker"
    w.models_fetched_at = now  # its first /v1/models read (failed or not): the pool is learnt
    assert svc.decide(Request("m", 10, 10), now) == UNKNOWN_MODEL


def test_the_grace_waits_for_each_source_and_ends_at_its_bound():
    grace = StartupGrace(100.0, 30.0, registration_ttl_s=10.0)
    grace.wait_for("kubernetes")
    assert grace.active(101.0, [])
    grace.ready("kubernetes")
    assert grace.active(105.0, [])  # registered workers may not have heartbeated yet
    assert not grace.active(110.0, [])  # every source has had its round
    bounded = StartupGrace(100.0, 5.0, registration_ttl_s=None)
    bounded.wait_for("kubernetes")  # a list that never succeeds
    assert bounded.active(104.0, []) and not bounded.active(105.0, [])
    assert not StartupGrace(100.0, 0.0, registration_ttl_s=10.0).active(100.0, [])  # switched off


def test_a_pinned_worker_not_known_yet_is_unavailable_until_the_pool_is_learnt():
    """After a restart, a follow-up pinned to a registered worker that has not heartbeated yet
    is told to retry (unavailable), not that its stored response is lost (gone); once the
    registrations are all back, an unknown worker is gone."""
    svc = SchedulerService(SchedulerConfig(registration_token="t", registration_ttl_s=10.0))
    w1 = svc.add_worker(WorkerState("http://127.0.0.1:9001", worker_id="w1", models=["m"]))
    w1.health.on_success(time.monotonic(), 1)
    start = svc.startup.until - svc.cfg.startup_grace_s
    pinned = Request("m", 10, 10, pin="w0")
    out = svc.decide(pinned, start + 1.0)
    assert isinstance(out, Wait) and out.reason == "pinned_worker_unavailable"
    out = svc.decide(pinned, start + 11.0)  # every registered worker has had its heartbeat
    assert isinstance(out, Wait) and out.reason == "pinned_worker_gone"
