"""Getting a worker for a request: ask the scheduler, queue when it says wait, and
fall back to round robin while it is unreachable.

Scheduler availability is one shared state per gateway process:
- The first failed call starts the clock and a background probe.
- Requests keep retrying the scheduler every try period until
  --wait-schedule-timeout-ms has passed since the first failure; then the gateway
  switches to fallback mode (round robin over last-known healthy workers; a session's
  requests by rendezvous hashing, to one worker: router/fallback.py).
- The probe (GET /health every --scheduler-probe-ms) switches back the moment the
  scheduler answers. Both switch durations are logged and exported.
- A scheduler that refuses the gateway's token (401/403: --scheduler-token is not its
  --gateway-token) counts as unavailable, not as a bad request: every client's request got a
  400 instead. The switch is the same, with one ERROR that names the 401 when it is first
  seen (per switch, not per request), and the probe then also asks whether the token is
  taken (an empty batch call: /health takes no token), so round robin lasts until it is.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp

from router.down_watch import DownWatch
from router.fallback import FallbackRouter, NoWorkerError
from router.flap_guard import FlapGuard
from router.metrics import RouterMetrics
from router.queue import AdmissionQueue, QueueTimeout
from router.sched_pipe import SchedulerPipe, orphan_release
from scheduler.client import (
    SchedulerAuthError,
    SchedulerClient,
    SchedulerError,
    SchedulerUnavailableError,
    UnknownModelError,
)
from scheduler.clip import clip_repr
from scheduler.tls import PeerContext

if TYPE_CHECKING:
    from router.trace_collect import RequestTrace

log = logging.getLogger("router.scheduling")
# How long the gateway stops passing the queue after a scheduler said it makes no follow-up holds.
_PASSING_PAUSE_S = 60.0


@dataclass(slots=True, weakref_slot=True, eq=False)  # identity: a member of a WeakSet
class Route:
    worker_id: str
    url: str
    lease_id: str | None
    policy: str
    reason: dict
    fallback: bool = False
    released: bool = False
    charge: float = 0.0  # its flow's estimated cost in the queue's token turns (fair_share)
    renew_at: float = 0.0  # when its lease is next renewed (Scheduling.open_leases)


class PinnedWorkerGone(Exception):
    """The one worker a request may go to (it stores what the request continues) left the pool."""


class Scheduling:
    def __init__(
        self,
        client: SchedulerClient | None,
        fallback: FallbackRouter,
        queue: AdmissionQueue,
        metrics: RouterMetrics,
        *,
        wait_schedule_timeout_s: float,
        try_period_s: float,
        probe_period_s: float,
        schedule_wait_ms: int,
        workers_refresh_s: float,
        followup_pass_s: float = 0.0,
        lease_renew_s: float = 0.0,
    ) -> None:
        self.client = client
        # Optional pipelined channel for the non-waiting schedule call and releases.
        self.pipe: SchedulerPipe | None = None
        self.fallback = fallback
        self.queue = queue
        self.metrics = metrics
        self.wait_timeout_s = wait_schedule_timeout_s
        self.try_period_s = try_period_s
        self.probe_period_s = probe_period_s
        self.schedule_wait_ms = schedule_wait_ms
        self.followup_pass_s = followup_pass_s
        # Set when the scheduler answers that it holds no room for follow-ups at all: passing
        # would cost one call per queued arrival for nothing. Tried again after a while, in
        # case the scheduler was restarted with holds on.
        self._passing_paused_until = 0.0
        self.workers_refresh_s = workers_refresh_s
        # No scheduler configured: round robin over --workers from the start.
        self.fallback_active = client is None
        self.down_since: float | None = None
        self.last_switch_s: dict[str, float] = {}
        self._probe: asyncio.Task | None = None
        self._fallback_timer: asyncio.TimerHandle | None = None  # the switch, while it is down
        self._flaps = FlapGuard()  # a scheduler whose /health answers but whose calls fail
        self.down_watch = DownWatch()  # non-stream requests on workers it finds down
        # A schedule call failed since the scheduler was marked down: then only a call that
        # succeeds ends the wait for the switch, not the /health probe (see _probe_loop).
        self._calls_failed = False
        # The scheduler refused our token since scheduled routing last worked: logged once, and
        # the probe brings scheduled routing back only once the token is taken.
        self.token_refused = False
        self._refresher: asyncio.Task | None = None
        self._static: asyncio.Task | None = None
        self.worker_views: list[dict] = []  # last /v1/workers answer (healthy ones)
        # Routes whose lease is renewed every lease_renew_s while they are open: a long
        # generation must not lose its lease to the scheduler's expiry, which is meant for
        # releases a gateway crash lost. Weak: a route no request holds any more (a release a
        # gateway bug skipped) is not renewed, and its lease expires as before. 0: none.
        self.lease_renew_s = lease_renew_s
        self.open_leases: weakref.WeakSet[Route] = weakref.WeakSet()
        self._renewer: asyncio.Task | None = None
        self.worker_views_at = 0.0
        # The scheduler's list may still lack workers it will learn (it started lately).
        self.scheduler_learning = False
        metrics.fallback_mode.set(1 if self.fallback_active else 0)

    # ---- lifecycle -----------------------------------------------------------------
    def release_nowait(self, rel: dict[str, Any]) -> None:
        if self.pipe is not None:
            self.pipe.release_nowait(rel)
        elif self.client is not None:
            self.client.release_nowait(rel)

    def prefilled_nowait(self, lease_id: str) -> None:
        if self.pipe is not None:
            self.pipe.prefilled_nowait(lease_id)
        elif self.client is not None:
            self.client.prefilled_nowait(lease_id)

    def _leased(self, payload: dict) -> Route:
        """The route of a decision, its lease renewed while it is open."""
        route = Route(payload["worker_id"], payload["url"].rstrip("/"), payload["lease_id"],
                      payload.get("policy", ""), payload.get("reason") or {})
        if self.lease_renew_s:
            route.renew_at = time.monotonic() + self.lease_renew_s
            self.open_leases.add(route)
        return route

    async def _renew_loop(self) -> None:
        """Renew the leases due, every quarter period: a lease is renewed between one and
        1.25 periods after it was issued or last renewed."""
        while True:
            await asyncio.sleep(self.lease_renew_s / 4)
            now = time.monotonic()
            for route in list(self.open_leases):
                if route.released:
                    self.open_leases.discard(route)
                elif route.renew_at <= now and route.lease_id is not None:
                    route.renew_at = now + self.lease_renew_s
                    if self.pipe is not None:
                        self.pipe.renew_nowait(route.lease_id)
                    elif self.client is not None:
                        self.client.renew_nowait(route.lease_id)

    def start(self, session: aiohttp.ClientSession | None = None,
              worker_tls: PeerContext | None = None) -> None:
        """`session`: the static --workers' models are asked for with it, and `worker_tls`'s
        context in force at each call (None: the system's CAs)."""
        loop = asyncio.get_running_loop()
        if self.client is not None:
            self._refresher = loop.create_task(self._refresh_loop())
            if self.lease_renew_s:
                self._renewer = loop.create_task(self._renew_loop())
        if session is not None and self.fallback.static_urls:
            self._static = loop.create_task(self._static_models_loop(session, worker_tls or PeerContext()))

    async def stop(self) -> None:
        if self.pipe is not None:
            self.pipe.close()
        if self._static is not None:
            self._static.cancel()
        if self._fallback_timer is not None:
            self._fallback_timer.cancel()
        for t in (self._probe, self._refresher, self._renewer):
            if t is not None:
                t.cancel()
        for t in (self._probe, self._refresher, self._renewer):
            if t is not None:
                try:
                    await t
                except (asyncio.CancelledError, Exception):
                    pass

    # ---- the per-request path --------------------------------------------------------
    async def acquire(self, body: dict[str, Any], exclude: list[str], deadline: float,
                      pinned_url: str | None = None, priority: int = 0, flow: str = "",
                      spans: RequestTrace | None = None) -> Route:
        """Place a request. body: the ScheduleRequest fields (model, prompt_tokens, ...; with
        `worker_id`, that worker only, whose URL is pinned_url). priority: its place in the
        queue, lower first; flow: its tenant, whose turn it waits for (router/queue.py);
        spans: its trace (tracing on), which notes the scheduler calls and the queue wait.
        Raises QueueFull, QueueTimeout, UnknownModelError, NoWorkerError, PinnedWorkerGone."""
        model = body["model"]
        pin = body.get("worker_id")
        # A pinned request queues in its worker's own line: at the head of the model's line,
        # waiting for that one worker, it would hold back requests any worker could take.
        line = model if pin is None else f"{model}\0{pin}"
        if exclude:
            body["exclude"] = exclude
        else:  # a body placed before (a retry, a WebSocket's move) keeps no earlier list
            body.pop("exclude", None)
        if self.queue.fair_share == "tokens":
            # The scheduler keeps the same counters over every replica's traffic and orders the
            # replicas' held calls by them (scheduler/service.py).
            body["flow"] = flow
        body.pop("waited_ms", None)  # set below, once it queues (a retry's body comes back)
        if priority:
            # And by priority before that: this queue's askers (--queue-askers) and the other
            # replicas' compete for the room that frees, as they do in this queue.
            body["priority"] = priority
        if not self.fallback_active:
            if not self.queue.has_waiters(line):
                route = await self._ask(body, 0, spans)
            elif (
                self.followup_pass_s
                and body.get("prefix_hashes")
                and time.monotonic() >= self._passing_paused_until
                and self.queue.oldest_asker_wait_s(line) < self.followup_pass_s
            ):
                # Others queue: this one passes them only into room the scheduler holds for
                # its prefix (a conversation's next turn; scheduler/reservations.py), and only
                # while they have not waited long (under steady saturation, follow-ups passing
                # without a bound starve first turns: P99 TTFT doubled in RESULTS.md).
                body["reserved_only"] = True
                try:
                    route = await self._ask(body, 0, spans)
                finally:
                    del body["reserved_only"]
            else:
                route = None
            if route is not None:
                return self._charged(route, body, flow)
        # Fallback picks are not charged: without the scheduler nothing queues, and the model
        # may be one no worker serves (the counters would keep every name a client makes up).
        if self.fallback_active:
            return self._fallback_pick(model, exclude, pin, pinned_url, body.get("session"))
        queued_at = time.monotonic()
        if spans is not None:
            spans.queued()
        async with self.queue.place(line, body.get("prompt_tokens") or 0, priority, flow, deadline):
            while True:
                if self.fallback_active:
                    return self._fallback_pick(model, exclude, pin, pinned_url, body.get("session"))
                now = time.monotonic()
                remaining_ms = int((deadline - now) * 1000)
                if remaining_ms <= 0:
                    raise QueueTimeout
                # Its place among the scheduler's held calls is its arrival here, so that a
                # poll that ran out and is asked again keeps it (scheduler/protocol.py).
                body["waited_ms"] = int((now - queued_at) * 1000)
                route = await self._ask(body, min(self.schedule_wait_ms, remaining_ms), spans)
                if route is not None:
                    # Charged before it leaves the line: the next turn (chosen as it leaves)
                    # counts it.
                    return self._charged(route, body, flow)

    @property
    def leasing(self) -> bool:
        """Whether a schedule call can get a lease now (a scheduler, and not in fallback mode)."""
        return self.client is not None and not self.fallback_active

    async def attach(self, body: dict[str, Any], bound: Route, flow: str = "") -> Route | None:
        """A lease for a request already bound for `bound`'s worker (a WebSocket's next request,
        on the connection the gateway holds to it): the scheduler counts it there whatever the
        worker's load (ScheduleRequest.attach). None: no lease to be had (fallback mode, the
        scheduler unreachable, or the worker unknown to it); the request goes on unleased. It
        is asked beside the request (router/ws_leases.py), so a failure here never waits out
        the fallback switch: the gateway's other traffic decides when that happens."""
        if not self.leasing:
            return None  # a socket placed in fallback mode is leased once the scheduler is back
        body = {**body, "worker_id": bound.worker_id, "attach": True}
        if self.queue.fair_share == "tokens":
            body["flow"] = flow
        t0 = time.perf_counter()
        try:
            if self.pipe is not None:
                status, payload = await self.pipe.schedule_raw(body)
            else:
                status, payload = await self._long_poll(body, 0)
        except SchedulerError:  # unreachable, or a model no worker serves now: unleased
            self.metrics.scheduler_errors.labels("schedule").inc()
            return None
        self.metrics.observe_scheduler("schedule", time.perf_counter() - t0)
        if status != 200:
            return None
        route = self._leased(payload)
        if route.worker_id != bound.worker_id:  # a scheduler that knows no pin (older than attach)
            self.release_nowait(orphan_release(route.lease_id))
            return None
        route.url = bound.url
        return route

    def _charged(self, route: Route, body: dict[str, Any], flow: str) -> Route:
        route.charge = self.queue.charge(body["model"], flow, body.get("prompt_tokens") or 0,
                                         body.get("max_tokens"))
        return route

    def _ask(self, body: dict[str, Any], wait_ms: int, spans: RequestTrace | None
             ) -> Awaitable[Route | None]:
        """_try_schedule, noted in the request's trace when it has one."""
        call = self._try_schedule(body, wait_ms)
        if spans is None:
            return call
        return spans.scheduler_call(call, wait_ms, lambda: self.down_since is not None)

    async def _try_schedule(self, body: dict[str, Any], wait_ms: int) -> Route | None:
        """One scheduler call. None: wait (the scheduler said so, or it is down and the
        fallback timeout has not passed yet; the caller loops)."""
        if wait_ms:
            body["wait_ms"] = wait_ms
        elif "wait_ms" in body:
            del body["wait_ms"]
        t0 = time.perf_counter()
        started = time.monotonic()
        try:
            if self.down_since is None:
                status, payload = await self._schedule_call(body, wait_ms)
            else:
                # Already unreachable: a hung scheduler (stopped, its host frozen: connections
                # accepted, never answered) would hold this call for the whole client timeout
                # past the fallback switch; the call is given up at the switch instead. A
                # cancelled call gives back a lease that came too late (_long_poll, the pipe).
                async with asyncio.timeout_at(self._fallback_due_loop_time()):
                    status, payload = await self._schedule_call(body, wait_ms)
        except TimeoutError:
            # asyncio.timeout_at's expiry (the clients turn their own timeouts into
            # SchedulerUnavailableError): no answer until the fallback switch.
            self.metrics.scheduler_errors.labels("schedule").inc()
            await self._scheduler_failed(SchedulerUnavailableError("no answer before the fallback switch"),
                                         started, wait_ms)
            return None
        except SchedulerUnavailableError as exc:
            self.metrics.scheduler_errors.labels("schedule").inc()
            await self._scheduler_failed(exc, started, wait_ms)
            return None
        except UnknownModelError:
            if self.down_since is None:
                raise
            # Answered by a scheduler that was away (restarted): it knows no worker yet, not
            # that nobody serves the model; as unreachable until it can route (the probe says
            # when), and the fallback answers for a model no last-known worker serves.
            await self._scheduler_failed(SchedulerUnavailableError("scheduler knows no worker yet"), started)
            return None
        self.metrics.observe_scheduler("wait" if wait_ms else "schedule", time.perf_counter() - t0)
        if self.down_since is not None:
            if status != 200 and payload.get("reason") == "no_routable_worker" and not body.get("exclude"):
                # The same for its "no healthy worker" (a request that excluded none).
                await self._scheduler_failed(SchedulerUnavailableError("no routable worker yet"), started)
                return None
            self._scheduler_back()
        if status == 200:
            return self._leased(payload)
        reason = payload.get("reason")
        if reason == "no_routable_worker":
            # Nobody to wait for (every worker of the model is down or already failed this
            # request): answer now rather than hold the client until the queue timeout.
            raise NoWorkerError(f"no healthy worker serves model {clip_repr(body['model'])} right now")
        if reason == "pinned_worker_unavailable":
            raise NoWorkerError(f"worker {body['worker_id']!r}, which holds what this request "
                                "continues, is not available right now")
        if reason == "pinned_worker_gone":
            raise PinnedWorkerGone(body["worker_id"])
        if reason == "holds_off":
            self._passing_paused_until = time.monotonic() + _PASSING_PAUSE_S
            log.warning("--followup-pass-ms is set but the scheduler holds no room for follow-ups "
                        "(its --followup-hold-ms is 0); not passing for %.0f s", _PASSING_PAUSE_S)
        if not wait_ms:
            return None
        # A long poll that ended without capacity: go round again (no sleep: the next
        # call is itself a wait). A scheduler answering a wait early must not spin.
        if time.perf_counter() - t0 < 0.005:
            await asyncio.sleep(min(payload.get("retry_after_ms", 50), 250) / 1000)
        return None

    async def _schedule_call(self, body: dict[str, Any], wait_ms: int) -> tuple[int, dict]:
        if wait_ms == 0 and self.pipe is not None:
            return await self.pipe.schedule_raw(body)  # gives back orphans itself
        return await self._long_poll(body, wait_ms)

    def _fallback_due_loop_time(self) -> float:
        """When (event-loop clock) the fallback switch is due while the scheduler is down."""
        assert self.down_since is not None
        loop = asyncio.get_running_loop()
        return loop.time() + max(0.0, self.down_since + self.wait_timeout_s - time.monotonic())

    async def _long_poll(self, body: dict[str, Any], wait_ms: int) -> tuple[int, dict]:
        """A schedule call over HTTP, held (wait_ms > 0) or not. If our client leaves meanwhile,
        the call is not cut off (the scheduler may have issued the lease already, or issue it to
        a closed connection, and it would then count as load until it expires): it finishes in
        the background and its lease is given back."""
        task = asyncio.ensure_future(self.client.schedule_raw(dict(body), wait_ms))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(self._give_back)
            raise

    def _give_back(self, task: asyncio.Future) -> None:
        if task.cancelled() or task.exception() is not None:
            return
        status, payload = task.result()
        if status == 200 and isinstance(payload, dict) and payload.get("lease_id"):
            self.release_nowait(orphan_release(payload["lease_id"]))

    def _fallback_pick(self, model: str, exclude: list[str], pin: str | None = None,
                       pinned_url: str | None = None, session: int | None = None) -> Route:
        """A worker without the scheduler: the pin, else by session (its key, router/sessions.py)
        or round robin (router/fallback.py)."""
        if pin is not None and pinned_url is not None:
            if pin in exclude:
                raise NoWorkerError(f"worker {pin!r}, which holds what this request continues, failed it")
            self.metrics.fallback_requests.inc()
            return Route(pin, pinned_url, None, "fallback_pinned", {}, fallback=True)
        w = self.fallback.pick(model, exclude, session)
        self.metrics.fallback_requests.inc()
        policy = "fallback_round_robin" if session is None else "fallback_session"
        return Route(w.worker_id, w.url, None, policy, {}, fallback=True)

    # ---- scheduler availability --------------------------------------------------------
    async def _scheduler_failed(self, exc: Exception, started: float, wait_ms: int = 0) -> None:
        """A call sent at `started` (monotonic) with `wait_ms` of long poll got no answer."""
        now = time.monotonic()
        self._mark_down(exc, min(now, started + wait_ms / 1000))
        self._calls_failed = True
        if self.fallback_active:
            return  # a flap: round robin at once (_mark_down)
        assert self.down_since is not None
        elapsed = now - self.down_since
        if elapsed >= self.wait_timeout_s:
            self._enter_fallback(elapsed)
            return
        await asyncio.sleep(min(self.try_period_s, self.wait_timeout_s - elapsed))
        if self.down_since is not None and time.monotonic() - self.down_since >= self.wait_timeout_s:
            self._enter_fallback(time.monotonic() - self.down_since)

    def _mark_down(self, exc: Exception, since: float) -> None:
        """Start the fallback clock (if not running) at `since`: when the scheduler was first
        owed an answer it did not give. A call's start (a long poll's: when its wait ran out),
        not when the client gave up on it: a hung scheduler's calls fail only at the client
        timeout (--scheduler-timeout-ms), and counting from then put the switch to round robin
        that much past --wait-schedule-timeout-ms."""
        refused = isinstance(exc, SchedulerAuthError)
        if refused and not self.token_refused:
            # Checked before the clock (which a plain outage may have started): a wrong token
            # is a configuration error that no retry mends, so it is said as an ERROR, once.
            self.token_refused = True
            log.error("scheduler refused this gateway's token (%s): set --scheduler-token "
                      "(ROUTER_SCHEDULER_TOKEN) to the scheduler's --gateway-token; serving by "
                      "round robin (after %.0f ms) until it takes the token", exc,
                      self.wait_timeout_s * 1000)
        if self.down_since is not None:
            return
        now = time.monotonic()
        self.down_since = since
        self._calls_failed = False
        self._fallback_timer = asyncio.get_running_loop().call_later(
            max(0.0, since + self.wait_timeout_s - now), self._fallback_due)
        self._start_probe()
        if self._flaps.failed(now):
            self._fallback_timer.cancel()
            self._fallback_timer = None
            log.warning("scheduler failed again (%s) soon after round robin ended: its /health "
                        "answers but its calls fail; round robin at once, scheduled routing "
                        "after %.0f s of healthy probes", exc, self._flaps.hold_s)
            self._enter_fallback(0.0)
            return
        if refused:
            return  # said above, as an ERROR
        log.warning(
            "scheduler unreachable (%s); retrying every %.0f ms, fallback after %.0f ms",
            exc,
            self.try_period_s * 1000,
            self.wait_timeout_s * 1000,
        )

    def _fallback_due(self) -> None:
        """The switch on time even when no call ends then (every request's call hangs, or none
        is asking): /health, the fallback metric and newcomers see fallback mode at once."""
        self._fallback_timer = None
        if self.down_since is not None:
            self._enter_fallback(time.monotonic() - self.down_since)

    def _enter_fallback(self, elapsed: float) -> None:
        if self.fallback_active:
            return
        self.fallback_active = True
        self.last_switch_s["fallback"] = elapsed
        self.metrics.fallback_mode.set(1)
        self.metrics.mode_switches.labels("fallback").inc()
        self.metrics.mode_switch_seconds.labels("fallback").set(elapsed)
        log.warning(
            "fallback mode ON: round robin over %d known workers (%.0f ms after the first failure)%s",
            len(self.fallback.workers),
            elapsed * 1000,
            " (the scheduler refuses our token: 401)" if self.token_refused else "",
        )

    def _scheduler_back(self, probe_started: float | None = None) -> None:
        was_fallback = self.fallback_active
        self.token_refused = False
        down_for = time.monotonic() - (self.down_since or time.monotonic())
        self.down_since = None
        if self._fallback_timer is not None:
            self._fallback_timer.cancel()
            self._fallback_timer = None
        self.fallback_active = False
        if was_fallback:
            self._flaps.returned(time.monotonic())
            # How late we noticed, at most: time since the last failed probe.
            self.metrics.fallback_mode.set(0)
            self.metrics.mode_switches.labels("scheduled").inc()
            lag = time.monotonic() - probe_started if probe_started is not None else 0.0
            self.last_switch_s["scheduled"] = lag
            self.metrics.mode_switch_seconds.labels("scheduled").set(lag)
            log.warning("fallback mode OFF: scheduler answers again (down %.1f s)", down_for)
        else:
            log.info("scheduler reachable again after %.0f ms", down_for * 1000)

    def _start_probe(self) -> None:
        if self._probe is None or self._probe.done():
            self._probe = asyncio.get_running_loop().create_task(self._probe_loop())

    async def _probe_loop(self) -> None:
        last_failed = time.monotonic()
        routable_since: float | None = None
        while self.down_since is not None:
            t0 = time.monotonic()
            # Back only once it can route: a restarted scheduler answers /health at once but
            # knows no worker until it has scraped them (self-registered or discovered ones:
            # until they register again, seconds); scheduled routing then answered clients
            # 404 model_not_found, where round robin over the last-known workers serves them.
            routable = await self.client.routable()
            # (Or it answers and round robin has no worker to offer instead: nothing to wait for.)
            if not routable and (routable is None or self.fallback.workers):
                routable_since = None
                last_failed = time.monotonic()
            elif self._calls_failed and not self.fallback_active:
                # Its /health answers while its calls fail (or it came back between them):
                # the requests asking find out which (a call that succeeds ends the wait);
                # ending it here restarted the clock at every probe, and a scheduler that
                # fails every call held each request until its client gave up.
                routable_since = None
            elif self.token_refused and not await self.client.token_accepted():
                # Its /health answers (it takes no token) while our token is refused: every
                # call would fail again, and the return would only flap.
                routable_since = None
                last_failed = time.monotonic()
            else:
                routable_since = routable_since or t0
                # After a flap, only once it has stayed routable a while (router/flap_guard.py).
                if not routable or self._flaps.may_return(routable_since, time.monotonic()):
                    if self.down_since is not None:
                        # The scheduler came back at some point after the last failed probe.
                        self._scheduler_back(probe_started=last_failed)
                    await self._refresh_workers()
                    return
            await asyncio.sleep(max(0.0, self.probe_period_s - (time.monotonic() - t0)))

    # ---- cached worker list -------------------------------------------------------------
    async def _refresh_loop(self) -> None:
        while True:
            if self.down_since is None:
                started = time.monotonic()
                if not await self._refresh_workers():
                    # The clock starts here too: an idle gateway showed mode "scheduled" (and
                    # router_fallback_mode 0) for as long as its scheduler was gone, and its
                    # first requests afterwards all waited out the switch.
                    self._mark_down(SchedulerUnavailableError("worker list refresh failed"), started)
            await asyncio.sleep(self.workers_refresh_s)

    async def _refresh_workers(self) -> bool:
        t0 = time.perf_counter()
        try:
            listed = await self.client.workers()
        except SchedulerUnavailableError as exc:
            self.metrics.scheduler_errors.labels("workers").inc()
            log.debug("worker list refresh failed: %s", exc)
            return False
        self.metrics.observe_scheduler("workers", time.perf_counter() - t0)
        views = listed.workers
        healthy = [v for v in views if v.healthy]
        self.worker_views = [v.model_dump() for v in views]
        self.scheduler_learning = listed.learning
        self.down_watch.update((v.worker_id, v.state, v.down_cause) for v in views)
        self.worker_views_at = time.monotonic()
        self.fallback.update_from_scheduler([(v.worker_id, v.url, list(v.models)) for v in healthy],
                                            frozenset(v.worker_id for v in views if v.cordoned))
        return True

    async def _static_models_loop(self, session: aiohttp.ClientSession, worker_tls: PeerContext) -> None:
        """Learn what the static --workers serve (for /v1/models and model filtering)."""
        timeout = aiohttp.ClientTimeout(total=2)
        while True:
            for url in self.fallback.static_urls:
                try:
                    async with session.get(url + "/v1/models", timeout=timeout,
                                           ssl=worker_tls.request_ssl) as r:
                        data = await r.json(content_type=None) if r.status == 200 else None
                    if isinstance(data, dict) and isinstance(data.get("data"), list):
                        ids = [
                            m["id"]
                            for m in data["data"]
                            if isinstance(m, dict) and isinstance(m.get("id"), str)
                        ]
                        self.fallback.set_static_models(url, ids)
                except (aiohttp.ClientError, TimeoutError, OSError, ValueError):
                    pass
            await asyncio.sleep(self.workers_refresh_s)

    async def models(self, max_age_s: float) -> list[str]:
        """Union of models of healthy workers (scheduler's view, cached; fallback's when down)."""
        if (
            not self.fallback_active
            and self.client is not None
            and time.monotonic() - self.worker_views_at > max_age_s
        ):
            await self._refresh_workers()
        return sorted(self.fallback.models())


__all__ = ["NoWorkerError", "PinnedWorkerGone", "Route", "Scheduling"]
