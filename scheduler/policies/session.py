"""session: vLLM production-stack's `--routing-logic session`, for operators who want exactly
that. A session's requests stay on the worker its first went to while that worker can be
chosen at all (routable, not cordoned, not excluded by a failed attempt), whatever its load; a
new session, and a request without one, goes to the worker with the fewest open requests
(least_request). It never holds a request. llm_aware keeps sessions too, softly (its
`session_slack`): it moves a session off a busy or saturated worker.
"""

from __future__ import annotations

from typing import ClassVar

from scheduler.policies.base import Pick, Request
from scheduler.policies.simple import LeastRequest
from scheduler.registry import WorkerState

_EMPTY: dict = {}


class SessionAffinity(LeastRequest):
    name: ClassVar[str] = "session"

    def choose(self, req: Request, cands: list[WorkerState], now: float) -> Pick | None:
        if req.session is not None:
            home = self.env.sessions.worker_of(req.session, now)
            if home is not None:
                for w in cands:
                    if w.worker_id == home:
                        return Pick(w, w.score, _EMPTY)
        return super().choose(req, cands, now)

    def on_issued(self, req: Request, w: WorkerState, now: float) -> str | None:
        return self.record_session(req, w, now)
