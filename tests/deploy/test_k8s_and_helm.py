"""Kubernetes manifests and the Helm chart, checked as objects (no cluster runs here).

The same checks run on the raw manifests of deploy/k8s/ and on the Helm chart rendered by
the real Helm engine (the `helm-python-sdk` package binds Helm's Go SDK; the render test
skips when it is not installed). The scheduler's own EndpointSlice reader is run on the
slice Kubernetes would create for the worker Service, built here by hand.
"""

from __future__ import annotations

import re
import subprocess

import pytest
import yaml

from inference_worker.config import WorkerConfig
from router.config import RouterConfig
from scheduler.config import SchedulerConfig
from tests.deploy.helpers import DEPLOY, DEPLOY_PARAMS

K8S = DEPLOY / "k8s"
CHART = DEPLOY / "helm" / "llm-router"
CONFIGS = {"worker": WorkerConfig, "scheduler": SchedulerConfig, "gateway": RouterConfig}
ALERTS = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())


def load_all(text: str) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


def raw_objects() -> list[dict]:
    return [doc for name in ("namespace", "worker", "scheduler", "gateway")
            for doc in load_all((K8S / f"{name}.yaml").read_text())]


def find(objs: list[dict], kind: str, name: str) -> dict:
    matches = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(matches) == 1, f"{kind}/{name}: {len(matches)} found"
    return matches[0]


def validate_config(service: str, values: dict) -> None:
    """Build the service's real pydantic config from these values (raises on a wrong field)."""
    CONFIGS[service](**values)


def config_of(objs: list[dict], prefix: str, service: str) -> dict:
    data = find(objs, "ConfigMap", f"{prefix}-{service}-config")["data"]
    return yaml.safe_load(data[f"{service}.yaml"])


def check_cluster(objs: list[dict], prefix: str, namespace: str) -> None:
    """What must hold for any rendering of the stack: names are `{prefix}-{component}`."""
    # Deployments: selectors match their pods, one Service each, configs valid for the service.
    deployments = [o for o in objs if o["kind"] == "Deployment"]
    assert {d["metadata"]["name"] for d in deployments} == {f"{prefix}-{c}" for c in CONFIGS}
    for dep in deployments:
        selector = dep["spec"]["selector"]["matchLabels"]
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= labels.items(), dep["metadata"]["name"]
        services = [o for o in objs
                    if o["kind"] == "Service" and o["spec"]["selector"].items() <= labels.items()]
        assert len(services) == 1, f"{dep['metadata']['name']} needs exactly one Service"
        container = dep["spec"]["template"]["spec"]["containers"][0]
        port = container["ports"][0]
        assert services[0]["spec"]["ports"][0]["targetPort"] == port["name"]
        service = container["args"][0]
        assert dep["metadata"]["name"] == f"{prefix}-{service}"
        mount = container["volumeMounts"][0]["mountPath"]
        assert container["args"][1:] == ["--config", f"{mount}/{service}.yaml"]
        values = config_of(objs, prefix, service)
        assert values["port"] == port["containerPort"] and values["host"] == "0.0.0.0"
        validate_config(service, values)
        # Annotation scrapes go where /metrics is served: the gateway's metrics port if set.
        annotations = dep["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/port"] == str(values.get("metrics_port") or values["port"])

    # The scheduler may list/watch EndpointSlices, through the account its pod runs as.
    pod = find(objs, "Deployment", f"{prefix}-scheduler")["spec"]["template"]["spec"]
    account = pod["serviceAccountName"]
    find(objs, "ServiceAccount", account)
    allowed = set()
    for binding in (o for o in objs if o["kind"] == "RoleBinding"):
        if not any(s["kind"] == "ServiceAccount" and s["name"] == account for s in binding["subjects"]):
            continue
        role = find(objs, binding["roleRef"]["kind"], binding["roleRef"]["name"])
        for rule in role["rules"]:
            if "discovery.k8s.io" in rule["apiGroups"] and "endpointslices" in rule["resources"]:
                allowed.update(rule["verbs"])
    assert {"list", "watch"} <= allowed

    # It selects the worker Service's slices, in its namespace, by the Service's port name.
    sched = config_of(objs, prefix, "scheduler")
    assert sched["k8s_label_selector"] == f"kubernetes.io/service-name={prefix}-worker"
    assert sched["k8s_namespace"] == namespace
    worker_service = find(objs, "Service", f"{prefix}-worker")
    assert sched["k8s_port"] in [p["name"] for p in worker_service["spec"]["ports"]]
    check_slice_discovery(sched, worker_service)
    # Cordons are kept in a file of a writable volume of its pod, read back as it restarts.
    assert set(cordon_volume(objs, prefix)) & {"emptyDir", "persistentVolumeClaim"}
    # llm_aware with the prefill cap measured for our worker's engine step (off in the code,
    # where the engines' step budget is unknown); kept per policy, so switching policy works.
    assert sched["policy"] == "llm_aware"
    assert SchedulerConfig(**sched).effective_policy_params == DEPLOY_PARAMS
    assert SchedulerConfig(**{**sched, "policy": "least_request"}).effective_policy_params == {}
    # Every discovered worker's running cap is the worker config's max_num_seqs.
    worker = config_of(objs, prefix, "worker")
    assert SchedulerConfig(**sched).default_running_cap == worker["max_num_seqs"]
    # A rolling update lets a worker finish its requests (plus up to 5 s of deregistration)
    # before Kubernetes kills it.
    grace = find(objs, "Deployment", f"{prefix}-worker")["spec"]["template"]["spec"]
    assert grace["terminationGracePeriodSeconds"] > WorkerConfig(**worker).shutdown_timeout + 5
    # The gateway keeps listening while its Service's endpoints are updated, within its grace,
    # and then has its shutdown_timeout to finish its streams before Kubernetes kills it.
    pod = find(objs, "Deployment", f"{prefix}-gateway")["spec"]["template"]["spec"]
    pre_stop = pod["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep" and 0 < int(pre_stop[1]) < pod["terminationGracePeriodSeconds"] / 2
    gateway_drain = RouterConfig(**config_of(objs, prefix, "gateway")).shutdown_timeout
    assert pod["terminationGracePeriodSeconds"] >= int(pre_stop[1]) + gateway_drain + 5

    # A node drain keeps a gateway: a PodDisruptionBudget over the gateway pods, below their
    # minimum count (at the minimum, it would block every drain).
    gateway_dep = find(objs, "Deployment", f"{prefix}-gateway")
    hpas = [o for o in objs if o["kind"] == "HorizontalPodAutoscaler"]
    least = hpas[0]["spec"]["minReplicas"] if hpas else gateway_dep["spec"]["replicas"]
    pod_labels = gateway_dep["spec"]["template"]["metadata"]["labels"]
    pdbs = [o for o in objs if o["kind"] == "PodDisruptionBudget"
            and o["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()]
    assert len(pdbs) == (1 if least > 1 else 0), f"{len(pdbs)} PodDisruptionBudget(s) for {least} gateway(s)"
    for pdb in pdbs:
        assert 1 <= pdb["spec"]["minAvailable"] < least

    # The gateway talks to the scheduler Service; falls back to the worker Service.
    gateway = config_of(objs, prefix, "gateway")
    sched_port = find(objs, "Service", f"{prefix}-scheduler")["spec"]["ports"][0]["port"]
    assert gateway["scheduler"] == f"http://{prefix}-scheduler:{sched_port}"
    assert gateway["workers"] == f"http://{prefix}-worker:{worker_service['spec']['ports'][0]['port']}"


def cordon_volume(objs: list[dict], prefix: str) -> dict:
    """The scheduler pod's volume that holds its cordon_file, mounted writable (a read-only or
    missing one: every write would fail, and a restart forget the cordons)."""
    path = config_of(objs, prefix, "scheduler")["cordon_file"]
    pod = find(objs, "Deployment", f"{prefix}-scheduler")["spec"]["template"]["spec"]
    [container] = pod["containers"]
    [mount] = [m for m in container["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/") + "/")]
    assert not mount.get("readOnly") and "subPath" not in mount, mount
    assert "/" not in path[len(mount["mountPath"].rstrip("/")) + 1:]  # right in it: no directory to create
    [volume] = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    return volume


def check_slice_discovery(sched_config: dict, worker_service: dict) -> None:
    """The scheduler's own selector parser and slice reader on the EndpointSlice Kubernetes
    creates for the worker Service (built by hand: no API server here)."""
    from lightkube.models.core_v1 import ObjectReference
    from lightkube.models.discovery_v1 import Endpoint, EndpointConditions, EndpointPort
    from lightkube.models.meta_v1 import ObjectMeta
    from lightkube.resources.discovery_v1 import EndpointSlice

    from scheduler.discovery.kubernetes import parse_selector, slice_workers

    name = worker_service["metadata"]["name"]
    # The EndpointSlice controller puts the Service's labels and its name on every slice.
    slice_labels = {**worker_service["metadata"]["labels"], "kubernetes.io/service-name": name,
                    "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io"}
    for key, value in parse_selector(sched_config["k8s_label_selector"]).items():
        assert key in slice_labels and (value is None or slice_labels[key] == value), key
    port = worker_service["spec"]["ports"][0]
    eps = EndpointSlice(
        metadata=ObjectMeta(name=f"{name}-abcde", labels=slice_labels), addressType="IPv4",
        ports=[EndpointPort(name=port["name"], port=port["port"], protocol="TCP")],
        endpoints=[
            Endpoint(addresses=["10.0.0.7"], conditions=EndpointConditions(ready=True),
                     targetRef=ObjectReference(kind="Pod", name=f"{name}-1")),
            Endpoint(addresses=["10.0.0.8"], conditions=EndpointConditions(ready=False)),
        ])
    urls = slice_workers(eps, sched_config["k8s_port"], "http")
    assert urls == {f"{name}-1:{port['port']}": f"http://10.0.0.7:{port['port']}"}


# ---------------------------------------------------------------- raw manifests


def test_raw_manifests_hold_together():
    objs = raw_objects()
    assert {o["metadata"].get("namespace", "llm-router") for o in objs} == {"llm-router"}
    check_cluster(objs, "llm", "llm-router")


def test_raw_gateway_runs_two_replicas_with_an_hpa():
    objs = raw_objects()
    # The HPA owns the replica count: a `replicas` in the manifest would scale the gateways back
    # to it at every `kubectl apply` (as the Helm chart, which leaves it out with autoscaling).
    assert "replicas" not in find(objs, "Deployment", "llm-gateway")["spec"]
    hpa = find(objs, "HorizontalPodAutoscaler", "llm-gateway")
    assert hpa["spec"]["scaleTargetRef"]["name"] == "llm-gateway" and hpa["spec"]["minReplicas"] == 2
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert all((K8S / r).is_file() for r in kustomization["resources"])


def selects(selector: dict, labels: dict) -> bool:
    """A label selector (matchLabels, matchExpressions In / NotIn / Exists) against a label set."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expr in selector.get("matchExpressions", []):
        op, value = expr["operator"], labels.get(expr["key"])
        ok = {"In": value in expr.get("values", []), "NotIn": value not in expr.get("values", []),
              "Exists": expr["key"] in labels, "DoesNotExist": expr["key"] not in labels}[op]
        if not ok:
            return False
    return True


def test_raw_monitoring_objects_match_the_prometheus_files():
    docs = load_all((K8S / "servicemonitors.yaml").read_text())
    monitors = [d for d in docs if d["kind"] == "ServiceMonitor"]
    [rule] = [d for d in docs if d["kind"] == "PrometheusRule"]
    assert rule["spec"]["groups"] == ALERTS["groups"]
    # Without jobLabel the job is the Service name: the job names of prometheus.yml.
    assert not any("jobLabel" in m["spec"] for m in monitors)
    services = {o["metadata"]["name"]: o for o in raw_objects() if o["kind"] == "Service"}
    jobs = {j["job_name"] for j in yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
            ["scrape_configs"]}
    assert set(services) == jobs


def check_monitors(objs: list[dict], token_sent: bool) -> None:
    """Each Service is scraped by exactly one ServiceMonitor (twice would be two copies of its
    series). The gateway's /metrics wants its admin token once one is set: its ServiceMonitor
    sends it (token_sent) from the Secret key the gateway's environment takes it from (a scrape
    without it is a 401, LLMGatewayDown). No other ServiceMonitor sends it: the workers and the
    scheduler need none, and a Secret the operator cannot read, which makes it skip the
    ServiceMonitor, must not leave them unscraped."""
    monitors = [o for o in objs if o["kind"] == "ServiceMonitor"]
    services = [o for o in objs if o["kind"] == "Service"]
    by = {svc["metadata"]["name"]: [m for m in monitors
                                    if selects(m["spec"]["selector"], svc["metadata"]["labels"])]
          for svc in services}
    assert {name: len(found) for name, found in by.items()} == dict.fromkeys(by, 1)
    [gateway] = [o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("-gateway")]
    [container] = gateway["spec"]["template"]["spec"]["containers"]
    refs = _secret_refs(container)
    for env in container.get("env", []):  # variables the gateway's config really reads
        assert env["name"].removeprefix("ROUTER_").lower() in RouterConfig.model_fields, env["name"]
    for name, [monitor] in by.items():
        if name.endswith("-gateway"):
            check_gateway_scrape_port(objs, name, monitor)
        for endpoint in monitor["spec"]["endpoints"]:
            if name.endswith("-gateway") and token_sent:
                ref = refs["ROUTER_ADMIN_TOKEN"]
                assert endpoint["authorization"] == {
                    "type": "Bearer", "credentials": {"name": ref["name"], "key": ref["key"]}}
            else:
                assert "authorization" not in endpoint, (name, monitor["metadata"]["name"])


def check_gateway_scrape_port(objs: list[dict], service_name: str, monitor: dict) -> None:
    """The gateway's ServiceMonitor scrapes the container port its config serves /metrics
    on: the metrics port, outside the client connections' cap, so that a gateway refusing
    clients at its cap is still scraped."""
    values = config_of(objs, service_name.removesuffix("-gateway"), "gateway")
    service = find(objs, "Service", service_name)
    [dep] = [o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"] == service_name]
    [container] = dep["spec"]["template"]["spec"]["containers"]
    container_ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    service_ports = {p["name"]: p["targetPort"] for p in service["spec"]["ports"]}
    for endpoint in monitor["spec"]["endpoints"]:
        scraped = container_ports[service_ports[endpoint["port"]]]
        assert scraped == (values.get("metrics_port") or values["port"]), endpoint


def test_raw_gateway_monitor_sends_the_admin_token_the_gateway_reads():
    objs = raw_objects()
    assert config_of(objs, "llm", "gateway")["metrics_port"]  # scraped outside its cap
    check_monitors(objs + load_all((K8S / "servicemonitors.yaml").read_text()), token_sent=True)
    [container] = find(objs, "Deployment", "llm-gateway")["spec"]["template"]["spec"]["containers"]
    # Optional: without the Secret the gateway starts, with no keys and no token.
    refs = [e["valueFrom"]["secretKeyRef"] for e in container["env"]]
    assert {r["key"] for r in refs} == {"api-keys", "admin-token", "gateway-token"}
    assert all(r["optional"] is True for r in refs)


def _secret_refs(container: dict) -> dict[str, dict]:
    return {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container.get("env", [])
            if "secretKeyRef" in e.get("valueFrom", {})}


def _key_file(pod: dict, container: dict, variable: str = "ROUTER_API_KEY_FILE") -> dict:
    """The Secret and key that the file `variable` names comes from (and whether the volume is
    optional, when it says). The mount is the volume's directory: a subPath mount is never
    updated, and a rotated key (or admin token) would not reach the service."""
    [path] = [e["value"] for e in container["env"] if e["name"] == variable]
    [mount] = [m for m in container["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/") + "/")]
    assert "subPath" not in mount and mount.get("readOnly") is True
    [volume] = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    [item] = [i for i in volume["secret"]["items"]
              if i["path"] == path.removeprefix(mount["mountPath"].rstrip("/") + "/")]
    optional = {"optional": volume["secret"]["optional"]} if "optional" in volume["secret"] else {}
    return {"secretName": volume["secret"]["secretName"], "key": item["key"], **optional}


def test_raw_scheduler_and_gateways_read_one_gateway_token():
    """The scheduler's decision API token and the one every gateway sends come from the same
    Secret key, optional on both sides (without the Secret: no token, as before)."""
    objs = raw_objects()
    pod = find(objs, "Deployment", "llm-scheduler")["spec"]["template"]["spec"]
    [scheduler] = pod["containers"]
    [gateway] = find(objs, "Deployment", "llm-gateway")["spec"]["template"]["spec"]["containers"]
    ref = {"name": "llm-scheduler-auth", "key": "gateway-token", "optional": True}
    assert _secret_refs(scheduler) == {"SCHEDULER_GATEWAY_TOKEN": ref}
    assert _secret_refs(gateway)["ROUTER_SCHEDULER_TOKEN"] == ref
    # The admin token: a file of the same Secret's volume, which the kubelet updates and the
    # scheduler re-reads (rotated without a restart); optional as the variable was.
    assert _key_file(pod, scheduler, "SCHEDULER_ADMIN_TOKEN_FILE") == {
        "secretName": "llm-scheduler-auth", "key": "admin-token", "optional": True}
    # Variables each service's config really reads (a Secret from a file: its last newline).
    assert {"gateway_token", "admin_token_file"} <= SchedulerConfig.model_fields.keys()
    assert "scheduler_token" in RouterConfig.model_fields
    assert "admin_token_file" not in config_of(objs, "llm", "scheduler")  # one source of it


# ---------------------------------------------------------------- Helm chart, statically


def _values_paths(values: dict, prefix: str = "") -> set[str]:
    paths = set()
    for key, value in values.items():
        path = f"{prefix}.{key}" if prefix else key
        paths.add(path)
        if isinstance(value, dict):
            paths |= _values_paths(value, path)
    return paths


def test_helm_templates_reference_only_defined_values_and_includes():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2" and chart["name"] == "llm-router"
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    defined = _values_paths(values)
    helpers = (CHART / "templates" / "_helpers.tpl").read_text()
    includes = set(re.findall(r'define "([^"]+)"', helpers))
    used, used_includes = set(), set()
    for template in (CHART / "templates").iterdir():
        text = template.read_text()
        assert text.count("{{") == text.count("}}"), template.name
        used |= set(re.findall(r"\.Values\.([A-Za-z0-9_.]+)", text))
        used_includes |= set(re.findall(r'include "([^"]+)"', text))
    assert used and used <= defined, f"undefined values: {sorted(used - defined)}"
    assert used_includes <= includes
    # The per-service config blocks are valid configs of those services.
    for service in CONFIGS:
        injected = {"workers": "http://w:1"} if service == "gateway" else {}  # set by the template
        validate_config(service, injected | values[service]["config"])
    # as in the raw manifests
    assert values["scheduler"]["config"]["params_by_policy"] == {"llm_aware": DEPLOY_PARAMS}
    caps = values["scheduler"]["config"]["worker_max_running"]
    assert caps == {"*": values["worker"]["config"]["max_num_seqs"]}


def test_helm_chart_makes_every_kind_of_object_the_raw_manifests_make():
    """The chart is "the same as" deploy/k8s (README): an object kind only one of them has is a
    protection an operator loses by choosing the other (the chart had no gateway PDB)."""
    monitoring = load_all((K8S / "servicemonitors.yaml").read_text())
    raw = {o["kind"] for o in raw_objects() + monitoring}
    templates = "\n".join(p.read_text() for p in (CHART / "templates").glob("*.yaml"))
    chart = set(re.findall(r"^kind: (\w+)\s*$", templates, re.M))
    assert raw - {"Namespace"} <= chart, f"missing from the chart: {sorted(raw - {'Namespace'} - chart)}"


def test_helm_chart_alert_rules_are_the_shipped_ones():
    copy = CHART / "files" / "alerts.yml"
    assert copy.read_text() == (DEPLOY / "prometheus" / "alerts.yml").read_text(), \
        "cp deploy/prometheus/alerts.yml deploy/helm/llm-router/files/alerts.yml"


# ---------------------------------------------------------------- Helm chart, rendered by Helm


def render(values: dict | None) -> list[dict]:
    helm = pytest.importorskip("helm_python", reason="helm-python-sdk (Helm's Go SDK) is not installed")
    manifests = helm.Chart.load(str(CHART)).render(values, name="prod", namespace="llm", is_install=True)
    return [doc for path, text in manifests.items() if path.endswith(".yaml") for doc in load_all(text)]


def test_helm_chart_renders_a_working_stack_with_defaults():
    objs = render(None)
    check_cluster(objs, "prod", "llm")
    assert find(objs, "HorizontalPodAutoscaler", "prod-gateway")["spec"]["minReplicas"] == 2
    assert "replicas" not in find(objs, "Deployment", "prod-gateway")["spec"]  # the HPA owns it
    assert not [o for o in objs if o["kind"] in ("ServiceMonitor", "PrometheusRule")]
    # Prometheus job names survive any release name through the Services' job label.
    jobs = {o["metadata"]["labels"]["llm-router.io/job"] for o in objs if o["kind"] == "Service"}
    assert jobs == {"llm-worker", "llm-scheduler", "llm-gateway"}


def test_helm_chart_renders_monitoring_and_fixed_replicas_when_asked():
    objs = render({"metrics": {"serviceMonitor": {"enabled": True}, "prometheusRule": {"enabled": True},
                               "extraLabels": {"release": "kps"}},
                   "gateway": {"replicas": 3, "autoscaling": {"enabled": False}},
                   "worker": {"replicas": 5, "config": {"backend": "sim", "sim_profile": "llama2-7b-a10"}}})
    check_cluster(objs, "prod", "llm")
    assert find(objs, "Deployment", "prod-gateway")["spec"]["replicas"] == 3
    assert find(objs, "Deployment", "prod-worker")["spec"]["replicas"] == 5
    assert config_of(objs, "prod", "worker")["sim_profile"] == "llama2-7b-a10"
    assert not [o for o in objs if o["kind"] == "HorizontalPodAutoscaler"]
    monitors = [o for o in objs if o["kind"] == "ServiceMonitor"]
    assert {m["metadata"]["name"] for m in monitors} == {"prod-llm-router", "prod-llm-router-gateway"}
    for monitor in monitors:
        assert monitor["spec"]["jobLabel"] == "llm-router.io/job"
        assert monitor["metadata"]["labels"]["release"] == "kps"
    check_monitors(objs, token_sent=False)
    assert config_of(objs, "prod", "gateway")["metrics_port"]  # scraped outside its cap
    rule = find(objs, "PrometheusRule", "prod-llm-router")
    assert rule["spec"]["groups"] == ALERTS["groups"]  # annotations' {{ $labels }} left for Prometheus


def test_helm_gateway_metrics_port_zero_scrapes_the_api_port():
    """gateway.metricsPort 0: no metrics port anywhere, and every scrape (the ServiceMonitor,
    the pod annotations) goes to the API port, where the gateway then serves /metrics."""
    objs = render({"gateway": {"metricsPort": 0}, "metrics": {"serviceMonitor": {"enabled": True}}})
    check_cluster(objs, "prod", "llm")
    check_monitors(objs, token_sent=False)
    assert "metrics_port" not in config_of(objs, "prod", "gateway")
    assert [p["name"] for p in find(objs, "Service", "prod-gateway")["spec"]["ports"]] == ["http"]


def test_a_longer_drain_gets_a_longer_grace_period():
    """terminationGracePeriodSeconds was fixed (45 s for a worker, 60 s for a gateway): one
    given a longer shutdown_timeout was killed in the middle of its drain, its answers cut."""
    objs = render({"worker": {"config": {"shutdown_timeout": 120}},
                   "gateway": {"config": {"shutdown_timeout": 300.5}}})
    check_cluster(objs, "prod", "llm")  # grace above each drain, as for the defaults
    grace = {o["metadata"]["name"]: o["spec"]["template"]["spec"].get("terminationGracePeriodSeconds")
             for o in objs if o["kind"] == "Deployment"}
    assert grace["prod-worker"] == 135 and grace["prod-gateway"] == 311
    defaults = render(None)  # as the raw manifests
    assert {o["metadata"]["name"]: o["spec"]["template"]["spec"].get("terminationGracePeriodSeconds")
            for o in defaults if o["kind"] == "Deployment"} == \
        {"prod-worker": 45, "prod-gateway": 60, "prod-scheduler": None}


def test_a_change_to_any_rendered_config_restarts_its_pods():
    """Each Deployment's checksum/config annotation hashes its config file as rendered, so
    `helm upgrade` rolls the pods whenever the file changes. It hashed the values' config block
    alone: a new scheduler port changed the gateway's file but not its pods, which kept
    calling the old port."""
    def checksums(values: dict | None) -> dict[str, str]:
        return {o["metadata"]["name"]: o["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
                for o in render(values) if o["kind"] == "Deployment"}

    base = checksums(None)
    assert set(base) == {"prod-gateway", "prod-scheduler", "prod-worker"}
    moved = checksums({"scheduler": {"port": 9090}, "worker": {"port": 8011}})
    assert moved["prod-gateway"] != base["prod-gateway"]  # its scheduler and workers URLs
    assert moved["prod-scheduler"] != base["prod-scheduler"]  # its own port
    assert moved["prod-worker"] != base["prod-worker"]
    assert checksums(None) == base  # stable: an upgrade that changes nothing restarts nothing


def test_gateway_auth_comes_from_a_secret_and_the_service_monitor_sends_the_admin_token(monkeypatch):
    """gateway.auth: client keys and the admin token reach the gateway from a Secret (never the
    ConfigMap): the keys as a file of the Secret's volume, which the kubelet updates when the
    Secret changes and the gateway re-reads (a variable changes only with a restart), the token
    as a variable; with the admin token, /metrics wants it, and the ServiceMonitor sends it
    (without, the gateway's own scrape failed with 401 and its LLMGatewayDown alert fired)."""
    values = {"gateway": {"auth": {"secret": "llm-gateway-auth", "apiKeys": True, "adminToken": True}},
              "metrics": {"serviceMonitor": {"enabled": True}}}
    objs = render(values)
    check_cluster(objs, "prod", "llm")
    pod = find(objs, "Deployment", "prod-gateway")["spec"]["template"]["spec"]
    [gateway] = pod["containers"]
    assert _secret_refs(gateway) == {
        "ROUTER_ADMIN_TOKEN": {"name": "llm-gateway-auth", "key": "admin-token"}}
    key_file = _key_file(pod, gateway)
    assert key_file == {"secretName": "llm-gateway-auth", "key": "api-keys"}
    # Variables the gateway's config really reads, as Secrets made from files hold them: a token
    # with its file's last newline.
    monkeypatch.setenv("ROUTER_ADMIN_TOKEN", "admin-1\n")
    cfg = RouterConfig(workers="http://w:1")
    assert cfg.admin_token == "admin-1"
    assert "admin_token" not in config_of(objs, "prod", "gateway")
    [endpoint] = find(objs, "ServiceMonitor", "prod-llm-router-gateway")["spec"]["endpoints"]
    assert endpoint["authorization"] == {"type": "Bearer",
                                         "credentials": {"name": "llm-gateway-auth", "key": "admin-token"}}
    check_monitors(objs, token_sent=True)
    assert validate_against_kubernetes_schemas(objs) > 0

    keys_only = render({"gateway": {"auth": {"secret": "llm-gateway-auth"}},
                        "metrics": {"serviceMonitor": {"enabled": True}}})
    pod = find(keys_only, "Deployment", "prod-gateway")["spec"]["template"]["spec"]
    [gateway] = pod["containers"]
    assert [e["name"] for e in gateway["env"]] == ["ROUTER_API_KEY_FILE"]
    assert _key_file(pod, gateway) == {"secretName": "llm-gateway-auth", "key": "api-keys"}
    check_monitors(keys_only, token_sent=False)
    [gateway] = find(render(None), "Deployment", "prod-gateway")["spec"]["template"]["spec"]["containers"]
    assert "env" not in gateway  # no Secret named: no auth, and no reference to a missing Secret


def test_helm_scheduler_auth_gives_the_scheduler_and_the_gateways_one_token(monkeypatch):
    """scheduler.auth.secret: the scheduler reads its gateway token from the Secret, and the
    gateways send the same key; with gateway.auth beside it, the gateway reads all three."""
    objs = render({"scheduler": {"auth": {"secret": "sched-auth"}},
                   "gateway": {"auth": {"secret": "llm-gateway-auth", "adminToken": True}}})
    check_cluster(objs, "prod", "llm")
    [scheduler] = find(objs, "Deployment", "prod-scheduler")["spec"]["template"]["spec"]["containers"]
    [gateway] = find(objs, "Deployment", "prod-gateway")["spec"]["template"]["spec"]["containers"]
    ref = {"name": "sched-auth", "key": "gateway-token"}
    assert _secret_refs(scheduler) == {"SCHEDULER_GATEWAY_TOKEN": ref}
    assert _secret_refs(gateway) == {
        "ROUTER_ADMIN_TOKEN": {"name": "llm-gateway-auth", "key": "admin-token"},
        "ROUTER_SCHEDULER_TOKEN": ref}
    assert "gateway_token" not in config_of(objs, "prod", "scheduler")  # never in the ConfigMap
    # What each service makes of the variables, as a Secret made from a file holds them.
    monkeypatch.setenv("SCHEDULER_GATEWAY_TOKEN", "tok-1\n")
    monkeypatch.setenv("ROUTER_SCHEDULER_TOKEN", "tok-1\n")
    assert SchedulerConfig().gateway_token == RouterConfig(workers="http://w:1").scheduler_token == "tok-1"
    assert validate_against_kubernetes_schemas(objs) > 0

    # And the cordon token, from the same Secret, when asked for: a file of its volume, which
    # the kubelet updates and the scheduler re-reads (rotated without a restart).
    with_admin = render({"scheduler": {"auth": {"secret": "sched-auth", "adminToken": True}}})
    check_cluster(with_admin, "prod", "llm")
    pod = find(with_admin, "Deployment", "prod-scheduler")["spec"]["template"]["spec"]
    [scheduler] = pod["containers"]
    assert _secret_refs(scheduler) == {"SCHEDULER_GATEWAY_TOKEN": ref}
    assert _key_file(pod, scheduler, "SCHEDULER_ADMIN_TOKEN_FILE") == {
        "secretName": "sched-auth", "key": "admin-token"}
    [path] = [e["value"] for e in scheduler["env"] if e["name"] == "SCHEDULER_ADMIN_TOKEN_FILE"]
    monkeypatch.setenv("SCHEDULER_ADMIN_TOKEN_FILE", path)
    assert SchedulerConfig().admin_token_file == path
    assert validate_against_kubernetes_schemas(with_admin) > 0

    # The scheduler's token alone: the gateway reads only that.
    alone = render({"scheduler": {"auth": {"secret": "sched-auth"}}})
    [gateway] = find(alone, "Deployment", "prod-gateway")["spec"]["template"]["spec"]["containers"]
    assert _secret_refs(gateway) == {"ROUTER_SCHEDULER_TOKEN": ref}
    # None named (the default): no token, and no reference to a missing Secret.
    [scheduler] = find(render(None), "Deployment", "prod-scheduler")["spec"]["template"]["spec"]["containers"]
    assert "env" not in scheduler


def notes(values: dict | None) -> str:
    helm = pytest.importorskip("helm_python", reason="helm-python-sdk (Helm's Go SDK) is not installed")
    manifests = helm.Chart.load(str(CHART)).render(values, name="prod", namespace="llm", is_install=True)
    [text] = [text for path, text in manifests.items() if path.endswith("NOTES.txt")]
    return text


def test_helm_notes_example_sends_an_api_key_when_the_gateway_wants_one(tmp_path):
    """Pasted as printed, the example got a 401 once the gateway had keys."""
    assert "Authorization" not in notes(None)
    text = notes({"gateway": {"auth": {"secret": "gw-auth", "apiKeys": True}}})
    [line] = [ln for ln in text.splitlines() if "API_KEY=$(" in ln]
    assert "get secret gw-auth" in line and "{.data.api-keys}" in line
    assert '-H "Authorization: Bearer $API_KEY" http://127.0.0.1:8000/v1/models' in text
    # The pipeline picks the first key of the file's format (lines or commas, '#' comments).
    pick = line.split("base64 -d | ", 1)[1].rstrip(")")
    out = subprocess.run(["bash", "-c", pick], input="# rotated 2026-11\n\n  sk-one, sk-two\n",
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "sk-one"


def test_helm_scheduler_keeps_cordons_in_an_emptydir_or_an_existing_claim():
    """scheduler.cordonState.existingClaim: the cordon file on a PersistentVolumeClaim, which a
    new pod finds again (an emptyDir, the default, outlasts a container restart only), written
    as the image's user through the pod's fsGroup."""
    default = render(None)
    assert cordon_volume(default, "prod") == {"name": "state", "emptyDir": {}}
    assert "securityContext" not in find(default, "Deployment", "prod-scheduler")["spec"]["template"]["spec"]
    assert cordon_volume(raw_objects(), "llm") == {"name": "state", "emptyDir": {}}

    objs = render({"scheduler": {"cordonState": {"existingClaim": "sched-state"}}})
    check_cluster(objs, "prod", "llm")
    claim = {"claimName": "sched-state"}
    assert cordon_volume(objs, "prod") == {"name": "state", "persistentVolumeClaim": claim}
    pod = find(objs, "Deployment", "prod-scheduler")["spec"]["template"]["spec"]
    uid = re.search(r"useradd .*--uid (\d+)", (DEPLOY / "docker" / "Dockerfile").read_text()).group(1)
    assert pod["securityContext"] == {"fsGroup": int(uid)}
    assert validate_against_kubernetes_schemas(objs) == len([o for o in objs if o["kind"] not in CRD_KINDS])
    # The path is the template's, where the volume is mounted: a config that names another
    # does not move it out.
    moved = render({"scheduler": {"config": {"cordon_file": "/tmp/elsewhere.json"}}})
    assert config_of(moved, "prod", "scheduler")["cordon_file"] == "/var/lib/llm-scheduler/cordons.json"


def test_helm_scheduler_admin_token_without_its_secret_fails_the_render():
    pytest.importorskip("helm_python", reason="helm-python-sdk (Helm's Go SDK) is not installed")
    with pytest.raises(Exception, match=re.escape("name that Secret")):
        render({"scheduler": {"auth": {"adminToken": True}}})


def test_helm_gateway_tls_serves_https_from_a_secret():
    """gateway.tls.secret: the gateway serves HTTPS with the Secret's certificate (its config
    names the files of the Secret's volume), the kubelet probes it in HTTPS, and the
    ServiceMonitor scrapes it in HTTPS, checking the certificate against the Secret's CA for
    the Service's name; the workers' and the scheduler's monitor is unchanged."""
    monitored = {"serviceMonitor": {"enabled": True}}
    objs = render({"gateway": {"tls": {"secret": "gw-tls"}}, "metrics": monitored})
    check_cluster(objs, "prod", "llm")
    cfg = config_of(objs, "prod", "gateway")
    pod = find(objs, "Deployment", "prod-gateway")["spec"]["template"]["spec"]
    [gateway] = pod["containers"]
    for field, key in (("ssl_certfile", "tls.crt"), ("ssl_keyfile", "tls.key")):
        directory, name = cfg[field].rsplit("/", 1)
        [mount] = [m for m in gateway["volumeMounts"] if m["mountPath"].rstrip("/") == directory]
        assert mount.get("readOnly") is True
        [volume] = [v for v in pod["volumes"] if v["name"] == mount["name"]]
        assert volume["secret"]["secretName"] == "gw-tls"
        assert {"key": key, "path": name} in volume["secret"]["items"]
    for probe in ("readinessProbe", "livenessProbe"):
        assert gateway[probe]["httpGet"]["scheme"] == "HTTPS"
    [endpoint] = find(objs, "ServiceMonitor", "prod-llm-router-gateway")["spec"]["endpoints"]
    assert endpoint["scheme"] == "https"
    assert endpoint["tlsConfig"] == {"ca": {"secret": {"name": "gw-tls", "key": "ca.crt"}},
                                     "serverName": "prod-gateway.llm.svc"}
    [others] = find(objs, "ServiceMonitor", "prod-llm-router")["spec"]["endpoints"]
    assert "scheme" not in others and "tlsConfig" not in others
    assert validate_against_kubernetes_schemas(objs) == len([o for o in objs if o["kind"] not in CRD_KINDS])

    named = render({"gateway": {"tls": {"secret": "gw-tls", "serverName": "llm.example.com"}},
                    "metrics": monitored})
    [endpoint] = find(named, "ServiceMonitor", "prod-llm-router-gateway")["spec"]["endpoints"]
    assert endpoint["tlsConfig"]["serverName"] == "llm.example.com"
    # Without it (the default): plain HTTP, as before.
    plain = render(None)
    assert not {"ssl_certfile", "ssl_keyfile"} & config_of(plain, "prod", "gateway").keys()
    [gateway] = find(plain, "Deployment", "prod-gateway")["spec"]["template"]["spec"]["containers"]
    assert "scheme" not in gateway["readinessProbe"]["httpGet"]


# ---------------------------------------------------------------- official Kubernetes schemas

KUBE_VERSION = "1.30.0"
CRD_KINDS = {"ServiceMonitor", "PrometheusRule"}  # Prometheus operator CRDs: no bundled schema


def validate_against_kubernetes_schemas(objs: list[dict]) -> int:
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed")
    checked = 0
    for obj in objs:
        if obj["kind"] in CRD_KINDS:
            continue
        kv.validate(obj, KUBE_VERSION, strict=True)  # raises on any unknown or mistyped field
        checked += 1
    return checked


def test_raw_manifests_match_the_kubernetes_schemas():
    assert validate_against_kubernetes_schemas(raw_objects()) == len(raw_objects())


def test_rendered_helm_chart_matches_the_kubernetes_schemas():
    objs = render({"metrics": {"serviceMonitor": {"enabled": True}, "prometheusRule": {"enabled": True}}})
    assert validate_against_kubernetes_schemas(objs) == len([o for o in objs if o["kind"] not in CRD_KINDS])
