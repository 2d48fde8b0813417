"""Build the Grafana dashboards (JSON) from one readable description.

    python -m deploy.grafana.generate          # rewrites deploy/grafana/dashboards/*.json

The JSON files are committed (Grafana provisioning reads them as they are);
a test checks that they are what this program writes, so edit here, not there.
Every query uses the metric names the services expose: the gateway's `router_*`,
the scheduler's `scheduler_*` and the workers' vLLM-compatible `vllm:*`.
"""

from __future__ import annotations

import json
from pathlib import Path

OUT_DIR = Path(__file__).resolve().parent / "dashboards"
DS = {"type": "prometheus", "uid": "${datasource}"}
RATE = "$__rate_interval"
# The metric prefixes of the gateway, the scheduler and the worker.
SERVICES = ("router", "scheduler", "worker")


def target(expr: str, legend: str, ref: str) -> dict:
    return {"datasource": DS, "expr": expr, "legendFormat": legend, "refId": ref, "range": True}


def panel(kind: str, title: str, queries: list[tuple[str, str]], unit: str = "short",
          description: str = "", width: int = 12, height: int = 8,
          min: float | None = None, max: float | None = None) -> dict:
    """A panel without id/gridPos: `layout` assigns those."""
    refs = "ABCDEFGHIJKLMNOP"
    body = {
        "type": kind,
        "title": title,
        "description": description,
        "datasource": DS,
        "targets": [target(expr, legend, refs[i]) for i, (expr, legend) in enumerate(queries)],
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                    "tooltip": {"mode": "multi", "sort": "desc"}},
        "_size": (width, height),
    }
    if kind == "stat":
        body["options"] = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                           "colorMode": "value", "graphMode": "area", "textMode": "auto"}
    if kind == "heatmap":
        body["options"] = {"calculate": False, "yAxis": {"unit": unit}, "cellGap": 1}
        for t in body["targets"]:
            t["format"] = "heatmap"
    for key, value in (("min", min), ("max", max)):
        if value is not None:
            body["fieldConfig"]["defaults"][key] = value
    return body


def row(title: str) -> dict:
    return {"type": "row", "title": title, "collapsed": False, "panels": [], "_size": (24, 1)}


def layout(panels: list[dict]) -> list[dict]:
    """Give each panel a unique id and a gridPos, filling 24-column lines left to right."""
    x = y = line_height = 0
    out = []
    for pid, p in enumerate(panels, start=1):
        w, h = p.pop("_size")
        if x + w > 24 or p["type"] == "row":
            x, y, line_height = 0, y + line_height, 0
        p["id"] = pid
        p["gridPos"] = {"x": x, "y": y, "w": w, "h": h}
        x += w
        line_height = max(line_height, h)
        out.append(p)
    return out


def quantiles(metric: str, by: str, sel: str, qs=(0.5, 0.9, 0.99)) -> list[tuple[str, str]]:
    """p-quantile series from a histogram, plus the mean from _sum/_count."""
    series = [
        (f"histogram_quantile({q}, sum by (le{by}) (rate({metric}_bucket{sel}[{RATE}])))",
         f"p{round(q * 100)}{legend_suffix(by)}")
        for q in qs
    ]
    group = f"sum by ({by.lstrip(', ')}) " if by else "sum"
    series.append((f"{group}(rate({metric}_sum{sel}[{RATE}])) / {group}(rate({metric}_count{sel}[{RATE}]))",
                   f"avg{legend_suffix(by)}"))
    return series


def legend_suffix(by: str) -> str:
    labels = [label.strip() for label in by.split(",") if label.strip()]
    return "".join(f" {{{{{label}}}}}" for label in labels)


def max_avg_min(metric: str, sel: str) -> list[tuple[str, str]]:
    """The reference product's max/avg/min/p50/p99 view, derived from one histogram.

    max and min are bucket-bound estimates: q=1 gives the upper bound of the highest
    non-empty bucket, q=0.001 (about) the lower bound of the lowest one.
    """
    agg = f"sum by (le) (rate({metric}_bucket{sel}[{RATE}]))"
    return [
        (f"histogram_quantile(1, {agg})", "max (bucket bound)"),
        (f"sum(rate({metric}_sum{sel}[{RATE}])) / sum(rate({metric}_count{sel}[{RATE}]))", "avg"),
        (f"histogram_quantile(0.001, {agg})", "min (bucket bound)"),
        (f"histogram_quantile(0.5, {agg})", "p50"),
        (f"histogram_quantile(0.99, {agg})", "p99"),
    ]


def every_service(template: str) -> str:
    """One query over a metric the three services each export under their prefix: `template`
    with {s} for the prefix, the three joined by `or` (their series differ by job)."""
    return " or ".join(template.format(s=s) for s in SERVICES)


def variable(name: str, label: str, query: str, include_all: bool = True) -> dict:
    return {
        "name": name, "label": label, "type": "query", "datasource": DS,
        "query": {"query": query, "refId": f"{name}-var"}, "definition": query,
        "refresh": 2, "includeAll": include_all, "multi": include_all, "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]} if include_all else {},
        "sort": 1,
    }


def dashboard(uid: str, title: str, description: str, variables: list[dict], panels: list[dict]) -> dict:
    datasource = {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
                  "current": {}, "hide": 0, "refresh": 1}
    return {
        "uid": uid, "title": title, "description": description, "tags": ["llm-router"],
        "editable": True, "graphTooltip": 1, "schemaVersion": 39, "version": 1,
        "time": {"from": "now-15m", "to": "now"}, "refresh": "10s", "timezone": "browser",
        "templating": {"list": [datasource, *variables]}, "annotations": {"list": []},
        "links": [], "panels": layout(panels),
    }


def router_dashboard() -> dict:
    m = '{model=~"$model"}'
    ts = "timeseries"
    panels = [
        row("Traffic"),
        panel("stat", "Requests/s", [(f"sum(rate(router_requests_total{m}[{RATE}]))", "req/s")],
              "reqps", width=4, height=4),
        panel("stat", "Error ratio (non-2xx)",
              [(f'sum(rate(router_requests_total{{model=~"$model",status!~"2..|499"}}[{RATE}])) / '
                f"sum(rate(router_requests_total{m}[{RATE}]))", "errors")], "percentunit", width=4, height=4,
              description="Answers other than 2xx, less 499: a client that left (a chat's stop "
              "button, a closed tab) is no error of the service"),
        panel("stat", "In flight", [("sum(router_requests_in_flight)", "in flight")], width=4, height=4,
              description="Accepted and not yet answered, the queued ones included"),
        panel("stat", "Queued", [("sum(router_requests_queued)", "queued")], width=4, height=4),
        panel("stat", "Fallback mode (gateways)", [("sum(router_fallback_mode)", "in fallback")],
              width=4, height=4, description="Gateway replicas routing by round robin (no scheduler)"),
        panel("stat", "Healthy workers", [("sum(scheduler_worker_healthy)", "healthy")], width=4, height=4,
              description="Workers in rotation, as the scheduler sees them"),
        panel(ts, "Requests/s by status", [
            (f"sum by (status) (rate(router_requests_total{m}[{RATE}]))", "{{status}}")], "reqps"),
        panel(ts, "Requests/s by worker", [
            (f"sum by (worker) (rate(router_requests_total{m}[{RATE}]))", "{{worker}}")], "reqps"),
        panel(ts, "In flight and queued (all gateways)", [
            ("sum(router_requests_in_flight)", "in flight (queued included)"),
            ("sum(router_requests_queued)", "queued"),
            ("max(router_queued_flows)", "tenants waiting (most in one gateway)")]),
        panel(ts, "Token throughput IN / OUT", [
            (f"sum(rate(router_prompt_tokens_total{m}[{RATE}]))", "IN (prompt tokens/s)"),
            (f"sum(rate(router_generation_tokens_total{m}[{RATE}]))", "OUT (generated tokens/s)")],
            "short", description="From the usage the workers return, counted at the gateway"),
        panel(ts, "Tokens by tenant (top 10)", [
            (f"topk(10, sum by (tenant) (rate(router_tenant_tokens_total[{RATE}])))", "{{tenant}}")],
            "short", description="Prompt and output tokens per second of each tenant (the queue's "
            "flow: id:<fairness header>, key:<API key digest>, shared without either; other past "
            "200 tenants). Token turns (--fair-share tokens) share the cluster by these, output "
            "tokens weighing 2"),
        row("Latency seen by clients (measured at the gateway)"),
        panel(ts, "Time to first token", max_avg_min("router_time_to_first_token_seconds", m), "s",
              description="Arrival at the gateway to the first streamed chunk (streamed requests); "
              "max/min are bucket bounds"),
        panel(ts, "Time per output token", max_avg_min("router_time_per_output_token_seconds", m), "s",
              description="(e2e - TTFT) / (output tokens - 1) of each answer (n choices or a "
              "batch of prompts: per answer), streamed requests and WebSocket answers"),
        panel(ts, "End-to-end latency", quantiles("router_e2e_request_latency_seconds", "", m), "s"),
        panel(ts, "Queue wait", quantiles("router_queue_wait_seconds", "", ""), "s",
              description="Time a request waited for a worker (gateway queue + scheduler holds)"),
        row("Resilience"),
        panel(ts, "Retries by reason", [
            (f"sum by (reason) (rate(router_retries_total[{RATE}]))", "{{reason}}")], "reqps", width=8),
        panel(ts, "Rejected by reason", [
            (f"sum by (reason) (rate(router_rejected_requests_total[{RATE}]))", "{{reason}}")], "reqps",
            width=8, description="429 queue full / queue timeout, auth, body size, ..."),
        panel(ts, "Streams cut by their worker", [
            (f"sum by (reason) (rate(router_stream_errors_total[{RATE}]))", "{{reason}}")], "reqps",
            width=8, description="Answers whose worker failed after the first bytes (their 200 "
            "was sent, so the request counters show them as served): the client got an error event "
            "instead of the rest"),
        panel(ts, "Fallback mode and fallback requests", [
            ("max by (instance) (router_fallback_mode)", "fallback {{instance}}"),
            (f"sum(rate(router_fallback_requests_total[{RATE}]))", "fallback req/s")], width=8),
        panel(ts, "Stored-response lookups", [
            (f"sum by (result) (rate(router_stored_response_lookups_total[{RATE}]))", "{{result}}")],
            "reqps", width=8,
            description="Requests on a stored response (previous_response_id, GET, cancel): its worker "
            "remembered, found by asking every worker (another gateway served it, or a restart), "
            "or missing (404)"),
        row("Scheduler"),
        panel(ts, "Gateway → scheduler call latency", [
            *[(f"histogram_quantile({q}, sum by (le, call) "
               f"(rate(router_scheduler_call_duration_seconds_bucket[{RATE}])))",
               f"p{round(q * 100)} {{{{call}}}}") for q in (0.5, 0.99)],
            (f"sum by (call) (rate(router_scheduler_errors_total[{RATE}]))", "errors/s {{call}}")],
            "s", width=8),
        panel(ts, "Scheduling decision latency (in the scheduler)",
              quantiles("scheduler_decision_latency_seconds", "", ""), "s", width=8),
        panel(ts, "Decisions by policy and outcome", [
            (f"sum by (policy, outcome) (rate(scheduler_decisions_total[{RATE}]))",
             "{{policy}} {{outcome}}"),
            (f"sum(rate(scheduler_waits_total[{RATE}]))", "held (all saturated)")], "reqps", width=8),
        panel(ts, "Worker health (scheduler view)", [
            ("scheduler_worker_healthy", "{{worker}}"),
            ("scheduler_worker_cordoned == 1", "cordoned {{worker}}")], width=8,
              description="1 = in rotation, 0 = out (failed probes/scrapes or reported by a gateway). "
              "Cordoned: an operator took it out for maintenance (scheduler POST "
              "/v1/workers/{id}/cordon): healthy, but only requests pinned to it go there"),
        panel(ts, "Worker load data age", [("scheduler_worker_data_age_seconds", "{{worker}}")], "s", width=8,
              description="Age of the newest metrics snapshot; stale data is treated as saturated"),
        panel(ts, "Open leases by worker", [("scheduler_worker_in_flight_leases", "{{worker}}")], width=8,
              description="Requests the scheduler handed out and the gateways have not released yet"),
        panel(ts, "Worker load as the scheduler sees it", [
            ("scheduler_worker_running", "running {{worker}}"),
            ("scheduler_worker_waiting", "waiting {{worker}}")], width=8),
        panel(ts, "Prefill backlog by worker", [("scheduler_worker_prefill_backlog_tokens", "{{worker}}")],
              width=8, description="Prompt tokens routed to the worker that it has not reported prefilled "
              "yet (llm_aware steers new requests away from a long backlog)"),
        panel(ts, "Scrape latency p99 and failures", [
            (f"histogram_quantile(0.99, sum by (le, worker) "
             f"(rate(scheduler_scrape_latency_seconds_bucket[{RATE}])))", "p99 {{worker}}"),
            (f"sum by (worker, kind) (rate(scheduler_scrape_failures_total[{RATE}]))",
             "failures/s {{worker}} {{kind}}"),
            (f"sum by (worker) (rate(scheduler_scrape_filter_misses_total[{RATE}]))",
             "filter misses/s {{worker}}")], "s", width=8,
              description="A filter miss: a filtered /metrics scrape failed, lacked the series or "
              "came back unfiltered; three per worker and it is read whole for good"),
        panel(ts, "Scheduler hold time (all workers saturated)",
              quantiles("scheduler_wait_seconds", "", ""), "s", width=8),
        panel(ts, "Workers kept for a large request", [
            ("scheduler_worker_kept", "kept {{worker}}"),
            (f"sum by (event) (rate(scheduler_room_keeps_total[{RATE}]))", "keeps/s {{event}}")], width=8,
              description="A worker kept for a held request too large for the room that frees on a "
              "busy pool (scheduler --keep-room-after-s): it takes nothing else until that request "
              "is placed. Often kept: large requests arrive faster than workers drain"),
        panel(ts, "Session affinity", [
            (f"sum by (outcome) (rate(scheduler_session_affinity_total[{RATE}]))", "{{outcome}}/s"),
            ("scheduler_sessions", "sessions kept")], width=8,
              description="Requests of a session (the gateway's --session-header, or the body's "
              "prompt_cache_key) placed on the session's worker (kept), on another one (moved: its "
              "worker was saturated, down, cordoned or more than session_slack busier than the "
              "best) or for a session it had no worker for (new); and the sessions the scheduler "
              "remembers. Zero until a gateway names a session header"),
        panel(ts, "Lease ends by outcome, and renewals", [
            (f"sum by (outcome) (rate(scheduler_lease_releases_total[{RATE}]))", "{{outcome}}"),
            (f"sum by (outcome) (rate(scheduler_lease_renewals_total[{RATE}]))", "renewed {{outcome}}"),
            (f"sum(rate(scheduler_gateway_leases_dropped_total[{RATE}]))", "ended: gateway gone")],
            "reqps", width=8,
            description="ok / failed: the gateway's part and the request ended; handed_off: the "
            "worker goes on with it (a background response: its load counts until a scrape shows "
            "it); unknown: the lease had expired or was released already. Renewed: a long "
            "request's lease, renewed by its gateway (router --lease-renew-ms) so that it does "
            "not expire while the request runs; renewed unknown: its lease had expired (renewals "
            "further apart than the scheduler's --lease-ttl-s) or the scheduler restarted. Ended: "
            "gateway gone: leases of a gateway whose channel stayed closed for the scheduler's "
            "--gateway-gone-grace-s (it crashed), ended then rather than at the TTL"),
        row("Client connections (every service)"),
        panel(ts, "Client connections: open and cap", [
            (f"sum by (job, instance) ({every_service('{s}_connections_open')})",
             "open {{job}} {{instance}}"),
            (f"max by (job, instance) (({every_service('{s}_connections_max')}) > 0)",
             "cap {{job}} {{instance}}")], width=8,
              description="Client connections each gateway, scheduler and worker serves at once "
              "(streams, held calls, WebSockets, and idle kept-alive ones until "
              "--keepalive-timeout-s), and its cap (--max-connections; none drawn for 0: no cap)"),
        panel(ts, "Share of the connection cap in use", [
            (f"max by (job, instance) ({every_service('{s}_connections_open / ({s}_connections_max > 0)')})",
             "{{job}} {{instance}}")], "percentunit", width=8, min=0, max=1,
              description="Open / cap of each service that has a cap; alert LLMConnectionsNearCap "
              "past 90 % for 5 minutes"),
        panel(ts, "Connections refused at the cap", [
            (f"sum by (job, instance) ({every_service('rate({s}_connections_refused_total[' + RATE + '])')})",
             "{{job}} {{instance}}")], "cps", width=8,
              description="New connections answered 503 (Retry-After: 1) and closed, their service "
              "at its cap: alert LLMConnectionsRefused. Raise the open-file limit and with it "
              "--max-connections, or add replicas"),
        row("Credentials"),
        panel(ts, "TLS certificates: days left", [
            ("min by (job, instance, certificate) ((router_tls_certificate_expiry_seconds or "
             "scheduler_tls_certificate_expiry_seconds or worker_tls_certificate_expiry_seconds)"
             " - time()) / 86400", "{{job}} {{instance}} {{certificate}}")], "d", width=12,
              description="Days until each certificate a service serves (served) or shows its peers "
              "(client) ends, as last loaded from its files (--ssl-reload-s). A renewal that loaded "
              "moves the line up; alert LLMTLSCertificateExpiresSoon at a week. Empty without TLS"),
        panel(ts, "Credential reloads", [
            (f"sum by (result) (rate(router_api_key_reloads_total[{RATE}]))", "API keys {{result}}"),
            ("min(router_api_key_file_last_read_ok)", "API key file readable (min over gateways)"),
            (f"sum by (result) (rate(scheduler_admin_token_reloads_total[{RATE}]))",
             "Admin token {{result}}"),
            ("min(scheduler_admin_token_file_last_read_ok)",
             "Admin token file readable (min over schedulers)"),
            (f"sum by (job, result) (rate(router_tls_reloads_total[{RATE}]) or "
             f"rate(scheduler_tls_reloads_total[{RATE}]) or rate(worker_tls_reloads_total[{RATE}]))",
             "TLS {{job}} {{result}}")], width=12,
              description="Re-reads of the gateway's --api-key-file, the scheduler's "
              "--admin-token-file and the TLS files after they changed (or SIGHUP): reloaded, "
              "unchanged, failed (the credentials in force are kept; alerts "
              "LLMGatewayApiKeyFileUnreadable and LLMSchedulerAdminTokenFileUnreadable for a file "
              "that stays unreadable). Empty without a key file, a token file or TLS"),
    ]
    variables = [variable("model", "model", "label_values(router_requests_total, model)")]
    return dashboard("llm-router", "LLM router", "Gateway traffic, client-side latency, resilience and "
                     "scheduling: what an operator watches.", variables, panels)


def worker_dashboard() -> dict:
    s = '{model_name=~"$model_name", instance=~"$instance"}'
    by = ", instance"
    ts = "timeseries"
    panels = [
        row("Load"),
        panel(ts, "Scheduler state: running / waiting", [
            (f"sum by (instance) (vllm:num_requests_running{s})", "running {{instance}}"),
            (f"sum by (instance) (vllm:num_requests_waiting{s})", "waiting {{instance}}")]),
        panel(ts, "KV cache usage", [
            (f"max by (instance) (vllm:kv_cache_usage_perc{s})", "{{instance}}")], "percentunit",
            max=1, min=0),
        panel(ts, "Token throughput", [
            (f"sum by (instance) (rate(vllm:prompt_tokens_total{s}[{RATE}]))", "prompt {{instance}}"),
            (f"sum by (instance) (rate(vllm:generation_tokens_total{s}[{RATE}]))",
             "generation {{instance}}")], width=8),
        panel(ts, "Prefix cache hit rate", [
            (f"sum by (instance) (rate(vllm:prefix_cache_hits_total{s}[{RATE}])) / "
             f"sum by (instance) (rate(vllm:prefix_cache_queries_total{s}[{RATE}]))", "{{instance}}")],
            "percentunit", width=8, description="Cached prompt tokens / queried prompt tokens"),
        panel(ts, "Preemptions/s", [
            (f"sum by (instance) (rate(vllm:num_preemptions_total{s}[{RATE}]))", "{{instance}}")], width=8),
        row("Latency (engine side)"),
        panel(ts, "Time to first token", quantiles("vllm:time_to_first_token_seconds", by, s), "s"),
        panel(ts, "Inter-token latency", quantiles("vllm:inter_token_latency_seconds", by, s), "s"),
        panel(ts, "End-to-end request latency", quantiles("vllm:e2e_request_latency_seconds", by, s), "s"),
        panel(ts, "Queue / prefill / decode time (mean)", [
            (f"sum by (instance) (rate(vllm:request_{phase}_time_seconds_sum{s}[{RATE}])) / "
             f"sum by (instance) (rate(vllm:request_{phase}_time_seconds_count{s}[{RATE}]))",
             f"{phase} {{{{instance}}}}") for phase in ("queue", "prefill", "decode")], "s"),
        row("Requests"),
        panel(ts, "Finish reason", [
            (f"sum by (finished_reason) (increase(vllm:request_success_total{s}[{RATE}]))",
             "{{finished_reason}}")], width=8),
        panel("heatmap", "Request prompt length", [
            (f"sum by (le) (increase(vllm:request_prompt_tokens_bucket{s}[{RATE}]))", "{{le}}")], width=8),
        panel("heatmap", "Request generation length", [
            (f"sum by (le) (increase(vllm:request_generation_tokens_bucket{s}[{RATE}]))", "{{le}}")],
            width=8),
    ]
    variables = [
        variable("model_name", "model", "label_values(vllm:num_requests_running, model_name)"),
        variable("instance", "worker", 'label_values(vllm:num_requests_running{model_name=~"$model_name"}, '
                                       "instance)"),
    ]
    return dashboard("llm-worker", "LLM workers (vLLM-compatible)", "Per-worker engine state, in the "
                     "spirit of vLLM's dashboard; works for real vLLM workers too.", variables, panels)


DASHBOARDS = {"router.json": router_dashboard, "worker.json": worker_dashboard}


def render(build) -> str:
    return json.dumps(build(), indent=2, sort_keys=False) + "\n"


def main() -> None:
    OUT_DIR.mkdir(exist_ok=True)
    for name, build in DASHBOARDS.items():
        (OUT_DIR / name).write_text(render(build))
        print(f"wrote {OUT_DIR / name}")


if __name__ == "__main__":
    main()
