"""Kubernetes discovery's bookkeeping, in process: EndpointSlice objects (lightkube's models,
built from the API's JSON shape) applied to a real SchedulerService. The watch against an
API server is tested in test_integration.py (against a stand-in: see fake_kube.py)."""

from __future__ import annotations

from lightkube.resources.discovery_v1 import EndpointSlice

from scheduler.config import SchedulerConfig
from scheduler.discovery.kubernetes import KubernetesDiscovery
from scheduler.service import SchedulerService


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
