"""Where a multi-turn run's mean TTFT comes from: each policy's TTFT by turn of conversation.

A conversation's later turns carry its whole history (hundreds to ~1,500 prompt tokens), so
routers that differ little in the mean can differ a lot per turn: one favours first turns,
another the long histories whose prefix its cache holds. This prints, per policy, the mean
TTFT of each turn index (the last group holds that turn and every later one), how many
requests each group has, and each group's part in the difference of the overall mean against
`--against` (ms of the overall mean: the group's mean difference times its share of requests).

    python -m benchmarks.routing_by_turn benchmarks/results/routing-multiturn.json \\
        --against peer:sglang-cache_aware
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def ttft_by_turn(result: dict, last_group: int = 3) -> dict[int, list[float]]:
    """Successful requests' TTFTs (ms) by turn index, turns from `last_group` on together. A
    request whose TTFT is missing (failed) is left out."""
    groups: dict[int, list[float]] = {}
    for ttft, turn in zip(result["ttfts"], result["turn_indices"], strict=True):
        if ttft:
            groups.setdefault(min(turn, last_group), []).append(ttft * 1000.0)
    return dict(sorted(groups.items()))


def contributions(mine: dict[int, list[float]], other: dict[int, list[float]]) -> dict[int, float]:
    """Each group's part (ms) in the difference of the overall means, mine less other's: the
    group's mean difference weighted by its share of my requests."""
    total = sum(len(v) for v in mine.values())
    return {turn: (statistics.fmean(v) - statistics.fmean(other[turn])) * len(v) / total
            for turn, v in mine.items() if turn in other}


def report(doc: dict, against: str | None, last_group: int = 3) -> str:
    policies = doc["policies"]
    groups = {name: ttft_by_turn(r, last_group) for name, r in policies.items() if r.get("turn_indices")}
    turns = sorted({t for g in groups.values() for t in g})
    label = {t: f"turn {t}" + ("+" if t == last_group else "") for t in turns}
    lines = [f"{'policy':<28} {'mean':>8}" + "".join(f" {label[t]:>14}" for t in turns)]
    for name, g in groups.items():
        every = [x for v in g.values() for x in v]
        row = f"{name:<28} {statistics.fmean(every):>8.0f}"
        row += "".join(f" {statistics.fmean(g[t]):>7.0f} (n{len(g[t]):>3})" if t in g else f" {'-':>14}"
                       for t in turns)
        lines.append(row)
    if against in groups:
        lines.append(f"\npart of each turn group in the mean's difference against {against} (ms)")
        for name, g in groups.items():
            if name == against:
                continue
            parts = contributions(g, groups[against])
            lines.append(f"{name:<28} {sum(parts.values()):>+8.0f}"
                         + "".join(f" {parts[t]:>+14.0f}" if t in parts else f" {'-':>14}" for t in turns))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("result", help="a routing JSON of the multi-turn scenario (benchmarks.routing --output)")
    p.add_argument("--against", help="the policy the differences are taken against")
    p.add_argument("--last-group", type=int, default=3, help="this turn and every later one together")
    args = p.parse_args(argv)
    print(report(json.loads(Path(args.result).read_text()), args.against, args.last_group))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
