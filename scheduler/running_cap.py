"""A worker's running-request cap (vLLM's --max-num-seqs, SGLang's --max-running-requests):
declared by whoever knows it, or learnt from the worker's metrics, since no engine's /metrics
publishes it.

Why: a worker whose running slots are all taken makes the next request wait for a whole answer
to finish, however much KV it has free. Until that request shows as waiting, the scrape looks
like any other worker's (two real vLLM servers, --max-num-seqs 2 and 8, each running 2: the
request that went to the small one waited 34 s for its first token while the large one had six
slots free). Once the cap is known, llm_aware treats a worker running that many (leases sent
since the scrape included) as saturated, before a request waits there.

How: an engine is at its cap when requests wait and yet none is admitted, although it has KV
to spare: waiting >= 1 (not counting those vLLM reports deferred by a LoRA budget or a KV
transfer), the running count unchanged, the prefilled-prompt counter unchanged
(nobody got through prefill), KV usage under KV_BOUND. A prompt that needs several prefill
steps can look like that for a moment, so the state must hold for PLATEAU_S. A cap is dropped
when the worker runs more than it (it was wrong), when it restarted (its prompt counter went
back), and after TTL_S (so that a cap learnt from an
odd stall, e.g. requests waiting for a grammar, or for a LoRA adapter on an engine that does
not report them deferred, cannot starve a worker for long); it is learnt again the next time
the worker queues at it.

Declared: the operator's config (`worker_max_running`), the worker's registration
(`max_running`), or TGI's /info (`max_batch_size`) can say it up front, so that the first burst,
sent before any scrape could show a queue, already respects it (with two real vLLM servers,
--max-num-seqs 2 and 8, half of the first wave went to the small one). The cap in force is
the smaller of the declared and the learnt. A declaration the worker disproves (it runs more)
is set aside, with a warning, until a different value is declared.
"""

from __future__ import annotations

import math

from scheduler.scrape.snapshot import LoadSnapshot

KV_BOUND = 0.8  # at or above, requests may be waiting for KV: no cap can be read
PLATEAU_S = 1.0
TTL_S = 60.0


# The largest count taken: caps and pool sizes are used as floats, and an int past float's
# range (JSON allows 400 digits) raised OverflowError there: a registration announcing one was
# a 500, and the worker's later registrations too (its cap was kept before the error).
MAX_COUNT = 1 << 53


def is_positive_int(value: object) -> bool:
    """A cap (or a pool size) as a JSON body or an engine's info may give it: bools are ints
    in Python but never a count."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 < value <= MAX_COUNT


class RunningCap:
    __slots__ = ("_disproved", "_prompts", "_running", "_since", "cap", "declared", "learnt", "learnt_at")

    def __init__(self) -> None:
        self.cap = math.inf  # in force: min(declared, learnt)
        self.declared = math.inf
        self._disproved = math.inf  # a declared value the worker ran more than
        self.learnt = math.inf
        self.learnt_at = -math.inf
        self._since: float | None = None  # start of the current at-cap-looking plateau
        self._running = -1.0
        self._prompts: float | None = None

    def declare(self, cap: float | None) -> bool:
        """The cap as configured or announced (None: none); True when the cap in force changed.
        Repeating a value the worker disproved does not bring it back."""
        before = self.cap
        cap = math.inf if cap is None else float(cap)
        if math.isinf(cap) or cap != self._disproved:
            self.declared, self._disproved = cap, math.inf
        self.cap = min(self.declared, self.learnt)
        return self.cap != before

    def observe(self, snap: LoadSnapshot) -> bool:
        """Take one scrape; True when the cap in force changed (learnt, dropped, disproved)."""
        before = self.cap
        now, running = snap.taken_at, snap.running
        if running > self.declared:
            self._disproved, self.declared = self.declared, math.inf
        prompts = snap.prefilled_tokens_total
        # A prompt counter that went back is a restarted engine, maybe with another
        # --max-num-seqs. A cap learnt from the old process held the new one to it for up to
        # TTL_S: llm_aware sends no more than the cap, so the worker could never run more and
        # disprove it.
        restarted = prompts is not None and self._prompts is not None and prompts < self._prompts
        if restarted or running > self.learnt or now - self.learnt_at > TTL_S:
            self.learnt, self.learnt_at = math.inf, -math.inf
        stuck = (snap.waiting - snap.waiting_deferred >= 1 and running >= 1 and prompts is not None
                 and snap.kv_usage is not None and snap.kv_usage < KV_BOUND)
        if not stuck:
            self._since = None
        elif self._since is None or running != self._running or prompts != self._prompts:
            self._since = now  # a plateau starts (or starts again: something moved)
        elif now - self._since >= PLATEAU_S:
            self.learnt, self.learnt_at = running, now
        self._running, self._prompts = running, prompts
        self.cap = min(self.declared, self.learnt)
        return self.cap != before

    @property
    def disproved(self) -> float:
        """The declared cap the worker ran more than (inf: none)."""
        return self._disproved

    def describe(self) -> str:
        """For the log line of a change."""
        if math.isinf(self.cap):
            if not math.isinf(self._disproved):
                return f"none (the declared {self._disproved:g} was disproved: the worker ran more)"
            return "none"
        how = "declared" if self.cap == self.declared else "learnt: requests wait with KV free"
        return f"{self.cap:g} ({how})"
