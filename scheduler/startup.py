"""The scheduler's first seconds: it knows no worker yet.

A restarted scheduler (a crash, a rollout, a new pod) learns its pool anew: static workers'
models at their first /v1/models read, discovered ones at the first Kubernetes list,
self-registered ones at their next heartbeat (within --registration-ttl-s). Until then a model
its workers serve is unknown, and "no such model" (a 404, which OpenAI clients do not retry)
would be wrong for every request in flight across the restart; "no healthy worker" (the
gateway's 503 no_worker, which they retry) is right. So an unknown model gets the latter until
the pool is learnt, and at most --startup-grace-s after start: a model that is still unknown
then is one nobody serves. Likewise a request pinned to a worker not known yet (a Responses
API follow-up, whose stored response lives there) is told its worker is unavailable (503,
retried), not gone with its response (404 response_lost).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol


class _Worker(Protocol):
    models: set[str]
    models_fetched_at: float


class StartupGrace:
    def __init__(self, now: float, max_s: float, registration_ttl_s: float | None) -> None:
        self.until = now + max_s
        # Registered workers heartbeat within their TTL: all back by then (None: registration
        # is off).
        self.registrations_until = None if registration_ttl_s is None else now + registration_ttl_s
        self.pending: set[str] = set()  # sources whose first round has not ended ("kubernetes")
        self.over = max_s <= 0

    def wait_for(self, source: str) -> None:
        self.pending.add(source)

    def ready(self, source: str) -> None:
        self.pending.discard(source)

    def active(self, now: float, workers: Iterable[_Worker]) -> bool:
        """Whether the pool may still be partly unknown (read on the unknown-model and
        unknown-pinned-worker paths only)."""
        if self.over:
            return False
        if now >= self.until:
            self.over = True
            return False
        if self.pending or (self.registrations_until is not None and now < self.registrations_until):
            return True
        # A worker whose models were never read (a static one before its first scrape).
        if any(not w.models and w.models_fetched_at < 0 for w in workers):
            return True
        self.over = True
        return False
