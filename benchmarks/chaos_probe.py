"""What the chaos soak's services say of their own state while it runs: each gateway's held
and in-flight request counts (its /metrics) and the scheduler's view of its workers (GET
/v1/workers: open leases, the running count of the last scrape, health), sampled every
`period_s` on the run's clock.

Why sampled from outside: a count that does not return to 0 (a held request forgotten, a
lease no gateway will release) leaves no trace in any request's outcome, and a process that
is down at a sample is itself evidence (None), not an error of the probe.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp

# The gateway's gauges read (router/metrics.py): held in its admission queue, and accepted and
# not yet answered (the held included).
QUEUED = "router_requests_queued"
IN_FLIGHT = "router_requests_in_flight"
FALLBACK = "router_fallback_mode"
GATEWAY_GAUGES = (QUEUED, IN_FLIGHT, FALLBACK)
PROBE_TIMEOUT_S = 1.0


@dataclass
class WorkerState:
    """One worker as the scheduler saw it."""

    worker_id: str
    healthy: bool
    in_flight_leases: int
    running: float | None  # its engine's running requests at the last scrape
    waiting: float | None


@dataclass
class Sample:
    at_s: float
    # Per gateway (the client's order): its gauges, or None when it did not answer.
    gateways: list[dict[str, float] | None] = field(default_factory=list)
    workers: list[WorkerState] | None = None  # None: the scheduler did not answer

    @property
    def queued(self) -> float | None:
        """Requests held in every answering gateway's queue (None: none answered)."""
        seen = [g[QUEUED] for g in self.gateways if g is not None and QUEUED in g]
        return sum(seen) if seen else None

    @property
    def leases(self) -> int | None:
        return None if self.workers is None else sum(w.in_flight_leases for w in self.workers)

    def as_dict(self) -> dict[str, Any]:
        return {"at_s": round(self.at_s, 3), "gateways": self.gateways,
                "workers": None if self.workers is None else [asdict(w) for w in self.workers],
                "queued": self.queued, "leases": self.leases}


def gauges_of(text: str, names: tuple[str, ...] = GATEWAY_GAUGES) -> dict[str, float]:
    """The unlabelled samples named in Prometheus text exposition."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.partition(" ")
        if name in names:
            with contextlib.suppress(ValueError):
                found[name] = float(value.split()[0])
    return found


def workers_of(doc: dict[str, Any]) -> list[WorkerState]:
    out = []
    for w in doc.get("workers") or ():
        snap = w.get("snapshot") or {}
        out.append(WorkerState(str(w.get("worker_id")), bool(w.get("healthy")),
                               int(w.get("in_flight_leases") or 0),
                               snap.get("running"), snap.get("waiting")))
    return out


class ClusterProbe:
    """`await probe.sample()` for one look; `probe.run(stop)` samples every period_s into
    `samples` until `stop` is set."""

    def __init__(self, gateway_urls: list[str], scheduler_url: str, clock: float,
                 period_s: float = 0.5) -> None:
        self.gateway_urls = gateway_urls
        self.scheduler_url = scheduler_url
        self.clock = clock
        self.period_s = period_s
        self.samples: list[Sample] = []
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> ClusterProbe:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S))
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()

    def now(self) -> float:
        return time.monotonic() - self.clock

    async def _get(self, url: str) -> aiohttp.ClientResponse | None:
        assert self._session is not None, "use `async with ClusterProbe(...)`"
        return await self._session.get(url)

    async def _gateway(self, url: str) -> dict[str, float] | None:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError):
            resp = await self._get(f"{url}/metrics")
            if resp is not None:
                async with resp:
                    if resp.status == 200:
                        return gauges_of(await resp.text())
        return None

    async def _scheduler(self) -> list[WorkerState] | None:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError, ValueError):
            resp = await self._get(f"{self.scheduler_url}/v1/workers")
            if resp is not None:
                async with resp:
                    if resp.status == 200:
                        return workers_of(await resp.json())
        return None

    async def sample(self) -> Sample:
        at = self.now()
        *gateways, workers = await asyncio.gather(*(self._gateway(u) for u in self.gateway_urls),
                                                  self._scheduler())
        return Sample(at, list(gateways), workers)

    async def run(self, stop: asyncio.Event) -> list[Sample]:
        while not stop.is_set():
            self.samples.append(await self.sample())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.period_s)
        return self.samples

    async def settled(self, timeout_s: float, lease_wait_s: float = 1.0
                      ) -> tuple[Sample, float | None, float | None]:
        """After the load: sample until every gateway holds and runs nothing (for up to
        timeout_s), then until the scheduler counts no open lease (for up to lease_wait_s more:
        the gateways' releases are sent as their requests end, so a lease still open then is
        one no live gateway will release). (The last sample, when the gateways were idle, when
        the leases were 0; None: not within the bound.)"""
        deadline = time.monotonic() + timeout_s
        idle_s = zero_s = None
        while True:
            s = await self.sample()
            self.samples.append(s)
            if idle_s is None and all(g is not None and g.get(QUEUED) == 0 and g.get(IN_FLIGHT) == 0
                                      for g in s.gateways):
                idle_s = s.at_s
                deadline = min(deadline, time.monotonic() + lease_wait_s)
            if idle_s is not None and s.leases == 0:
                zero_s = s.at_s
            if zero_s is not None or time.monotonic() >= deadline:
                return s, idle_s, zero_s
            await asyncio.sleep(self.period_s)
