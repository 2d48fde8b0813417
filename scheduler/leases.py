"""Leases: one per scheduled request, open until the gateway releases it or it expires.

An expired lease is a release that was lost (gateway crash): without expiry its
load would count against the worker forever.

A lease can also be handed off: the gateway's part ended but the request goes on in the
worker (a background response, answered `queued` at once). Its load must not vanish before
a scrape shows it in the worker's own numbers (a burst of such requests would all go to the
worker that looked emptiest), and its end frees nothing (the scrapes follow it from then on):
it stays counted while unseen and is dropped, freeing nothing, once a scrape has seen it.

A lease decided for a gateway that names itself is tagged with its instance id (`tag`): when
that gateway is gone (its channel closed and not reopened within a grace period), its leases
end at once (`close_gateway`) instead of at the TTL (scheduler/gateways.py). A handed-off lease
is not its gateway's any more: it stays until a scrape shows it.
"""

from __future__ import annotations

import itertools
import os

from scheduler.fair_share import FlowLedger
from scheduler.registry import WorkerState


class Lease:
    __slots__ = ("expires_at", "fair", "fair_open", "gateway", "issued_at", "lease_id", "prefilled",
                 "prefix_key", "prompt", "tokens", "trial", "unseen", "worker")

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
        # (ledger, flow, estimate) when its flow was charged (scheduler/fair_share.py): settled
        # with what it used at release; an expired or dropped lease keeps the estimate.
        self.fair: tuple[FlowLedger, str, float] | None = None
        self.fair_open = False  # counted among its flow's open requests (scheduler/service.py)
        self.gateway: str | None = None  # the instance id of the gateway it was decided for


class LeaseTable:
    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self.leases: dict[str, Lease] = {}
        # Handed off while unseen, by worker: counted until a scrape shows them
        # (drop_handed_off). Apart, so that a scrape of a worker without any costs nothing
        # more; by worker, since each scrape looks at its own worker's only (one set for all
        # made every scrape of every worker walk the whole pool's: workers x leases per round).
        self.handed_off: dict[WorkerState, set[Lease]] = {}
        # Short ids: a per-process prefix (so a restarted scheduler never matches an old id)
        # plus a counter; cheaper than uuid4 on the hot path.
        # Open leases by the gateway instance they were decided for (scheduler/gateways.py).
        self.by_gateway: dict[str, set[Lease]] = {}
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
        lease = self.leases.get(lease_id)
        if lease is None:
            return None
        w = lease.worker
        self._forget(lease)
        if lease.unseen:
            return lease  # its KV was never in the scrape, only in unseen_tokens (taken out)
        if w.shown_finished > 0:
            # The last scrape already showed a seen request gone: this is (or stands for)
            # that one; its slot and KV are already free in the scrape's numbers.
            w.shown_finished -= 1
        else:
            # The last scrape counted this request's KV as used; it is free now.
            w.finished_since += 1
            w.freed_tokens += used_tokens
        return lease

    def hand_off(self, lease_id: str) -> Lease | None:
        """The gateway's part of the request ended; the worker goes on with it (see above)."""
        lease = self.leases.get(lease_id)
        if lease is None:
            return None
        if lease.unseen:
            # counted until a scrape shows it (drop_handed_off)
            self.handed_off.setdefault(lease.worker, set()).add(lease)
        else:
            self._forget(lease)  # the last scrape counts it already
        return lease

    def tag(self, lease_id: str, gateway: str) -> None:
        """The lease was decided for the gateway instance `gateway`."""
        lease = self.leases.get(lease_id)
        if lease is None or lease.gateway is not None:
            return
        lease.gateway = gateway
        self.by_gateway.setdefault(gateway, set()).add(lease)

    def close_gateway(self, gateway: str) -> list[Lease]:
        """That gateway is gone: its open leases end (the workers stopped its requests with its
        connections), as expired leases end. Handed-off ones stay (their requests go on)."""
        closed = []
        for lease in list(self.by_gateway.pop(gateway, ())):
            lease.gateway = None
            if lease in self.handed_off.get(lease.worker, ()):
                continue
            if self.close(lease.lease_id) is not None:
                closed.append(lease)
        return closed

    def drop_handed_off(self, worker: WorkerState, cutoff: float) -> None:
        """Before a scrape of `worker` is applied: the handed-off leases it shows (issued before
        `cutoff`) are in the worker's numbers from now on."""
        mine = self.handed_off.get(worker)
        if not mine:
            return
        shown = [lease for lease in mine if lease.issued_at <= cutoff]
        for lease in shown:
            self._forget(lease)

    def _forget(self, lease: Lease) -> None:
        """Take a lease out, with the load it added (not the load a scrape showed)."""
        self.leases.pop(lease.lease_id, None)
        w = lease.worker
        mine = self.handed_off.get(w)
        if mine is not None:
            mine.discard(lease)
            if not mine:
                del self.handed_off[w]
        w.leases.pop(lease.lease_id, None)
        if lease.gateway is not None:
            theirs = self.by_gateway.get(lease.gateway)
            if theirs is not None:
                theirs.discard(lease)
                if not theirs:
                    del self.by_gateway[lease.gateway]
        # A request that ended (or was cancelled) before its prefill was counted must not
        # stay in the backlog: the backlog never exceeds the prompts still open.
        w.open_prompt_tokens = max(0.0, w.open_prompt_tokens - lease.prompt)
        w.prefill_backlog = min(w.prefill_backlog, w.open_prompt_tokens)
        if lease.unseen:
            w.unseen -= 1
            w.unseen_tokens -= lease.tokens

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

    def renew(self, lease_id: str, now: float) -> bool:
        lease = self.leases.get(lease_id)
        if lease is None:
            return False
        lease.expires_at = now + self.ttl_s
        return True

    def expire(self, now: float) -> list[Lease]:
        dead = [lid for lid, lease in self.leases.items() if lease.expires_at <= now]
        return [lease for lid in dead if (lease := self.close(lid)) is not None]

    def drop_worker(self, worker: WorkerState) -> None:
        for lid in list(worker.leases):
            self.close(lid)
