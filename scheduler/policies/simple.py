"""The classic policies: they look at counts only and never hold a request."""

from __future__ import annotations

import random as _random
from typing import ClassVar

from scheduler.policies.base import Pick, Policy, Request, load_of
from scheduler.registry import WorkerState

_EMPTY: dict = {}


class RoundRobin(Policy):
    name: ClassVar[str] = "round_robin"

    def __init__(self, *a, **k) -> None:
        super().__init__(*a, **k)
        self._next = 0

    def choose(self, req: Request, cands: list[WorkerState], now: float) -> Pick | None:
        i = self._next % len(cands)
        self._next = i + 1
        w = cands[i]
        return Pick(w, w.score, _EMPTY)


class Random(Policy):
    name: ClassVar[str] = "random"

    def choose(self, req: Request, cands: list[WorkerState], now: float) -> Pick | None:
        w = _random.choice(cands)
        return Pick(w, w.score, _EMPTY)


class LeastRequest(Policy):
    """Fewest open leases (requests this scheduler sent and that have not finished)."""

    name: ClassVar[str] = "least_request"

    def __init__(self, *a, **k) -> None:
        super().__init__(*a, **k)
        self._rot = 0

    def refresh(self, w: WorkerState) -> None:
        w.score = float(len(w.leases))

    def choose(self, req: Request, cands: list[WorkerState], now: float) -> Pick | None:
        # Rotate the starting point so ties do not always go to the first worker.
        n = len(cands)
        self._rot = (self._rot + 1) % n
        best = None
        best_s = float("inf")
        for j in range(n):
            w = cands[(self._rot + j) % n]
            if w.score < best_s:
                best, best_s = w, w.score
        return Pick(best, best_s, _EMPTY)


class PowerOfTwo(Policy):
    """Two random candidates, the less loaded one wins (running + waiting + unseen leases)."""

    name: ClassVar[str] = "power_of_two"

    def choose(self, req: Request, cands: list[WorkerState], now: float) -> Pick | None:
        if len(cands) == 1:
            w = cands[0]
        else:
            a, b = _random.sample(cands, 2)
            w = a if a.score <= b.score else b
        return Pick(w, w.score, _EMPTY)


class LeastKv(Policy):
    """Lowest KV usage, counting the blocks that unseen leases will take."""

    name: ClassVar[str] = "least_kv"

    def refresh(self, w: WorkerState) -> None:
        s = w.snapshot
        kv = (s.kv_usage or 0.0) if s else 0.0
        if s and s.num_blocks and s.block_size:
            kv += w.unseen_tokens / (s.num_blocks * s.block_size)
        # Requests break ties (engines without a KV gauge).
        w.score = kv + 1e-3 * load_of(w)

    def choose(self, req: Request, cands: list[WorkerState], now: float) -> Pick | None:
        best = min(cands, key=_score)
        return Pick(best, best.score, _EMPTY)


def _score(w: WorkerState) -> float:
    return w.score
