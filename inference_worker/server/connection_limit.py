"""How long an idle client connection is kept, and how many client connections are served.

aiohttp keeps an idle kept-alive connection for 3630 s: thousands of idle clients hold a file
descriptor each for an hour. --keepalive-timeout-s (75 s, nginx's keepalive_timeout) is handed
to aiohttp as its `keepalive_timeout`. It must stay above the idle time after which clients
close their pooled connections themselves (load balancers commonly 60 s; our own: the gateway's
pool to workers 30 s, the scheduler client 60 s, the scheduler's scrapes 30 s, a worker's
registration 15 s), so the client closes first and never reuses a connection the server is
closing. aiohttp's 0 is no "no keep-alive": its answers still say keep-alive (HTTP/1.1) and the
connection is closed right after each, racing the client's next request, so 0 is refused.

aiohttp sets no cap on connections: past the process's open-file limit accept() fails (EMFILE),
and so does every connection the service itself opens (the gateway's to its workers: requests
in flight are lost). At start-up the soft limit is raised to the hard one (as Go's runtime and
nginx's worker_rlimit_nofile do: the soft 1024 is a default for select()-era programs), and
--max-connections (default from that limit) caps the connections served at once. One beyond the
cap is answered, once its request head is in, with a 503 in the service's OpenAI error shape,
`Retry-After: 1` and `Connection: close`, and closed: no route runs. Its head gets at most
REFUSED_HEAD_TIMEOUT_S, so a flood of connections that send nothing does not hold descriptors
for the whole receive timeout; and at most MAX_REFUSING refused connections are answered at
once (each may hold its descriptor a few seconds more, while aiohttp reads the rest of a body
before it closes): past them a new one is dropped unanswered (a reset), so refusals cannot
take the descriptors the cap keeps. A WARNING says so at most once per REFUSED_LOG_INTERVAL_S.
The cap is set on aiohttp's private RequestHandler attributes: connection_budget, first at
start-up, refuses an aiohttp that lacks them (receive_timeout.require_aiohttp_handler).

A twin of scheduler/connection_limit.py, the same code (a test keeps them alike): the worker
imports nothing of the other parts.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import ClassVar

from aiohttp import web
from aiohttp.web_request import BaseRequest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from inference_worker.server.receive_timeout import HeadTimedRequestHandler, require_aiohttp_handler

try:
    import resource
except ImportError:  # not on Windows: no limit to raise or read
    resource = None  # type: ignore[assignment]

# nginx's keepalive_timeout.
DEFAULT_KEEPALIVE_TIMEOUT_S = 75.0
# Descriptors a service holds besides the connections it serves: its listening sockets, the
# event loop's, log and reloaded files (keys, certificates, a tokenizer), its calls to peers
# that do not scale with its clients (the scheduler channel and pool, a worker's registration,
# scrapes of tens of workers) and a GPU driver's device files. A quarter of a small limit.
RESERVED_FDS = 256
# Soft limits tried, largest first, where the hard limit is unlimited: macOS's default is a
# soft 256 under an unlimited hard one, which would cap a gateway at 96 connections. The
# kernel takes none above its own per-process maximum (macOS: kern.maxfilesperproc, and
# OPEN_MAX, 10240, for setrlimit), so the first one it takes is kept.
UNLIMITED_HARD_SOFT_LIMITS = (1 << 20, 65_536, 10_240)
REFUSED_HEAD_TIMEOUT_S = 2.0
# Refused connections answered at once, at most: a quarter of RESERVED_FDS, the descriptors
# they may hold besides the cap's.
MAX_REFUSING = 64
REFUSED_LOG_INTERVAL_S = 10.0
REFUSED_MESSAGE = ("too many connections: the server is at its cap of open connections "
                   "(--max-connections); retry on a new connection")

KEEPALIVE_HELP = (
    "seconds an idle kept-alive client connection is kept open (nginx's keepalive_timeout; "
    "aiohttp's was 3630): keep it above the idle timeout of what connects to it (load balancers "
    "commonly 60 s; the gateway's pools 30 and 60 s), so a client never reuses a connection the "
    "server is closing. Not 0: aiohttp would answer keep-alive and close right after")
MAX_CONNECTIONS_HELP = (
    "client connections served at once; one more is answered 503 (OpenAI error shape, "
    "Retry-After: 1, Connection: close) and closed, no route run, so the service keeps "
    "descriptors for its own files and connections; 0: no cap. Default: the open-file limit "
    f"(its soft limit is raised to the hard one at start-up) less {RESERVED_FDS} kept for those")


def raise_fd_limit() -> tuple[int, int]:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit; (before, now), -1 for none
    (unlimited, or no such call here). Under an unlimited hard limit, to the first of
    UNLIMITED_HARD_SOFT_LIMITS the system takes (some refuse an unlimited soft limit)."""
    if resource is None:
        return -1, -1
    soft, hard = (-1 if n == resource.RLIM_INFINITY else n
                  for n in resource.getrlimit(resource.RLIMIT_NOFILE))
    if soft < 0:
        return soft, soft
    for target in (hard,) if hard >= 0 else UNLIMITED_HARD_SOFT_LIMITS:
        if target <= soft:
            break
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE,
                               (target, hard if hard >= 0 else resource.RLIM_INFINITY))
        except (OSError, ValueError):  # over the system's maximum, or a sandbox that forbids it
            continue
        return soft, target
    return soft, soft


def default_max_connections(fd_limit: int, fds_per_connection: int) -> int:
    """The connections a service may serve with `fd_limit` descriptors (-1: unlimited, so no
    cap, 0), each taking `fds_per_connection` (the gateway 2: a client request holds one to its
    worker too), RESERVED_FDS (at most a quarter of the limit) kept for the rest."""
    if fd_limit < 0:
        return 0
    reserve = min(RESERVED_FDS, fd_limit // 4)
    return max(1, (fd_limit - reserve) // fds_per_connection)


@dataclass(frozen=True)
class ConnectionBudget:
    """What start-up found: the open-file limit (-1: none) before and after raising it, and the
    connections to serve at once (0: no cap), `given` by --max-connections or drawn from it."""

    limit_before: int
    limit: int
    max_connections: int
    given: bool

    def describe(self) -> str:
        """One line for the log, once the service listens (an error before it is the only line)."""
        raised = f" (raised from {self.limit_before})" if self.limit != self.limit_before else ""
        how = "--max-connections" if self.given else "by default; --max-connections sets it"
        return (f"open-file limit {self.limit if self.limit >= 0 else 'none'}{raised}; serving at "
                f"most {self.max_connections or 'any number of'} client connections at once ({how})")


def connection_budget(configured: int | None, fds_per_connection: int) -> ConnectionBudget:
    """At start-up, before files and connections are opened: the open-file limit raised, and
    the cap it gives unless one is `configured`. First, SystemExit on an aiohttp whose handler
    cannot carry the cap and the head timer, before the service loads or opens anything."""
    require_aiohttp_handler(CappedRequestHandler)
    before, limit = raise_fd_limit()
    cap = configured if configured is not None else default_max_connections(limit, fds_per_connection)
    return ConnectionBudget(before, limit, cap, configured is not None)


class ConnectionCap:
    """The client connections served at once (`max`, 0: no cap): those open, and those refused."""

    def __init__(self, max_connections: int, log: logging.Logger) -> None:
        self.max = max_connections
        self.open = 0
        self.refused = 0
        self.refusing = 0  # refused connections still open (being answered)
        self.max_refusing = MAX_REFUSING
        self.dropped = 0  # refused unanswered: max_refusing were being answered
        self._log = log
        self._warned_at = -REFUSED_LOG_INTERVAL_S
        self._warned_refused = 0

    def admit(self) -> bool:
        """A new connection: True if it is served (then `release` it when it ends)."""
        if self.max and self.open >= self.max:
            self.refused += 1
            now = time.monotonic()
            if now - self._warned_at >= REFUSED_LOG_INTERVAL_S:  # a flood must not flood the log
                self._log.warning("%d connections open, the cap (--max-connections): new ones are "
                                  "answered 503, or dropped while %d are being answered (%d "
                                  "refused since the last such line, %d dropped in all)",
                                  self.open, self.max_refusing, self.refused - self._warned_refused,
                                  self.dropped)
                self._warned_at, self._warned_refused = now, self.refused
            return False
        self.open += 1
        return True

    def release(self) -> None:
        self.open -= 1

    def answer_refusal(self) -> bool:
        """A refused connection: True if it is answered (then `refusal_done` when it ends),
        False if it is to be dropped (max_refusing are being answered)."""
        if self.refusing >= self.max_refusing:
            self.dropped += 1
            return False
        self.refusing += 1
        return True

    def refusal_done(self) -> None:
        self.refusing -= 1

    def collector(self, prefix: str) -> ConnectionCollector:
        return ConnectionCollector(self, prefix)


class ConnectionCollector:
    """`<prefix>_connections_open`, `<prefix>_connections_max` and
    `<prefix>_connections_refused_total`, read from the cap at each scrape."""

    def __init__(self, cap: ConnectionCap, prefix: str) -> None:
        self.cap, self.prefix = cap, prefix

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        yield GaugeMetricFamily(f"{self.prefix}_connections_open",
                                "Client connections open and served (those refused not counted)",
                                value=self.cap.open)
        yield GaugeMetricFamily(f"{self.prefix}_connections_max",
                                "Client connections served at once, --max-connections (0: no cap)",
                                value=self.cap.max)
        yield CounterMetricFamily(f"{self.prefix}_connections_refused",
                                  "Client connections refused at the cap: answered 503 and "
                                  "closed, or dropped unanswered past MAX_REFUSING at once",
                                  value=self.cap.refused)


class CappedRequestHandler(HeadTimedRequestHandler):
    """A connection's handler that counts itself in `_cap` (set by the server that makes it);
    beyond the cap, every request on it is answered `_cap_answer()` (the service's 503), made
    final: `Retry-After: 1`, `Connection: close`; or, with max_refusing such answers under way,
    dropped at once."""

    __slots__ = ("_cap", "_cap_answer", "_counted", "_refusing")
    _cap: ConnectionCap
    _cap_answer: Callable[[], web.StreamResponse]
    # aiohttp's handler of the requests: set to _refuse beyond the cap (checked at start-up).
    AIOHTTP_ATTRIBUTES: ClassVar[tuple[str, ...]] = (
        *HeadTimedRequestHandler.AIOHTTP_ATTRIBUTES, "_request_handler")

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._counted = self._cap.admit()
        self._refusing = False
        if not self._counted:
            # aiohttp reads the request head, answers with this in place of the app's routes,
            # and reads what is left of a body before it closes (the client then reads the 503
            # rather than a reset). A refused client is not waited for long.
            self._refusing = self._cap.answer_refusal()
            self._request_handler = self._refuse
            self._head_timeout_s = min(self._head_timeout_s, REFUSED_HEAD_TIMEOUT_S)
        super().connection_made(transport)
        if not (self._counted or self._refusing):
            transport.abort()  # connection_lost follows, from the loop

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._counted:
            self._counted = False
            self._cap.release()
        elif self._refusing:
            self._refusing = False
            self._cap.refusal_done()
        super().connection_lost(exc)

    async def _refuse(self, request: BaseRequest) -> web.StreamResponse:
        resp = self._cap_answer()
        resp.headers["Retry-After"] = "1"
        resp.force_close()
        return resp
