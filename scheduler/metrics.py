"""The scheduler's own Prometheus metrics (own registry, served at GET /metrics)."""

from __future__ import annotations

import contextlib
import math
import time
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

if TYPE_CHECKING:
    from scheduler.service import SchedulerService

_DECISION_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.1)
_SCRAPE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _WorkerCollector:
    """Per-worker gauges read from the registry at collection time (nothing on the hot path)."""

    def __init__(self, service: SchedulerService) -> None:
        self.service = service

    def collect(self):
        healthy = GaugeMetricFamily("scheduler_worker_healthy", "1 when the worker is in rotation",
                                    labels=["worker"])
        age = GaugeMetricFamily("scheduler_worker_data_age_seconds", "age of the worker's load data",
                                labels=["worker"])
        leases = GaugeMetricFamily("scheduler_worker_in_flight_leases", "open leases", labels=["worker"])
        running = GaugeMetricFamily("scheduler_worker_running", "running requests (scraped)",
                                    labels=["worker"])
        waiting = GaugeMetricFamily("scheduler_worker_waiting", "waiting requests (scraped)",
                                    labels=["worker"])
        kv = GaugeMetricFamily("scheduler_worker_kv_usage", "KV usage 0-1 (scraped)", labels=["worker"])
        backlog = GaugeMetricFamily("scheduler_worker_prefill_backlog_tokens",
                                    "prompt tokens sent that the worker has not reported prefilled",
                                    labels=["worker"])
        reserved = GaugeMetricFamily("scheduler_worker_reserved_tokens",
                                     "freed KV held for a follow-up turn", labels=["worker"])
        cap = GaugeMetricFamily("scheduler_worker_running_cap", "running-request cap in force: declared "
                                "(config, registration, TGI /info) or learnt from the worker's scrapes "
                                "(absent while unknown)", labels=["worker"])
        now = time.monotonic()
        for w in list(self.service.registry.workers.values()):
            wid = [w.worker_id]
            healthy.add_metric(wid, 1.0 if w.health.routable else 0.0)
            leases.add_metric(wid, float(w.in_flight))
            backlog.add_metric(wid, w.prefill_backlog)
            reserved.add_metric(wid, w.reserved_tokens)
            if w.running_cap.cap != math.inf:
                cap.add_metric(wid, w.running_cap.cap)
            s = w.snapshot
            if s is not None:
                age.add_metric(wid, now - s.taken_at)
                running.add_metric(wid, s.running)
                waiting.add_metric(wid, s.waiting)
                if s.kv_usage is not None:
                    kv.add_metric(wid, s.kv_usage)
        yield from (healthy, age, leases, backlog, reserved, running, waiting, kv, cap)
        yield from self._reservations()
        yield from self._kept_rooms()
        yield self._cordons()
        yield from self._sessions()

    def _sessions(self):
        table = self.service.env.sessions
        table.expire(time.monotonic())  # here, off the decision path: the gauge counts live ones
        outcomes = CounterMetricFamily(
            "scheduler_session_affinity", "requests of a session (the gateways' --session-header) "
            "issued to its worker (kept), to another (moved: its worker was saturated, busier than "
            "the session slack allows, cordoned, down or failed it) or with none yet (new); only "
            "the llm_aware and session policies keep sessions", labels=["outcome"])
        for outcome, n in table.counts.items():
            outcomes.add_metric([outcome], n)
        size = GaugeMetricFamily("scheduler_sessions", "sessions whose worker is kept (at most "
                                 "--max-sessions, each for --session-ttl-s after its last request)")
        size.add_metric([], len(table))
        yield from (outcomes, size)

    def _cordons(self) -> GaugeMetricFamily:
        service = self.service
        cordoned = GaugeMetricFamily("scheduler_worker_cordoned", "1 while an operator has the worker "
                                     "cordoned (POST /v1/workers/{id}/cordon): no new requests, pinned "
                                     "ones still; also for a cordoned id no worker has now",
                                     labels=["worker"])
        cordons = service.cordons.by_id
        for wid in list(service.registry.workers):
            cordoned.add_metric([wid], 1.0 if wid in cordons else 0.0)
        for wid in [wid for wid in cordons if wid not in service.registry.workers]:
            cordoned.add_metric([wid], 1.0)
        return cordoned

    def _kept_rooms(self):
        keeper = self.service.kept
        keeps = CounterMetricFamily("scheduler_room_keeps", "workers kept for a held request too large "
                                    "for the room smaller ones kept taking (started), and those whose "
                                    "request was then placed (placed)", labels=["event"])
        keeps.add_metric(["started"], keeper.started)
        keeps.add_metric(["placed"], keeper.placed)
        kept = GaugeMetricFamily("scheduler_worker_kept", "1 while the worker is kept for one held "
                                 "request (scheduler/kept_room.py)", labels=["worker"])
        for w in list(keeper.by_worker):
            kept.add_metric([w.worker_id], 1.0)
        yield from (keeps, kept)

    def _reservations(self):
        table = self.service.reservations
        ends = CounterMetricFamily("scheduler_followup_reservations",
                                   "follow-up holds that ended, by outcome", labels=["outcome"])
        ends.add_metric(["claimed"], table.claimed)
        ends.add_metric(["expired"], table.expired)
        rate = GaugeMetricFamily("scheduler_followup_claim_rate",
                                 "running share of holds claimed (below the minimum, few are held)")
        rate.add_metric([], table.claim_rate)
        yield from (ends, rate)


SCRAPE_FAILURE_KINDS = ("timeout", "connection", "http")


class SchedulerMetrics:
    def __init__(self, service: SchedulerService) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.decisions = Counter("scheduler_decisions", "scheduling decisions", ["policy", "outcome"],
                                 registry=r)
        self.decision_latency = Histogram("scheduler_decision_latency_seconds", "in-process decision time",
                                          buckets=_DECISION_BUCKETS, registry=r)
        self.waits = Counter("scheduler_waits", "requests held while every worker was saturated",
                             registry=r)
        self.wait_seconds = Histogram("scheduler_wait_seconds", "time held", ["outcome"],
                                      buckets=_WAIT_BUCKETS, registry=r)
        self.scrape_latency = Histogram("scheduler_scrape_latency_seconds", "metrics scrape time",
                                        ["worker"], buckets=_SCRAPE_BUCKETS, registry=r)
        self.scrape_failures = Counter("scheduler_scrape_failures", "failed scrapes", ["worker", "kind"],
                                       registry=r)
        self.scrape_filter_misses = Counter(
            "scheduler_scrape_filter_misses", "filtered /metrics scrapes that failed, lacked the "
            "series or were not filtered (the next scrape reads the whole page)", ["worker"],
            registry=r)
        self.releases = Counter("scheduler_lease_releases", "lease ends", ["outcome"], registry=r)
        self.prefilled = Counter("scheduler_prefilled_reports", "first tokens the gateway reported",
                                 ["outcome"], registry=r)
        self.gateway_leases_dropped = Counter(
            "scheduler_gateway_leases_dropped", "leases ended because their gateway was gone (its "
            "channel closed for --gateway-gone-grace-s: a crash), not released", registry=r)
        self.renewals = Counter("scheduler_lease_renewals", "leases of long requests the gateway renewed "
                                "(unknown: released, expired or issued before a restart)", ["outcome"],
                                registry=r)
        self.failure_reports = Counter("scheduler_failure_reports", "gateway failure reports", registry=r)
        self.cordon_file_write_failures = Counter(
            "scheduler_cordon_file_write_failures", "writes of the cordon file (--cordon-file) that "
            "failed: the cordons then in force hold in memory only until a write succeeds",
            registry=r)
        r.register(_WorkerCollector(service))
        policy = service.cfg.policy
        # Children resolved once: labels() lookups are not free on the hot path.
        self._ok = self.decisions.labels(policy, "scheduled")
        self._wait = self.decisions.labels(policy, "wait")
        self._unknown = self.decisions.labels(policy, "unknown_model")
        self._held_ok = self.wait_seconds.labels("scheduled")
        self._held_timeout = self.wait_seconds.labels("timeout")
        self._held_cancelled = self.wait_seconds.labels("cancelled")

    def forget_worker(self, worker_id: str) -> None:
        """Drop a removed worker's labelled series: in Kubernetes every rollout brings new pod
        addresses, and the old ones' series would otherwise be exported forever."""
        series = [(self.scrape_latency, (worker_id,)), (self.scrape_filter_misses, (worker_id,))]
        series += [(self.scrape_failures, (worker_id, kind)) for kind in SCRAPE_FAILURE_KINDS]
        for metric, labels in series:
            with contextlib.suppress(KeyError):
                metric.remove(*labels)

    def decision_done(self, out, seconds: float) -> None:
        self.decision_latency.observe(seconds)
        if isinstance(out, dict):
            self._ok.inc()
        elif isinstance(out, str):
            self._unknown.inc()
        else:
            self._wait.inc()

    def wait_cancelled(self, seconds: float) -> None:
        """The caller went away while held: no decision, no lease."""
        self._held_cancelled.observe(seconds)

    def wait_done(self, scheduled: bool, seconds: float) -> None:
        (self._held_ok if scheduled else self._held_timeout).observe(seconds)
        if scheduled:
            self._ok.inc()
