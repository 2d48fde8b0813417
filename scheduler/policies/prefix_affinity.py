"""prefix_affinity: send a prompt where its prefix was sent before (its KV is likely
cached there), unless that worker is too loaded compared with the least loaded one.

Guard (the idea of SGLang's cache-aware balance thresholds): the affine worker is
used only while load <= balance_rel * min_load + balance_abs; otherwise the least
loaded worker wins. Load = running + waiting + unseen leases.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from scheduler.policies.base import Pick, Policy, Request, load_of
from scheduler.registry import WorkerState


@dataclass
class PrefixAffinityParams:
    balance_abs: float = 4.0
    balance_rel: float = 1.5
    min_match_chunks: int = 1


class PrefixAffinity(Policy):
    name: ClassVar[str] = "prefix_affinity"
    Params: ClassVar[type] = PrefixAffinityParams

    def refresh(self, w: WorkerState) -> None:
        w.score = load_of(w)

    def choose(self, req: Request, cands: list[WorkerState], now: float) -> Pick | None:
        p: PrefixAffinityParams = self.p
        least = min(cands, key=_score)
        hashes = req.prefix_hashes
        if not hashes:
            return Pick(least, least.score, {"prefix_match": 0})
        matches = self.env.prefix_index.match(self.prefix_keys(req))
        limit = p.balance_rel * least.score + p.balance_abs
        best, best_m = None, 0
        for w in cands:
            m = matches.get(w.worker_id, 0)
            if m >= p.min_match_chunks and w.score <= limit and (
                m > best_m or (m == best_m and best is not None and w.score < best.score)
            ):
                best, best_m = w, m
        if best is None:
            return Pick(least, least.score, {"prefix_match": matches.get(least.worker_id, 0)})
        return Pick(best, best.score, {"prefix_match": best_m})

    def on_issued(self, req: Request, w: WorkerState, now: float) -> None:
        if req.prefix_hashes:
            self.env.prefix_index.record(self.prefix_keys(req), w.worker_id, now)


def _score(w: WorkerState) -> float:
    return w.score
