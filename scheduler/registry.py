"""Every known worker, its health, latest load snapshot and lease accounting."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from urllib.parse import urlsplit

from scheduler.health import HALF_OPEN, Health
from scheduler.running_cap import RunningCap
from scheduler.scrape.rates import RateTracker
from scheduler.scrape.snapshot import LoadSnapshot

log = logging.getLogger(__name__)

WHOLE_METRICS_PATH = "/metrics"


def worker_id_for(url: str) -> str:
    parts = urlsplit(url)
    return parts.netloc or url


class WorkerState:
    """One worker. The lease counters are the load the latest scrape cannot show yet."""

    def __init__(self, url: str, *, worker_id: str | None = None, models=(), engine: str | None = None,
                 source: str = "static") -> None:
        self.url = url.rstrip("/")
        self.worker_id = worker_id or worker_id_for(self.url)
        self.models: set[str] = set(models)
        self.models_from_registration = bool(models)
        self.engine_hint = engine
        self.sources: set[str] = {source}
        self.health = Health()
        self.dialect: str | None = None
        self.snapshot: LoadSnapshot | None = None
        self.rates = RateTracker()
        self.models_fetched_at = -math.inf
        # KV pool size in tokens from the engine's info endpoint, for engines whose /metrics
        # shows the KV in use but not the pool (TGI: /info max_batch_total_tokens).
        self.info_kv_capacity: int | None = None
        self.info_fetched_at = -math.inf
        self.scraping = False
        # Where /metrics is read: the dialect's filtered path once the dialect is known
        # (Dialect.filtered_metrics_path); back to the whole page after a filtered scrape that
        # failed or came back without the series or unfiltered, and for good after a few.
        self.metrics_path = WHOLE_METRICS_PATH
        self.filtered_misses = 0
        self.whole_page_bytes = 0  # size of the last whole page, to tell an ignored filter
        self.expires_at: float | None = None  # registrations expire without heartbeats
        self.running_cap = RunningCap()  # declared, or learnt from the scrapes
        self.announced_running_cap: int | None = None  # by its registration or TGI's /info
        # Lease accounting.
        self.leases: dict[str, object] = {}
        self.unseen = 0  # leases issued after the snapshot was taken
        self.unseen_tokens = 0.0
        self.finished_since = 0  # leases the snapshot saw that were released since
        # Leases the snapshot counted as sent yet no longer shows running or waiting: they
        # finished at the engine before the scrape and their releases have not come yet. Those
        # releases are no news (the scrape already freed their slots), so they must not count
        # in finished_since a second time: a worker at its running cap would look one free
        # (seen on our worker, cap 2: a request sent there waited 15 s for a slot).
        self.shown_finished = 0
        self.freed_tokens = 0.0  # their KV (prompt + output, as the gateway reported), freed since
        # Freed KV held for a finished request's follow-up (scheduler/reservations.py): not
        # free for anyone else until claimed or expired.
        self.reserved_tokens = 0.0
        # Prefill backlog: prompt tokens sent here that the worker has not reported as
        # prefilled yet (its prompt-token counter lags them). It is the queue of work that
        # stands between a new request and its first token; running counts cannot show it.
        # (An engine whose prompt counter moves when a request arrives, like TGI's input length
        # histogram, recorded at validation in its router, drains it at the next scrape: there
        # the backlog only spans the time between scrapes, and queued prompts show as waiting.)
        self.prefill_backlog = 0.0
        self.open_prompt_tokens = 0.0  # prompts of open leases: the backlog's ceiling
        self.prompt_total_seen: float | None = None
        # The counter moves only when a prompt is done, yet the engine prefills all along:
        # at each scrape, the tokens its recent prefill rate has done since the counter last
        # moved count as progress, so a worker about to run out of prompt work takes more a
        # scrape or two before its counter shows the drain.
        self.prefill_progress = 0.0
        self._progress_since: float | None = None
        # Prompts the gateway saw finish (their first token streamed back) and already took
        # off the backlog; the prompt counter reports them too, a scrape later. Kept in two
        # generations, so a report the counter never matches (a wrong size, or a scrape
        # that counted it before the report came) stops absorbing drains after one scrape.
        self.prefilled_credit_old = 0.0
        self.prefilled_credit_new = 0.0
        # Policy-maintained fields.
        self.score = 0.0
        self.free_tokens = math.inf
        self.saturated: str | None = None
        self.capacity_tokens = math.inf
        self.taken_at = math.inf  # of the snapshot the policy last saw (inf: no data yet)
        self.rank = 0.0

    # ---- derived load, reconciled with leases ------------------------------------------

    @property
    def in_flight(self) -> int:
        return len(self.leases)

    @property
    def metrics_filtered(self) -> bool:
        """Scraped for its dialect's series alone (not the whole page)."""
        return self.metrics_path != WHOLE_METRICS_PATH

    @property
    def waiting_eff(self) -> float:
        s = self.snapshot
        if s is None:
            return 0.0
        # A finished request frees a slot that a waiting one takes first.
        return max(0.0, s.waiting - self.finished_since)

    @property
    def running_eff(self) -> float:
        s = self.snapshot
        if s is None:
            return float(self.unseen)
        freed = max(0.0, self.finished_since - s.waiting)
        return max(0.0, s.running - freed) + self.unseen

    def data_age_s(self, now: float | None = None) -> float | None:
        if self.snapshot is None:
            return None
        return (time.monotonic() if now is None else now) - self.snapshot.taken_at

    @property
    def routable(self) -> bool:
        h = self.health
        if h.state == HALF_OPEN:
            # A single trial at a time. Leases from before it went down do not count: a worker
            # taken out while long streams ran on it would otherwise stay out until the last
            # of them ended (up to the gateway's request timeout), with its scrapes fine.
            return not any(lease.trial for lease in self.leases.values())
        return h.routable

    def on_snapshot(self, snap: LoadSnapshot, visibility_lag_s: float) -> None:
        """Leases issued before the scrape was sent (minus a lag for the gateway to
        forward) are in the worker's own numbers now: stop counting them twice."""
        self.snapshot = snap
        if self.running_cap.observe(snap):
            self._log_running_cap()
        cutoff = snap.taken_at - visibility_lag_s
        unseen, tokens = 0, 0.0
        for lease in self.leases.values():
            lease.unseen = lease.issued_at > cutoff
            if lease.unseen:
                unseen += 1
                tokens += lease.tokens
        self.unseen, self.unseen_tokens, self.finished_since = unseen, tokens, 0
        # Exact when all of the worker's traffic comes through this scheduler; other traffic
        # only makes it smaller (the old, optimistic count), and a seen lease the engine has
        # not received yet makes it larger (the worker looks busier until the next scrape).
        self.shown_finished = max(0, len(self.leases) - unseen - int(snap.running + snap.waiting))
        self.freed_tokens = 0.0
        total = snap.prefilled_tokens_total
        drained = False
        if total is not None:
            prev = self.prompt_total_seen
            if prev is not None and total > prev:  # a drop is a restarted worker: no drain
                self.prefill_backlog = max(0.0, self.prefill_backlog - self._absorb_credit(total - prev))
                drained = True
            self.prompt_total_seen = total
        self.prefilled_credit_old, self.prefilled_credit_new = self.prefilled_credit_new, 0.0
        if drained or self.prefill_backlog <= 0.0 or self._progress_since is None:
            self._progress_since, self.prefill_progress = snap.taken_at, 0.0
        else:
            elapsed = snap.taken_at - self._progress_since
            self.prefill_progress = min(self.prefill_backlog, (snap.prefill_tps or 0.0) * elapsed)

    def declare_running_cap(self, cap: float | None) -> None:
        """What the config, the registration or the engine's info says the cap is."""
        if self.running_cap.declare(cap):
            self._log_running_cap()

    def _log_running_cap(self) -> None:
        rc = self.running_cap
        level = logging.WARNING if math.isinf(rc.cap) and not math.isinf(rc.disproved) else logging.INFO
        log.log(level, "%s: running cap %s", self.worker_id, rc.describe())

    def _absorb_credit(self, counted: float) -> float:
        """The part of a prompt-counter increase that is not a prompt already reported
        prefilled by the gateway (those left the backlog when their first token came)."""
        take = min(counted, self.prefilled_credit_old)
        self.prefilled_credit_old -= take
        counted -= take
        take = min(counted, self.prefilled_credit_new)
        self.prefilled_credit_new -= take
        return counted - take

    def on_prefilled(self, prompt: float, now: float) -> None:
        """A request's first token reached the gateway: its prompt is prefilled now, a scrape
        before the worker's counter can say so."""
        self.prefill_backlog = max(0.0, self.prefill_backlog - prompt)
        self.open_prompt_tokens = max(0.0, self.open_prompt_tokens - prompt)
        self.prefilled_credit_new += prompt
        # The progress the prefill rate implies since the counter last moved covers this
        # prompt too (if the rate kept up): take the prompt out of it, and its time out of
        # the span the next scrape extrapolates over.
        self.prefill_progress = max(0.0, self.prefill_progress - prompt)
        rate = self.snapshot.prefill_tps if self.snapshot is not None else None
        if self._progress_since is not None and rate:
            self._progress_since = min(now, self._progress_since + prompt / rate)

    @property
    def prefill_pending(self) -> float:
        """The prefill backlog less the progress the worker has likely made on it since its
        counter last moved: what a policy should weigh."""
        return max(0.0, self.prefill_backlog - self.prefill_progress)

    def view(self, now: float) -> dict:
        age = self.data_age_s(now)
        return {
            "worker_id": self.worker_id,
            "url": self.url,
            "healthy": self.health.routable,
            "state": self.health.state,
            "dialect": self.dialect,
            "metrics_filtered": self.metrics_filtered,
            "models": sorted(self.models),
            "snapshot": self.snapshot.as_dict() if self.snapshot else None,
            "data_age_ms": None if age is None else round(age * 1000.0, 1),
            "in_flight_leases": self.in_flight,
            "unseen_leases": self.unseen,
            "prefill_backlog_tokens": round(self.prefill_backlog),
            "running_cap": None if math.isinf(self.running_cap.cap) else self.running_cap.cap,
            "running_cap_declared": (None if math.isinf(self.running_cap.declared)
                                     else self.running_cap.declared),
            "score": None if math.isinf(self.score) else round(self.score, 4),
            "saturated": self.saturated,
            "sources": sorted(self.sources),
            "last_error": self.health.last_error,
            "down_cause": self.health.down_cause,
        }


class Registry:
    """Workers by id, plus a model -> workers index for the decision's first filter."""

    def __init__(self, model_gone_grace_s: float = 0.0) -> None:
        self.model_gone_grace_s = model_gone_grace_s
        self.workers: dict[str, WorkerState] = {}
        self.by_model: dict[str, list[WorkerState]] = {}
        # URL -> the worker there: one engine found by two discovery sources under two ids
        # (a pod's name, a registration's host:port) must be one worker, or it is counted as
        # two and draws twice its share. Looked up on every registration heartbeat.
        self._by_url: dict[str, WorkerState] = {}
        # (source, the id that source gave it) -> the id the worker is known by here. A worker
        # found at one URL by two sources keeps the first one's id; the other source still
        # names it by its own (a pod's name, a static URL's host:port) when it drops it.
        self._aliases: dict[tuple[str, str], str] = {}
        self.listeners: list[Callable[[], None]] = []  # called when membership/models change
        # Model -> when its last worker left (monotonic): a model that is only between workers
        # (its one pod restarting, a rollout, a registration that lapsed) is not "no such model".
        self.gone_since: dict[str, float] = {}

    def add(self, worker: WorkerState) -> WorkerState:
        """Add a worker, or merge it into the one already known: by the id its source gave it
        before, by its id, or by its URL. One URL is one worker whatever announced it (a
        --workers entry and the pod Kubernetes found there, under two ids): as two, the engine
        drew two shares of the traffic and each counted only its own leases."""
        source = next(iter(worker.sources))  # a new WorkerState has the one source it came from
        key = (source, worker.worker_id)
        existing = self.workers.get(self._aliases.get(key, worker.worker_id))
        if existing is not None and existing.url != worker.url and source not in existing.sources \
                and worker_id_for(existing.url) != worker_id_for(worker.url):
            # Its id is another source's worker somewhere else (a StatefulSet pod, listed
            # statically too, came back at a new address under its old name): a new worker.
            existing = None
        if existing is None:
            existing = self._by_url.get(worker.url)
        if existing is None:
            worker.worker_id = self._free_id(worker.worker_id)
            self.workers[worker.worker_id] = worker
            self._by_url.setdefault(worker.url, worker)
            self._aliases[key] = worker.worker_id
            self.reindex()
            return worker
        self._aliases[key] = existing.worker_id
        existing.sources |= worker.sources
        if worker.models_from_registration:
            existing.models = set(worker.models)
            existing.models_from_registration = True
            self.reindex()
        if worker.engine_hint:
            existing.engine_hint = worker.engine_hint
        return existing

    def _free_id(self, worker_id: str) -> str:
        """`worker_id`, or that id with a suffix where another worker has it already."""
        candidate, n = worker_id, 1
        while candidate in self.workers:
            n += 1
            candidate = f"{worker_id}~{n}"
        return candidate

    def remove(self, worker_id: str, source: str | None = None) -> WorkerState | None:
        """Drop `source`'s claim on the worker it calls `worker_id` (every claim without a
        source); the worker goes once no source claims it."""
        if source is None:
            w = self.workers.get(worker_id)
        else:
            w = self.workers.get(self._aliases.pop((source, worker_id), worker_id))
        if w is None:
            return None
        if source is not None:
            claims = [k for k, wid in self._aliases.items() if wid == w.worker_id]
            if not any(s == source for s, _ in claims):
                w.sources.discard(source)
            if w.sources:
                return None  # still known through another discovery source
        for k in [k for k, wid in self._aliases.items() if wid == w.worker_id]:
            del self._aliases[k]
        del self.workers[w.worker_id]
        if self._by_url.get(w.url) is w:
            del self._by_url[w.url]
            other = next((o for o in self.workers.values() if o.url == w.url), None)
            if other is not None:
                self._by_url[w.url] = other
        self.reindex()
        return w

    def recently_gone(self, model: str, now: float) -> bool:
        """Whether the model's last worker left within --model-gone-grace-s."""
        since = self.gone_since.get(model)
        return since is not None and now - since <= self.model_gone_grace_s

    def by_url(self, url: str) -> WorkerState | None:
        """The worker at this URL, whatever its id."""
        return self._by_url.get(url.rstrip("/"))

    def set_models(self, worker: WorkerState, models: set[str]) -> None:
        if models != worker.models:
            worker.models = models
            self.reindex()

    def reindex(self) -> None:
        index: dict[str, list[WorkerState]] = {}
        for w in self.workers.values():
            for m in w.models:
                index.setdefault(m, []).append(w)
        now = time.monotonic()
        for model in self.by_model.keys() - index.keys():
            self.gone_since[model] = now
        for model in [m for m, t in self.gone_since.items()
                      if m in index or now - t > self.model_gone_grace_s]:
            del self.gone_since[model]
        self.by_model = index
        for fn in self.listeners:
            fn()
