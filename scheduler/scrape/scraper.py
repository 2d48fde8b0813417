"""One async loop scrapes every worker's /metrics concurrently, on keep-alive connections.

Each tick starts a scrape for every worker whose previous scrape has finished (a slow
worker is never piled on). Connection-level failures (refused, reset, closed) count
toward the eviction streak; a timeout does not: it ages the data (the policy treats a
stale worker as saturated) and triggers a /health probe whose connection failure does
count. Parsing happens on the loop, so it uses the fast selective parser.

Once a worker's dialect is known, engines whose /metrics honours `?name[]=` (vLLM, SGLang, ours)
are asked for the series the dialect reads and no others: rendering a whole vLLM-like page
costs the engine's server ~5 ms of CPU, ten times a second. A filtered scrape that fails, lacks
the series, or comes back as big as the whole page (the filter ignored) sends the next scrape
to the whole page; after FILTERED_MISSES_MAX of those the worker is read whole for good.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import weakref
from contextlib import AbstractAsyncContextManager

import aiohttp

from scheduler.protocol import CONNECTION_FAILED, FAILING, REFUSED, UNRESPONSIVE, connection_refused
from scheduler.registry import WHOLE_METRICS_PATH, WorkerState
from scheduler.running_cap import is_positive_int
from scheduler.scrape import dialects
from scheduler.scrape.parse import parse_selected
from scheduler.scrape.rates import build_snapshot
from scheduler.scrape.sglang_info import SERVER_INFO_PATHS, RankLayout, ServerInfoState, parse_server_info
from scheduler.service import SchedulerService
from scheduler.tls import PeerContext, tls_failure

log = logging.getLogger(__name__)

# Errors that mean "nothing is listening / the process is gone", not "busy".
CONNECTION_ERRORS = (
    aiohttp.ClientConnectorError,
    aiohttp.ServerDisconnectedError,
    aiohttp.ClientOSError,
    ConnectionError,
)


def connection_cause(exc: BaseException) -> str:
    """The down cause of a connection-level failure: REFUSED (nothing listens on the port: the
    worker drains, or its process is gone), else CONNECTION_FAILED (reset, cut, unreachable)."""
    return REFUSED if connection_refused(exc) else CONNECTION_FAILED


# The largest page read from a worker (/metrics, /v1/models, /info). A real vLLM page is
# ~50 KB whole, ~2 KB filtered; a URL that points at something else (a file server, a stream)
# must fail the scrape, not fill the scheduler's memory every 100 ms.
MAX_PAGE_BYTES = 16 * 1024 * 1024


class PageTooLarge(aiohttp.ClientPayloadError):
    """A worker's answer was over MAX_PAGE_BYTES (counted as an HTTP-level scrape failure)."""


async def read_capped(resp: aiohttp.ClientResponse, limit: int = MAX_PAGE_BYTES) -> bytes:
    """The body, or PageTooLarge as soon as it passes `limit` bytes."""
    length = resp.content_length
    # A Content-Length counts the bytes sent: of a gzipped page, not the (unpacked) body read.
    if length is not None and "Content-Encoding" not in resp.headers:
        if length > limit:
            raise PageTooLarge(f"{resp.url.path} is {length} bytes, over {limit}")
        return await resp.read()  # the usual case: a sized page, read in one go
    body = bytearray()
    async for chunk in resp.content.iter_any():
        body += chunk
        if len(body) > limit:
            raise PageTooLarge(f"{resp.url.path} is over {limit} bytes")
    return bytes(body)


# Filtered scrapes that missed (failed, lacked the series, or were not filtered) before a worker
# is scraped whole for good.
FILTERED_MISSES_MAX = 3
# A "filtered" page at least this share of the whole page's size was not filtered.
IGNORED_FILTER_SHARE = 0.5


class Scraper:
    def __init__(self, service: SchedulerService, *, tls: PeerContext | None = None) -> None:
        self.service = service
        # https:// workers: checked against --worker-ca-file (else the system's CAs), with
        # --ssl-client-certfile for workers that ask for one. Plain http:// ones ignore it.
        # Read for each request (_get): a reload (tls_reload.py) swaps its context.
        self.tls = tls if tls is not None else PeerContext()
        cfg = service.cfg
        self.interval_s = cfg.scrape_interval_ms / 1000.0
        self.timeout = aiohttp.ClientTimeout(total=cfg.scrape_timeout_ms / 1000.0)
        self.probe_timeout = aiohttp.ClientTimeout(total=min(cfg.scrape_timeout_ms / 1000.0, 1.0))
        self.session: aiohttp.ClientSession | None = None
        self._tasks: set[asyncio.Task] = set()
        self._stopping = False
        # SGLang workers' server info (sglang_info.py), read once per worker and again after it
        # may have restarted. Held here, not on WorkerState, and dropped with the worker.
        self._server_info: weakref.WeakKeyDictionary[WorkerState, ServerInfoState] = (
            weakref.WeakKeyDictionary())

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=4, keepalive_timeout=30)
        # identity: prometheus_client's exposition (vLLM's and SGLang's filtered /metrics/) gzips
        # for a client that accepts it, on the API server's CPU, ten times a second, to save
        # bytes on a local network: 0.45 of the 2.3 ms a filtered scrape costs a real vLLM
        # (benchmarks/RESULTS.md, "What the router costs the workers").
        self.session = aiohttp.ClientSession(connector=connector, skip_auto_headers=("User-Agent",),
                                             headers={"Accept-Encoding": "identity"})

    def _get(self, url: str,
             timeout: aiohttp.ClientTimeout) -> AbstractAsyncContextManager[aiohttp.ClientResponse]:
        """A GET to a worker, with the context in force now (a connection of an older one, from
        before a reload, is not reused for it)."""
        assert self.session is not None  # start() ran
        return self.session.get(url, timeout=timeout, ssl=self.tls.request_ssl)

    async def run(self) -> None:
        if self.session is None:
            await self.start()
        next_tick = time.monotonic()
        next_housekeeping = next_tick
        while not self._stopping:
            now = time.monotonic()
            try:
                next_housekeeping = self._tick(now, next_housekeeping)
            except Exception:
                # This task is the scheduler's only view of its workers: a bug in one tick must
                # not end it, or every snapshot goes stale and the pool looks saturated for good
                # while the process looks alive. Logged every tick it recurs.
                log.exception("scrape loop tick failed; going on")
            next_tick += self.interval_s
            delay = next_tick - time.monotonic()
            if delay < 0:  # fell behind (overload): skip ticks rather than burst
                next_tick = time.monotonic()
                delay = 0
            await asyncio.sleep(delay)

    def _tick(self, now: float, next_housekeeping: float) -> float:
        """Start the scrapes that are due, check silences, and once a second expire leases and
        registrations. Returns when the next housekeeping is due."""
        svc = self.service
        for w in list(svc.registry.workers.values()):
            if not w.scraping:
                w.scraping = True
                task = asyncio.create_task(self.scrape_one(w))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            if w.health.check_silence(now, svc.cfg.dead_after_ms / 1000.0):
                svc.on_health_change(w)
        if now >= next_housekeeping:
            next_housekeeping = now + 1.0  # before the calls: one that raises waits its second
            svc.expire_leases(now)
            self.expire_registrations(now)
        return next_housekeeping

    def expire_registrations(self, now: float) -> None:
        for w in list(self.service.registry.workers.values()):
            if w.expires_at is not None and w.expires_at < now and "registration" in w.sources:
                log.info("registration of %s expired (no heartbeat)", w.worker_id)
                w.expires_at = None
                self.service.remove_worker(w.worker_id, source="registration")

    async def stop(self) -> None:
        self._stopping = True
        for t in list(self._tasks):
            t.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.session is not None:
            await self.session.close()

    async def scrape_one(self, w: WorkerState) -> None:
        svc, m = self.service, self.service.metrics
        cfg = svc.cfg
        sent = time.monotonic()
        try:
            try:
                url = w.url + w.metrics_path
                async with self._get(url, self.timeout) as resp:
                    status = resp.status
                    # read + decode: no charset sniffing on a 50 KB body, every 100 ms
                    text = (await read_capped(resp)).decode("utf-8", "replace") if status == 200 else ""
            except (TimeoutError, aiohttp.ClientError) as exc:
                if not svc.is_gone(w):
                    await self._fetch_failed(w, exc)
                return
            if svc.is_gone(w):
                # Removed while this scrape was out: its answer is about no worker of ours, and
                # counting it would bring back the removed worker's metric series for good.
                return
            now = time.monotonic()
            m.scrape_latency.labels(w.worker_id).observe(now - sent)
            if status != 200 and w.metrics_filtered:
                # The filtered path itself may be what fails (a proxy that knows only /metrics):
                # the whole page, next, tells whether the worker is at fault.
                self._filter_missed(w, f"answered {status}")
                return
            if status >= 500:
                m.scrape_failures.labels(w.worker_id, "http").inc()
                self._may_have_restarted(w)  # a proxy's 502/503 while the engine restarts
                self._failure(w, f"metrics answered {status}", connection_level=False, cause=FAILING)
                return
            if now - w.models_fetched_at > cfg.models_refresh_ms / 1000.0 or not w.models:
                await self.refresh_models(w)
            if status == 200:
                self._ingest(w, text, sent)
            if w.dialect == "tgi" and now - w.info_fetched_at > cfg.models_refresh_ms / 1000.0:
                await self.refresh_tgi_info(w)
            self._read_server_info_if_due(w, now)
            changed = w.health.on_success(now, cfg.recover_streak)
            if changed:
                svc.on_health_change(w)
        except asyncio.CancelledError:
            raise
        except Exception:  # never let one odd worker kill its scrape slot
            log.exception("scrape of %s failed", w.worker_id)
        finally:
            w.scraping = False

    def _ingest(self, w: WorkerState, text: str, sent: float) -> None:
        dialect = dialects.DIALECTS.get(w.dialect or "")
        filtered = w.metrics_filtered
        layout = self._layout(w)
        fams = parse_selected(text, dialect.wanted) if dialect else {}
        raw = dialect.read(fams, layout) if dialect else None
        if raw is None or (raw.running is None and raw.waiting is None) or dialects.OUTRANKED in fams:
            if filtered:
                # The filter took the series away (an engine restarted as another, a proxy
                # that misreads it): the next scrape reads a whole page and detects afresh.
                self._filter_missed(w, f"lacks the {w.dialect} series")
                return
            dialect = dialects.detect(text)  # first scrape, or the worker changed engine
            if dialect is None:
                w.dialect = "unknown"
                return
            if dialect.name != w.dialect:
                w.rates.reset()
                self._may_have_restarted(w)
            w.dialect = dialect.name
            raw = dialect.read(parse_selected(text, dialect.wanted), layout)
        if not filtered:
            w.whole_page_bytes = len(text)
            if (w.filtered_misses < FILTERED_MISSES_MAX and dialect.filtered_metrics_path
                    and self.service.cfg.scrape_only_used_series):
                w.metrics_path = dialect.filtered_metrics_path  # from the next scrape on
        elif len(text) >= IGNORED_FILTER_SHARE * w.whole_page_bytes:
            # The page is good, only not filtered: use it, and stop paying for the query.
            self._filter_missed(w, f"was not filtered ({len(text)} bytes)")
        cap = w.info_kv_capacity
        if raw.kv_usage is None and raw.used_tokens is not None and cap:
            raw.kv_usage = min(1.0, raw.used_tokens / cap)
            raw.block_size, raw.num_blocks = 1, cap  # a pool counted in tokens
        rates = w.rates.update(raw, sent)
        if w.rates.went_back:  # a counter restarted: so did the engine, maybe with new arguments
            self._may_have_restarted(w)
        self.service.on_snapshot(w, build_snapshot(raw, rates, sent, time.time(), w.dialect))

    def _filter_missed(self, w: WorkerState, what: str) -> None:
        w.metrics_path = WHOLE_METRICS_PATH
        w.filtered_misses += 1
        self.service.metrics.scrape_filter_misses.labels(w.worker_id).inc()
        log.warning("%s: a filtered /metrics scrape %s (%d of %d); reading the whole page%s",
                    w.worker_id, what, w.filtered_misses, FILTERED_MISSES_MAX,
                    " from now on" if w.filtered_misses >= FILTERED_MISSES_MAX else " next")

    async def _fetch_failed(self, w: WorkerState, exc: BaseException) -> None:
        m = self.service.metrics
        if isinstance(exc, TimeoutError):
            m.scrape_failures.labels(w.worker_id, "timeout").inc()
            await self._probe_after_timeout(w)
        elif isinstance(exc, CONNECTION_ERRORS):
            m.scrape_failures.labels(w.worker_id, "connection").inc()
            self._failure(w, tls_failure(exc) or type(exc).__name__, connection_level=True,
                          cause=connection_cause(exc))
        else:
            m.scrape_failures.labels(w.worker_id, "http").inc()
            self._failure(w, f"{type(exc).__name__}", connection_level=False, cause=FAILING)

    def _failure(self, w: WorkerState, error: str, connection_level: bool, cause: str) -> None:
        """`cause`: scheduler/protocol.py's, the worker's down cause if this takes it out (or
        comes while it is out)."""
        if connection_level:  # nothing listening: the engine is down, or restarting
            self._may_have_restarted(w)
        if w.health.on_failure(error, self.service.cfg.fail_streak, connection_level, cause):
            self.service.on_health_change(w)

    async def _probe_after_timeout(self, w: WorkerState) -> None:
        """Metrics timed out: is the process there at all? A worker that answers /health is
        busy, not dead; its data ages and it counts as saturated meanwhile."""
        try:
            async with self._get(w.url + "/health", self.probe_timeout) as resp:
                await read_capped(resp)
            self._failure(w, "metrics timeout (health ok)", connection_level=False, cause=UNRESPONSIVE)
        except CONNECTION_ERRORS as exc:
            self._failure(w, f"health probe: {tls_failure(exc) or type(exc).__name__}", connection_level=True,
                          cause=connection_cause(exc))
        except (TimeoutError, aiohttp.ClientError):
            self._failure(w, "metrics and health timeout", connection_level=False, cause=UNRESPONSIVE)

    async def refresh_tgi_info(self, w: WorkerState) -> None:
        """TGI's KV pool size: /info's max_batch_total_tokens (the token budget its batches
        are admitted against, which tgi_batch_current_max_tokens fills); and its running cap,
        /info's max_batch_size, when the server was started with one."""
        w.info_fetched_at = time.monotonic()
        try:
            async with self._get(w.url + "/info", self.timeout) as resp:
                if resp.status != 200:
                    return
                info = json.loads(await read_capped(resp))
            cap = info.get("max_batch_total_tokens")
            batch = info.get("max_batch_size")
        except (aiohttp.ClientError, TimeoutError, ValueError, AttributeError) as exc:
            log.debug("info of %s: %r", w.worker_id, exc)
            return
        if is_positive_int(cap):
            w.info_kv_capacity = cap
        if is_positive_int(batch):
            self.service.announce_running_cap(w, batch)

    def _layout(self, w: WorkerState) -> RankLayout | None:
        state = self._server_info.get(w)
        return state.layout if state is not None else None

    def _may_have_restarted(self, w: WorkerState) -> None:
        state = self._server_info.get(w)
        if state is not None:
            state.expire()

    def _read_server_info_if_due(self, w: WorkerState, now: float) -> None:
        """Start reading an SGLang worker's server info if it is due: in a task of its own, so
        that the scrapes go on meanwhile (SGLang answers it after asking every DP scheduler for
        its internal state, which a busy scheduler can take a while to give)."""
        dialect = dialects.DIALECTS.get(w.dialect or "")
        if dialect is None or not dialect.ranked:
            return
        state = self._server_info.setdefault(w, ServerInfoState())
        if not state.due(now) or self._stopping:
            return
        # Until this read settles (or, failed, until it is tried again): no second one.
        state.due_at = now + self.service.cfg.models_refresh_ms / 1000.0
        task = asyncio.create_task(self.refresh_server_info(w, state, state.epoch))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def refresh_server_info(self, w: WorkerState, state: ServerInfoState, epoch: int) -> None:
        """Read the worker's rank layout from SGLang's server info (sglang_info.py). A route that
        is missing (404) is tried under its older name; neither there, the page is read without
        a layout from now on (until the worker restarts). A failed read (timeout, refused, 5xx,
        401 with --api-key) changes nothing and is tried again after models_refresh_ms."""
        try:
            for path in SERVER_INFO_PATHS:
                async with self._get(w.url + path, self.timeout) as resp:
                    if resp.status in (404, 405):
                        continue
                    if resp.status != 200:
                        log.debug("server info of %s: %s answered %d", w.worker_id, path, resp.status)
                        return
                    info = json.loads(await read_capped(resp))
                self._settle_layout(w, state, epoch, parse_server_info(info))
                return
            self._settle_layout(w, state, epoch, None)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            log.debug("server info of %s: %r", w.worker_id, exc)
        except Exception:  # a task of its own: nobody else would see it fail
            log.exception("server info of %s failed", w.worker_id)

    def _settle_layout(self, w: WorkerState, state: ServerInfoState, epoch: int,
                       layout: RankLayout | None) -> None:
        if epoch != state.epoch:
            return  # the worker may have restarted since this read began: read it again
        state.due_at = math.inf  # read: valid until the worker may have restarted
        if layout == state.layout:
            return
        log.info("%s: SGLang rank layout %s", w.worker_id,
                 layout or "unknown (no server info): every TP rank read as a group of its own")
        state.layout = layout
        # Other series are summed from now on: each starts a new baseline, or one the sum did not
        # hold before would count its whole total as one interval's increase.
        w.rates.reset()

    async def refresh_models(self, w: WorkerState) -> None:
        """Served models come from the worker's /v1/models (registrations may name them)."""
        w.models_fetched_at = time.monotonic()
        if w.models_from_registration:
            return
        try:
            async with self._get(w.url + "/v1/models", self.timeout) as resp:
                if resp.status != 200:
                    return
                data = json.loads(await read_capped(resp))
            models = {str(item["id"]) for item in data.get("data", []) if isinstance(item, dict)}
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, AttributeError) as exc:
            log.debug("models of %s: %r", w.worker_id, exc)
            return
        self.service.registry.set_models(w, models)
