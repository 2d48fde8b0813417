"""When each router delivers the first token, and what that does to TTFT and TPOT.

The benchmark client times a request's first token when the first chunk reaches it, and its
TPOT over the gaps between the chunks after that. A proxy that holds the first chunk until the
second one comes moves one decode step from TPOT into TTFT: its median TTFT rises by about a
step and its per-request mean TPOT falls, most for short answers, though nothing decoded
faster. Every routing JSON keeps, per request, the first gap (first chunk to second) and the
mean gap after the second chunk (`first_gaps`, `tpots_from_second`; benchmarks/routing_client.py),
and the routing tables show their summary. This program splits them by policy and by window
of start times (the t=0 wave apart from the rest):

- how many first gaps were under 2 ms, i.e. the first two chunks arrived together;
- the mean TTFT, and the mean time to the second token;
- the per-request mean TPOT as the client reports it, its P99, and the same mean measured from
  the second token, which a held first chunk cannot move.

    python -m benchmarks.routing --profile llama2-7b-a10 --workers 5 --concurrency 160 \\
      --num-prompts 1000 --policies baseline,llm_aware,peer:sglang-cache_aware \\
      --scheduler-config benchmarks/configs/llm_aware.yaml --no-plots --output /tmp/h.json
    python -m benchmarks.routing_first_tokens /tmp/h.json --windows 0,10

JSONs from before these lists need a run with `--keep-itls` (all gaps, 8 MB per 1000 requests).
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

# Two chunks closer than this arrived in one read: no engine step is this short.
TOGETHER_S = 0.002


@dataclass(frozen=True)
class FirstTokenStats:
    requests: int  # successful requests with at least two chunks, started in the window
    first_together: int  # of those, first and second chunk arrived together
    mean_ttft_ms: float
    mean_second_token_ms: float  # TTFT plus the first gap
    mean_tpot_ms: float  # per-request mean over all gaps, as the client reports TPOT
    p99_tpot_ms: float
    mean_tpot_from_second_ms: float  # per-request mean over the gaps after the second token


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def compact_lists(itls: list[list[float]]) -> tuple[list[float | None], list[float | None]]:
    """Per request: the first gap (None without one), and the mean gap after the second chunk
    (None with fewer than two gaps), in seconds rounded to 0.1 ms / 1 us."""
    first = [round(gaps[0], 4) if gaps else None for gaps in itls]
    rest = [round(statistics.fmean(gaps[1:]), 6) if len(gaps) >= 2 else None for gaps in itls]
    return first, rest


def _lists(result: dict) -> tuple[list, list, list] | None:
    """(first_gaps, tpots_from_second, tpots) of a result: stored, or derived from its gaps.
    TPOT is the client's own (over output tokens) where it saved one."""
    itls = result.get("itls")
    tpots = result.get("tpots") or [statistics.fmean(gaps) if gaps else None for gaps in itls or []]
    if result.get("first_gaps") and result.get("tpots_from_second") and tpots:
        return result["first_gaps"], result["tpots_from_second"], tpots
    if not itls:
        return None
    first, rest = compact_lists(itls)
    return first, rest, tpots


def first_token_stats(result: dict, start_s: float = 0.0,
                      end_s: float = float("inf")) -> FirstTokenStats | None:
    """Stats of the requests that started in [start_s, end_s) after the run's first request
    (None if the result has neither the compact lists nor the gaps, or no request in the window
    has two gaps: the TPOT from the second token needs one gap after it)."""
    lists, ttfts, starts = _lists(result), result.get("ttfts"), result.get("start_times")
    if lists is None or not ttfts or not starts:
        return None
    first, rest, tpots = lists
    errors = result.get("errors") or [""] * len(starts)
    t0 = min(starts)
    chosen = [i for i in range(len(starts))
              if not errors[i] and rest[i] is not None and tpots[i] is not None
              and start_s <= starts[i] - t0 < end_s]
    if not chosen:
        return None
    tpots_ms = [1000.0 * tpots[i] for i in chosen]
    return FirstTokenStats(
        requests=len(chosen),
        first_together=sum(1 for i in chosen if first[i] < TOGETHER_S),
        mean_ttft_ms=1000.0 * statistics.fmean(ttfts[i] for i in chosen),
        mean_second_token_ms=1000.0 * statistics.fmean(ttfts[i] + first[i] for i in chosen),
        mean_tpot_ms=statistics.fmean(tpots_ms),
        p99_tpot_ms=_p99(tpots_ms),
        mean_tpot_from_second_ms=1000.0 * statistics.fmean(rest[i] for i in chosen),
    )


def windows_of(spec: str) -> list[tuple[float, float]]:
    """"0,10" -> [(0, 10), (10, inf)]: each edge starts a window; the first edge should be 0."""
    try:
        edges = sorted(float(e) for e in spec.split(",") if e.strip())
    except ValueError:
        raise ValueError(f"--windows takes seconds separated by commas, such as 0,10; got {spec!r}") from None
    if not edges or any(e != e or e < 0 for e in edges):
        raise ValueError(f"--windows takes seconds of 0 or more, such as 0,10; got {spec!r}")
    return [(lo, hi) for lo, hi in zip(edges, [*edges[1:], float("inf")], strict=True)]


def table(doc: dict, windows: list[tuple[float, float]]) -> str:
    rows = ["| started (s) | policy | requests | first two together | mean TTFT (ms) "
            "| mean time to 2nd token (ms) | mean TPOT (ms) | P99 TPOT (ms) "
            "| mean TPOT from 2nd token (ms) |",
            "|---|---|---|---|---|---|---|---|---|"]
    for lo, hi in windows:
        span = f"{lo:g}-{hi:g}" if hi != float("inf") else f"{lo:g}-end"
        for policy, result in doc.get("policies", {}).items():
            s = first_token_stats(result, lo, hi)
            if s is None:
                continue
            rows.append(f"| {span} | {policy} | {s.requests} | {100.0 * s.first_together / s.requests:.0f}% "
                        f"| {s.mean_ttft_ms:.0f} | {s.mean_second_token_ms:.0f} | {s.mean_tpot_ms:.2f} "
                        f"| {s.p99_tpot_ms:.1f} | {s.mean_tpot_from_second_ms:.2f} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.routing_first_tokens", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("result", help="routing JSON (from before the compact lists: written with --keep-itls)")
    p.add_argument("--windows", default="0",
                   help="start-time edges in seconds, e.g. 0,10 (default: the whole run)")
    args = p.parse_args(argv)
    try:
        windows = windows_of(args.windows)
    except ValueError as exc:
        p.error(str(exc))
    doc = json.loads(Path(args.result).read_text())
    if not any(_lists(r) for r in doc.get("policies", {}).values()):
        p.error(f"{args.result} has no per-request gaps: it predates them; run benchmarks.routing again "
                "(or with --keep-itls)")
    print(table(doc, windows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
