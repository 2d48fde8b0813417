"""The decision core: candidates for a request, the policy's pick, leases, and holding
requests while every candidate is saturated (woken by events, never by polling).

Held calls are woken when something may have freed room, in the order scheduler/held_calls.py
gives them (priority, then each model's flows' token counters, then the requests' arrivals in
their gateways' queues). Each gateway sends only the head of its own queue (or its best few:
--queue-askers), so this orders the replicas' heads: without it a tenant alone on one replica
got one turn per request against the tenants of the others, whatever its requests cost."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from pathlib import Path

from scheduler.config import SchedulerConfig
from scheduler.cordon_file import CordonFile
from scheduler.cordons import Cordon, Cordons
from scheduler.fair_share import FlowLedger
from scheduler.gateways import GatewayPresence
from scheduler.health import HALF_OPEN
from scheduler.held_calls import ASKED_AGAIN_WITHIN_S, HeldCalls
from scheduler.kept_room import RoomKeeper
from scheduler.leases import Lease, LeaseTable
from scheduler.metrics import SchedulerMetrics
from scheduler.policies import Pick, PolicyEnv, Request, make_policy
from scheduler.protocol import (
    CLIENT_LEFT,
    CONNECTION_FAILED,
    DRAINING,
    FAILING,
    MAX_TOKENS_COUNTED,
    REFUSED,
    UNRESPONSIVE,
    LeaseRelease,
)
from scheduler.registry import Registry, WorkerState
from scheduler.reservations import ReservationTable
from scheduler.scrape.snapshot import LoadSnapshot
from scheduler.sessions import SessionTable
from scheduler.startup import StartupGrace

log = logging.getLogger(__name__)

UNKNOWN_MODEL = "unknown_model"
# The gateway's failure kinds that say the worker's connection failed (router/streaming.py:
# refused, reset or cut, closed before a byte); its others (http_5xx, timeout, idle_timeout)
# say a request failed on a worker that answered, or was slow; "draining" (router/draining.py)
# that the worker refused it with a 503 "shutting down".
CONNECTION_FAILURES = frozenset({"connect", "connection", "empty_stream"})
# Its kinds that say the worker took the request and answered nothing in time ("worker_down":
# the gateway gave up on a worker reported down while it waited).
SILENCES = frozenset({"timeout", "idle_timeout", "worker_down"})
# Why a policy counts a worker saturated (WorkerState.saturated), when that keeps every request
# off it: all but "kv_usage", which room held for a follow-up may get past (_claim).
_NO_PLACE = frozenset({"waiting", "running", "running_cap", "prefill_backlog"})


def cause_of_report(error: str | None, refused: bool = False) -> str:
    """The down cause (scheduler/protocol.py) a gateway's failure kind says; `refused`: its
    connection was refused (a report says so; "connect" alone, from an older gateway, may be
    a connect timeout or an unreachable host too). The kind "draining" (a 503 "shutting down"
    answer) is its own cause: an older gateway sends "http_503" for it, a failure as before."""
    if refused:
        return REFUSED
    if error == DRAINING:
        return DRAINING
    if error in CONNECTION_FAILURES:
        return CONNECTION_FAILED
    return UNRESPONSIVE if error in SILENCES else FAILING


class Wait:
    """Every candidate is saturated (or none is routable right now)."""

    __slots__ = ("reason", "retry_after_ms")

    def __init__(self, retry_after_ms: int, reason: str) -> None:
        self.retry_after_ms = retry_after_ms
        self.reason = reason


class SchedulerService:
    def __init__(self, config: SchedulerConfig, metrics: SchedulerMetrics | None = None) -> None:
        self.cfg = config
        self.registry = Registry(config.model_gone_grace_s)
        self.leases = LeaseTable(config.lease_ttl_s)
        # Gateways' channels: a gateway gone for --gateway-gone-grace-s has its leases ended.
        self.gateways = GatewayPresence(config.gateway_gone_grace_s, self.drop_gateway)
        self.env = PolicyEnv(stale_after_s=config.stale_after_ms / 1000.0,
                             sessions=SessionTable(config.session_ttl_s, config.max_sessions))
        self.policy = make_policy(config.policy, config.effective_policy_params, self.env)
        self.reservations = ReservationTable(config.followup_hold_ms / 1000.0, self._reservation_ended)
        self.metrics = metrics or SchedulerMetrics(self)
        self._lag_s = config.visibility_lag_ms / 1000.0
        self._retry_after_ms = config.retry_after_ms or config.scrape_interval_ms
        self.held = HeldCalls()  # calls waiting for the next event that may free room
        # Workers kept for held requests that freed room kept passing by (too large for it).
        self.kept = RoomKeeper(config.keep_room_after_s if self.policy.holds else 0.0)
        self._ledgers: dict[str, FlowLedger] = {}  # by model key: the flows' token counters
        # Open leases per (counters, flow): a flow with requests running is not arriving anew
        # when its gateway's next request asks, so it is not lifted then (see schedule()).
        self._open_flows: Counter[tuple[FlowLedger, str]] = Counter()
        # Workers on probation: each gets one trial request before any policy choice.
        self.half_open: set[str] = set()
        # Workers an operator took out of rotation (scheduler/cordons.py), by id.
        self.cordons = Cordons()
        # Where they are kept across restarts (--cordon-file), if anywhere: read by
        # restore_cordons() at start, written by persist_cordons() after each change.
        self.cordon_file = (CordonFile(Path(config.cordon_file), self.metrics.cordon_file_write_failures)
                            if config.cordon_file else None)
        # model -> routable workers serving it; rebuilt lazily after any health or membership
        # change, so a decision does not test every worker's health.
        self._routable: dict[str, list[WorkerState]] = {}
        self.registry.listeners.append(self._membership_changed)
        self.startup = StartupGrace(time.monotonic(), config.startup_grace_s,
                                    config.registration_ttl_s if config.registration_token else None)

    def _membership_changed(self) -> None:
        self._routable.clear()
        self.capacity_changed()

    # ---- events that can free capacity -----------------------------------------------

    def capacity_changed(self) -> None:
        """Wake the held calls. Each decides again as it resumes, in the order woken, and waits
        again if still saturated."""
        self.held.wake_all()

    def _ledger_of(self, req: Request) -> FlowLedger | None:
        """The counters of the request's model (or LoRA, as decide() routes it), when it
        names a flow and fair_share is on."""
        if req.flow is None or not self.cfg.fair_share:
            return None
        key = self._key_of(req)
        ledger = self._ledgers.get(key)
        if ledger is None:
            ledger = self._ledgers[key] = FlowLedger(self.cfg.fair_output_token_weight)
        return ledger

    def fair_state(self, limit: int = 20) -> dict[str, dict]:
        """Per model: the level, how many flows have counters, the most served (/v1/workers)."""
        return {model: {"level": round(ledger.level, 1), "flows": len(ledger),
                        "most_served": ledger.most_served(limit)}
                for model, ledger in self._ledgers.items()}

    def refresh(self, w: WorkerState) -> None:
        self.policy.refresh(w)

    def is_gone(self, w: WorkerState) -> bool:
        """Removed while its scrape was in flight (the scrape ends later): what it found is
        about no worker of ours, and its id may be another worker's by now (re-added)."""
        return self.registry.workers.get(w.worker_id) is not w

    def on_snapshot(self, w: WorkerState, snap: LoadSnapshot) -> None:
        if self.is_gone(w):
            return
        self.leases.drop_handed_off(w, snap.taken_at - self._lag_s)
        w.on_snapshot(snap, self._lag_s)
        self.policy.refresh(w)
        if w.saturated in _NO_PLACE:
            # Still full, for a reason no request can get past (nor claim room held there): a
            # snapshot changes only its own worker, so waking the held calls would only have
            # each decide again over every worker, for the same wait. Under saturation that was
            # held calls x workers decisions per scrape of every worker.
            return
        self.capacity_changed()

    def on_health_change(self, w: WorkerState) -> None:
        if self.is_gone(w):
            return  # else a removed worker's late verdict landed on the id's new worker
        h = w.health
        if h.state == HALF_OPEN:
            # Answering again: the error it still carries is what took it out, not news.
            log.info("worker %s is half_open: answering again after %s; its next request is a trial",
                     w.worker_id, h.last_error or "an outage")
        else:
            log.info("worker %s is %s (%s)", w.worker_id, h.state, h.last_error or "ok")
        self._routable.clear()
        if w.health.state == HALF_OPEN:
            self.half_open.add(w.worker_id)
        else:
            self.half_open.discard(w.worker_id)
        self.policy.refresh(w)
        self.capacity_changed()

    def add_worker(self, w: WorkerState) -> WorkerState:
        w = self.registry.add(w)
        cap = self._running_cap_of(w)
        if cap is not None:
            w.declare_running_cap(cap)
        self.policy.refresh(w)
        return w

    def announce_running_cap(self, w: WorkerState, cap: int) -> None:
        """A cap the worker announced (its registration, TGI's /info)."""
        w.announced_running_cap = cap
        w.declare_running_cap(self._running_cap_of(w))
        self.policy.refresh(w)

    def _running_cap_of(self, w: WorkerState) -> int | None:
        """Who knows best: the operator about this very worker, then the worker itself, then
        the operator's pool-wide default (a worker announces its own flag, which a "*" entry
        written for the whole pool may not match)."""
        own = self.cfg.declared_running_cap(w.worker_id, w.url)
        if own is not None:
            return own
        if w.announced_running_cap is not None:
            return w.announced_running_cap
        return self.cfg.default_running_cap

    def remove_worker(self, worker_id: str, source: str | None = None) -> bool:
        w = self.registry.remove(worker_id, source)
        if w is None:
            return False
        for lease in list(w.leases.values()):
            self._lease_ended(lease)
        self.leases.drop_worker(w)
        self.reservations.forget_worker(w)
        self.kept.forget_worker(w)
        self.half_open.discard(w.worker_id)
        self.env.prefix_index.forget(w.worker_id)
        self.env.sessions.forget_worker(w.worker_id)
        self.metrics.forget_worker(w.worker_id)
        return True

    # ---- decisions --------------------------------------------------------------------

    def _key_of(self, req: Request) -> str:
        """The pool a request is placed in: its adapter's where a worker serves it, else its
        model's."""
        return req.lora if req.lora and req.lora in self.registry.by_model else req.model

    def learning_pool(self, now: float) -> bool:
        """Whether the pool may still be partly unknown after a start (scheduler/startup.py)."""
        return self.startup.active(now, self.registry.workers.values())

    def decide(self, req: Request, now: float, arrival: float | None = None):
        """A decision dict, a Wait, or UNKNOWN_MODEL. Synchronous and allocation-light.
        arrival: when a held request arrived in its gateway's queue (scheduler/kept_room.py)."""
        by_model = self.registry.by_model
        key = self._key_of(req)
        if req.attach:
            return self._attach(req, by_model.get(key), now)
        cands = self._routable.get(key)
        if cands is None:
            pool = by_model.get(key)
            if pool is None:
                if self.registry.recently_gone(key, now) or self.startup.active(
                        now, self.registry.workers.values()):
                    # Between workers, or not learnt yet (scheduler/startup.py), not unknown:
                    # the gateway answers 503 no_worker, which clients retry, where a 404 would
                    # tell them the model does not exist.
                    return Wait(self._retry_after_ms, "no_routable_worker")
                return UNKNOWN_MODEL
            cands = self._routable[key] = self._placeable(pool)
        excl = req.exclude
        if excl:
            cands = [w for w in cands if w.worker_id not in excl]
        if req.pin is not None:
            cands = [w for w in cands if w.worker_id == req.pin]
            if not cands and req.pin in self.cordons.by_id:
                cands = self._cordoned_pin(req, key)
            if not cands:
                # Gone, and its state with it; but not while the pool is still being learnt
                # after a restart (scheduler/startup.py): the worker may just not have
                # heartbeated yet, and a follow-up told its response is lost would not retry.
                gone = req.pin not in self.registry.workers and not self.learning_pool(now)
                return Wait(self._retry_after_ms,
                            "pinned_worker_gone" if gone else "pinned_worker_unavailable")
        if not cands:
            return Wait(self._retry_after_ms, "no_routable_worker")
        if self.kept.by_worker and req.pin is None:
            cands = self.kept.others_may_use(cands, key, self.policy.kv_need(req), arrival, now)
            if not cands:
                return Wait(self._retry_after_ms, "saturated")
        pick = None
        if self.reservations.by_key and req.prefix_hashes and req.pin is None:
            pick = self._claim(req, cands, now)
        if pick is None and req.reserved_only:
            # "holds_off" tells the gateway that asking again is pointless (it stops passing).
            return Wait(self._retry_after_ms, "no_reservation" if self.reservations.enabled else "holds_off")
        if pick is None and self.half_open:
            trial = next((w for w in cands if w.worker_id in self.half_open), None)
            if trial is not None:
                pick = Pick(trial, trial.score, {"trial": True})
        if pick is None:
            pick = self.policy.choose(req, cands, now)
        if pick is None:
            if arrival is not None and self.kept.after_s and req.pin is None:
                self.kept.consider(key, self.policy.kv_need(req), arrival, cands, now)
            return Wait(self._retry_after_ms, "saturated")
        out = self._issue(req, pick, pick.worker.health.state == HALF_OPEN, len(cands), now)
        if self.kept.by_key and arrival is not None:
            keep = self.kept.mine(key, self.policy.kv_need(req), arrival)
            if keep is not None:
                out["reason"]["kept_room"] = keep.worker is pick.worker
                self.kept.end(keep, "placed")
                self.capacity_changed()  # what it left there is everyone's again
        return out

    def _placeable(self, pool: list[WorkerState]) -> list[WorkerState]:
        """The pool's candidates for a new request: routable and not cordoned. Built only when
        the cached candidates were cleared (a health, membership or cordon change)."""
        cordoned = self.cordons.by_id
        if not cordoned:
            return [w for w in pool if w.routable]
        return [w for w in pool if w.routable and w.worker_id not in cordoned]

    def _cordoned_pin(self, req: Request, key: str) -> list[WorkerState]:
        """A request pinned to a cordoned worker still goes there, as it would were the worker
        not cordoned (routable, serving the model, not excluded): what it continues is stored
        there only (a Responses API follow-up), so no other worker can serve it."""
        w = self.registry.workers.get(req.pin)
        if w is None or not w.routable or w not in self.registry.by_model.get(key, ()):
            return []
        if req.exclude and w.worker_id in req.exclude:
            return []
        return [w]

    def _attach(self, req: Request, pool: list[WorkerState] | None, now: float):
        """A lease on the worker a request is already bound for (ScheduleRequest.attach): no
        choice, whatever its load or health (the connection to it is open), and never its
        trial (one request on a socket placed before says little about the worker)."""
        if pool is None:
            return UNKNOWN_MODEL
        w = self.registry.workers.get(req.pin)
        if w is None or w not in pool:
            return Wait(self._retry_after_ms, "pinned_worker_gone")
        detail: dict = {"attached": True}
        # The socket's previous request ended there and its room may be held for this one (a
        # follow-up hold): it is this request's, and unclaimed it would count twice until it
        # expired, and lower the claim rate that decides whether chat traffic gets holds at all.
        claimed = self.reservations.claim(self.policy.prefix_keys(req), w) if req.prefix_hashes else None
        if claimed is not None:
            detail["prefix_match"] = claimed[1]
        self.policy.refresh(w)
        return self._issue(req, Pick(w, w.score, detail), False, 1, now)

    def _issue(self, req: Request, pick: Pick, trial: bool, candidates: int, now: float) -> dict:
        """The lease for a pick, its flow charged, and the decision that tells the gateway."""
        w = pick.worker
        # Prefill work: the prompt less what the worker holds: the part the gateway knows it
        # holds, and the chunks it likely holds in its prefix cache.
        prompt = max(0, req.prompt_tokens - req.cached_tokens)
        matched = pick.detail.get("prefix_match")
        if matched and req.prefix_hashes:
            prompt *= max(0.0, 1.0 - matched / len(req.prefix_hashes))
        # Its room is held for the conversation's next turn under its last prefix key, which
        # the prefix index scopes by model and adapter (an engine caches per adapter: a hold
        # claimed by another adapter's turn would hand it a cache it does not have).
        lease = self.leases.issue(w, now, self.policy.kv_need(req), trial=trial, prompt=prompt,
                                  prefix_key=self.policy.prefix_keys(req)[-1] if req.prefix_hashes else None)
        if trial:
            self._routable.clear()  # one trial at a time: out of the candidates until it ends
        ledger = self._ledger_of(req)
        if ledger is not None:
            ledger.pick((req.flow,))  # the flow served last sets the level new flows start at
            lease.fair = (ledger, req.flow, ledger.charge(req.flow, req.prompt_tokens, req.max_tokens))
            self._open_flows[ledger, req.flow] += 1
            lease.fair_open = True
        session = self.policy.on_issued(req, w, now)
        self.policy.refresh(w)
        snap = w.snapshot
        reason = {
            "score": round(pick.score, 3),
            "candidates": candidates,
            "running": snap.running if snap else None,
            "waiting": snap.waiting if snap else None,
            "kv": snap.kv_usage if snap else None,
            "unseen": w.unseen,
            "age_ms": round((now - snap.taken_at) * 1000.0, 1) if snap else None,
        }
        if pick.detail:
            reason.update(pick.detail)
        if req.cached_tokens:
            reason["cached_tokens"] = req.cached_tokens
        if session is not None:
            reason["session"] = session  # kept, moved or new (scheduler/sessions.py)
        return {
            "worker_id": w.worker_id,
            "url": w.url,
            "lease_id": lease.lease_id,
            "policy": self.policy.name,
            "reason": reason,
        }

    def _claim(self, req: Request, cands: list[WorkerState], now: float) -> Pick | None:
        """The room held for this prompt's prefix, if its worker can still take it. The
        worker holds the whole previous turn in its cache, so no policy choice is needed,
        unless it has since started to queue or its load data went stale: then the hold
        ends and the request is placed like any other."""
        claimed = self.reservations.claim(self.policy.prefix_keys(req))
        if claimed is None:
            return None
        res, matched_chunks = claimed
        w = res.worker
        self.policy.refresh(w)  # its reserved room is free again, for this request
        if (w not in cands or w.saturated not in (None, "kv_usage")
                or w.taken_at < now - self.env.stale_after_s):
            self.capacity_changed()
            return None
        return Pick(w, w.score, {"followup": True, "prefix_match": matched_chunks})

    def _reservation_ended(self, w: WorkerState) -> None:
        """A hold expired unclaimed: its room is everyone's again."""
        self.policy.refresh(w)
        self.capacity_changed()

    def schedule_now(self, req: Request, now: float, arrival: float | None = None):
        """decide() with its metrics; never holds (the batch channel's path)."""
        t0 = time.perf_counter()
        out = self.decide(req, now, arrival)
        self.metrics.decision_done(out, time.perf_counter() - t0)
        return out

    async def schedule(self, req: Request, wait_ms: int = 0, waited_ms: int = 0):
        """decide(), holding up to wait_ms while the answer is Wait. waited_ms: how long the
        request has waited in its gateway's queue (its place among held calls)."""
        now = time.monotonic()
        arrival = now - waited_ms / 1000.0
        out = self.schedule_now(req, now, arrival)
        if not isinstance(out, Wait) or wait_ms <= 0:
            return out
        deadline = now + wait_ms / 1000.0
        self.metrics.waits.inc()
        ledger = self._ledger_of(req)
        held = self.held.new(now, waited_ms, ledger, req.flow, req.priority)
        if ledger is not None and self._idle(ledger, req.flow, now):
            # The flow arrives: no lower than the flows waiting beside it (no credit banked
            # while away; scheduler/fair_share.py). Not while it has requests running or held:
            # each gateway asks for its queue's head only, so a busy tenant's next request
            # asks anew after each placement, and lifting it then to the heavy tenant's counter
            # would undo every turn it had.
            ledger.lift(req.flow, self.held.flows_held(ledger))
        # At its request's place first; woken and still waiting, back in the order woken.
        at = self.held.place_of(held)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.metrics.wait_done(False, time.monotonic() - now)
                if ledger is not None:
                    self.held.poll_ran_out(ledger, req.flow)
                self._call_left(req, arrival)
                return out
            woken = self.held.hold(held, at)
            at = None
            try:
                await asyncio.wait([woken], timeout=remaining)
            except asyncio.CancelledError:
                # The caller hung up (the HTTP handler is cancelled): deciding later would hand
                # a lease to nobody, counted as load on a worker until it expired.
                self.held.unhold(held)
                self.metrics.wait_cancelled(time.monotonic() - now)
                self._call_left(req, arrival)
                raise
            self.held.unhold(held)
            out = self.decide(req, time.monotonic(), arrival)
            if not isinstance(out, Wait):
                self.metrics.wait_done(True, time.monotonic() - now)
                return out

    def _call_left(self, req: Request, arrival: float) -> None:
        """A held call ended unplaced. If a worker is kept for its request, the keep ends
        unless the request asks again soon (a poll that ran out is asked again at once)."""
        if not self.kept.by_key:
            return
        self.kept.left(self._key_of(req), self.policy.kv_need(req), arrival, time.monotonic())
        asyncio.get_running_loop().call_later(ASKED_AGAIN_WITHIN_S + 0.05, self._expire_keeps)

    def _expire_keeps(self) -> None:
        if self.kept.expire(time.monotonic()):
            self.capacity_changed()

    def _idle(self, ledger: FlowLedger, flow: str, now: float) -> bool:
        """Whether the flow arrives now: nothing of it runs here, and it is not waiting (a call
        held, or one that ran out just before: its gateway asks again at once)."""
        if (ledger, flow) in self._open_flows:
            return False
        return not self.held.waiting(ledger, flow, now)

    def _lease_ended(self, lease: Lease) -> None:
        """Released, handed off, expired or dropped with its worker: its flow has one request
        fewer running here."""
        if lease.fair is None or not lease.fair_open:
            return  # not charged, or ended already (a handed-off lease can still expire)
        lease.fair_open = False
        key = (lease.fair[0], lease.fair[1])
        left = self._open_flows[key] - 1
        if left > 0:
            self._open_flows[key] = left
        else:
            del self._open_flows[key]

    # ---- lease ends and failure reports -------------------------------------------------

    def release(self, lease_id: str, ok: bool, error: str | None = None, used_tokens: float = 0.0,
                handed_off: bool = False) -> bool:
        """used_tokens: prompt + output tokens the gateway saw; their KV is free before the
        next scrape can show it, so a worker held back by the KV guard frees up at once.
        handed_off: the gateway's part ended and the worker goes on with the request
        (leases.py): nothing is freed. False: unknown or expired lease."""
        if handed_off:
            lease = self.leases.hand_off(lease_id)
        else:
            lease = self.leases.close(lease_id, used_tokens)
        if lease is None:
            return False
        self._lease_ended(lease)
        w = lease.worker
        if ok and not error:
            w.health.on_request_ok()
        if lease.trial:
            self._routable.clear()
        if (ok and not error and not handed_off and lease.prefix_key is not None and not lease.unseen
                and w.worker_id not in self.cordons.by_id):
            # Only KV the last scrape counted is reserved: an unseen lease's tokens leave
            # unseen_tokens on close, and were never in the scrape's usage. None on a cordoned
            # worker: the conversation's next turn is placed elsewhere.
            self.reservations.hold(lease.prefix_key, w, used_tokens)
        # A trial whose client left is no verdict: the worker stays half open, and (its
        # candidates cleared above) the next request is its trial.
        verdict = lease.trial and not (ok and error == CLIENT_LEFT)
        if verdict and w.health.trial_result(ok and not error, cause_of_report(error)):
            self.on_health_change(w)
        else:
            self.policy.refresh(w)
            if not handed_off:
                self.capacity_changed()
        return True

    def release_reported(self, rel: LeaseRelease) -> bool:
        """A gateway's release (HTTP or channel): end the lease, credit the KV its prompt and
        output held, count the outcome. False: unknown or expired lease."""
        handed_off = rel.handed_off and rel.ok and not rel.error
        # Clamped (protocol.MAX_TOKENS_COUNTED); a negative count frees nothing.
        prompt = min(max(0, rel.prompt_tokens), MAX_TOKENS_COUNTED)
        output = min(max(0, rel.output_tokens), MAX_TOKENS_COUNTED)
        lease = self.leases.leases.get(rel.lease_id)
        found = self.release(rel.lease_id, rel.ok, rel.error, min(prompt + output, MAX_TOKENS_COUNTED),
                             handed_off)
        if found and lease is not None and lease.fair is not None and not handed_off:
            # The estimate gives way to what it used. A handed-off request goes on in its
            # worker: its usage is not known here, so it keeps the estimate.
            ledger, flow, charged = lease.fair
            ledger.settle(flow, charged, prompt, output)
        if not found:
            outcome = "unknown"  # expired, released already, or never granted
        elif handed_off:
            outcome = "handed_off"
        else:
            outcome = "ok" if rel.ok else "failed"
        self.metrics.releases.labels(outcome).inc()
        return found

    def prefilled(self, lease_id: str) -> bool:
        """The gateway saw the lease's first token: its prompt leaves the worker's prefill
        backlog now, and calls held for a worker with room to prefill may go, unless the
        worker's KV usage is at `prefilled_max_kv_usage` or more (its next scrape drains it
        then). False: unknown or released lease, or already reported."""
        lease, drained = self.leases.prefilled(lease_id, time.monotonic(), self.cfg.prefilled_max_kv_usage)
        self.metrics.prefilled.labels("unknown" if lease is None else "ok" if drained else "kv_bound").inc()
        if lease is None:
            return False
        if drained:
            self.policy.refresh(lease.worker)
            self.capacity_changed()
        return True

    def renew(self, lease_id: str) -> bool:
        """The gateway says the lease's request still runs: it expires a TTL from now. False:
        unknown, released or expired lease."""
        found = self.leases.renew(lease_id, time.monotonic())
        self.metrics.renewals.labels("ok" if found else "unknown").inc()
        return found

    def report_failure(self, worker_id: str, error: str, refused: bool = False) -> bool:
        """A gateway's report: `error` is its failure kind (router/streaming.py), `refused`
        whether the worker's port refused the connection. A connection that was refused, reset
        or closed empty takes the worker out at once, and so does a draining worker's 503 (it
        takes no new request, however many its scrapes say it has room for); anything else (an
        HTTP 5xx, a timeout) only after cfg.failure_report_streak in a row."""
        w = self.registry.workers.get(worker_id)
        if w is None:
            return False
        cause = cause_of_report(error, refused)
        if error in CONNECTION_FAILURES or cause == DRAINING:
            changed = w.health.force_down(f"gateway: {error}{' (refused)' if refused else ''}", cause)
        else:
            changed = w.health.on_request_failed(f"gateway: {error}", self.cfg.failure_report_streak,
                                                 cause)
        if changed:
            self.on_health_change(w)
        return True

    def expire_leases(self, now: float) -> int:
        expired = self.leases.expire(now)
        if expired:
            self._unreleased_ended(expired)
            log.warning("%d lease(s) expired without release", len(expired))
        return len(expired)

    def drop_gateway(self, gateway: str) -> int:
        """The gateway instance `gateway` is gone (scheduler/gateways.py): its leases end now, as
        expired ones do (their flows keep their estimates). How many ended."""
        dropped = self.leases.close_gateway(gateway)
        if dropped:
            self._unreleased_ended(dropped)
            self.metrics.gateway_leases_dropped.inc(len(dropped))
            log.warning("gateway %s gone (no channel for %.1f s): its %d open lease(s) ended",
                        gateway, self.cfg.gateway_gone_grace_s, len(dropped))
        else:
            log.info("gateway %s gone (no channel for %.1f s), with no open lease",
                     gateway, self.cfg.gateway_gone_grace_s)
        return len(dropped)

    def _unreleased_ended(self, leases: list[Lease]) -> None:
        """Leases ended without a release (expired, or their gateway gone)."""
        for lease in leases:
            self._lease_ended(lease)
            self.policy.refresh(lease.worker)
        self._routable.clear()  # an ended trial lease lets the next trial through
        self.capacity_changed()

    # ---- cordons (operators' maintenance) ------------------------------------------------

    def cordon(self, worker_id: str, reason: str | None = None, by: str | None = None) -> Cordon | None:
        """Take the worker out of rotation for new requests: it stays scraped and health-tracked,
        its requests in flight finish, and pinned requests still go there (scheduler/cordons.py).
        The new cordon, or None when it was cordoned already."""
        cordon = self.cordons.cordon(worker_id, reason, time.time())
        if cordon is None:
            return None
        self._routable.clear()
        w = self.registry.workers.get(worker_id)
        in_flight = 0
        if w is not None:
            in_flight = w.in_flight
            # Room held there for a conversation's next turn: that turn is placed elsewhere now.
            self.reservations.forget_worker(w)
            self.policy.refresh(w)
            keep = self.kept.by_worker.get(w)
            if keep is not None:
                self.kept.end(keep, "cordoned")
                self.capacity_changed()  # its held request may fit on another worker
        log.info("worker %s cordoned%s%s: no new requests go there (pinned ones still do); "
                 "%d request(s) in flight finish there", worker_id,
                 f" by {by}" if by else "", f" ({reason})" if reason else "", in_flight)
        return cordon

    def uncordon(self, worker_id: str, by: str | None = None) -> Cordon | None:
        """Put the worker back in rotation. The cordon lifted, or None when there was none."""
        cordon = self.cordons.uncordon(worker_id)
        if cordon is None:
            return None
        self._routable.clear()
        log.info("worker %s uncordoned%s after %.0f s: back in rotation", worker_id,
                 f" by {by}" if by else "", max(0.0, time.time() - cordon.since))
        self.capacity_changed()  # calls held for room may go there now
        return cordon

    def restore_cordons(self) -> int:
        """Read the cordon file back (before any decision: no request may reach a worker it
        holds). How many were restored; raises CordonFileError when the file is unusable."""
        if self.cordon_file is None:
            return 0
        restored = self.cordon_file.load()
        self.cordons.restore(restored)
        self._routable.clear()
        return len(restored)

    async def persist_cordons(self) -> bool | None:
        """Write every cordon to the cordon file: True once written, False when the write failed
        (the cordons hold in memory all the same), None without a cordon file."""
        if self.cordon_file is None:
            return None
        return await self.cordon_file.save(self.cordons.by_id)

    def workers_view(self) -> list[dict]:
        now = time.monotonic()
        cordons = self.cordons
        return [{**w.view(now), **cordons.view(w.worker_id)} for w in self.registry.workers.values()]
