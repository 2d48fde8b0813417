"""Every shipped way of scraping the gateway sends its admin token, against a real gateway and
a real Prometheus on 127.0.0.1.

With --admin-token (ROUTER_ADMIN_TOKEN) the gateway's /metrics answers 401 to anyone without it;
a scrape that does not send it leaves the gateway down in Prometheus (LLMGatewayDown). One
Prometheus scrapes one gateway with the gateway job of each shipped config:

- local: deploy/prometheus/prometheus.yml, its token file beside it (the launcher's file);
- compose: deploy/docker/prometheus-compose.yml, Prometheus started by compose.yaml's own
  entrypoint command, which writes ROUTER_ADMIN_TOKEN to the file the config reads (its
  container paths moved under a temporary folder);
- k8s / helm: the gateway's ServiceMonitor endpoint as the Prometheus operator turns it into a
  scrape job (no operator runs here), its Secret key holding the token the gateway reads through
  its Deployment's environment;
- control: a job that sends nothing, which must fail while the gateway has a token (the other
  jobs being up then proves they sent it).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import yaml

from tests.deploy.helpers import DEPLOY, REPO, free_ports, stop_process, wait_until
from tests.deploy.test_k8s_and_helm import K8S, load_all, raw_objects, render, selects

PROMETHEUS = shutil.which("prometheus")
pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(PROMETHEUS is None, reason="the prometheus binary is not installed "
                                                  "(apt-get install prometheus)"),
]

TOKEN = "scrape-auth-test-token-0123456789"


def gateway_job(config: dict) -> dict:
    return next(job for job in config["scrape_configs"] if job["job_name"] == "llm-gateway")


def gateway_monitor_endpoint(objs: list[dict], monitors: list[dict]) -> dict:
    """The one ServiceMonitor endpoint that scrapes the gateway Service."""
    [service] = [o for o in objs if o["kind"] == "Service" and o["metadata"]["name"].endswith("-gateway")]
    matching = [m for m in monitors if selects(m["spec"]["selector"], service["metadata"]["labels"])]
    assert len(matching) == 1, [m["metadata"]["name"] for m in matching]
    [endpoint] = matching[0]["spec"]["endpoints"]
    return endpoint


def gateway_env(objs: list[dict], secret: dict[str, str]) -> dict[str, str]:
    """The gateway container's environment, its Secret references resolved against `secret`."""
    [deployment] = [o for o in objs
                    if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("-gateway")]
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    env = {}
    for var in container.get("env", []):
        ref = var["valueFrom"]["secretKeyRef"]
        if ref["key"] in secret:
            env[var["name"]] = secret[ref["key"]]
        else:
            assert ref.get("optional"), f"{var['name']}: the pod would not start without {ref}"
    return env


def operator_job(name: str, endpoint: dict, secret: dict[str, str]) -> dict:
    """The scrape job the Prometheus operator makes of a ServiceMonitor endpoint (its Secret
    reference resolved to the key's value)."""
    job: dict = {"job_name": name, "metrics_path": endpoint.get("path", "/metrics")}
    if auth := endpoint.get("authorization"):
        job["authorization"] = {"type": auth.get("type", "Bearer"),
                                "credentials": secret[auth["credentials"]["key"]]}
    return job


@contextmanager
def process(argv: list[str], log: Path, env: dict[str, str]) -> Iterator[subprocess.Popen]:
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, **env})
        try:
            yield proc
        finally:
            stop_process(proc)


def compose_prometheus_argv(tmp: Path, flags: list[str], token: str) -> tuple[list[str], dict[str, str]]:
    """compose.yaml's Prometheus entrypoint as compose runs it ($$ is its escape for $), with the
    container's paths under tmp, and the environment compose gives it for this token."""
    service = yaml.safe_load((DEPLOY / "docker" / "compose.yaml").read_text())["services"]["prometheus"]
    argv = [arg.replace("$$", "$").replace("/bin/prometheus", "\0")
            .replace("/prometheus/", f"{tmp}/compose/").replace("\0", PROMETHEUS)
            for arg in service["entrypoint"]]
    assert service["environment"]["ROUTER_ADMIN_TOKEN"] == "${ROUTER_ADMIN_TOKEN:-}"
    return [*argv, *flags], {"ROUTER_ADMIN_TOKEN": token}


def targets_health(api: httpx.Client) -> dict[str, str]:
    try:
        active = api.get("/targets").json()["data"]["activeTargets"]
    except (httpx.HTTPError, ValueError, KeyError):
        return {}
    return {t["labels"]["job"]: t["health"] for t in active}


@pytest.mark.parametrize("token", [TOKEN, ""], ids=["admin-token", "no-token"])
def test_every_shipped_scrape_of_the_gateway_sends_its_admin_token(token, tmp_path, monkeypatch):
    secret = {"admin-token": token}  # the k8s Secret llm-gateway-auth (Helm: gateway.auth.secret)
    raw = raw_objects()
    raw_monitors = [o for o in load_all((K8S / "servicemonitors.yaml").read_text())
                    if o["kind"] == "ServiceMonitor"]
    chart = render({"gateway": {"auth": {"secret": "llm-gateway-auth", "apiKeys": False, "adminToken": True}},
                    "metrics": {"serviceMonitor": {"enabled": True}}})
    chart_monitors = [o for o in chart if o["kind"] == "ServiceMonitor"]
    # Both ways give the gateway the token the monitor sends: the same Secret key.
    env = gateway_env(raw, secret)
    assert env == gateway_env(chart, secret) == {"ROUTER_ADMIN_TOKEN": token}

    gateway_port, prometheus_port = free_ports(2)
    target = {"targets": [f"127.0.0.1:{gateway_port}"]}
    local = {**gateway_job(yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())),
             "job_name": "local", "static_configs": [target]}
    (tmp_path / local["authorization"]["credentials_file"]).write_text(token + "\n")  # the launcher's file
    compose = {**gateway_job(yaml.safe_load((DEPLOY / "docker" / "prometheus-compose.yml").read_text())),
               "job_name": "compose", "static_configs": [target]}
    compose["authorization"]["credentials_file"] = compose["authorization"]["credentials_file"].replace(
        "/prometheus/", f"{tmp_path}/compose/")
    (tmp_path / "compose").mkdir()
    jobs = [local, compose,
            operator_job("k8s", gateway_monitor_endpoint(raw, raw_monitors), secret),
            operator_job("helm", gateway_monitor_endpoint(chart, chart_monitors), secret),
            {"job_name": "control"}]
    for job in jobs:
        job["static_configs"] = [target]
    config = {"global": {"scrape_interval": "1s", "scrape_timeout": "1s"}, "scrape_configs": jobs}
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    flags = [f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'data'}",
             f"--web.listen-address=127.0.0.1:{prometheus_port}"]
    prometheus_argv, prometheus_env = compose_prometheus_argv(tmp_path, flags, token)

    unused, = free_ports(1)  # no scheduler, no worker: /metrics is all that is asked of it
    gateway = [sys.executable, "-m", "router", "--host", "127.0.0.1", "--port", str(gateway_port),
               "--scheduler", f"http://127.0.0.1:{unused}", "--workers", f"http://127.0.0.1:{unused}"]
    monkeypatch.delenv("ROUTER_ADMIN_TOKEN", raising=False)
    metrics = f"http://127.0.0.1:{gateway_port}/metrics"

    def metrics_status() -> int | None:
        try:
            return httpx.get(metrics, timeout=2, trust_env=False).status_code
        except httpx.HTTPError:
            return None

    api_url = f"http://127.0.0.1:{prometheus_port}/api/v1"
    with process(gateway, tmp_path / "gateway.log", env), \
            process(prometheus_argv, tmp_path / "prometheus.log", prometheus_env), \
            httpx.Client(base_url=api_url, timeout=10, trust_env=False) as api:
        gateway_log = tmp_path / "gateway.log"
        assert wait_until(lambda: metrics_status() is not None, 60, 0.2), gateway_log.read_text()
        # The gateway's own word: with a token, /metrics is closed to a request without it.
        assert metrics_status() == (401 if token else 200)
        expected = {"local": "up", "compose": "up", "k8s": "up", "helm": "up",
                    "control": "down" if token else "up"}
        settled = wait_until(lambda: targets_health(api) == expected, 60, 0.5)
        assert settled, (targets_health(api), (tmp_path / "prometheus.log").read_text()[-3000:])
    # compose's entrypoint wrote the token for Prometheus alone to read.
    written = tmp_path / "compose" / "gateway-admin-token"
    assert written.read_text() == token and written.stat().st_mode & 0o077 == 0
