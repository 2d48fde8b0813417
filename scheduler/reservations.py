"""Follow-up reservations: a finished request's room, held briefly for its next turn.

In a chat, a conversation's next request arrives milliseconds after the previous one
ends, carrying the previous prompt and answer as its prefix, which the worker that
served it still holds in its prefix cache. When every worker is saturated, the room that
request just freed would go at once to whichever request waits longest in the gateway,
and the follow-up, arriving a few ms later, would queue behind the others and, placed
later elsewhere, prefill its whole history again.

So when a lease with a prompt fingerprint ends, the KV it held stays reserved on its
worker for `hold_s`: other requests do not see that room (the policy subtracts
`reserved_tokens` from the worker's free KV) until a request whose prefix carries that
fingerprint claims it, or the hold expires and the room is offered to everyone.

Holding costs the freed room for `hold_s` when no follow-up comes (single-turn traffic),
so it adapts: a running claim rate is kept, and below `min_claim_rate` only every
`probe_every`-th release is held (enough to notice when follow-ups start again).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from scheduler.registry import WorkerState


class Reservation:
    __slots__ = ("key", "timer", "tokens", "worker")

    def __init__(self, key: int, worker: WorkerState, tokens: float) -> None:
        self.key = key  # the released request's last prefix fingerprint
        self.worker = worker
        self.tokens = tokens
        self.timer: asyncio.TimerHandle | None = None


class ReservationTable:
    """Open reservations by fingerprint, and the claim rate that decides whether to hold."""

    def __init__(self, hold_s: float, on_expired: Callable[[WorkerState], None], *,
                 min_claim_rate: float = 0.2, probe_every: int = 8, rate_alpha: float = 0.05) -> None:
        self.hold_s = hold_s
        self.on_expired = on_expired  # the worker's room is back: refresh it, wake waiters
        self.min_claim_rate = min_claim_rate
        self.probe_every = probe_every
        self.rate_alpha = rate_alpha
        self.by_key: dict[int, Reservation] = {}
        # Start neutral-high so a chat workload holds from its first releases.
        self.claim_rate = 0.5
        self._skipped = 0
        self.claimed = 0
        self.expired = 0

    @property
    def enabled(self) -> bool:
        return self.hold_s > 0

    def should_hold(self) -> bool:
        if self.claim_rate >= self.min_claim_rate:
            return True
        self._skipped += 1
        if self._skipped >= self.probe_every:
            self._skipped = 0
            return True
        return False

    def hold(self, key: int, worker: WorkerState, tokens: float) -> Reservation | None:
        """Reserve `tokens` of `worker` for the request whose prefix carries `key`."""
        if not self.enabled or tokens <= 0 or not self.should_hold():
            return None
        old = self.by_key.pop(key, None)
        if old is not None:  # the same prompt ended twice: keep one hold, the newest
            self._drop(old)
            if old.worker is not worker:
                # Its room is everyone's again, as when a hold expires: its worker's view
                # (free KV, saturation) still hid it, and the calls held for room were not
                # woken, until that worker's next scrape.
                self.on_expired(old.worker)
        res = Reservation(key, worker, tokens)
        worker.reserved_tokens += tokens
        res.timer = asyncio.get_running_loop().call_later(self.hold_s, self._expire, res)
        self.by_key[key] = res
        return res

    def claim(self, hashes: Sequence[int],
              worker: WorkerState | None = None) -> tuple[Reservation, int] | None:
        """The reservation made for a prefix of this prompt (longest first; with `worker`, one
        on that worker only), removed, and how many of the prompt's chunks that prefix covers."""
        if not self.by_key:
            return None
        for i in range(len(hashes) - 1, -1, -1):
            res = self.by_key.get(hashes[i])
            if res is not None and (worker is None or res.worker is worker):
                del self.by_key[hashes[i]]
                self._drop(res)
                self.claimed += 1
                self._outcome(1.0)
                return res, i + 1
        return None

    def forget_worker(self, worker: WorkerState) -> None:
        for key in [k for k, r in self.by_key.items() if r.worker is worker]:
            self._drop(self.by_key.pop(key))

    def _expire(self, res: Reservation) -> None:
        if self.by_key.get(res.key) is not res:
            return
        del self.by_key[res.key]
        self._drop(res)
        self.expired += 1
        self._outcome(0.0)
        self.on_expired(res.worker)

    def _drop(self, res: Reservation) -> None:
        if res.timer is not None:
            res.timer.cancel()
            res.timer = None
        res.worker.reserved_tokens = max(0.0, res.worker.reserved_tokens - res.tokens)

    def _outcome(self, claimed: float) -> None:
        self.claim_rate += self.rate_alpha * (claimed - self.claim_rate)
