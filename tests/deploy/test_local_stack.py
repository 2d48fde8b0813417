"""The one-command local stack, for real: `python -m deploy.local --backend sim` on free ports,
traffic through the gateway with the official openai client, the shipped dashboards' and
alerts' metric names against the live /metrics, a real Prometheus scraping the stack with the
shipped config and rules, and Ctrl-C stopping every child. The tests of this module share one
stack and run in file order; the last one stops it. Its gateway has an admin token (from the
launcher's --admin-token-file), which the shipped prometheus.yml must send, and its scheduler a
gateway token (from the launcher's SCHEDULER_GATEWAY_TOKEN), which the gateway must send.
"""

from __future__ import annotations

import re
import shutil
import signal
import subprocess

import httpx
import pytest
import yaml
from openai import OpenAI

from tests.deploy.helpers import DEPLOY, MEASURED, free_port, pid_alive, stop_process, wait_until
from tests.deploy.promql import (
    PROMETHEUS_BUILTINS,
    exposed_label_names,
    exposed_sample_names,
    label_names,
    metric_names,
    shipped_queries,
)
from tests.deploy.stack import LocalStack, start_ready_stack, stop_stack

pytestmark = pytest.mark.timeout(300)


ADMIN_TOKEN = "local-stack-admin-0123456789"
SCHEDULER_TOKEN = "local-stack-scheduler-9876543210"


@pytest.fixture(scope="module")
def token_dir(tmp_path_factory):
    """Where the launcher's token file and the test's Prometheus config live side by side, as
    deploy/prometheus/gateway-admin-token and prometheus.yml do (its credentials_file is relative)."""
    tmp = tmp_path_factory.mktemp("local-stack")
    (tmp / "gateway-admin-token").write_text(ADMIN_TOKEN + "\n")  # Prometheus trims it too
    return tmp


@pytest.fixture(scope="module")
def stack(token_dir):
    stack = start_ready_stack(workers=2, extra=("--max-num-seqs", "32"),
                        admin_token_file=str(token_dir / "gateway-admin-token"),
                        scheduler_token=SCHEDULER_TOKEN)
    try:
        yield stack
    finally:
        stop_stack(stack)


def client(stack: LocalStack) -> OpenAI:
    return OpenAI(base_url=f"{stack.gateway}/v1", api_key="unused", max_retries=0, timeout=60,
                  http_client=httpx.Client(trust_env=False))


def send_chat(stack: LocalStack, n: int) -> None:
    with client(stack) as c:
        for i in range(n):
            reply = c.chat.completions.create(
                model="smollm2", max_tokens=8, messages=[{"role": "user", "content": f"hello number {i}"}])
            assert reply.choices[0].finish_reason in ("stop", "length")
            stack.ok_requests += 1
            stack.completion_tokens += reply.usage.completion_tokens


def scrape(stack: LocalStack, url: str) -> str:
    headers = {"Authorization": f"Bearer {stack.admin_token}"} if url == stack.gateway else {}
    resp = httpx.get(f"{url}/metrics", timeout=10, trust_env=False, headers=headers)
    resp.raise_for_status()
    return resp.text


def test_banner_names_the_gateway_and_ready_to_paste_examples(stack):
    out = stack.output()
    assert f"LLM router ready: {stack.gateway}/v1" in out
    assert f"curl -s {stack.gateway}/v1/chat/completions" in out
    assert f'OpenAI(base_url="{stack.gateway}/v1"' in out
    assert set(stack.child_pids()) == {"worker-0", "worker-1", "scheduler", "gateway"}
    # Children's logs are forwarded with their name as prefix.
    for name in ("worker-0", "worker-1", "scheduler", "gateway"):
        assert any(line.startswith(f"[{name}] ") for line in stack.lines), name
    # Everything listens where the launcher said.
    for url in [stack.gateway, stack.scheduler, *stack.workers]:
        assert httpx.get(f"{url}/health", timeout=5, trust_env=False).status_code == 200
    # The scheduler runs llm_aware with the prefill cap measured for our worker's engine step.
    view = httpx.get(f"{stack.scheduler}/v1/workers", timeout=5, trust_env=False).json()
    assert view["policy"] == "llm_aware"
    assert view["policy_params"]["max_prefill_backlog"] == MEASURED["max_prefill_backlog"]
    assert view["policy_params"]["w_prefix"] == MEASURED["w_prefix"]  # a code default
    # --max-num-seqs caps the workers and declares that cap to the scheduler.
    assert [w["running_cap_declared"] for w in view["workers"]] == [32, 32]


def test_the_gateway_has_the_admin_token_of_the_launchers_file(stack, token_dir):
    assert stack.admin_token == ADMIN_TOKEN
    assert f"/metrics (Bearer token from {token_dir / 'gateway-admin-token'})" in stack.output()
    assert ADMIN_TOKEN not in stack.output()  # not on the logged command line
    metrics = f"{stack.gateway}/metrics"
    assert httpx.get(metrics, timeout=10, trust_env=False).status_code == 401
    wrong = {"Authorization": "Bearer not-the-token"}
    assert httpx.get(metrics, timeout=10, trust_env=False, headers=wrong).status_code == 401
    assert "router_requests_total" in scrape(stack, stack.gateway)
    # The others take no token: Prometheus scrapes them without.
    for url in [stack.scheduler, *stack.workers]:
        assert httpx.get(f"{url}/metrics", timeout=10, trust_env=False).status_code == 200


def test_completions_through_the_gateway(stack):
    send_chat(stack, 4)
    with client(stack) as c:
        chunks = list(c.completions.create(model="smollm2", prompt="Once upon a time", max_tokens=6,
                                           stream=True, stream_options={"include_usage": True}))
        text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
        assert text
        usage = next(ch.usage for ch in chunks if ch.usage)
        assert usage.completion_tokens == 6
        stack.ok_requests += 1
        stack.completion_tokens += usage.completion_tokens
        assert [m.id for m in c.models.list().data] == ["smollm2"]
    # The gateway's access log line made it through the launcher's log forwarding.
    assert stack.wait_for_line("[gateway]", 5)


def test_the_scheduler_wants_the_launchers_token_and_the_gateway_sends_it(stack):
    body = {"model": "smollm2", "prompt_tokens": 1}
    r = httpx.post(f"{stack.scheduler}/v1/schedule", json=body, timeout=10, trust_env=False)
    assert r.status_code == 401, r.text
    # The requests above were scheduled, not served by round robin after 401s.
    mode = [line for line in scrape(stack, stack.gateway).splitlines()
            if line.startswith("router_fallback_mode ")]
    assert mode and float(mode[0].split()[1]) == 0, mode
    assert SCHEDULER_TOKEN not in stack.output()


# Families exposed only under a setting the local stack does not use, and the test that shows
# them exposed there.
ONLY_WHEN_CONFIGURED = {
    "router_api_key_file_last_read_ok": "--api-key-file (tests/router/test_key_rotation.py)",
    "router_api_key_reloads_total": "--api-key-file (tests/router/test_key_rotation.py)",
    "scheduler_admin_token_file_last_read_ok":
        "--admin-token-file (tests/scheduler/test_admin_token_file.py)",
    "scheduler_admin_token_reloads_total": "--admin-token-file (tests/scheduler/test_admin_token_file.py)",
    "router_tls_reloads_total": "--ssl-certfile (tests/router/test_tls_reload.py)",
    "scheduler_tls_reloads_total": "--ssl-certfile (tests/scheduler/test_tls_reload.py)",
    "worker_tls_reloads_total": "--ssl-certfile (tests/router/test_tls_reload.py)",
    "router_tls_certificate_expiry_seconds": "--ssl-certfile (tests/router/test_tls_reload.py)",
    "scheduler_tls_certificate_expiry_seconds": "--ssl-certfile (tests/scheduler/test_tls_reload.py)",
    "worker_tls_certificate_expiry_seconds": "--ssl-certfile (tests/router/test_tls_reload.py)",
}


def test_every_metric_in_dashboards_and_alerts_is_exposed_by_the_stack(stack):
    if stack.ok_requests == 0:
        send_chat(stack, 2)  # labelled families need one request to show their series
    exposed = set(PROMETHEUS_BUILTINS) | ONLY_WHEN_CONFIGURED.keys()
    for url in [stack.gateway, stack.scheduler, *stack.workers]:
        exposed |= exposed_sample_names(scrape(stack, url))
    missing = {}
    for where, expr in shipped_queries().items():
        for name in metric_names(expr) - exposed:
            missing.setdefault(name, []).append(where)
    assert not missing, f"metrics used but not exposed: {missing}"


# Labels Prometheus adds to every series of a target (the `component` of prometheus.yml).
TARGET_LABELS = {"job", "instance", "component"}


def test_every_label_in_dashboards_and_alerts_is_on_its_metrics(stack):
    """A label a query groups by or matches on that its metrics do not carry (model_name on a
    router_* series, model on a vllm:* one) gives one unlabelled line or nothing at all."""
    if stack.ok_requests == 0:
        send_chat(stack, 2)
    labels: dict[str, set[str]] = {}
    for url in [stack.gateway, stack.scheduler, *stack.workers]:
        for name, names in exposed_label_names(scrape(stack, url)).items():
            labels.setdefault(name, set()).update(names)
    wrong, checked = {}, 0
    for where, expr in shipped_queries().items():
        metrics = metric_names(expr) - PROMETHEUS_BUILTINS
        if not metrics <= labels.keys():
            continue  # a family with no sample on a healthy stack (retries, scrape failures ...)
        checked += 1
        carried = TARGET_LABELS.union(*(labels[m] for m in metrics))
        if missing := label_names(expr) - carried:
            wrong[where] = sorted(missing)
    assert not wrong, f"labels their metrics do not carry: {wrong}"
    # Most queries are checked: those left out only read families a healthy stack leaves empty.
    assert checked >= 0.8 * len(shipped_queries()), checked


# ---------------------------------------------------------------- real Prometheus

PROMETHEUS = shutil.which("prometheus")


def prometheus_config(stack: LocalStack, tmp_dir) -> str:
    """The shipped prometheus.yml with this stack's ports (and the shipped alert rules), written
    beside the launcher's token file: its credentials_file is relative, as shipped."""
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    config["global"]["scrape_interval"] = "1s"
    config["global"]["evaluation_interval"] = "1s"
    config["rule_files"] = [str(DEPLOY / "prometheus" / "alerts.yml")]
    targets = {
        "llm-worker": [f"127.0.0.1:{p}" for p in stack.worker_ports],
        "llm-scheduler": [f"127.0.0.1:{stack.scheduler_port}"],
        "llm-gateway": [f"127.0.0.1:{stack.gateway_port}"],
    }
    for job in config["scrape_configs"]:
        job["static_configs"][0]["targets"] = targets.pop(job["job_name"])
    assert not targets, f"jobs missing from the shipped config: {targets}"
    path = tmp_dir / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


@pytest.fixture(scope="module")
def prometheus(stack, token_dir):
    if PROMETHEUS is None:
        pytest.skip("the prometheus binary is not installed (apt-get install prometheus)")
    tmp = token_dir
    port = free_port()
    log = open(tmp / "prometheus.log", "w")
    proc = subprocess.Popen(
        [PROMETHEUS, f"--config.file={prometheus_config(stack, tmp)}",
         f"--web.listen-address=127.0.0.1:{port}", f"--storage.tsdb.path={tmp / 'data'}"],
        stdout=subprocess.DEVNULL, stderr=log,
    )
    api = httpx.Client(base_url=f"http://127.0.0.1:{port}/api/v1", timeout=10, trust_env=False)
    try:
        yield api
    finally:
        api.close()
        log.close()
        stop_process(proc)


def query(api: httpx.Client, expr: str) -> list[dict]:
    body = api.get("/query", params={"query": expr}).json()
    assert body["status"] == "success", body
    return body["data"]["result"]


def targets_up(api: httpx.Client) -> dict[str, str]:
    try:
        active = api.get("/targets").json()["data"]["activeTargets"]
    except (httpx.HTTPError, ValueError):
        return {}
    return {t["scrapeUrl"]: t["health"] for t in active}


def test_prometheus_scrapes_every_service_of_the_stack(stack, prometheus):
    all_up = wait_until(lambda: list(targets_up(prometheus).values()) == ["up"] * 4, 60, 0.5)
    assert all_up, targets_up(prometheus)
    jobs = {t["labels"]["job"] for t in prometheus.get("/targets").json()["data"]["activeTargets"]}
    assert jobs == {"llm-worker", "llm-scheduler", "llm-gateway"}

    running = query(prometheus, "vllm:num_requests_running")
    assert {r["metric"]["instance"] for r in running} == {f"127.0.0.1:{p}" for p in stack.worker_ports}
    assert {r["metric"]["model_name"] for r in running} == {"smollm2"}

    send_chat(stack, 3)
    # After a scrape, Prometheus holds exactly what the tests sent through the gateway.
    def totals_match() -> bool:
        ok = query(prometheus, 'sum(router_requests_total{status="200", worker!=""})')
        gen = query(prometheus, "sum(vllm:generation_tokens_total)")
        return (bool(ok) and float(ok[0]["value"][1]) == stack.ok_requests
                and bool(gen) and float(gen[0]["value"][1]) == stack.completion_tokens)
    assert wait_until(totals_match, 30, 0.5), (query(prometheus, "sum by (status) (router_requests_total)"),
                                               stack.ok_requests, stack.completion_tokens)

    healthy = query(prometheus, "scheduler_worker_healthy")
    assert len(healthy) == 2 and all(r["value"][1] == "1" for r in healthy)


def test_prometheus_evaluates_the_shipped_rules_and_dashboard_queries(stack, prometheus):
    def rules_evaluated() -> list[dict]:
        groups = prometheus.get("/rules").json()["data"]["groups"]
        return [r for g in groups for r in g["rules"] if r.get("lastEvaluation", "").startswith("0001")]
    assert wait_until(lambda: not rules_evaluated(), 30, 0.5)
    rules = [r for g in prometheus.get("/rules").json()["data"]["groups"] for r in g["rules"]]
    assert len(rules) == sum(1 for w in shipped_queries() if w.startswith("alerts.yml"))
    assert all(r["health"] == "ok" for r in rules), [r for r in rules if r["health"] != "ok"]
    # A healthy stack fires no availability alert.
    firing = {r["name"] for r in rules if r["state"] == "firing"}
    assert not firing & {"LLMWorkerDown", "LLMSchedulerDown", "LLMGatewayDown", "LLMNoWorkerInRotation"}

    # Every dashboard query parses and runs in Prometheus (Grafana variables filled in).
    for where, expr in shipped_queries().items():
        if where.startswith("alerts.yml"):
            continue
        concrete = expr.replace("$__rate_interval", "1m")
        concrete = re.sub(r"\$\w+", ".*", concrete)
        body = prometheus.get("/query", params={"query": concrete}).json()
        assert body["status"] == "success", (where, concrete, body)
    # And they return data on a live stack: the throughput panel sees the tokens.
    result = query(prometheus, "sum(rate(vllm:generation_tokens_total[1m]))")
    assert result and float(result[0]["value"][1]) > 0


# ---------------------------------------------------------------- last: Ctrl-C


def test_ctrl_c_stops_every_child(stack):
    pids = stack.child_pids()
    assert len(pids) == 4 and all(pid_alive(p) for p in pids.values())
    stack.proc.send_signal(signal.SIGINT)
    assert stack.proc.wait(60) == 0
    assert wait_until(lambda: not any(pid_alive(p) for p in pids.values()), 10), \
        {name: pid for name, pid in pids.items() if pid_alive(pid)}
    assert "[launcher] all processes stopped" in stack.output()
    # Stopped front door first.
    stops = [line for line in stack.lines if line.startswith("[launcher] stopping ")]
    assert stops[0].startswith("[launcher] stopping gateway")
    for url in [stack.gateway, stack.scheduler, *stack.workers]:
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/health", timeout=2, trust_env=False)
