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
