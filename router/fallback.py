"""Routing used while the scheduler is unreachable: round robin, or by session, with passive
health.

The worker list is the last healthy set the scheduler reported (refreshed while
it is up) plus the static --workers. A worker that fails a request rests for a
cooldown and then gets traffic again (the next failure sends it back to rest).
Static workers whose models are unknown are assumed to serve any model. A worker
the scheduler last listed as cordoned (an operator's maintenance) is kept in the
list, since stored responses are looked up there, but is not picked; a WebSocket on it leaves
it at its next request (is_cordoned, router/ws_relay.py), in either mode.

A request with a session key (router/sessions.py: the gateway's --session-header) is placed by
rendezvous (highest-random-weight) hashing instead (scheduler/rendezvous.py): of the usable
workers for its model, the one whose score for (key, worker URL) is highest. So a session's
turns stay on one worker (and its prefix cache) while the scheduler is away, every gateway
replica picks the same one without sharing state (the score is a fixed integer mix, not
Python's salted hash()), and when a worker rests, is cordoned, excluded or gone only its own
sessions move, each to its next-highest worker. The URL names a worker, not its id: a static
--workers entry's id is its URL, and a replica that never heard the scheduler's list knows the
worker by that alone. The scheduler places a session it keeps no worker for (new, idle past its
TTL, its worker gone; all of them after a restart) on the same rendezvous worker while that
worker has room (its llm_aware and session policies), so a session keeps its worker when the
scheduler goes away and when it comes back, restarted with an empty table or not. Only a session
the scheduler had moved off its rendezvous worker (load, a failure) changes worker: this does not
know of the move, so it goes back to its rendezvous worker while the scheduler is away, and to
the worker the scheduler's table still holds when it returns. Requests without a session key go
round robin.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from scheduler.clip import clip_repr
from scheduler.rendezvous import rendezvous_score, url_seed


class NoWorkerError(Exception):
    """No usable worker for the model (unknown_model: no known worker serves it at all)."""

    def __init__(self, message: str, unknown_model: bool = False) -> None:
        super().__init__(message)
        self.unknown_model = unknown_model


@dataclass
class KnownWorker:
    worker_id: str
    url: str
    models: frozenset[str] | None  # None: unknown, assume any
    down_until: float = 0.0
    failures: int = field(default=0)
    cordoned: bool = False  # the scheduler's last word: no new requests for it
    seed: int = field(init=False, repr=False)  # url_seed(url), for sessions' rendezvous picks

    def __post_init__(self) -> None:
        self.seed = url_seed(self.url)

    def serves(self, model: str) -> bool:
        return self.models is None or model in self.models


class FallbackRouter:
    def __init__(self, static_urls: list[str], cooldown_s: float) -> None:
        self.cooldown_s = cooldown_s
        self._static = [KnownWorker(url, url, None) for url in static_urls]
        self._from_scheduler: list[KnownWorker] = []
        self._by_url: dict[str, KnownWorker] = {w.url: w for w in self._static}
        self._all: list[KnownWorker] = list(self._static)
        self._cordoned: frozenset[str] = frozenset()
        self._next = 0

    @property
    def workers(self) -> list[KnownWorker]:
        return self._all

    def update_from_scheduler(self, views: list[tuple[str, str, list[str]]],
                              cordoned: frozenset[str] = frozenset()) -> None:
        """views: (worker_id, url, models) of the workers the scheduler calls healthy;
        cordoned: the ids of the workers an operator cordoned (healthy or not)."""
        self._cordoned = cordoned
        fresh: list[KnownWorker] = []
        for worker_id, url, models in views:
            url = url.rstrip("/")
            old = self._by_url.get(url)
            w = KnownWorker(worker_id, url, frozenset(models), cordoned=worker_id in cordoned)
            if old is not None:
                w.down_until, w.failures = old.down_until, old.failures
            fresh.append(w)
        self._from_scheduler = fresh
        urls = {w.url for w in fresh}
        self._all = fresh + [w for w in self._static if w.url not in urls]
        self._by_url = {w.url: w for w in self._all}

    def is_cordoned(self, worker_id: str) -> bool:
        """Whether the scheduler last listed the worker as cordoned."""
        return worker_id in self._cordoned

    @property
    def static_urls(self) -> list[str]:
        return [w.url for w in self._static]

    def set_static_models(self, url: str, models: list[str]) -> None:
        """Models a static worker listed at its /v1/models (until then: any model)."""
        for w in self._static:
            if w.url == url:
                w.models = frozenset(models)

    def models(self) -> set[str]:
        out: set[str] = set()
        for w in self._all:
            if w.models:
                out |= w.models
        return out

    def pick(self, model: str, exclude: list[str], session: int | None = None) -> KnownWorker:
        """The next worker for `model` not in `exclude` (ids or URLs): round robin, or, with a
        session key, the usable worker of highest rendezvous score (the module's docstring).
        One that rests is picked only when all do (the one resting longest). Raises
        NoWorkerError."""
        ws = self._all
        if any(w.models is not None for w in ws) and not any(w.models and model in w.models for w in ws):
            # Workers whose models are still unknown (never answered /v1/models) are not
            # taken as proof that someone serves a model no known worker lists.
            raise NoWorkerError(f"no known worker serves model {clip_repr(model)}", unknown_model=True)
        n = len(ws)
        now = time.monotonic()
        resting: KnownWorker | None = None
        best: KnownWorker | None = None  # a session's pick so far, and its score
        best_score = -1
        serving = cordoned = 0
        for i in range(n):
            w = ws[(self._next + i) % n]
            if not w.serves(model):
                continue
            serving += 1
            if w.cordoned:
                cordoned += 1
                continue
            if w.worker_id in exclude or w.url in exclude:
                continue
            if w.down_until > now:
                if resting is None or w.down_until < resting.down_until:
                    resting = w
                continue
            if session is None:
                self._next = (self._next + i + 1) % n
                return w
            score = rendezvous_score(session, w.seed)
            if score > best_score:
                best, best_score = w, score
        if best is not None:
            return best
        if resting is not None:  # everyone is resting: try the one resting longest rather than fail
            return resting
        if serving == 0:
            raise NoWorkerError(f"no known worker serves model {clip_repr(model)}", unknown_model=True)
        if cordoned == serving:
            raise NoWorkerError(f"every worker serving model {clip_repr(model)} is cordoned")
        raise NoWorkerError(f"every worker serving model {clip_repr(model)} failed this request")

    def mark_failed(self, url: str) -> None:
        w = self._by_url.get(url.rstrip("/"))
        if w is not None:
            w.failures += 1
            w.down_until = time.monotonic() + self.cooldown_s

    def mark_ok(self, url: str) -> None:
        w = self._by_url.get(url)
        if w is not None and w.failures:
            w.failures = 0
            w.down_until = 0.0
