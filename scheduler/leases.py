"""Leases: one per scheduled request, open until the gateway releases it or it expires.

An expired lease is a release that was lost (gateway crash): without expiry its
load would count against the worker forever.
"""

from __future__ import annotations

import itertools
import os

from scheduler.registry import WorkerState


class Lease:
    __slots__ = ("expires_at", "issued_at", "lease_id", "prefilled", "prefix_key", "prompt", "tokens",
                 "trial", "unseen", "worker")

    def __init__(self, lease_id: str, worker: WorkerState, issued_at: float, ttl_s: float,
                 tokens: float, trial: bool, prompt: float = 0.0, prefix_key: int | None = None) -> None:
        self.lease_id = lease_id
        self.worker = worker
        self.issued_at = issued_at
        self.expires_at = issued_at + ttl_s
        self.tokens = tokens  # KV it takes until a scrape shows it (the policy's kv_need)
        self.prompt = prompt  # prompt tokens still to prefill when issued
        self.trial = trial
        self.unseen = True
        self.prefilled = False  # the gateway reported its first token
        # The request's last prefix fingerprint: its follow-up's prompt carries it.
        self.prefix_key = prefix_key


class LeaseTable:
    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self.leases: dict[str, Lease] = {}
        # Short ids: a per-process prefix (so a restarted scheduler never matches an old id)
        # plus a counter; cheaper than uuid4 on the hot path.
        self._prefix = os.urandom(4).hex()
        self._counter = itertools.count(1)

    def issue(self, worker: WorkerState, now: float, tokens: float, trial: bool = False,
              prompt: float = 0.0, prefix_key: int | None = None) -> Lease:
        lease = Lease(f"{self._prefix}-{next(self._counter)}", worker, now, self.ttl_s, tokens, trial,
                      prompt, prefix_key)
        self.leases[lease.lease_id] = lease
        worker.leases[lease.lease_id] = lease
        worker.unseen += 1
        worker.unseen_tokens += tokens
        worker.prefill_backlog += prompt
        worker.open_prompt_tokens += prompt
        return lease

    def close(self, lease_id: str, used_tokens: float = 0.0) -> Lease | None:
        """End a lease. used_tokens: the KV the request held (prompt + output), when known."""
        lease = self.leases.pop(lease_id, None)
        if lease is None:
            return None
        w = lease.worker
        w.leases.pop(lease_id, None)
        # A request that ended (or was cancelled) before its prefill was counted must not
        # stay in the backlog: the backlog never exceeds the prompts still open.
        w.open_prompt_tokens = max(0.0, w.open_prompt_tokens - lease.prompt)
        w.prefill_backlog = min(w.prefill_backlog, w.open_prompt_tokens)
        if lease.unseen:
            w.unseen -= 1
            w.unseen_tokens -= lease.tokens
        elif w.shown_finished > 0:
            # The last scrape already showed a seen request gone: this is (or stands for)
            # that one; its slot and KV are already free in the scrape's numbers.
            w.shown_finished -= 1
        else:
            # The last scrape counted this request's KV as used; it is free now (an unseen
            # lease's KV was never in the scrape, only in unseen_tokens).
            w.finished_since += 1
            w.freed_tokens += used_tokens
        return lease

    def prefilled(self, lease_id: str, now: float, max_kv_usage: float = 1.0) -> tuple[Lease | None, bool]:
        """The gateway saw this request's first token: its prompt leaves the worker's backlog,
        unless the worker's last scrape showed KV usage at `max_kv_usage` or more (then the
        prompt counter drains it at the next scrape). (None, False): unknown lease, or already
        reported; else (lease, whether the backlog drained now)."""
        lease = self.leases.get(lease_id)
        if lease is None or lease.prefilled:
            return None, False
        lease.prefilled = True
        snap = lease.worker.snapshot
        if snap is not None and snap.kv_usage is not None and snap.kv_usage >= max_kv_usage:
            return lease, False
        if lease.prompt > 0.0:
            lease.worker.on_prefilled(lease.prompt, now)
            lease.prompt = 0.0
        return lease, True

    def expire(self, now: float) -> list[Lease]:
        dead = [lid for lid, lease in self.leases.items() if lease.expires_at <= now]
        return [lease for lid in dead if (lease := self.close(lid)) is not None]

    def drop_worker(self, worker: WorkerState) -> None:
        for lid in list(worker.leases):
            self.close(lid)
