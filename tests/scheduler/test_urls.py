"""Worker and scheduler URLs are checked where they enter: flags, config, registrations."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from scheduler.config import SchedulerConfig
from scheduler.discovery.registration import RegistrationError, deregister, register
from scheduler.urls import http_url_problem
from tests.scheduler.helpers import make_service

GOOD = ["http://127.0.0.1:8001", "https://vllm-0.vllm.svc:8000/", "http://[::1]:9000", "http://worker"]
BAD = ["http://", "https://", "http://:8001", "127.0.0.1:8001", "ftp://x", "http://h:99999", "http://h:0x",
       # A host aiohttp cannot encode for DNS failed every scrape with a traceback (no
       # connection error, so never taken out); credentials showed in ids, logs and metrics; a
       # query or fragment swallowed the paths appended to it.
       "http://" + "a" * 64 + ":8001", "http://a..b:8001", "http://a b:8001", "http://h\t:8001",
       "http://u:p@h:8001", "http://h:8001/x?y=1", "http://h:8001#f"]


@pytest.mark.parametrize("url", GOOD)
def test_usable_urls_pass(url):
    assert http_url_problem(url) is None


@pytest.mark.parametrize("url", BAD)
def test_unusable_urls_are_named(url):
    problem = http_url_problem(url)
    assert problem is not None and repr(url) in problem


@pytest.mark.parametrize("url", BAD)
def test_registration_refuses_them_as_a_400_on_url(url):
    svc = make_service(n=0, config={"registration_token": "t"})
    with pytest.raises(RegistrationError) as err:
        register(svc, {"url": url, "models": ["m"]})
    assert (err.value.status, err.value.param) == (400, "url")
    assert not svc.registry.workers


@pytest.mark.parametrize("url", BAD)
def test_static_workers_refuse_them_at_start_up(url):
    with pytest.raises(ValidationError, match="workers"):
        SchedulerConfig(workers=f"http://127.0.0.1:8001,{url}")


def test_registration_at_another_url_of_a_known_worker_is_refused():
    """The registry keeps a known worker's URL: a registration of the same id elsewhere was
    answered as registered while calls went on to the old URL."""
    svc = make_service(n=0, config={"registration_token": "t"})
    register(svc, {"url": "http://127.0.0.1:8001", "models": ["m"], "worker_id": "a"})
    register(svc, {"url": "http://127.0.0.1:8002", "models": ["m"]})  # id 127.0.0.1:8002
    for body in ({"url": "http://127.0.0.1:8003", "worker_id": "a"}, {"url": "http://127.0.0.1:8002/v2"}):
        with pytest.raises(RegistrationError) as err:
            register(svc, {**body, "models": ["m"]})
        assert (err.value.status, err.value.param) == (409, "url")
    assert register(svc, {"url": "http://127.0.0.1:8001/", "models": ["m"], "worker_id": "a"})[1] is False
    assert {w.url for w in svc.registry.workers.values()} == {"http://127.0.0.1:8001", "http://127.0.0.1:8002"}


def test_a_running_cap_past_float_range_is_refused_and_leaves_the_worker_registrable():
    """It raised OverflowError after the cap was kept: that registration and every later one of
    the worker were 500s."""
    svc = make_service(n=0, config={"registration_token": "t"})
    with pytest.raises(RegistrationError) as err:
        register(svc, {"url": "http://127.0.0.1:8001", "max_running": 10**400})
    assert (err.value.status, err.value.param) == (400, "max_running")
    w, _ = register(svc, {"url": "http://127.0.0.1:8001", "max_running": 8})
    assert w.running_cap.cap == 8
    with pytest.raises(ValidationError, match="worker_max_running"):
        SchedulerConfig(worker_max_running={"*": 10**400})


def test_registrations_past_the_bound_are_refused_until_one_leaves():
    """Every registered worker is scraped every interval: a registrar minting ids without end
    (a leaked token, a crash loop) is refused past the bound, and heartbeats still go through."""
    svc = make_service(n=0, config={"registration_token": "t", "max_registered_workers": 2})
    for port in (8001, 8002):
        register(svc, {"url": f"http://127.0.0.1:{port}", "models": ["m"]})
    with pytest.raises(RegistrationError) as err:
        register(svc, {"url": "http://127.0.0.1:8003", "models": ["m"]})
    assert err.value.status == 429 and "max_registered_workers" in str(err.value)
    assert register(svc, {"url": "http://127.0.0.1:8001", "models": ["m"]})[1] is False  # a heartbeat
    assert deregister(svc, "127.0.0.1:8002")
    assert register(svc, {"url": "http://127.0.0.1:8003", "models": ["m"]})[1] is True
