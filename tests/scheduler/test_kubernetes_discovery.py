"""Kubernetes discovery in process: EndpointSlice objects (lightkube's models, built from the
API's JSON shape) applied to a real SchedulerService, and its list and watch over loopback
against a stand-in API server (no cluster runs here: see fake_kube.py). The whole scheduler
against that stand-in is tested in test_integration.py."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
from lightkube.resources.discovery_v1 import EndpointSlice

from scheduler.config import SchedulerConfig
from scheduler.discovery.kubernetes import KubernetesDiscovery
from scheduler.service import SchedulerService
from tests.scheduler.fake_kube import FakeKubeApi


def endpoint(pod: str, ip: str, **conditions: bool) -> dict:
    return {"addresses": [ip], "conditions": {"ready": True, **conditions},
            "targetRef": {"kind": "Pod", "name": pod, "namespace": "llm"}}


def endpoint_slice(name: str, *endpoints: dict, ports: list[dict] | None = None) -> EndpointSlice:
    return EndpointSlice.from_dict({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
        "metadata": {"name": name, "namespace": "llm"},
        "endpoints": list(endpoints),
        "ports": [{"name": "http", "port": 8000, "protocol": "TCP"}] if ports is None else ports,
    })


def discovery(**config) -> tuple[SchedulerService, KubernetesDiscovery]:
    cfg = SchedulerConfig(k8s_namespace="llm", k8s_label_selector="app=vllm", **config)
    svc = SchedulerService(cfg)
    return svc, KubernetesDiscovery(svc, cfg)


def urls(svc: SchedulerService) -> dict[str, str]:
    return {wid: w.url for wid, w in svc.registry.workers.items()}


def test_a_pod_back_at_another_address_is_scraped_there():
    """A StatefulSet pod keeps its name when it is recreated, and gets a new IP: the worker
    must move to it. The registry keeps a known worker's URL, so the scheduler went on
    scraping (and sending requests to) the old address, and the pod never came back."""
    svc, k8s = discovery()
    k8s.apply("ADDED", endpoint_slice("vllm-abc", endpoint("vllm-0", "10.0.0.1")))
    assert urls(svc) == {"vllm-0:8000": "http://10.0.0.1:8000"}
    old = svc.registry.workers["vllm-0:8000"]
    lease = svc.leases.issue(old, 0.0, 10.0)
    k8s.apply("MODIFIED", endpoint_slice("vllm-abc", endpoint("vllm-0", "10.0.0.7")))
    assert urls(svc) == {"vllm-0:8000": "http://10.0.0.7:8000"}
    new = svc.registry.workers["vllm-0:8000"]
    assert new is not old and new.leases == {}  # the old pod's load left with it
    assert lease.lease_id not in svc.leases.leases
    # The same move seen only in a fresh list (the watch missed it).
    k8s.resync({"vllm-abc": endpoint_slice("vllm-abc", endpoint("vllm-0", "10.0.0.9"))})
    assert urls(svc) == {"vllm-0:8000": "http://10.0.0.9:8000"}


def test_a_pod_in_two_slices_stays_until_no_slice_lists_it():
    """Two Services selecting the same pods (a headless one beside the client-facing one, as
    StatefulSets have), or the IPv4 and IPv6 slices of a dual-stack Service, list each pod
    twice. Deleting one slice removed the worker although the other still listed it ready."""
    svc, k8s = discovery()
    k8s.apply("ADDED", endpoint_slice("vllm-abc", endpoint("vllm-0", "10.0.0.1"),
                                      endpoint("vllm-1", "10.0.0.2")))
    k8s.apply("ADDED", endpoint_slice("vllm-headless-xyz", endpoint("vllm-0", "10.0.0.1")))
    k8s.apply("DELETED", endpoint_slice("vllm-abc"))
    assert urls(svc) == {"vllm-0:8000": "http://10.0.0.1:8000"}
    # Not ready in the remaining slice: now it goes.
    k8s.apply("MODIFIED", endpoint_slice("vllm-headless-xyz", endpoint("vllm-0", "10.0.0.1", ready=False)))
    assert urls(svc) == {}
    # The same through a fresh list: a slice gone while unwatched leaves the pod in the other.
    k8s.resync({"a": endpoint_slice("a", endpoint("vllm-0", "10.0.0.1")),
                "b": endpoint_slice("b", endpoint("vllm-0", "10.0.0.1"))})
    k8s.resync({"b": endpoint_slice("b", endpoint("vllm-0", "10.0.0.1"))})
    assert urls(svc) == {"vllm-0:8000": "http://10.0.0.1:8000"}
    k8s.resync({})
    assert urls(svc) == {}


def test_an_endpoint_moved_between_slices_is_not_dropped():
    """The EndpointSlice controller may add an endpoint to one slice before it takes it out of
    another: the removal must not take the worker out."""
    svc, k8s = discovery()
    k8s.apply("ADDED", endpoint_slice("s1", endpoint("vllm-0", "10.0.0.1")))
    w = svc.registry.workers["vllm-0:8000"]
    k8s.apply("ADDED", endpoint_slice("s2", endpoint("vllm-0", "10.0.0.1")))
    k8s.apply("MODIFIED", endpoint_slice("s1"))
    assert svc.registry.workers.get("vllm-0:8000") is w  # the same worker: its state is kept


def test_terminating_endpoints_and_portless_slices_are_no_workers():
    """A Service that publishes not-ready addresses (a StatefulSet's headless one) keeps
    ready=true on a terminating pod: it was kept in rotation through its shutdown, each new
    request refused or cut. A slice port without a number ("all ports") made a worker at
    http://<ip>:None."""
    svc, k8s = discovery()
    k8s.apply("ADDED", endpoint_slice("s1", endpoint("vllm-0", "10.0.0.1", terminating=True),
                                      endpoint("vllm-1", "10.0.0.2"),
                                      {"addresses": ["10.0.0.3"], "targetRef": {"name": "vllm-2"}}))
    # vllm-2's conditions are unset: unknown means ready.
    assert urls(svc) == {"vllm-1:8000": "http://10.0.0.2:8000", "vllm-2:8000": "http://10.0.0.3:8000"}
    k8s.apply("ADDED", endpoint_slice("s2", endpoint("vllm-9", "10.0.0.9"), ports=[{"protocol": "TCP"}]))
    assert "vllm-9:8000" not in urls(svc) and not any("None" in u for u in urls(svc).values())
    # With --k8s-port naming the number, the portless slice's endpoints are workers on it.
    svc, k8s = discovery(k8s_port="8000")
    k8s.apply("ADDED", endpoint_slice("s2", endpoint("vllm-9", "10.0.0.9"), ports=[{"protocol": "TCP"}]))
    assert urls(svc) == {"vllm-9:8000": "http://10.0.0.9:8000"}


async def _until(pred, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


@pytest.fixture
async def fake_api():
    api = FakeKubeApi({"PORT_A": 8001, "PORT_B": 8002})  # nothing listens: no scrapes here
    await api.start()
    yield api
    await api.stop()


async def _watching(api: FakeKubeApi, **config):
    svc, k8s = discovery(k8s_api_server=api.url, **config)
    task = asyncio.create_task(k8s.run())
    await _until(lambda: set(urls(svc)) == {"sim-a-0:8001", "sim-b-0:8002"}, 10, "the listed slices")
    await _until(lambda: api.streams, 10, "the watch")
    return svc, k8s, task


async def _stop(task: asyncio.Task) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.wait_for(task, 5)


async def test_a_watch_whose_connection_died_silently_is_replaced(fake_api):
    """A watch connection that dies without a close (an idle load balancer's drop, a lost
    node) sent nothing more, and the scheduler waited on it forever: every pod change after
    it went unseen (here a pod turning not ready stayed in rotation). Each watch now asks the
    server to end it after k8s_watch_timeout_s, and a watch with no event for a little longer
    is dropped and the slices listed again."""
    svc, _, task = await _watching(fake_api, k8s_watch_timeout_s=1)
    try:
        assert "timeoutSeconds=1" in fake_api.requests[1]
        fake_api.stall()
        fake_api.release_next()  # sim-b turns not ready; the stalled watch cannot say so
        await _until(lambda: set(urls(svc)) == {"sim-a-0:8001"}, 15,
                     "a fresh list after the silent watch")
        assert sum("watch=true" not in r for r in fake_api.requests) >= 2  # listed again
    finally:
        await _stop(task)


async def test_a_watch_the_server_ends_resumes_from_its_last_version(fake_api):
    """The API server ends each watch after timeoutSeconds: the next one starts from the last
    resourceVersion seen (no event lost, none replayed), not with a fresh list."""
    svc, _, task = await _watching(fake_api, k8s_watch_timeout_s=1)
    try:
        fake_api.release_next()  # version 3: sim-b turns not ready
        await _until(lambda: set(urls(svc)) == {"sim-a-0:8001"}, 10, "the watched event")
        await _until(lambda: len(fake_api.requests) >= 3, 10, "the watch resumed")
        resumed = fake_api.requests[2]
        assert "watch=true" in resumed and "resourceVersion=3" in resumed, fake_api.requests
    finally:
        await _stop(task)


def test_a_pod_also_listed_statically_is_one_worker():
    """--workers names a pod's address that Kubernetes discovery also finds (under the pod's
    name): two ids for one URL made two workers, each drawing a full share of the traffic and
    counting only its own leases (the engine got twice its load). Either order, one worker; the
    pod leaving discovery keeps it, as the static list still names it."""
    from scheduler.discovery.static import add_static_workers

    for static_first in (True, False):
        svc, k8s = discovery()
        if static_first:
            add_static_workers(svc, ["http://10.0.0.1:8000"])
        k8s.apply("ADDED", endpoint_slice("vllm-abc", endpoint("vllm-0", "10.0.0.1")))
        if not static_first:
            add_static_workers(svc, ["http://10.0.0.1:8000"])
        (w,) = svc.registry.workers.values()
        assert w.url == "http://10.0.0.1:8000" and w.sources == {"static", "kubernetes"}
        lease = svc.leases.issue(w, 0.0, 10.0)
        k8s.apply("DELETED", endpoint_slice("vllm-abc"))
        assert list(svc.registry.workers.values()) == [w] and w.sources == {"static"}
        assert lease.lease_id in svc.leases.leases  # its load is still there
        # The pod back at the same address joins the same worker again, and at another
        # address is a worker of its own beside the static one.
        k8s.apply("ADDED", endpoint_slice("vllm-abc", endpoint("vllm-0", "10.0.0.1")))
        assert list(svc.registry.workers.values()) == [w]
        k8s.apply("MODIFIED", endpoint_slice("vllm-abc", endpoint("vllm-0", "10.0.0.7")))
        assert sorted(u for u in urls(svc).values()) == ["http://10.0.0.1:8000", "http://10.0.0.7:8000"]
        assert w.sources == {"static"}
        k8s.apply("DELETED", endpoint_slice("vllm-abc"))
        assert list(svc.registry.workers.values()) == [w]
