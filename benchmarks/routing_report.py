"""Tables for the routing experiment: each policy against the no-router baseline.

Rows, units and order follow the reference product's table (issue 6); values come from the
benchmark client's result object (vLLM --save-result keys).
"""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.routing_closed_loop import token_weighted_tpot_ms
from benchmarks.routing_first_tokens import first_token_stats


@dataclass(frozen=True)
class Row:
    label: str
    unit: str
    key: str  # result key, or a derived name handled in row_value
    lower_is_better: bool


ROWS: tuple[Row, ...] = (
    Row("benchmark duration", "s", "duration", True),
    Row("input token throughput", "tok/s", "input_throughput", False),
    Row("output token throughput", "tok/s", "output_throughput", False),
    Row("output throughput, all clients busy", "tok/s", "busy_output_throughput", False),
    Row("mean TTFT", "ms", "mean_ttft_ms", True),
    Row("median TTFT", "ms", "median_ttft_ms", True),
    Row("P99 TTFT", "ms", "p99_ttft_ms", True),
    Row("mean TPOT", "ms", "mean_tpot_ms", True),
    # Not in the reference's table: mean TPOT is a mean over requests, so a few short answers
    # that stalled move it; this weighs every token once and shows decode speed itself
    # (benchmarks/routing_closed_loop.py).
    Row("decode time per output token (token-weighted)", "ms", "token_tpot_ms", True),
    Row("P99 TPOT", "ms", "p99_tpot_ms", True),
    # Not in the reference's table either. A proxy that holds the first chunk until the second
    # comes moves a decode step from TPOT into TTFT (sglang-router does, under load): the mean
    # TPOT measured from the second token cannot be moved that way, and the share of requests
    # whose first two chunks arrived together says whether it happened
    # (benchmarks/routing_first_tokens.py). Over requests with three chunks or more.
    Row("mean TPOT from the 2nd token", "ms", "tpot_from_second_ms", True),
    Row("first two tokens delivered together", "%", "first_together_pct", True),
)

# The reference product's changes against round robin (issue 6). Homogeneous goal: at least these.
REFERENCE_CHANGE_PCT = {
    "output_throughput": 7.5,
    "mean_ttft_ms": -84.0,
    "p99_ttft_ms": -81.0,
    "mean_tpot_ms": -42.0,
    "p99_tpot_ms": -69.0,
}


def busy_output_throughput(result: dict) -> float | None:
    """Output tokens per second from the first request sent to the last one sent.

    In that window every client has a request in flight, as in the steady state of a long
    run. After it the run drains: a few long answers finish on whichever workers they
    landed, and in a short run that tail (40 % of a 1000-request run here, more in a slow
    cluster) sets the duration, and with it the whole-run throughput, more than routing
    does. Each request's tokens are taken as evenly spread between its first token and
    its end (per-chunk times are not kept in the JSON).
    """
    starts = result.get("start_times") or []
    e2els, ttfts, outs = result.get("e2els"), result.get("ttfts"), result.get("output_lens")
    if not starts or not e2els or not ttfts or not outs:
        return None
    t0 = min(starts)
    window = max(starts) - t0
    if window <= 0:
        return None
    errors = result.get("errors") or [""] * len(starts)
    tokens = 0.0
    for start, ttft, e2el, out, err in zip(starts, ttfts, e2els, outs, errors, strict=False):
        if err or not out:
            continue
        first, end = start - t0 + ttft, start - t0 + e2el
        if end <= window:
            tokens += out
        elif first < window:
            tokens += out * (window - first) / max(end - first, 1e-9)
    return tokens / window


def row_value(result: dict, key: str) -> float | None:
    if key == "busy_output_throughput":
        return busy_output_throughput(result)
    if key == "token_tpot_ms":
        return token_weighted_tpot_ms(result)
    if key in ("tpot_from_second_ms", "first_together_pct"):
        stats = first_token_stats(result)
        if stats is None:
            return None
        if key == "tpot_from_second_ms":
            return stats.mean_tpot_from_second_ms
        return 100.0 * stats.first_together / stats.requests
    if key == "input_throughput":  # not a vLLM key: total prompt tokens over the run's duration
        if "input_throughput" in result:
            return float(result["input_throughput"])
        duration = result.get("duration")
        tokens = result.get("total_input_tokens")
        if not duration or tokens is None:
            return None
        return tokens / duration
    value = result.get(key)
    return None if value is None else float(value)


def change_pct(base: float | None, value: float | None) -> float | None:
    if base is None or value is None or base == 0:
        return None
    return (value - base) / base * 100.0


def _fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "n/a"
    return f"{value:.1f} {unit}" if unit == "s" else f"{value:.2f} {unit}"


def _fmt_change(pct: float | None, row: Row) -> str:
    if pct is None:
        return "n/a"
    better = (pct < 0) if row.lower_is_better else (pct > 0)
    mark = "better" if better and abs(pct) >= 0.05 else ("worse" if abs(pct) >= 0.05 else "same")
    return f"{pct:+.1f}% ({mark})"


def policy_table(name: str, baseline: dict, result: dict, ref_name: str = "baseline") -> str:
    """The issue's table (markdown) for one policy against the baseline (or another reference)."""
    ref_label = "without router (baseline)" if ref_name == "baseline" else ref_name
    lines = [
        f"| metric | {ref_label} | with router ({name}) | change |",
        "|---|---|---|---|",
    ]
    for row in ROWS:
        b, v = row_value(baseline, row.key), row_value(result, row.key)
        lines.append(f"| {row.label} | {_fmt(b, row.unit)} | {_fmt(v, row.unit)} | "
                     f"{_fmt_change(change_pct(b, v), row)} |")
    lines.append(f"| failed requests | {baseline.get('failed', 'n/a')} | {result.get('failed', 'n/a')} | |")
    return "\n".join(lines)


def summary_table(results: dict[str, dict], baseline_name: str = "baseline") -> str:
    """Every policy side by side (markdown), change vs baseline in parentheses."""
    names = list(results)
    base = results.get(baseline_name)
    lines = ["| metric | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for row in ROWS:
        cells = []
        for n in names:
            v = row_value(results[n], row.key)
            cell = "n/a" if v is None else f"{v:.1f}"
            pct = change_pct(row_value(base, row.key), v) if base is not None and n != baseline_name else None
            cells.append(cell if pct is None else f"{cell} ({pct:+.0f}%)")
        lines.append(f"| {row.label} ({row.unit}) | " + " | ".join(cells) + " |")
    failed = " | ".join(str(results[n].get("failed", "n/a")) for n in names)
    lines.append(f"| failed requests | {failed} |")
    return "\n".join(lines)


def goal_check(results: dict[str, dict], candidate: str = "llm_aware", baseline_name: str = "baseline",
               reference: bool = True) -> list[str]:
    """Plain-language verdicts: reference changes met (homogeneous), best TTFT, throughput kept."""
    if candidate not in results or baseline_name not in results:
        return [f"goal check skipped: needs both {candidate!r} and {baseline_name!r}"]
    base, cand = results[baseline_name], results[candidate]
    verdicts = []
    if reference:
        for key, goal in REFERENCE_CHANGE_PCT.items():
            pct = change_pct(row_value(base, key), row_value(cand, key))
            met = pct is not None and (pct >= goal if goal > 0 else pct <= goal)
            shown = "n/a" if pct is None else f"{pct:+.1f}%"
            verdicts.append(f"{'MET ' if met else 'MISS'} {key}: {shown} (reference {goal:+.1f}%)")
    for key in ("mean_ttft_ms", "p99_ttft_ms"):
        values = {n: row_value(r, key) for n, r in results.items() if row_value(r, key) is not None}
        best = min(values, key=values.__getitem__) if values else None
        ok = best == candidate
        best_ms, cand_ms = values.get(best, float("nan")), values.get(candidate, float("nan"))
        verdicts.append(f"{'MET ' if ok else 'MISS'} best {key}: {best} ({best_ms:.1f} ms; "
                        f"{candidate} {cand_ms:.1f} ms)")
    for key, what in (("output_throughput", "throughput"), ("busy_output_throughput", "busy throughput")):
        pct = change_pct(row_value(base, key), row_value(cand, key))
        if pct is None and key == "busy_output_throughput":
            continue
        ok = pct is not None and pct >= -1.0  # within run-to-run noise of 1%
        verdicts.append(f"{'MET ' if ok else 'MISS'} {what} kept vs baseline: "
                        f"{'n/a' if pct is None else f'{pct:+.1f}%'} (allowing -1% noise)")
    return verdicts


def steady_state(result: dict, skip: int) -> dict[str, float] | None:
    """TTFT/TPOT statistics (ms) over the successful requests after the first `skip` dispatched.

    With --max-concurrency C every client sends its first request at t=0, so the first C requests
    all prefill at once: no router can avoid that queue, and in a short run it dominates the tail.
    This view (not part of vLLM's result) shows what routing does once the run is under way.
    """
    import numpy as np

    starts = result.get("start_times") or []
    if not starts:
        return None
    order = sorted(range(len(starts)), key=starts.__getitem__)[skip:]
    errors = result.get("errors") or [""] * len(starts)
    ttfts = [result["ttfts"][i] * 1000 for i in order if not errors[i]]
    tpots = [result["tpots"][i] * 1000 for i in order
             if not errors[i] and result.get("tpots") and result["tpots"][i] is not None]
    if not ttfts:
        return None
    out = {"requests": len(ttfts), "mean_ttft_ms": float(np.mean(ttfts)),
           "median_ttft_ms": float(np.median(ttfts)), "p99_ttft_ms": float(np.percentile(ttfts, 99))}
    if tpots:
        out.update(mean_tpot_ms=float(np.mean(tpots)), p99_tpot_ms=float(np.percentile(tpots, 99)))
    return out


def steady_state_table(results: dict[str, dict], skip: int, ref_name: str = "baseline") -> str:
    stats = {n: steady_state(r, skip) for n, r in results.items()}
    names = [n for n, s in stats.items() if s is not None]
    if not names:
        return ""
    keys = (("mean TTFT", "mean_ttft_ms"), ("median TTFT", "median_ttft_ms"), ("P99 TTFT", "p99_ttft_ms"),
            ("mean TPOT", "mean_tpot_ms"), ("P99 TPOT", "p99_tpot_ms"))
    lines = ["| after the first wave (ms) | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    base = stats.get(ref_name)
    for label, key in keys:
        cells = []
        for n in names:
            v = stats[n].get(key)
            pct = change_pct(base.get(key), v) if base is not None and n != ref_name else None
            cells.append("n/a" if v is None else f"{v:.1f}" + ("" if pct is None else f" ({pct:+.0f}%)"))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append("| requests | " + " | ".join(str(stats[n]["requests"]) for n in names) + " |")
    return "\n".join(lines)


CPU_PARTS = ("workers", "scheduler", "gateway", "client")


def cpu_table(cpu: dict[str, dict], results: dict[str, dict]) -> str:
    """Markdown: the cores each part used while the client ran (CPU seconds over the client's
    wall seconds), and the router's CPU per request. On a shared machine a router's own CPU
    is taken from the engines beside it; `baseline` has no router, so its client does the
    routing. "-" where a part was absent (no scheduler in front of a peer router)."""
    head = " | ".join(f"{part} (cores)" for part in CPU_PARTS)
    lines = [f"| policy | client run (s) | {head} | router CPU per request (ms) |",
             "|---" * (3 + len(CPU_PARTS)) + "|"]
    for name, used in cpu.items():
        wall = used.get("wall_s")
        if not wall:
            continue
        cores = ["-" if part not in used else f"{used[part] / wall:.2f}" for part in CPU_PARTS]
        router_s = sum(used.get(part, 0.0) for part in ("scheduler", "gateway"))
        done = results.get(name, {}).get("completed")
        per_request = f"{1000.0 * router_s / done:.2f}" if done and router_s else "-"
        lines.append(f"| {name} | {wall:.1f} | " + " | ".join(cores) + f" | {per_request} |")
    return "\n".join(lines) if len(lines) > 2 else ""
