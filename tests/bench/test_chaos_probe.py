"""The chaos soak's probe (benchmarks/chaos_probe.py) reads the gateways' gauges and the
scheduler's workers as the services write them; no processes."""

from __future__ import annotations

from benchmarks.chaos_probe import IN_FLIGHT, QUEUED, Sample, WorkerState, gauges_of, workers_of

METRICS = """\
# HELP router_requests_in_flight Requests accepted and not yet answered, those queued for a worker included
# TYPE router_requests_in_flight gauge
router_requests_in_flight 7.0
# HELP router_requests_queued Requests waiting in the admission queue
# TYPE router_requests_queued gauge
router_requests_queued 3.0
router_requests_total{model="llama2",status="200",worker="127.0.0.1:1"} 12.0
router_requests_queued_flows 1.0
"""


def test_the_gateways_gauges_are_read_by_exact_name():
    assert gauges_of(METRICS) == {IN_FLIGHT: 7.0, QUEUED: 3.0}


def test_the_schedulers_workers_and_a_sample_of_a_cluster_with_a_gateway_down():
    doc = {"workers": [
        {"worker_id": "a", "healthy": True, "in_flight_leases": 4,
         "snapshot": {"running": 3.0, "waiting": 0.0}},
        {"worker_id": "b", "healthy": False, "in_flight_leases": 2, "snapshot": None}]}
    workers = workers_of(doc)
    assert workers == [WorkerState("a", True, 4, 3.0, 0.0), WorkerState("b", False, 2, None, None)]
    s = Sample(1.0, [{QUEUED: 2.0, IN_FLIGHT: 5.0}, None], workers)
    assert (s.queued, s.leases) == (2.0, 6)
    assert Sample(2.0, [None, None], None).queued is None
    assert Sample(2.0, [None, None], None).leases is None
