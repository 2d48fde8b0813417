"""Self-registration against the registry's other sources, and workers that leave and come
back, in process (register() as the POST /v1/workers handler calls it)."""

from __future__ import annotations

import time

import pytest

from scheduler.discovery.registration import RegistrationError, deregister, register
from scheduler.policies import Request
from scheduler.registry import WorkerState
from tests.scheduler.helpers import feed, make_service

URL = "http://10.0.0.5:8000"


def test_a_second_id_at_a_registered_url_is_refused_until_the_first_leaves():
    """A worker back from a crash under a new id (no DELETE sent), or two registrars
    advertising one engine: the scheduler kept two workers at one URL, each drawing a full
    share of the traffic and each counting only its own leases."""
    svc = make_service(n=0, config={"registration_token": "t"})
    register(svc, {"url": URL, "models": ["m"], "worker_id": "run-1"})
    with pytest.raises(RegistrationError) as err:
        register(svc, {"url": URL, "models": ["m"], "worker_id": "run-2"})
    assert (err.value.status, err.value.param) == (409, "url") and "run-1" in str(err.value)
    with pytest.raises(RegistrationError):  # no id: its host:port id would be a third name
        register(svc, {"url": URL + "/", "models": ["m"], "worker_id": "10.0.0.5:8000"})
    assert [w.worker_id for w in svc.registry.workers.values()] == ["run-1"]
    assert deregister(svc, "run-1")  # gone (or expired): the new id goes through
    assert register(svc, {"url": URL, "models": ["m"], "worker_id": "run-2"})[1] is True
    assert [w.worker_id for w in svc.registry.workers.values()] == ["run-2"]


def test_a_registration_joins_the_worker_another_source_found_at_its_url():
    """Kubernetes names a worker after its pod; the same engine registering itself (no id:
    host:port) became a second worker at the same URL."""
    svc = make_service(n=0, config={"registration_token": "t"})
    pod = svc.add_worker(WorkerState(URL, worker_id="vllm-0:8000", source="kubernetes"))
    w, created = register(svc, {"url": URL, "models": ["m"]})
    assert w is pod and created  # created: as a registration (it expires, it may leave)
    assert list(svc.registry.workers) == ["vllm-0:8000"] and pod.sources == {"kubernetes", "registration"}
    assert register(svc, {"url": URL, "models": ["m"]}) == (pod, False)  # its heartbeat
    # Leaving keeps the pod's worker: Kubernetes still lists it.
    assert deregister(svc, "vllm-0:8000") and svc.registry.workers["vllm-0:8000"] is pod
    assert pod.sources == {"kubernetes"}
    # Once the pod's worker is gone, the URL is free for a registration of its own.
    assert svc.remove_worker("vllm-0:8000", source="kubernetes")
    assert svc.registry.by_url(URL) is None
    assert register(svc, {"url": URL, "models": ["m"]})[0].worker_id == "10.0.0.5:8000"


def test_a_removed_worker_s_late_scrape_does_not_touch_its_successor():
    """A worker left (deregistered, its pod gone) and came back under the same id while a
    scrape of its old state was in flight. That scrape's verdict (half open) was applied by
    id: the new worker, up and busy, became every request's "trial" pick, ahead of the
    policy and past its saturation."""
    svc = make_service(n=2, config={"registration_token": "t"}, max_waiting=1)
    old = svc.registry.workers["w0"]
    old.health.force_down("connect")
    svc.on_health_change(old)
    old.health.on_success(time.monotonic(), svc.cfg.recover_streak)  # one of the two it needs
    assert svc.remove_worker("w0")
    new = svc.add_worker(WorkerState(old.url, worker_id="w0", models=["m"]))
    assert new.health.on_success(time.monotonic(), svc.cfg.recover_streak)
    svc.on_health_change(new)
    feed(svc, new, running=8, waiting=4)  # queueing: the policy passes it over
    # The old state's scrape ends now, as the scraper reports it.
    if old.health.on_success(time.monotonic(), svc.cfg.recover_streak):
        svc.on_health_change(old)
    feed(svc, old, running=0)
    assert svc.half_open == set() and new.snapshot.running == 8
    picks = {svc.decide(Request("m", 100, 100), time.monotonic())["worker_id"] for _ in range(3)}
    assert picks == {"w1"}


@pytest.mark.parametrize("url", ["http://0.0.0.0:8000", "http://[::]:8000"])
def test_a_worker_advertising_every_interface_is_refused(url):
    """A worker run with --host 0.0.0.0 (as in a container) and no --advertise-url registered
    http://0.0.0.0:8000: the scheduler then scraped its own host's port 8000, and every such
    worker, on whatever machine, was the one worker '0.0.0.0:8000'."""
    svc = make_service(n=0, config={"registration_token": "t"})
    with pytest.raises(RegistrationError) as err:
        register(svc, {"url": url, "models": ["m"]})
    assert (err.value.status, err.value.param) == (400, "url") and "advertise-url" in str(err.value)
    assert not svc.registry.workers
    assert register(svc, {"url": "http://10.0.0.5:8000", "models": ["m"]})[1] is True
