"""session: vLLM production-stack's `--routing-logic session`, for operators who want exactly
that. A session's requests stay on the worker its first went to while that worker can be
chosen at all (routable, not cordoned, not excluded by a failed attempt), whatever its load. A
session with no worker kept (new, idle past its TTL, its worker gone) starts on its rendezvous
worker (scheduler/rendezvous.py: a hash of its key over the candidates' URLs, as
production-stack places sessions by a hash ring) under that same rule, whatever its load: the
worker the gateway's fallback picks for it, so a session keeps its worker when the scheduler
goes away, comes back, or restarts with an empty table. A session whose kept worker left
rotation, and a request without a session, go to the worker with the fewest open requests
(least_request). It never holds a request. llm_aware keeps sessions too, softly (its
`session_slack`): it moves a session off a busy or saturated worker.
"""

from __future__ import annotations

from typing import ClassVar

from scheduler.policies.base import Pick, Request
from scheduler.policies.simple import LeastRequest
from scheduler.registry import WorkerState
from scheduler.rendezvous import rendezvous_pick

_EMPTY: dict = {}
_RENDEZVOUS = {"rendezvous": True}  # the decision's reason: placed anew, where the fallback would


class SessionAffinity(LeastRequest):
    name: ClassVar[str] = "session"

    def choose(self, req: Request, cands: list[WorkerState], now: float) -> Pick | None:
        if req.session is not None:
            home = self.env.sessions.worker_of(req.session, now)
            if home is None:
                w = rendezvous_pick(req.session, cands)
                return Pick(w, w.score, _RENDEZVOUS)
            for w in cands:
                if w.worker_id == home:
                    return Pick(w, w.score, _EMPTY)
        return super().choose(req, cands, now)

    def on_issued(self, req: Request, w: WorkerState, now: float) -> str | None:
        return self.record_session(req, w, now)
