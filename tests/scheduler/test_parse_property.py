"""The fast selective parser agrees with prometheus_client's parser on every value both
produce: on the real vLLM captures, on every hand-written fixture, and on generated
expositions (hypothesis) with escaped label values, odd spacing, timestamps, +Inf/NaN.
Ours drops NaN and infinite values (they carry no load figure), so the reference's are left
out of the comparison."""

from __future__ import annotations

import math
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest
from prometheus_client.parser import text_string_to_metric_families

from scheduler.scrape.parse import parse_selected, series_names

# Hand-written fixtures and copies of the real vLLM 0.32 captures from ../shared/fixtures.
FIXTURES = sorted(Path(__file__).parent.joinpath("fixtures").glob("*.txt"))


def reference(text: str) -> dict[tuple[str, frozenset], float]:
    out = {}
    names = series_names(text)
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            name = s.name
            # prometheus_client reports a counter exposed without `_total` under `<name>_total`.
            if name.endswith("_total") and name not in names and name[:-6] in names:
                name = name[:-6]
            if math.isfinite(s.value):
                out[(name, frozenset(s.labels.items()))] = s.value
    return out


def ours(text: str, names: set[str]) -> dict[tuple[str, frozenset], float]:
    parsed = parse_selected(text, {n: n for n in names})
    return {(name, frozenset(labels.items())): v for name, samples in parsed.items() for labels, v in samples}


def assert_agree(text: str, subset=None) -> None:
    """Both parsers agree on every series; with `subset`, ours reads only those names."""
    ref = reference(text)
    names = series_names(text)
    if subset is not None:
        names = {n for n in names if subset(n)}
        ref = {k: v for k, v in ref.items() if k[0] in names}
        if not ref:
            return
    mine = ours(text, names)
    if not ref:  # every value NaN or infinite: ours keeps none of them
        assert not mine
        return
    both = set(ref) & set(mine)
    assert both, "the parsers share no series"
    for key in both:
        assert ref[key] == mine[key], key
    # Ours must not invent or miss series that the reference reports.
    assert set(mine) == set(ref)


def test_an_untyped_family_whose_name_extends_the_typed_one_before_it():
    # Found by the generated test below (whose subsets depend on the hash seed): `a0` follows
    # family `a`'s block without a TYPE line of its own, and reading `a0` alone must find it.
    text = "# TYPE a gauge\na 0.0\na0 1.0\n# TYPE a9 gauge\na9 2.0\n"
    assert ours(text, {"a0"}) == {("a0", frozenset()): 1.0}
    assert_agree(text, subset=lambda n: n != "a")


def test_agree_on_fixtures():
    assert FIXTURES
    for path in FIXTURES:
        assert_agree(path.read_text())


_name = st.from_regex(r"[a-z][a-z0-9_:]{0,12}", fullmatch=True).filter(
    lambda n: not n.endswith(("_created", "_total", "_sum", "_count", "_bucket", "_info", "_gsum", "_gcount"))
)
_label_name = st.from_regex(r"[a-z][a-z0-9_]{0,6}", fullmatch=True).filter(
    lambda n: n not in ("le", "quantile")
)
_label_value = st.text(alphabet=st.sampled_from('ab c"\\\n{}=,x1'), max_size=8)
_value = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True, width=64),
    st.integers(min_value=-(10**12), max_value=10**12).map(float),
)


def _blanks(least: int) -> st.SearchStrategy[str]:
    return st.text(alphabet=" \t", min_size=least, max_size=2)


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _fmt(v: float) -> str:
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(v)


@st.composite
def exposition(draw) -> str:
    names = draw(st.lists(_name, min_size=1, max_size=5, unique=True))
    lines = []
    for name in names:
        if draw(st.booleans()):
            lines.append(f"# HELP {name} some help text")
        kind = draw(st.sampled_from(["gauge", "untyped-no-type-line", "histogram"]))
        if kind == "histogram":
            lines.append(f"# TYPE {name} histogram")
            count = draw(st.integers(min_value=0, max_value=100))
            for le in ("0.1", "1.0", "+Inf"):
                lines.append(f'{name}_bucket{{le="{le}"}} {count}')
            lines.append(f"{name}_sum {_fmt(draw(_value))}")
            lines.append(f"{name}_count {count}")
            continue
        if kind == "gauge":
            lines.append(f"# TYPE {name} gauge")
        label_sets = draw(
            st.lists(
                st.dictionaries(_label_name, _label_value, max_size=3), min_size=1, max_size=3, unique_by=str
            )
        )
        seen = set()
        for labels in label_sets:
            key = frozenset(labels.items())
            if key in seen:
                continue
            seen.add(key)
            body = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
            label_text = "{" + body + "}" if labels or draw(st.booleans()) else ""
            # Tokens are separated by spaces or tabs, and blanks may come before the labels too.
            if label_text:
                label_text = draw(_blanks(0)) + label_text
            ts = ""
            if draw(st.booleans()):
                ts = draw(_blanks(1)) + str(draw(st.integers(min_value=0, max_value=2**40)))
            lines.append(f"{name}{label_text}{draw(_blanks(1))}{_fmt(draw(_value))}{ts}")
    return "\n".join(lines) + "\n"


@settings(max_examples=200, deadline=None)
@given(exposition(), st.integers(min_value=0, max_value=2**16))
def test_agree_on_generated_text(text, seed):
    assert_agree(text)
    # Reading only some names (as a dialect does) must not change the values read.
    assert_agree(text, subset=lambda n: hash((n, seed)) % 3 != 0)
    assert_agree(text, subset=lambda n: n.endswith(("_sum", "_count")))


def test_an_openmetrics_exemplar_is_not_read_as_the_sample():
    """prometheus_client's OpenMetrics exposition puts an exemplar after a counter's value, with a
    label block of its own (here holding a "}"): the last "}" of the line closed the sample's
    labels, so the exemplar's value (3) and labels were read for the counter (10)."""
    registry = CollectorRegistry()
    counter = Counter("sglang_prompt_tokens", "prompt tokens", ["model_name"], registry=registry)
    counter.labels("qwen").inc(7)
    counter.labels("qwen").inc(3, exemplar={"trace_id": "a}b"})
    text = openmetrics_latest(registry).decode()
    assert '# {trace_id="a}b"} 3.0' in text
    assert ours(text, {"sglang_prompt_tokens_total"}) == {
        ("sglang_prompt_tokens_total", frozenset({("model_name", "qwen")})): 10.0}
