"""Room kept for a held request that freed room keeps passing by.

A request whose prompt fits a worker's whole KV pool but not what is free on any of them waits
for one to drain. Meanwhile the room each release frees is taken by smaller requests that fit
it: other gateways' heads, and the same gateway's other askers (--queue-askers), which the
scheduler wakes after it and which decide right after it fails. Under steady load a worker
never drains that far, and the large request waits until its queue timeout: starvation. One
gateway with one asker cannot starve it (nothing behind its head asks), but the deployments
this project ships run several replicas with four askers each.

So once such a request, one that needs a tenth of a pool or more (LARGE_SHARE), has waited
`keep_room_after_s` since it arrived in its gateway's queue, the worker nearest to holding it
(the most free KV among those whose pool can hold it) is kept for it: no other request is
placed there until it is (it still goes wherever it fits first). The kept worker's running
requests finish and free their KV, and nothing refills it. That costs the smaller requests one
worker for as long as the drain takes (seconds to tens of seconds: benchmarks/RESULTS.md,
"Large requests beside a saturating load"), the price of an order in which every request that
fits some worker is eventually served.

A keep ends when its request is placed, when its call ends without being asked again within
ASKED_AGAIN_WITHIN_S (its client left, or its gateway's queue timed it out), or when its worker
leaves the pool or stops being a candidate. One keep per model (the oldest starving request's),
and a worker is kept for one request at a time.

The request is recognised across calls (a long poll that runs out is asked again, a new call)
by its model, KV need and arrival: the gateway sends how long it has waited in its queue, so
every call of it gives the same arrival, to the gateway's clock's and the wire's jitter.
"""

from __future__ import annotations

import logging

from scheduler.held_calls import ASKED_AGAIN_WITHIN_S
from scheduler.registry import WorkerState

log = logging.getLogger(__name__)

# Only a request that needs at least this share of a worker's pool has a worker kept for it.
# Under saturation every request waits, and each that needs a few hundred tokens more than
# is free is held "by its size" for a moment; but the room a release or two frees soon
# covers it, while a share this large is rarely free on a full worker (the KV guard keeps
# about 5 % free). Kept for them too, the workers went to one small request after another
# (each for a second or two), and a large one waited for its turn at the per-model keep.
LARGE_SHARE = 0.1
# Two calls of one request give arrivals this close (its waited_ms is whole milliseconds, and
# the poll's answer and the next call take a round trip); two requests this close with the
# same need are interchangeable here.
SAME_ARRIVAL_S = 0.25


class KeptRoom:
    __slots__ = ("arrival", "key", "left_at", "need", "worker")

    def __init__(self, key: str, worker: WorkerState, need: float, arrival: float) -> None:
        self.key = key  # the model (or adapter) the request is for
        self.worker = worker
        self.need = need  # its KV need (Policy.kv_need)
        self.arrival = arrival  # when it arrived in its gateway's queue (time.monotonic())
        self.left_at: float | None = None  # its last call ended unplaced (asked again: None)

    def is_for(self, key: str, need: float, arrival: float | None) -> bool:
        return (arrival is not None and key == self.key and need == self.need
                and abs(arrival - self.arrival) <= SAME_ARRIVAL_S)


class RoomKeeper:
    def __init__(self, after_s: float) -> None:
        self.after_s = after_s  # 0: off
        self.by_key: dict[str, KeptRoom] = {}
        self.by_worker: dict[WorkerState, KeptRoom] = {}
        self.started = 0  # keeps begun, for the metrics
        self.placed = 0  # keeps whose request was placed

    def expire(self, now: float) -> bool:
        """End the keeps whose request left and was not asked again. Whether any ended."""
        ended = False
        for keep in list(self.by_worker.values()):
            if keep.left_at is not None and now - keep.left_at > ASKED_AGAIN_WITHIN_S:
                self.end(keep, "left")
                ended = True
        return ended

    def others_may_use(self, cands: list[WorkerState], key: str, need: float,
                       arrival: float | None, now: float) -> list[WorkerState]:
        """The candidates less the workers kept for another request."""
        self.expire(now)
        if not self.by_worker:
            return cands
        kept = self.by_worker
        return [w for w in cands if (keep := kept.get(w)) is None or keep.is_for(key, need, arrival)]

    def mine(self, key: str, need: float, arrival: float | None) -> KeptRoom | None:
        keep = self.by_key.get(key)
        return keep if keep is not None and keep.is_for(key, need, arrival) else None

    def consider(self, key: str, need: float, arrival: float, cands: list[WorkerState],
                 now: float) -> KeptRoom | None:
        """A held request that did not fit: keep a worker for it if it has waited long enough,
        none is kept for an older one of its model, and its size is what holds it back (some
        candidate's pool could hold it, and none has that much free). Its keep, if any."""
        if not self.after_s or now - arrival < self.after_s:
            return None
        if any(need <= w.free_tokens for w in cands):
            return None  # it has the room somewhere: what holds it back holds every request
        keep = self.by_key.get(key)
        if keep is not None:
            if not keep.is_for(key, need, arrival):
                return None  # one at a time per model: the older request's
            if keep.worker in cands:
                keep.left_at = None
                return keep
            self.end(keep, "worker_gone")  # no longer a candidate: keep another one
        target = None
        for w in cands:
            if (w.capacity_tokens >= need > w.free_tokens and need >= LARGE_SHARE * w.capacity_tokens
                    and w not in self.by_worker and (target is None or w.free_tokens > target.free_tokens)):
                target = w
        if target is None:
            return None
        keep = KeptRoom(key, target, need, arrival)
        self.by_key[key] = keep
        self.by_worker[target] = keep
        self.started += 1
        log.info("keeping worker %s for a request of %s needing %.0f KV tokens (%.0f free), "
                 "waiting %.1f s", target.worker_id, key, need, target.free_tokens, now - arrival)
        return keep

    def left(self, key: str, need: float, arrival: float, now: float) -> None:
        """The request's call ended unplaced: its keep ends unless it is asked again soon."""
        keep = self.mine(key, need, arrival)
        if keep is not None:
            keep.left_at = now

    def end(self, keep: KeptRoom, why: str) -> None:
        if self.by_key.get(keep.key) is keep:
            del self.by_key[keep.key]
        if self.by_worker.get(keep.worker) is keep:
            del self.by_worker[keep.worker]
        if why == "placed":
            self.placed += 1
        log.info("worker %s no longer kept (%s)", keep.worker.worker_id, why)

    def forget_worker(self, w: WorkerState) -> bool:
        keep = self.by_worker.get(w)
        if keep is None:
            return False
        self.end(keep, "worker_gone")
        return True
