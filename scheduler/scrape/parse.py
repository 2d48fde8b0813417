"""Line-oriented Prometheus text parser that keeps only the series a dialect needs.

prometheus_client's parser builds every family and sample of the exposition
(~650 lines for vLLM, mostly histogram buckets nobody routes on); this one looks
at each line's name first and skips unwanted lines with two string scans. The
benchmark (benchmarks/scheduler_bench.py) measures both on the real captures,
and tests/scheduler/test_parse_property.py checks they agree on every value
both produce.
"""

from __future__ import annotations

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


# A label block after its "{", up to its own "}" (the slow path of _split_at): a quoted value may
# hold "}", and an OpenMetrics exemplar after the value (`... 10 # {trace_id="a"} 1.0`) ends the
# line with a "}" of its own, so neither the first nor the last "}" of a line is always the one.
_LABEL_BLOCK_RE = re.compile(r'\{((?:[^"}]+|"(?:[^"\\]+|\\.)*")*)\}')


def _name_end(line: str) -> int:
    """Where a sample's name ends: at its labels, or at the blank before its value (the text
    format separates tokens with spaces or tabs, and allows blanks between a name and its
    labels); -1 for no sample line."""
    brace, space = line.find("{"), line.find(" ")
    cut = brace if brace != -1 and (space == -1 or brace < space) else space
    tab = line.find("\t", 0, len(line) if cut == -1 else cut)  # only the name is searched
    return cut if tab == -1 else tab


def _split_line(line: str) -> tuple[str, str, str] | None:
    """(name, label text, rest after the labels) of one sample line."""
    cut = _name_end(line)
    return None if cut == -1 else _split_at(line, cut)


def _split_at(line: str, cut: int) -> tuple[str, str, str] | None:
    """_split_line, the name known to end at `cut`."""
    brace = cut
    if line[brace] != "{":
        brace = len(line) - len(line[cut:].lstrip(" \t"))
        if not line.startswith("{", brace):
            return line[:cut], "", line[cut:]
    end = line.find("}", brace)
    if end == -1:
        return None  # an unterminated label block
    text = line[brace + 1 : end]
    if "\\" in text or text.count('"') % 2:
        # That "}" may sit in a quoted value: find the block's end the slow, exact way.
        block = _LABEL_BLOCK_RE.match(line, brace)
        if block is None:
            return None
        text, end = block.group(1), block.end() - 1
    return line[:cut], text, line[end + 1 :]


def _parse_region(
    text: str, start: int, end: int, wanted: dict[str, str], out: dict[str, list[Sample]]
) -> None:
    """Line by line over text[start:end]; comment lines and unwanted names are skipped."""
    for line in text[start:end].splitlines():
        if not line or line[0] == "#":
            continue
        cut = _name_end(line)
        if cut == -1:
            continue
        key = wanted.get(line[:cut])
        if key is None:  # most lines: skipped before their labels are looked at
            continue
        parts = _split_at(line, cut)
        if parts is None:
            continue
        _, labels, rest = parts
        fields = rest.split()
        if not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        if value - value != 0.0:  # NaN or +-Inf: no load figure, and it would poison every rate
            continue
        out.setdefault(key, []).append((parse_labels(labels) if labels else {}, value))


_FAMILY_CACHE: dict[int, tuple[dict[str, str], dict[str, tuple[str, ...] | None]]] = {}


def _families(wanted: dict[str, str]) -> dict[str, tuple[str, ...] | None]:
    """Family names (as in `# TYPE` lines) whose samples may carry a wanted series name ->
    the wanted `_sum`/`_count` series of that histogram family, or None (read every line)."""
    hit = _FAMILY_CACHE.get(id(wanted))
    if hit is not None and hit[0] is wanted:
        return hit[1]
    fams: dict[str, tuple[str, ...] | None] = {}
    for name in wanted:
        fams[name] = None
        for suffix in ("_total", "_bucket"):
            if name.endswith(suffix):
                fams[name[: -len(suffix)]] = None
    summary: dict[str, tuple[str, ...]] = {}
    for name in wanted:
        for suffix in ("_sum", "_count"):
            if name.endswith(suffix):
                base = name[: -len(suffix)]
                summary[base] = (*summary.get(base, ()), name)
    for base, series in summary.items():
        if base not in fams:  # a family read whole (e.g. buckets wanted) stays whole
            fams[base] = series
    _FAMILY_CACHE[id(wanted)] = (wanted, fams)
    return fams


def _summary_lines(text: str, start: int, end: int, names: tuple[str, ...], wanted: dict[str, str],
                   out: dict[str, list[Sample]]) -> None:
    """Only the `_sum`/`_count` lines of a histogram block: found with str.find, the
    bucket lines in between are never split."""
    for name in names:
        needle = "\n" + name
        i = text.find(needle, start - 1, end)
        while i != -1:
            nl = text.find("\n", i + 1, end)
            line_end = end if nl == -1 else nl
            _parse_region(text, i + 1, line_end, wanted, out)
            i = text.find(needle, line_end, end)


def parse_selected(text: str, wanted: dict[str, str]) -> dict[str, list[Sample]]:
    """Samples of the wanted series names, keyed by the canonical key `wanted` maps them to.

    The text format groups each family's samples after its `# TYPE` line, so the blocks of
    unwanted families (most of vLLM's exposition: histogram buckets) are jumped over with
    str.find instead of being split into lines. A block whose last line does not belong to
    its family (an untyped family appended to it) and every stretch outside typed blocks is
    read line by line. Malformed lines, values that are not floats, and NaN or infinite
    values (a gauge an engine could not compute, e.g. a ratio over nothing) are skipped: to a
    router such a sample says nothing, and one NaN counter would turn its smoothed rate into
    NaN for good.
    """
    out: dict[str, list[Sample]] = {}
    fams = _families(wanted)
    n = len(text)
    pos = 0
    while pos < n:
        head = text.find("# TYPE ", pos)
        if head == -1 or (head > 0 and text[head - 1] != "\n"):
            if head == -1:
                _parse_region(text, pos, n, wanted, out)
                break
            # "# TYPE " inside a line (e.g. a label value): read up to there line by line.
            eol = text.find("\n", head)
            end = n if eol == -1 else eol + 1
            _parse_region(text, pos, end, wanted, out)
            pos = end
            continue
        if head > pos and not (text[pos] == "#" and text.find("\n", pos, head) == head - 1):
            _parse_region(text, pos, head, wanted, out)  # untyped samples (a lone HELP line is skipped)
        eol = text.find("\n", head)
        if eol == -1:
            break
        family = text[head + 7 : eol].split(" ", 1)[0]
        nxt = text.find("\n#", eol)
        end = n if nxt == -1 else nxt + 1
        only = fams.get(family, ())
        if only is None:
            _parse_region(text, eol + 1, end, wanted, out)
        elif end - 1 > eol + 1:
            last = text.rfind("\n", eol, end - 1) + 1
            if not _of_family(text, last, family):
                _parse_region(text, eol + 1, end, wanted, out)  # an untyped family follows
            elif only:
                _summary_lines(text, eol + 1, end, only, wanted, out)
        pos = end
    return out


_FAMILY_SUFFIXES = ("", "_bucket", "_sum", "_count", "_total", "_created", "_info", "_gsum", "_gcount")


def _of_family(text: str, line_start: int, family: str) -> bool:
    """Is the sample at `line_start` one of `family`'s? Its name must be the family's name
    with one of the text format's suffixes, not merely start with it (`a0` is not `a`'s)."""
    if not text.startswith(family, line_start):
        return False
    after = line_start + len(family)
    for suffix in _FAMILY_SUFFIXES:
        name_end = after + len(suffix)
        if text.startswith(suffix, after) and text[name_end : name_end + 1] in ("{", " "):
            return True
    return False


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
