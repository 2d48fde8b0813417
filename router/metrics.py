"""Prometheus metrics of the gateway, in a registry of its own.

Label children are looked up once per label tuple and cached in plain dicts, so a
request costs a dict hit plus the observe/inc itself (prometheus_client's
`.labels()` does argument validation and locking on every call).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, disable_created_metrics, generate_latest

from router.fast_metrics import FastCounter as Counter
from router.fast_metrics import FastGauge as Gauge
from router.fast_metrics import FastHistogram as Histogram

# The *_created series double the exposition size and no dashboard uses them.
disable_created_metrics()

MAX_SERIES = 2000  # request-counter label sets kept before new ones are counted as model "other"
MAX_MODELS = 200
# Tenants (the queue's flows) with series of their own; later ones are counted as "other". A
# fairness id is the client's word, so the bound keeps made-up ids from growing the page.
MAX_TENANTS = 200
# How a worker fails a stream that had begun (router/streaming.py's failure kinds, and a
# WebSocket worker that closed with answers owed): a fixed set, so a fixed set of series.
STREAM_ERROR_REASONS = ("connection", "timeout", "idle_timeout", "upstream_closed")
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)
_SCHED_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1, 5)


class RouterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "router_requests_total",
            "Requests answered, by model, HTTP status and worker",
            ["model", "status", "worker"],
            registry=r,
        )
        self.in_flight = Gauge(
            "router_requests_in_flight",
            "Requests accepted and not yet answered, those queued for a worker included",
            registry=r,
        )
        self.queued = Gauge(
            "router_requests_queued", "Requests waiting in the admission queue", registry=r
        )
        self.queued_flows = Gauge(
            "router_queued_flows",
            "Flows (tenants: fairness id or API key) with requests waiting their turn in the queue",
            registry=r,
        )
        self.prompt_tokens = Counter(
            "router_prompt_tokens_total",
            "Prompt tokens (from the worker's usage)",
            ["model"],
            registry=r,
        )
        self.generation_tokens = Counter(
            "router_generation_tokens_total",
            "Generated tokens (from the worker's usage)",
            ["model"],
            registry=r,
        )
        self.tenant_requests = Counter(
            "router_tenant_requests_total",
            "Requests served, by tenant (the queue's flow: id:<fairness header>, key:<API key "
            f"digest>, shared without either; other past {MAX_TENANTS} tenants)",
            ["tenant"],
            registry=r,
        )
        self.tenant_tokens = Counter(
            "router_tenant_tokens_total",
            "Tokens served, by tenant and kind (prompt, output; from the worker's usage)",
            ["tenant", "kind"],
            registry=r,
        )
        self.ttft = Histogram(
            "router_time_to_first_token_seconds",
            "Time to first byte of the answer, measured at the gateway",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "router_time_per_output_token_seconds",
            "(e2e - TTFT) / (output tokens per answer - 1), streams only (n answers, or a "
            "batch's, are generated side by side)",
            ["model"],
            buckets=_TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "router_e2e_request_latency_seconds",
            "Arrival to last byte",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.stored_response_lookups = Counter(
            "router_stored_response_lookups_total",
            "Requests on a stored response (previous_response_id, GET, cancel) by how its worker "
            "was known: remembered from its answer, found by asking every worker, missing, or "
            "remembered as lost with its worker",
            ["result"],
            registry=r,
        )
        for result in ("remembered", "found", "missing", "lost"):  # at 0 from the start, for rate()
            self.stored_response_lookups.labels(result)
        self.queue_wait = Histogram(
            "router_queue_wait_seconds",
            "Time spent waiting for a worker (queue and scheduler)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.retries = Counter(
            "router_retries_total", "Requests re-sent to another worker", ["reason"], registry=r
        )
        self.rejected = Counter(
            "router_rejected_requests_total",
            "Requests refused before reaching a worker",
            ["reason"],
            registry=r,
        )
        self.stream_errors = Counter(
            "router_stream_errors_total",
            "Streams whose worker failed after the answer had begun (its status, 200, was sent): "
            "the client got an error event instead of the rest, by how the worker failed",
            ["reason"],
            registry=r,
        )
        for reason in STREAM_ERROR_REASONS:  # at 0 from the start, for rate()
            self.stream_errors.labels(reason)
        self.fallback_mode = Gauge(
            "router_fallback_mode",
            "1 while routing by round robin because the scheduler is unreachable",
            registry=r,
        )
        self.fallback_requests = Counter(
            "router_fallback_requests_total", "Requests routed by the round-robin fallback", registry=r
        )
        self.mode_switches = Counter(
            "router_mode_switches_total",
            "Switches between scheduled and fallback routing",
            ["to"],
            registry=r,
        )
        self.mode_switch_seconds = Gauge(
            "router_last_mode_switch_duration_seconds",
            "to=fallback: first failed scheduler call to fallback; to=scheduled: scheduler back to first "
            "successful probe",
            ["to"],
            registry=r,
        )
        self.scheduler_latency = Histogram(
            "router_scheduler_call_duration_seconds",
            "Latency of calls to the scheduler",
            ["call"],
            buckets=_SCHED_BUCKETS,
            registry=r,
        )
        self.scheduler_errors = Counter(
            "router_scheduler_errors_total", "Scheduler calls that failed", ["call"], registry=r
        )
        self._req_children: dict[tuple[str, str, str], Counter] = {}
        self._model_children: dict[str, tuple] = {}
        self._tenant_children: dict[str, tuple] = {}
        self._sched_children = {
            c: self.scheduler_latency.labels(c) for c in ("schedule", "wait", "workers")
        }

    def request_done(self, model: str, status: int, worker: str) -> None:
        if status == 404:
            model = "unknown"  # a client can invent any number of model names: not a label each
        key = (model, str(status), worker)
        child = self._req_children.get(key)
        if child is None:
            if len(self._req_children) > MAX_SERIES:  # bound label cardinality
                key = ("other", key[1], key[2])
            child = self._req_children[key] = self.requests.labels(*key)
        child.inc()

    def has_model(self, model: str) -> bool:
        """A worker served the model here (it has series of its own)."""
        return model in self._model_children

    def per_model(self, model: str) -> tuple:
        """(prompt_tokens, generation_tokens, ttft, tpot, e2e) children for a model."""
        children = self._model_children.get(model)
        if children is None:
            if len(self._model_children) > MAX_MODELS:
                model = "other"
            children = self._model_children[model] = (
                self.prompt_tokens.labels(model),
                self.generation_tokens.labels(model),
                self.ttft.labels(model),
                self.tpot.labels(model),
                self.e2e.labels(model),
            )
        return children

    def per_tenant(self, flow: str) -> tuple:
        """(requests, prompt_tokens, output_tokens) children for a flow (router/fairness.py)."""
        children = self._tenant_children.get(flow)
        if children is None and len(self._tenant_children) >= MAX_TENANTS:
            # One entry for the rest: no flow is named "other" (flows are id:..., key:... or "").
            flow = "other"
            children = self._tenant_children.get(flow)
        if children is None:
            tenant = flow or "shared"
            children = self._tenant_children[flow] = (
                self.tenant_requests.labels(tenant),
                self.tenant_tokens.labels(tenant, "prompt"),
                self.tenant_tokens.labels(tenant, "output"),
            )
        return children

    def stream_failed(self, reason: str) -> None:
        self.stream_errors.labels(reason if reason in STREAM_ERROR_REASONS else "connection").inc()

    def observe_scheduler(self, call: str, seconds: float) -> None:
        self._sched_children[call].observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
