"""What the shipped dashboards and alert rules ask Prometheus for.

`metric_names` pulls the metric names out of a PromQL expression; `shipped_queries`
collects every expression of the Grafana dashboards and alert rules;
`exposed_sample_names` turns a /metrics text into the series names Prometheus stores.
"""

from __future__ import annotations

import json
import re

import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.deploy.helpers import DEPLOY

# Synthetic series Prometheus makes for every target; not exposed by our services.
PROMETHEUS_BUILTINS = {"up", "scrape_duration_seconds", "scrape_samples_scraped"}

_KEYWORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool",
    "offset", "inf", "nan",
}
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGE = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression (functions, keywords, labels and numbers removed)."""
    text = _STRING.sub('""', expr)
    text = re.sub(r"\$\{?\w+\}?", "1m", text)  # Grafana variables
    text = _MATCHERS.sub(" ", text)
    text = _RANGE.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    names = set()
    for match in _IDENT.finditer(text):
        word = match.group()
        rest = text[match.end():].lstrip()
        if rest.startswith("("):  # a function call
            continue
        if word.lower() in _KEYWORDS or re.fullmatch(r"\d.*|e\d*", word):
            continue
        names.add(word)
    return names


_LABEL_MATCHER = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)")


def label_names(expr: str) -> set[str]:
    """Label names an expression selects on or groups by (matchers, by/without/on/ignoring)."""
    text = _STRING.sub('""', expr)
    names = set()
    for matchers in _MATCHERS.findall(text):
        names.update(_LABEL_MATCHER.findall(matchers))
    for grouping in _GROUPING.findall(text):
        inner = grouping[grouping.index("(") + 1:-1]
        names.update(label.strip() for label in inner.split(",") if label.strip())
    return names


def _panels(dashboard: dict) -> list[dict]:
    out = []
    for panel in dashboard.get("panels", []):
        out.append(panel)
        out.extend(_panels(panel))  # rows may nest panels
    return out


def dashboard_queries() -> dict[str, str]:
    """{"<file>: <panel title> [<ref>]": expr} for every dashboard target and query variable."""
    queries = {}
    for path in sorted((DEPLOY / "grafana" / "dashboards").glob("*.json")):
        dashboard = json.loads(path.read_text())
        for panel in _panels(dashboard):
            for target in panel.get("targets", []):
                queries[f"{path.name}: {panel['title']} [{target['refId']}]"] = target["expr"]
        for var in dashboard["templating"]["list"]:
            if var["type"] == "query":
                inner = re.fullmatch(r"label_values\((.*),\s*\w+\)", var["definition"])
                assert inner, f"unexpected variable query {var['definition']}"
                queries[f"{path.name}: variable {var['name']}"] = inner.group(1)
    return queries


def alert_queries() -> dict[str, str]:
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    return {f"alerts.yml: {rule['alert']}": rule["expr"]
            for group in rules["groups"] for rule in group["rules"]}


def shipped_queries() -> dict[str, str]:
    return {**dashboard_queries(), **alert_queries()}


def exposed_label_names(metrics_text: str) -> dict[str, set[str]]:
    """{series name: label names its samples carry} (series without a sample are absent)."""
    labels: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            labels.setdefault(sample.name, set()).update(sample.labels)
    return labels


def exposed_sample_names(metrics_text: str) -> set[str]:
    """Every series name a scrape of this text can produce (families listed even without samples)."""
    suffixes = {
        "counter": ("_total", "_created"),
        "histogram": ("_bucket", "_sum", "_count", "_created"),
        "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
        "summary": ("", "_sum", "_count", "_created"),
        "info": ("_info",),
    }
    # A counter's or histogram's family name (`router_requests` of router_requests_total) is
    # never a series: a query on it finds nothing, so it must not count as exposed.
    bare_is_a_series = {"gauge", "unknown", "untyped", "summary", "stateset"}
    names = set()
    for family in text_string_to_metric_families(metrics_text):
        if family.type in bare_is_a_series:
            names.add(family.name)
        names.update(family.name + s for s in suffixes.get(family.type, ()))
        names.update(sample.name for sample in family.samples)
    return names
