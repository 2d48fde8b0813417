"""Little's law on a closed-loop run: what mean TTFT, TPOT and throughput say about each other.

With a fixed number of clients that each send their next request when the last one ends,
the requests in the system L, the completion rate X and the mean end-to-end latency E obey
L = X * E. Each request's latency is its TTFT plus its decode time, so

    mean decode time per output token (token-weighted) = (E - mean TTFT) / (mean output - 1)

which, unlike the per-request mean TPOT that vLLM's benchmark reports, weighs every token
once: a request with 5 output tokens that stalled for a second counts 4 tokens here, but
weighs as much as a 1,000-token answer in the per-request mean.

Two uses:
- A run's own numbers (`closed_loop`): L, X, E, the per-request mean TPOT beside the
  token-weighted one; and the throughput a policy would need for a target mean TTFT at its
  measured decode time per token (`throughput_for_ttft`).
- A published table that gives only duration, request count, output throughput, mean TTFT
  and mean TPOT (`implied_by_table`): with L = the client concurrency, the token-weighted
  decode time it implies. The reference product's table (issue 6) implies ~58 ms per token
  without its router and ~60 ms with it, while its per-request mean TPOT falls from 120 to
  69 ms: decoding did not get faster; a minority of requests stalled mid-answer without it.

    python -m benchmarks.routing_closed_loop benchmarks/results/routing-homogeneous-10000.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ClosedLoop:
    in_system: float  # L = X * E, requests
    req_per_s: float  # X
    mean_e2e_s: float  # E
    mean_ttft_ms: float
    mean_tpot_ms: float  # per-request mean, as the benchmark client reports it
    token_tpot_ms: float  # token-weighted: (E - mean TTFT) / (mean output - 1)
    mean_output: float


def _successful(result: dict) -> list[int]:
    errors = result.get("errors") or [""] * len(result["e2els"])
    return [i for i, err in enumerate(errors) if not err]


def token_weighted_tpot_ms(result: dict) -> float | None:
    """Decode time per output token after the first, over every successful request's tokens
    (None without the per-request lists, or without any such token)."""
    if not result.get("e2els") or not result.get("ttfts") or not result.get("output_lens"):
        return None
    ok = _successful(result)
    tokens = sum(max(result["output_lens"][i] - 1, 0) for i in ok)
    if not tokens:
        return None
    return 1000.0 * sum(result["e2els"][i] - result["ttfts"][i] for i in ok) / tokens


def closed_loop(result: dict) -> ClosedLoop:
    """Little's-law quantities of one benchmark-client result (its per-request lists)."""
    ok = _successful(result)
    x = len(ok) / result["duration"]
    mean_e2e = statistics.fmean(result["e2els"][i] for i in ok)
    token_tpot = token_weighted_tpot_ms(result)
    return ClosedLoop(
        in_system=x * mean_e2e,
        req_per_s=x,
        mean_e2e_s=mean_e2e,
        mean_ttft_ms=1000.0 * statistics.fmean(result["ttfts"][i] for i in ok),
        mean_tpot_ms=float(result["mean_tpot_ms"]),
        token_tpot_ms=float("nan") if token_tpot is None else token_tpot,
        mean_output=statistics.fmean(result["output_lens"][i] for i in ok),
    )


def throughput_for_ttft(loop: ClosedLoop, target_ttft_ms: float) -> float:
    """Requests per second at which the same clients (L) and the same decode time per token
    would give a mean TTFT of `target_ttft_ms`: X = L / (TTFT + (mean output - 1) * TPOT)."""
    e2e = target_ttft_ms / 1000.0 + (loop.mean_output - 1.0) * loop.token_tpot_ms / 1000.0
    return loop.in_system / e2e


@dataclass(frozen=True)
class TableRow:
    """What a published benchmark table gives for one run."""

    duration_s: float
    num_requests: int
    output_tok_per_s: float
    mean_ttft_ms: float
    mean_tpot_ms: float


def implied_by_table(row: TableRow, concurrency: int) -> ClosedLoop:
    """The closed-loop quantities a table row implies if `concurrency` requests were always
    in the system (an upper bound on L: client gaps and the final drain lower it)."""
    x = row.num_requests / row.duration_s
    mean_output = row.output_tok_per_s * row.duration_s / row.num_requests
    e2e = concurrency / x
    return ClosedLoop(
        in_system=float(concurrency),
        req_per_s=x,
        mean_e2e_s=e2e,
        mean_ttft_ms=row.mean_ttft_ms,
        mean_tpot_ms=row.mean_tpot_ms,
        token_tpot_ms=1000.0 * (e2e - row.mean_ttft_ms / 1000.0) / (mean_output - 1.0),
        mean_output=mean_output,
    )


# The reference product's table (issue 6): 10,000 ShareGPT requests, 160 clients, 5 x A10.
REFERENCE = {
    "reference: without router": TableRow(1138.4, 10000, 2466.79, 1981.86, 120.33),
    "reference: with router": TableRow(1060.9, 10000, 2651.42, 304.00, 69.41),
}


def table(loops: dict[str, ClosedLoop]) -> str:
    lines = ["| run | requests in system (L) | req/s (X) | mean e2e (s) | mean TTFT (ms) "
             "| mean output (tok) | per-request mean TPOT (ms) | token-weighted TPOT (ms) |",
             "|---|---|---|---|---|---|---|---|"]
    for name, c in loops.items():
        lines.append(f"| {name} | {c.in_system:.0f} | {c.req_per_s:.2f} | {c.mean_e2e_s:.2f} "
                     f"| {c.mean_ttft_ms:.0f} | {c.mean_output:.0f} | {c.mean_tpot_ms:.1f} "
                     f"| {c.token_tpot_ms:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", type=Path, nargs="?", help="a benchmarks.routing JSON")
    ap.add_argument("--baseline", default="baseline")
    ap.add_argument("--target-ttft-change", type=float, default=-84.0,
                    help="percent change of mean TTFT against the baseline to price in throughput")
    args = ap.parse_args(argv)
    concurrency = 160
    loops: dict[str, ClosedLoop] = {}
    if args.results:
        doc = json.loads(args.results.read_text())
        concurrency = int(doc["scenario"]["concurrency"])
        loops = {name: closed_loop(r) for name, r in doc["policies"].items()}
    loops.update({name: implied_by_table(row, concurrency) for name, row in REFERENCE.items()})
    print(table(loops))
    if args.baseline in loops:
        base = loops[args.baseline]
        target = base.mean_ttft_ms * (1.0 + args.target_ttft_change / 100.0)
        print(f"\nmean TTFT {args.target_ttft_change:+.0f}% against {args.baseline} "
              f"({target:.0f} ms) at the same clients needs, at each run's own decode time per token:")
        for name, c in loops.items():
            if name.startswith("reference"):
                continue
            need = throughput_for_ttft(c, target)
            print(f"  {name}: {need:.2f} req/s ({100.0 * (need / base.req_per_s - 1.0):+.1f}% "
                  f"against {args.baseline}; measured {100.0 * (c.req_per_s / base.req_per_s - 1.0):+.1f}%)")


if __name__ == "__main__":
    main()
