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


@pytest.mark.parametrize(("field", "value"), [
    # A path segment the gateways' failure reports and the DELETE cannot reach.
    ("worker_id", "a?b"), ("worker_id", "a#b"), ("worker_id", ".."), ("worker_id", "a b"),
    ("worker_id", "w\nINFO scheduler: forged"),  # a line of its own in both services' logs
    ("worker_id", "w" * 254),
    ("models", ["m\r\nINFO forged"]), ("models", ["m" * 1025]),
    ("engine", "vllm\nforged"), ("engine", "e" * 65),
])
def test_registered_names_that_logs_paths_or_labels_cannot_hold_are_refused(field, value):
    svc = make_service(n=0, config={"registration_token": "t"})
    with pytest.raises(RegistrationError) as err:
        register(svc, {"url": URL, "models": ["m"], field: value})
    assert (err.value.status, err.value.param) == (400, field)
    assert not svc.registry.workers


def test_usual_worker_ids_and_model_names_are_taken():
    svc = make_service(n=0, config={"registration_token": "t"})
    for i, worker_id in enumerate(("vllm-0:8000", "[fd00::5]:8000", "3f2c9a1e-7b4d-4c1a-9e3f-0a1b2c3d4e5f")):
        model = "/models/meta-llama/Llama-3.1-8B-Instruct" if i else "llama 3 (8B)"
        w, created = register(svc, {"url": f"http://10.0.0.{i + 1}:8000", "models": [model],
                                    "worker_id": worker_id, "engine": "sglang"})
        assert created and w.worker_id == worker_id and w.models == {model}


async def test_a_failure_report_cannot_forge_log_lines(caplog):
    """POST /v1/workers/{id}/failure needs no token, and its error went into the log line of
    the worker's health change as sent: a newline in it wrote a line of the sender's choosing."""
    from aiohttp.test_utils import TestClient, TestServer

    from scheduler.app import build_app

    svc = make_service(n=1, config={"failure_report_streak": 1})
    caplog.set_level("INFO", logger="scheduler")
    async with TestClient(TestServer(build_app(svc))) as client:
        resp = await client.post("/v1/workers/w0/failure",
                                 json={"error": "timeout\n2026-01-01 INFO scheduler: forged"})
        assert resp.status == 204
    lines = [r.getMessage() for r in caplog.records if "w0" in r.getMessage()]
    assert lines and all("\n" not in line for line in lines), lines
    assert "forged" in svc.registry.workers["w0"].health.last_error  # still readable, escaped


@pytest.mark.parametrize("url", ["http://169.254.169.254", "http://169.254.169.254/latest/meta-data",
                                 "http://[::ffff:169.254.169.254]", "http://[fe80::1]:8000",
                                 "http://[fd00:ec2::254]", "http://224.0.0.1:8000"])
def test_a_registration_cannot_point_at_link_local_or_metadata_addresses(url):
    """The scheduler scrapes a registered URL and every gateway sends clients' requests to it
    (`/v1/...` under its path): whoever held the token aimed both at the cloud metadata service."""
    svc = make_service(n=0, config={"registration_token": "t"})
    with pytest.raises(RegistrationError) as err:
        register(svc, {"url": url, "models": ["m"]})
    assert (err.value.status, err.value.param) == (400, "url")
    assert not svc.registry.workers


def test_registrations_are_kept_to_the_allowed_networks():
    svc = make_service(n=0, config={"registration_token": "t",
                                    "registration_allowed_networks": "10.0.0.0/8, fd00:1::/64"})
    assert register(svc, {"url": "http://10.1.2.3:8000", "models": ["m"]})[1]
    assert register(svc, {"url": "http://[fd00:1::5]:8000", "models": ["m"]})[1]
    for url in ("http://192.168.1.5:8000", "http://127.0.0.1:8000", "http://kubernetes.default:443",
                "http://[fd00:2::5]:8000"):
        with pytest.raises(RegistrationError) as err:
            register(svc, {"url": url, "models": ["m"]})
        assert (err.value.status, err.value.param) == (400, "url"), url
    assert sorted(svc.registry.workers) == ["10.1.2.3:8000", "[fd00:1::5]:8000"]
    # Without the option every other address is taken, names too (a compose service's).
    svc = make_service(n=0, config={"registration_token": "t"})
    for url in ("http://192.168.1.5:8000", "http://worker-1:8001"):
        assert register(svc, {"url": url, "models": ["m"]})[1]


# ---- names under --registration-allowed-networks (resolved, checked again at heartbeats) ----

async def _post(svc, url: str, **more):
    """POST /v1/workers as a worker's registrar does: (status, JSON body)."""
    from aiohttp.test_utils import TestClient, TestServer

    from scheduler.app import build_app

    async with TestClient(TestServer(build_app(svc))) as client:
        resp = await client.post("/v1/workers", json={"url": url, "models": ["m"], **more},
                                 headers={"Authorization": "Bearer t"})
        return resp.status, await resp.json()


def _fake_dns(monkeypatch, answers: dict[str, list[str]]) -> list[str]:
    """The running loop's getaddrinfo answers `answers` (a name's addresses, changed by the test
    between calls: a DNS rebinding) and refuses names it has none for, as NXDOMAIN; returns the
    names asked. Other names than the test's go to the real resolver."""
    import asyncio
    import socket

    loop = asyncio.get_running_loop()
    real, asked = loop.getaddrinfo, []

    async def getaddrinfo(host, port, *args, **kwargs):
        if not str(host).endswith(".test"):  # the test client's own connection
            return await real(host, port, *args, **kwargs)
        asked.append(host)
        if host not in answers:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, 6, "",
                 (a, 0)) for a in answers[host]]

    monkeypatch.setattr(loop, "getaddrinfo", getaddrinfo)
    return asked


async def test_a_name_that_resolves_inside_the_allowed_networks_is_taken():
    """Workers usually address themselves by name (a pod's or a Service's, a compose service's):
    with allowed networks set, every such registration was refused, whatever the name
    resolved to. Resolved for real: localhost is 127.0.0.1 (and ::1 where /etc/hosts says so)."""
    svc = make_service(n=0, config={"registration_token": "t",
                                    "registration_allowed_networks": "127.0.0.0/8, ::1/128"})
    status, body = await _post(svc, "http://localhost:8000")
    assert status == 201, body
    assert body["worker_id"] == "localhost:8000" and body["url"] == "http://localhost:8000"
    assert (await _post(svc, "http://localhost:8000/"))[0] == 200  # its heartbeat
    assert list(svc.registry.workers) == ["localhost:8000"]


async def test_a_name_that_resolves_outside_or_not_at_all_is_refused_saying_why():
    svc = make_service(n=0, config={"registration_token": "t",
                                    "registration_allowed_networks": "10.0.0.0/8"})
    status, body = await _post(svc, "http://localhost:8000")
    assert status == 400, body
    error = body["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", "url")
    assert "resolves to 127.0.0.1" in error["message"] or "resolves to ::1" in error["message"]
    assert "outside registration_allowed_networks (10.0.0.0/8)" in error["message"]
    # .invalid never resolves (RFC 6761): refused, and the message says so.
    status, body = await _post(svc, "http://no-such-worker.invalid:8000")
    assert (status, body["error"]["param"]) == (400, "url"), body
    assert "no-such-worker.invalid" in body["error"]["message"]
    assert "resolve" in body["error"]["message"]
    assert not svc.registry.workers


async def test_a_name_with_any_address_outside_or_at_metadata_is_refused(monkeypatch):
    """Every address counts: a client (the scraper, a gateway) may dial any of them."""
    _fake_dns(monkeypatch, {"mixed.test": ["10.0.0.5", "192.168.1.5"],
                            "meta.test": ["10.0.0.6", "169.254.169.254"],
                            "v6.test": ["10.0.0.7", "fd00:1::7"]})
    svc = make_service(n=0, config={"registration_token": "t",
                                    "registration_allowed_networks": "10.0.0.0/8, fd00:1::/64"})
    status, body = await _post(svc, "http://mixed.test:8000")
    assert status == 400 and "resolves to 192.168.1.5, which is outside" in body["error"]["message"]
    status, body = await _post(svc, "http://meta.test:8000")
    assert status == 400 and "169.254.169.254, which is a link-local" in body["error"]["message"]
    assert not svc.registry.workers
    assert (await _post(svc, "http://v6.test:8000"))[0] == 201


async def test_a_registered_name_that_now_resolves_outside_is_dropped_at_its_heartbeat(
        monkeypatch, caplog):
    """DNS rebinding: the name was checked while it resolved inside, then pointed elsewhere
    (the metadata service, a host outside the pod network); the scraper and the gateways would
    follow it there. The next heartbeat resolves it again and the registration goes."""
    answers = {"worker.test": ["10.0.0.5"]}
    asked = _fake_dns(monkeypatch, answers)
    svc = make_service(n=0, config={"registration_token": "t",
                                    "registration_allowed_networks": "10.0.0.0/8"})
    assert (await _post(svc, "http://worker.test:8000"))[0] == 201
    assert (await _post(svc, "http://worker.test:8000"))[0] == 200
    assert asked == ["worker.test", "worker.test"]  # resolved at every heartbeat, not cached
    answers["worker.test"] = ["10.0.0.5", "192.168.7.7"]
    caplog.set_level("WARNING", logger="scheduler")
    status, body = await _post(svc, "http://worker.test:8000")
    assert status == 400 and "192.168.7.7" in body["error"]["message"]
    assert not svc.registry.workers  # dropped now, not at its TTL
    assert any("registration of worker.test:8000 dropped" in r.getMessage()
               and "192.168.7.7" in r.getMessage() for r in caplog.records)


async def test_a_registered_name_that_stops_resolving_lapses_at_its_ttl(monkeypatch):
    """A DNS hiccup is no rebinding: the worker, still serving, is not dropped, but a heartbeat
    whose name cannot be checked does not renew it either."""
    from scheduler.scrape.scraper import Scraper

    answers = {"worker.test": ["10.0.0.5"]}
    _fake_dns(monkeypatch, answers)
    svc = make_service(n=0, config={"registration_token": "t", "registration_ttl_s": 5,
                                    "registration_allowed_networks": "10.0.0.0/8"})
    assert (await _post(svc, "http://worker.test:8000"))[0] == 201
    w = svc.registry.workers["worker.test:8000"]
    expires = w.expires_at
    del answers["worker.test"]
    status, body = await _post(svc, "http://worker.test:8000")
    assert status == 400 and "does not resolve" in body["error"]["message"], body
    assert svc.registry.workers["worker.test:8000"] is w and w.expires_at == expires
    Scraper(svc).expire_registrations(expires + 1)
    assert not svc.registry.workers


async def test_a_resolver_that_does_not_answer_is_refused_in_time(monkeypatch):
    import asyncio

    from scheduler.discovery import registration

    async def never(*args, **kwargs):
        await asyncio.sleep(60)

    monkeypatch.setattr(asyncio.get_running_loop(), "getaddrinfo", never)
    monkeypatch.setattr(registration, "RESOLVE_TIMEOUT_S", 0.05)
    svc = make_service(n=0, config={"registration_token": "t",
                                    "registration_allowed_networks": "10.0.0.0/8"})
    with pytest.raises(RegistrationError) as err:
        await registration.resolve_and_register(svc, {"url": "http://slow.test:8000", "models": ["m"]})
    assert (err.value.status, err.value.param) == (400, "url")
    assert "did not resolve within 0.05 s" in str(err.value)


async def test_without_allowed_networks_names_are_not_resolved(monkeypatch):
    """As before: the name is taken as given (the scraper and the gateways resolve it)."""
    asked = _fake_dns(monkeypatch, {})
    svc = make_service(n=0, config={"registration_token": "t"})
    assert (await _post(svc, "http://worker-1.test:8001"))[0] == 201
    assert asked == []
