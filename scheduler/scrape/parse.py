"""Line-oriented Prometheus text parser that keeps only the series a dialect needs.

prometheus_client's parser builds every family and sample of the exposition
(~650 lines for vLLM, mostly histogram buckets nobody routes on); this one looks
at each line's name first and skips unwanted lines with two string scans. The
benchmark (benchmarks/scheduler_bench.py) measures both on the real captures,
and tests/scheduler/test_parse_property.py checks they agree on every value
both produce.
"""

from __future__ import annotations

import math
import re

# One label pair: name="value" with backslash escapes inside the value.
_LABEL_RE = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}
_ESC_RE = re.compile(r'\\[\\"n]')

Sample = tuple[dict[str, str], float]


def _unescape(value: str) -> str:
    if "\\" not in value:
        return value
    return _ESC_RE.sub(lambda m: _UNESCAPE[m.group(0)], value)


def parse_labels(text: str) -> dict[str, str]:
    return {k: _unescape(v) for k, v in _LABEL_RE.findall(text)}


def parse_value(text: str) -> float:
    # Prometheus allows +Inf/-Inf/NaN spelled in several cases; float() accepts them all.
    return float(text)


def _split_line(line: str) -> tuple[str, str, str] | None:
    """(name, label text, rest after the labels) of one sample line."""
    brace = line.find("{")
    space = line.find(" ")
    if brace != -1 and (space == -1 or brace < space):
        end = line.rfind("}")
        if end < brace:
            return None
        return line[:brace], line[brace + 1 : end], line[end + 1 :]
    if space == -1:
        return None
    return line[:space], "", line[space:]


def parse_selected(text: str, wanted: dict[str, str]) -> dict[str, list[Sample]]:
    """Samples of the wanted series names, keyed by the canonical key `wanted` maps them to.

    Malformed lines are skipped (a scrape must not fail on one odd line). Values that do
    not parse as floats are skipped too.
    """
    out: dict[str, list[Sample]] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        parts = _split_line(line)
        if parts is None:
            continue
        name, labels, rest = parts
        key = wanted.get(name)
        if key is None:
            continue
        fields = rest.split()
        if not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        out.setdefault(key, []).append((parse_labels(labels) if labels else {}, value))
    return out


def series_names(text: str) -> set[str]:
    """Every sample name in the exposition (used once per worker to detect its dialect)."""
    names: set[str] = set()
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        parts = _split_line(line)
        if parts is not None:
            names.add(parts[0])
    return names


def label_present(text: str, name: str, label: str) -> bool:
    """Does any sample of `name` carry `label`? (dialect detection only)."""
    for line in text.splitlines():
        if line.startswith(name + "{"):
            parts = _split_line(line)
            if parts and label in parse_labels(parts[1]):
                return True
    return False


def is_finite(value: float) -> bool:
    return not (math.isnan(value) or math.isinf(value))
