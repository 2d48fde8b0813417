"""llm_aware (the default): load in requests, prefill backlog, KV headroom against this
request's need, decode speed, token rates, leases the scrape cannot see yet, data age, and
prefix-cache affinity.

What it does, in order:
1. A candidate is saturated when it has `max_waiting` or more requests waiting for capacity, its
   KV usage (including blocks unseen leases will take, less what requests released since
   the scrape held, plus what is reserved for follow-ups) is at `max_kv_usage` or more,
   it runs `max_running` requests (if set) or as many as its running cap, declared or learnt
   from its scrapes (`use_running_cap`, scheduler/running_cap.py; its open leases count as
   running too, since its gauges lag what it was sent), it has `max_prefill_backlog` or more prompt
   tokens sent and not yet prefilled (if set; less the progress its prefill rate implies
   since its prompt counter last moved), its load data is stale, or its free KV cannot
   hold this request (prompt + output_fraction * max_tokens, which is also what a lease
   counts as taken until the next scrape).
2. Among the unsaturated, the lowest score wins:
   score = w_waiting*waiting + w_running*running + w_pending*unseen_leases + w_kv*kv
         + w_prefill*pending_prefill_tokens/1000
         + w_gen_rate*gen_tok_per_s/1000 + w_prompt_rate*prompt_tok_per_s/1000 + w_itl*itl_ms
         + w_age*data_age_s - w_prefix*(matched prefix chunks / chunks)
   A request of a session (scheduler/sessions.py) goes to its session's worker instead when
   that worker is among these (unsaturated, fresh, room for it) and scores at most
   `session_slack` above the winner; otherwise the winner takes it, and the session with it.
   A session with no worker kept (new, idle past its TTL, its worker gone) is offered its
   rendezvous worker (scheduler/rendezvous.py) under the same rule: the candidate the gateway's
   fallback would pick for it, so a session's worker is the same with or without the
   scheduler, and after a restart that emptied the table, unless load moved it.
3. When every candidate is saturated, the request is held (`hold_when_saturated`) rather
   than piled onto one worker; else the least bad saturated one is used.
Every knob is a policy parameter, so tuning is a config change. The defaults are the settings
measured in benchmarks/RESULTS.md (benchmarks/configs/llm_aware.yaml spells them out with each
value's reason, and a test keeps the two equal) except `max_prefill_backlog`, which depends on
the engines' step budget: see its comment.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any, ClassVar

from scheduler.policies.base import Pick, Policy, PolicyEnv, Request
from scheduler.registry import WorkerState
from scheduler.rendezvous import rendezvous_pick

_INF = math.inf


def _rank(w: WorkerState) -> float:
    return w.rank


def _home_rank(home: str, cands: list[WorkerState], need: float, stale_before: float,
               matches: dict[str, int] | None, bonus: float) -> tuple[WorkerState, float] | None:
    """A session's worker and its rank (prefix bonus included), when it is a candidate that
    could take this request now: the guards choose() applies to every worker apply to it. A
    second pass over the candidates, made only for a request whose session's worker did not
    win outright."""
    for w in cands:
        if w.worker_id == home:
            if w.saturated is None and w.taken_at >= stale_before and need <= w.free_tokens:
                return w, (w.rank - bonus * matches.get(home, 0)) if matches else w.rank
            return None
    return None


def _too_large_for_all(need: float, cands: list[WorkerState]) -> bool:
    """Whether no candidate's whole KV pool, saturated or not, could hold `need`. Such a request
    waits for no one: it goes to an unsaturated worker and its engine answers it (vLLM refuses a
    prompt longer than its max_model_len, which its pool always holds). One that some pool can
    hold waits for that worker: sent to a smaller pool (a mixed fleet) it was refused there,
    or never admitted, while the larger one would have served it once it drained. A second
    pass, run only when nothing else fits."""
    return all(need > w.capacity_tokens for w in cands)


@dataclass
class LlmAwareParams:
    max_waiting: float = 1.0
    max_kv_usage: float = 0.95
    max_running: float = 0.0  # 0: no cap
    # 0: no cap. Else a worker with this many prompt tokens still to prefill takes no more
    # until it drains: after a burst, the rest wait in the gateway, where the queue can put
    # short prompts first, instead of in each engine's FCFS queue. About half an engine step's
    # token budget (1024 for the 2048 of vLLM on most cards and of our worker). Off by default
    # because no engine publishes that budget (vLLM's server takes 8192 on cards of 70 GiB or
    # more but the A100), and a cap far below it would leave prefill steps short in every burst;
    # the deploy configs (deploy/, the local stack) set 1024 for our worker.
    max_prefill_backlog: float = 0.0
    # Share of max_tokens counted as KV need on top of the prompt. 0: vLLM admits by prompt
    # blocks, and reserving output too held long-history chats at the head of the gateway's
    # queue for KV they did not need yet.
    output_fraction: float = 0.0
    # A worker running as many requests as the cap its scrapes revealed (requests waiting
    # while no prompt gets through and KV is free) is saturated: the next one would wait there
    # for a whole answer to finish. Only workers that have queued at their cap have one.
    use_running_cap: bool = True
    hold_when_saturated: bool = True
    w_waiting: float = 4.0
    w_running: float = 1.0
    w_pending: float = 1.0
    w_kv: float = 8.0
    # Per 1000 prompt tokens sent but not yet prefilled: a new request's first token waits
    # behind them on that worker (prefill is FCFS). 16: a pending 250-token prompt weighs
    # 4 requests, so a burst spreads prompt tokens, not just counts, and the next arrival
    # avoids a worker busy prefilling; the backlog drains within a scrape or two, so the
    # count balance of the long-lived decodes comes back.
    w_prefill: float = 16.0
    w_gen_rate: float = 0.0
    w_prompt_rate: float = 0.0
    # Per ms of the worker's recent mean inter-token latency (its histogram, smoothed over ~1 s):
    # the decode speed a request placed there will see. 0.25: a card decoding 40 ms per token
    # slower (an L4 beside an A10) counts as 10 more running requests, so a mixed fleet's slow
    # cards take fewer requests (heterogeneous cluster: mean TPOT -2 to -5 %, P99 TPOT -13 to
    # -16 %, TTFT level); among equal cards it differs by a request or two and changed nothing
    # measurable.
    w_itl: float = 0.25
    w_age: float = 1.0
    # A worker holding the whole prefix is worth 8 queued requests: re-prefilling a long chat
    # history elsewhere costs more than queueing behind a few decodes.
    w_prefix: float = 8.0
    # How far above the best score a session's worker may score and still get the session's
    # next request (in the score's units: a running request is 1). Its worker holds what the
    # prompt's text fingerprints may not show (a history under a changed system prompt, state
    # offloaded with the session); that is worth at most what a whole cached prefix is
    # (w_prefix), and half of it, 4 requests, keeps the affinity soft: a worker 4 requests busier
    # than the best (an eighth of the ~30 a 7B A10 runs at 160 clients over 5) loses it. 0: only
    # on a tie; it never makes a saturated worker a candidate (no hold for a session's worker).
    session_slack: float = 4.0


class LlmAware(Policy):
    name: ClassVar[str] = "llm_aware"
    Params: ClassVar[type] = LlmAwareParams
    holds: ClassVar[bool] = True

    def __init__(self, params: dict[str, Any] | None = None, env: PolicyEnv | None = None) -> None:
        super().__init__(params, env)
        # Workers refreshed without a snapshot, by id; weak, since a removed worker is never
        # refreshed again and must not be ranked at every decision for good.
        self._blind: weakref.WeakValueDictionary[str, WorkerState] = weakref.WeakValueDictionary()

    def refresh(self, w: WorkerState) -> None:
        p: LlmAwareParams = self.p
        s = w.snapshot
        waiting, running, unseen = w.waiting_eff, w.running_eff, w.unseen
        if s is None:
            # No load data (unknown dialect): only leases tell; never stale, never full.
            w.score = (p.w_running * running + p.w_pending * unseen
                       + p.w_prefill * w.prefill_pending / 1000.0)
            w.free_tokens = w.capacity_tokens = _INF
            # Never stale, never KV-full, but its leases are exact: the caps that count them
            # hold here too (a cap the worker declared when it registered is all we know).
            w.saturated, w.taken_at = self._lease_bound(w, running), _INF
            # Its rank is set at each decision (choose): the others' ranks are score - w_age *
            # taken_at, and a rank of its bare score, compared with those, made the clock's
            # value decide (seconds since boot dwarf any score): it got nothing while any other
            # worker had room, whatever its leases.
            w.rank = w.score
            self._blind[w.worker_id] = w
            return
        if self._blind:
            self._blind.pop(w.worker_id, None)
        kv = s.kv_usage or 0.0
        if s.num_blocks and s.block_size:
            capacity = s.num_blocks * s.block_size
            free = (min(capacity, capacity * (1.0 - kv) - w.unseen_tokens + w.freed_tokens)
                    - w.reserved_tokens)
            kv = 1.0 - free / capacity
            w.free_tokens, w.capacity_tokens = free, capacity
        else:
            w.free_tokens = w.capacity_tokens = _INF
        sat = None
        # Only requests waiting for capacity say the next one would queue: vLLM's scheduler
        # skips those it defers (a LoRA budget full of other adapters, a KV transfer) and
        # admits the requests behind them. Counted, a worker with one deferred request was
        # saturated for every model and adapter it serves. They still weigh in the score.
        if waiting - s.waiting_deferred >= p.max_waiting:
            sat = "waiting"
        elif kv >= p.max_kv_usage:
            sat = "kv_usage"
        else:
            sat = self._lease_bound(w, running)
        w.saturated = sat
        w.taken_at = s.taken_at
        w.score = (
            p.w_waiting * waiting
            + p.w_running * running
            + p.w_pending * unseen
            + p.w_kv * kv
            + p.w_prefill * w.prefill_pending / 1000.0
            + p.w_gen_rate * (s.gen_tps or 0.0) / 1000.0
            + p.w_prompt_rate * (s.prompt_tps or 0.0) / 1000.0
            + p.w_itl * (s.itl_mean_s or 0.0) * 1000.0
        )
        # score + w_age * (now - taken_at) = rank + w_age * now: the same `now` for every
        # candidate, so decisions compare `rank` and never compute ages.
        w.rank = w.score - p.w_age * s.taken_at

    def _lease_bound(self, w: WorkerState, running: float) -> str | None:
        """The guards that count what this scheduler sent (with or without load data)."""
        p: LlmAwareParams = self.p
        if p.max_running and max(running, w.in_flight) >= p.max_running:
            return "running"
        if p.use_running_cap and max(running, w.in_flight) >= w.running_cap.cap:
            # Open leases too: an engine's gauges lag a request it was sent (ours update at
            # the end of the step that admits it, 100+ ms on a busy CPU), so a scrape in
            # that gap shows its slot free; a request sent on that view waited 10-15 s at
            # a cap of 2. A lease stays open only until the gateway sees the answer end.
            return "running_cap"
        if p.max_prefill_backlog and w.prefill_pending >= p.max_prefill_backlog:
            return "prefill_backlog"
        return None

    def choose(self, req: Request, cands: list[WorkerState], now: float) -> Pick | None:
        p: LlmAwareParams = self.p
        need = self.kv_need(req)
        hashes = req.prefix_hashes
        matches = self.env.prefix_index.match(self.prefix_keys(req)) if hashes and p.w_prefix else None
        stale_before = now - self.env.stale_after_s
        age_term = p.w_age * now
        if self._blind:
            # Workers without load data have no age: rank as if their data were fresh now.
            for w in self._blind.values():
                w.rank = w.score - age_term
        best = None
        best_r = _INF
        # The best unsaturated worker whose whole pool is smaller than this request: used only
        # when no candidate's pool could hold it (see _too_large_for_all).
        over = None
        over_r = _INF
        if matches:
            bonus = p.w_prefix / len(hashes)  # of the whole prompt's chunks (keys may be fewer)
            for w in cands:
                if w.saturated is None and w.taken_at >= stale_before:
                    r = w.rank - bonus * matches.get(w.worker_id, 0)
                    if need <= w.free_tokens:
                        if r < best_r:
                            best, best_r = w, r
                    elif need > w.capacity_tokens and r < over_r:
                        over, over_r = w, r
        else:
            for w in cands:
                # unsaturated, fresh data, and room for this request's KV
                if w.saturated is None and w.taken_at >= stale_before:
                    r = w.rank
                    if need <= w.free_tokens:
                        if r < best_r:
                            best, best_r = w, r
                    elif need > w.capacity_tokens and r < over_r:
                        over, over_r = w, r
        if best is None and over is not None and _too_large_for_all(need, cands):
            best, best_r = over, over_r
        rendezvous = None
        if best is not None and req.session is not None:
            home = self.env.sessions.worker_of(req.session, now)
            if home is None:
                # No worker kept for it (new, idle past the TTL, its worker gone): its home is
                # its rendezvous worker, the one the gateway's fallback picks for it, so the two
                # agree and a scheduler restarted with an empty table puts it back where it was.
                rendezvous = home = rendezvous_pick(req.session, cands).worker_id
            if home != best.worker_id:
                bonus = p.w_prefix / len(hashes) if matches else 0.0
                stay = _home_rank(home, cands, need, stale_before, matches, bonus)
                if stay is not None and stay[1] <= best_r + p.session_slack:
                    best, best_r = stay
        if best is not None:
            detail: dict[str, Any] = {"saturated": None}
            if matches:
                detail["prefix_match"] = matches.get(best.worker_id, 0)
            if rendezvous is not None and best.worker_id == rendezvous:
                detail["rendezvous"] = True  # a session placed anew, where the fallback would
            return Pick(best, best_r + age_term, detail)
        if p.hold_when_saturated:
            return None
        # Every candidate is saturated and holding is off: the least bad one.
        w = min(cands, key=_rank)
        return Pick(w, w.rank + age_term, {"saturated": self._why(w, need, stale_before)})

    @staticmethod
    def _why(w: WorkerState, need: float, stale_before: float) -> str:
        if w.taken_at < stale_before:
            return "stale"
        return w.saturated or "kv_headroom"

    def kv_need(self, req: Request) -> float:
        # The same need its headroom guard checks: an engine admits on the prompt's blocks and
        # the answer's grow step by step, which later scrapes show. Counting all of max_tokens
        # until the next scrape made a KV-bound worker look full and held requests that fit.
        return req.prompt_tokens + self.p.output_fraction * self.max_tokens(req)

    def on_issued(self, req: Request, w: WorkerState, now: float) -> str | None:
        if req.prefix_hashes and self.p.w_prefix:
            self.env.prefix_index.record(self.prefix_keys(req), w.worker_id, now)
        return self.record_session(req, w, now)
