"""The shipped alert rules in a real Prometheus, against real services on 127.0.0.1, for the
states the local stack test cannot reach (it runs a healthy stack).

A scheduler that knows no worker at all (in Kubernetes: every worker pod not ready, so its
EndpointSlice has no ready endpoint) exports no scheduler_worker_healthy series; the alert
"The scheduler has no healthy worker" must still go off there. A scheduler whose admin token
file has become unreadable keeps its token and says so on /metrics, which the alert reads. A
gateway at its cap of connections refuses the next one, which the connection alerts read.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import yaml

from tests.deploy.helpers import DEPLOY, REPO, free_ports, stop_process, wait_until

PROMETHEUS = shutil.which("prometheus")
pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(PROMETHEUS is None, reason="the prometheus binary is not installed "
                                                  "(apt-get install prometheus)"),
]


@contextmanager
def process(argv: list[str], log: Path, env: dict[str, str] | None = None) -> Iterator[subprocess.Popen]:
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            yield proc
        finally:
            stop_process(proc)


@contextmanager
def prometheus_with_shipped_rules(targets: dict[str, list[str]], tmp: Path) -> Iterator[httpx.Client]:
    """A real Prometheus with the shipped scrape jobs (these targets) and alert rules, 1 s cycles."""
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    config["rule_files"] = [str(DEPLOY / "prometheus" / "alerts.yml")]
    for job in config["scrape_configs"]:
        job["static_configs"][0]["targets"] = targets.get(job["job_name"], [])
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    (port,) = free_ports(1)
    argv = [PROMETHEUS, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}"]
    with process(argv, tmp / "prometheus.log"), \
            httpx.Client(base_url=f"http://127.0.0.1:{port}/api/v1", timeout=10, trust_env=False) as api:
        yield api


def rule_state(api: httpx.Client, name: str) -> str | None:
    """inactive / pending / firing of the named alerting rule, once it has been evaluated."""
    try:
        groups = api.get("/rules").json()["data"]["groups"]
    except (httpx.HTTPError, ValueError, KeyError):
        return None  # Prometheus still starting
    for rule in (r for g in groups for r in g["rules"]):
        if rule["name"] == name and not rule.get("lastEvaluation", "0001").startswith("0001"):
            return rule["state"]
    return None


def query_values(api: httpx.Client, expr: str) -> list[str]:
    """The values of an instant query ([] while Prometheus is still starting)."""
    try:
        result = api.get("/query", params={"query": expr}).json()["data"]["result"]
    except (httpx.HTTPError, ValueError, KeyError):
        return []
    return [r["value"][1] for r in result]


def scheduler_up(api: httpx.Client) -> bool:
    return query_values(api, 'up{job="llm-scheduler"}') == ["1"]


def test_no_worker_alert_goes_off_when_the_scheduler_knows_no_worker(tmp_path):
    (sched_port,) = free_ports(1)
    scheduler = [sys.executable, "-m", "scheduler", "--host", "127.0.0.1", "--port", str(sched_port)]
    with process(scheduler, tmp_path / "scheduler.log"), \
            prometheus_with_shipped_rules({"llm-scheduler": [f"127.0.0.1:{sched_port}"]}, tmp_path) as api:
        assert wait_until(lambda: scheduler_up(api), 60, 0.5), (tmp_path / "scheduler.log").read_text()
        health = httpx.get(f"http://127.0.0.1:{sched_port}/health", timeout=5, trust_env=False).json()
        assert health["workers"] == 0
        # pending: the expression holds; the rule's `for: 1m` is too long to wait for firing.
        active = ("pending", "firing")
        assert wait_until(lambda: rule_state(api, "LLMNoWorkerInRotation") in active, 30, 0.5), \
            rule_state(api, "LLMNoWorkerInRotation")
        assert rule_state(api, "LLMSchedulerDown") == "inactive"


def test_no_worker_alert_goes_off_when_every_worker_is_cordoned(tmp_path):
    """A healthy worker an operator cordoned takes no request: with it the only one, nothing is
    in rotation, as the alert's `unless on(worker)` reads the scheduler's real exposition."""
    sched_port, worker_port = free_ports(2)
    worker = [sys.executable, "-m", "inference_worker", "--backend", "sim", "--sim-profile", "tiny",
              "--served-model-name", "m", "--host", "127.0.0.1", "--port", str(worker_port)]
    scheduler = [sys.executable, "-m", "scheduler", "--host", "127.0.0.1", "--port", str(sched_port),
                 "--workers", f"http://127.0.0.1:{worker_port}", "--admin-token", "adm-0123456789"]
    sched = f"http://127.0.0.1:{sched_port}"
    with process(worker, tmp_path / "worker.log"), process(scheduler, tmp_path / "scheduler.log"), \
            prometheus_with_shipped_rules({"llm-scheduler": [f"127.0.0.1:{sched_port}"]}, tmp_path) as api:
        assert wait_until(lambda: scheduler_up(api), 60, 0.5), (tmp_path / "scheduler.log").read_text()
        assert wait_until(lambda: httpx.get(sched + "/health", timeout=5, trust_env=False).json()
                          .get("routable") == 1, 60, 0.5), (tmp_path / "scheduler.log").read_text()
        # Healthy and in rotation: evaluated, and not active (Prometheus scrapes every second).
        assert wait_until(lambda: rule_state(api, "LLMNoWorkerInRotation") == "inactive", 30, 0.5)
        r = httpx.post(f"{sched}/v1/workers/127.0.0.1:{worker_port}/cordon", timeout=5, trust_env=False,
                       headers={"Authorization": "Bearer adm-0123456789"})
        assert r.status_code == 200, r.text
        active = ("pending", "firing")
        assert wait_until(lambda: rule_state(api, "LLMNoWorkerInRotation") in active, 30, 0.5), \
            rule_state(api, "LLMNoWorkerInRotation")


def test_admin_token_file_alert_goes_off_when_the_file_is_emptied(tmp_path):
    """The alert reads scheduler_admin_token_file_last_read_ok as the real scheduler exposes it:
    inactive while the file holds a token, pending once a re-read found it empty."""
    token_file = tmp_path / "admin-token"
    token_file.write_text("adm-0123456789\n")
    (sched_port,) = free_ports(1)
    scheduler = [sys.executable, "-m", "scheduler", "--host", "127.0.0.1", "--port", str(sched_port),
                 "--admin-token-file", str(token_file), "--admin-token-reload-s", "0.2"]
    name = "LLMSchedulerAdminTokenFileUnreadable"
    with process(scheduler, tmp_path / "scheduler.log"), \
            prometheus_with_shipped_rules({"llm-scheduler": [f"127.0.0.1:{sched_port}"]}, tmp_path) as api:
        assert wait_until(lambda: scheduler_up(api), 60, 0.5), (tmp_path / "scheduler.log").read_text()
        assert wait_until(lambda: rule_state(api, name) == "inactive", 30, 0.5), rule_state(api, name)
        token_file.write_text("")  # a Secret emptied by mistake: the token in force is kept
        # pending: the expression holds; the rule's `for: 5m` is too long to wait for firing.
        assert wait_until(lambda: rule_state(api, name) in ("pending", "firing"), 30, 0.5), \
            (rule_state(api, name), (tmp_path / "scheduler.log").read_text())


def test_connection_alerts_go_off_when_the_gateway_refuses_at_its_cap(tmp_path):
    """A gateway run with --max-connections 2, scraped on its --metrics-port (not under the cap):
    two connections held open fill the cap (LLMConnectionsNearCap: 100 %), and a third one is
    answered 503 and counted, which LLMConnectionsRefused reads as the real gateway exposes it."""
    gw_port, metrics_port, worker_port = free_ports(3)  # no worker listens: none is needed here
    gateway = [sys.executable, "-m", "router", "--host", "127.0.0.1", "--port", str(gw_port),
               "--metrics-port", str(metrics_port), "--workers", f"http://127.0.0.1:{worker_port}",
               "--max-connections", "2"]
    env = {k: v for k, v in os.environ.items() if k != "ROUTER_ADMIN_TOKEN"}  # /metrics without a token
    (tmp_path / "gateway-admin-token").write_text("")  # the shipped gateway job's token file: none
    log = tmp_path / "gateway.log"
    with process(gateway, log, env), \
            prometheus_with_shipped_rules({"llm-gateway": [f"127.0.0.1:{metrics_port}"]}, tmp_path) as api:
        # Scraped before any refusal: increase() needs the count at 0 to see it grow.
        assert wait_until(lambda: query_values(api, "router_connections_refused_total") == ["0"], 60, 0.5), \
            log.read_text()
        assert rule_state(api, "LLMConnectionsRefused") in ("inactive", None)
        held = [socket.create_connection(("127.0.0.1", gw_port), timeout=5) for _ in range(2)]
        try:
            assert wait_until(lambda: query_values(api, "router_connections_open") == ["2"], 30, 0.5), \
                log.read_text()
            for _ in range(3):
                with socket.create_connection(("127.0.0.1", gw_port), timeout=5) as extra:
                    extra.sendall(b"GET /health HTTP/1.1\r\nHost: gateway\r\n\r\n")
                    assert extra.recv(4096).startswith(b"HTTP/1.1 503 "), log.read_text()
            # pending: the expressions hold; the rules' `for` is too long to wait for firing.
            active = ("pending", "firing")
            for name in ("LLMConnectionsRefused", "LLMConnectionsNearCap"):
                assert wait_until(lambda name=name: rule_state(api, name) in active, 30, 0.5), \
                    (name, rule_state(api, name), query_values(api, "router_connections_refused_total"))
        finally:
            for sock in held:
                sock.close()
