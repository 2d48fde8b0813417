"""A worker that registers with a scheduler must advertise an address the scheduler can reach."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from inference_worker.config import WorkerConfig
from inference_worker.registration import Registrar

SCHEDULER = "http://scheduler:8090"


@pytest.mark.parametrize("host", ["0.0.0.0", "::", ""])
def test_registering_while_listening_on_every_interface_needs_an_advertised_url(host):
    """--host 0.0.0.0 (as in a container) without --advertise-url registered
    http://0.0.0.0:8001: the scheduler scraped its own host there, and every such worker was
    one worker. Now start-up stops with a line that names the missing flag; the scheduler
    refuses such a URL too (scheduler/discovery/registration.py)."""
    with pytest.raises(ValidationError, match="advertise-url"):
        WorkerConfig(host=host, register_with=SCHEDULER)
    cfg = WorkerConfig(host=host, register_with=SCHEDULER, advertise_url="http://10.0.0.5:8001")
    assert Registrar(cfg)._body()["url"] == "http://10.0.0.5:8001"
    assert WorkerConfig(host=host).register_with is None  # not registering: nothing to advertise


def test_a_named_or_specific_host_is_advertised_as_given():
    for host in ("127.0.0.1", "worker-0.llm.svc", "10.0.0.5"):
        assert Registrar(WorkerConfig(host=host, register_with=SCHEDULER))._body()["url"] == f"http://{host}:8001"


def test_an_ipv6_host_is_advertised_in_brackets():
    """http://::1:8001 has no host: the scheduler refused it at every heartbeat."""
    from scheduler.urls import http_url_problem

    url = Registrar(WorkerConfig(host="::1", register_with=SCHEDULER))._body()["url"]
    assert url == "http://[::1]:8001" and http_url_problem(url) is None


def test_a_registration_token_from_a_secret_file_goes_out_without_its_newline():
    """A Secret made from a file keeps its last newline; aiohttp refused the header holding it,
    so every registration failed, a warning every few seconds for the worker's life."""
    config = WorkerConfig(register_with="http://127.0.0.1:8090", registration_token="s3cret\n")
    assert Registrar(config)._headers == {"Authorization": "Bearer s3cret"}
    with pytest.raises(ValidationError, match="registration_token"):
        WorkerConfig(register_with="http://127.0.0.1:8090", registration_token="s3\ncret")
