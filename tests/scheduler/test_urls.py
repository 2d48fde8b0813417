"""Worker and scheduler URLs are checked where they enter: flags, config, registrations."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from scheduler.config import SchedulerConfig
from scheduler.discovery.registration import RegistrationError, register
from scheduler.urls import http_url_problem
from tests.scheduler.helpers import make_service

GOOD = ["http://127.0.0.1:8001", "https://vllm-0.vllm.svc:8000/", "http://[::1]:9000", "http://worker"]
BAD = ["http://", "https://", "http://:8001", "127.0.0.1:8001", "ftp://x", "http://h:99999", "http://h:0x"]


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
