"""The chaos soak's report: counts per class per fault, TTFT around each fault, the gateways'
own account of retries (their access logs), and the log lines of every lost request."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from benchmarks.chaos_checks import FALLBACK_POLICY, FaultCheck
from benchmarks.chaos_client import Outcome
from benchmarks.chaos_outcomes import CLASSES, LIMITS, LOST, FaultView, Settings, classify, failure_text

STEADY = "no fault"
SHORT = {"ok": "ok", "stream_cut_worker_killed": "cut:kill", "cut_at_worker_drain_deadline": "cut:w-drain",
         "cut_at_gateway_drain_deadline": "cut:gw-drain", "cut_gateway_killed": "cut:gw-kill",
         "stream_idle_on_hung_worker": "idle:hang",
         "refused_queue_full": "429:full", LOST: "LOST"}
SHOWN = 12  # the items of a long list of evidence printed
def _ttft(outcomes: list[Outcome]) -> dict[str, float | int | None]:
    ms = np.array([o.ttft_s * 1000 for o in outcomes if o.ok and o.ttft_s is not None])
    if not ms.size:
        return {"n": 0, "mean_ms": None, "p50_ms": None, "p99_ms": None, "max_ms": None}
    return {"n": int(ms.size), "mean_ms": float(ms.mean()), "p50_ms": float(np.percentile(ms, 50)),
            "p99_ms": float(np.percentile(ms, 99)), "max_ms": float(ms.max())}


def summarize(outcomes: list[Outcome], faults: list[FaultView], s: Settings,
              retries: dict[str, int], span_s: float) -> dict[str, Any]:
    """Counts per class per fault, TTFT before/during/after each fault and over the run."""
    rows: dict[str, Counter] = {STEADY: Counter(), **{f.name: Counter() for f in faults}}
    classes: list[dict[str, Any]] = []
    for o in outcomes:
        cls, fault = classify(o, faults, s)
        row = rows[fault.name if fault is not None else STEADY]
        row[cls] += 1
        row["requests"] += 1
        row["retried"] += retries.get(o.request_id, 0) > 0
        row["failed over"] += bool(o.no_answer)
        row["round robin"] += o.policy == FALLBACK_POLICY
        classes.append({"id": o.request_id, "class": cls, "fault": fault.name if fault else None,
                        **({"failure": failure_text(o)} if cls != "ok" else {})})
    around = {}
    for f in faults:
        start, end = f.window(s.settle_s)
        around[f.name] = {
            "before": _ttft([o for o in outcomes if start - span_s <= o.start_s < start]),
            "during": _ttft([o for o in outcomes if start <= o.start_s <= end]),
            "after": _ttft([o for o in outcomes if end < o.start_s <= end + span_s]),
            # A stream running through the fault may stall (a stopped worker) without any
            # first token being late: its longest wait between two events shows it.
            "longest_stream_stall_ms": max((o.max_gap_s * 1000 for o in outcomes if o.stream
                                            and o.start_s <= end and (o.end_s or 0) >= start), default=0.0)}
    windows = [f.window(s.settle_s) for f in faults]
    first = min((w[0] for w in windows), default=float("inf"))

    def in_window(o: Outcome) -> bool:
        return any(a <= o.start_s <= b for a, b in windows)

    phases = {"before the first fault": _ttft([o for o in outcomes if o.start_s < first]),
              "during a fault": _ttft([o for o in outcomes if in_window(o)]),
              "after a fault, before the next": _ttft(
                  [o for o in outcomes if o.start_s >= first and not in_window(o)])}
    totals = Counter(c["class"] for c in classes)
    return {"rows": {name: dict(c) for name, c in rows.items()},
            "totals": {k: totals.get(k, 0) for k in CLASSES},
            "ttft_around_faults": around, "ttft_phases": phases, "classes": classes,
            "fault_windows": {f.name: [round(x, 3) for x in f.window(s.settle_s)] for f in faults}}


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def table(summary: dict[str, Any], faults: list[FaultView]) -> str:
    cols = ["requests", *CLASSES, "retried", "failed over", "round robin"]
    heads = [SHORT.get(c, c) for c in cols]
    lines = [f"{'fault':<16} {'at s':>6} {'back s':>7}" + "".join(f" {h:>11}" for h in heads)]
    at = {f.name: (f.signal_s, f.recovered_s) for f in faults}
    for name, row in summary["rows"].items():
        sig, back = at.get(name, (None, None))
        lines.append(f"{name:<16} {_ms(sig) if sig is None else f'{sig:.1f}':>6} "
                     f"{'-' if back is None else f'{back:.1f}':>7}"
                     + "".join(f" {row.get(c, 0):>11}" for c in cols))
    lines.append("")
    lines.append(f"{'TTFT of streams begun':<22}" + "".join(
        f" {p + ' p50/max ms (n)':>22}" for p in ("before", "during", "after")) + "  longest stall ms")
    for name, parts in summary["ttft_around_faults"].items():
        cells = [f"{_ms(t['p50_ms'])} / {_ms(t['max_ms'])} ({t['n']})"
                 for t in (parts[p] for p in ("before", "during", "after"))]
        lines.append(f"{name:<22}" + "".join(f" {c:>22}" for c in cells)
                     + f"  {_ms(parts['longest_stream_stall_ms']):>16}")
    lines.append("")
    lines.append(f"{'phase':<32} {'streams':>8} {'mean':>7} {'p50':>7} {'p99':>7} {'max':>7}  (TTFT ms)")
    for name, t in summary["ttft_phases"].items():
        lines.append(f"{name:<32} {t['n']:>8} {_ms(t['mean_ms']):>7} {_ms(t['p50_ms']):>7} "
                     f"{_ms(t['p99_ms']):>7} {_ms(t['max_ms']):>7}")
    lines.append("")
    lines.append("classes: " + "; ".join(f"{SHORT[k]} = {v}" for k, v in LIMITS.items())
                 + f"; {SHORT[LOST]} = failed where the design says the product survives")
    return "\n".join(lines)


def checks_text(checks: list[FaultCheck]) -> str:
    lines = []
    for c in checks:
        failed = [k for k, ok in c.checks.items() if not ok]
        lines.append(f"{c.fault:<16} {'verified' if c.passed else 'NOT VERIFIED: ' + ', '.join(failed)}")
        for k, v in c.evidence.items():
            if isinstance(v, list) and len(v) > SHOWN:  # a time series: every few, all in the JSON
                step = -(-len(v) // SHOWN)
                lines.append(f"    {k} (every {step}th of {len(v)}):")
                lines.extend(f"      {x}" for x in v[::step])
            elif v is not None:
                lines.append(f"    {k}: {v}")
    return "\n".join(lines)
