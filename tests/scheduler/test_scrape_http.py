"""The scraper over real HTTP against stand-in workers of other engines (small aiohttp
servers on 127.0.0.1 serving the hand-written dialect fixtures and /v1/models): dialect
detection, rates from counter deltas, and a worker whose /metrics stalls while /health
answers (busy, not dead: kept in rotation but treated as saturated)."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import math
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import gzip_accepted
from prometheus_client.parser import text_string_to_metric_families

from scheduler.config import SchedulerConfig
from scheduler.discovery.static import add_static_workers
from scheduler.policies import Request
from scheduler.scrape.dialects import TGI, VLLM_V1
from scheduler.scrape.scraper import FILTERED_MISSES_MAX, MAX_PAGE_BYTES, PageTooLarge, Scraper, read_capped
from scheduler.service import SchedulerService, Wait

FIXTURES = Path(__file__).parent / "fixtures"


async def serve(app: web.Application) -> tuple[web.AppRunner, str]:
    """Serve `app` on a free 127.0.0.1 port: (runner to clean up, base URL)."""
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"


@contextlib.asynccontextmanager
async def scraping(services: list[SchedulerService], runners: list[web.AppRunner]) -> AsyncIterator[None]:
    """Each service's scraper runs for the block; then the scrapers and the stand-ins stop."""
    scrapers = [Scraper(svc) for svc in services]
    tasks = [asyncio.create_task(sc.run()) for sc in scrapers]
    try:
        yield
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for sc in scrapers:
            await sc.stop()
        for r in runners:
            await r.cleanup()


class StandIn:
    """One stand-in worker: /metrics from a fixture (counters advanced by `bump` per scrape)."""

    metrics_paths: tuple[str, ...] = ("/metrics",)

    def __init__(self, fixture: str, model: str, bump: str | None = None, stall_s: float = 0.0,
                 info: dict | None = None) -> None:
        self.text = (FIXTURES / fixture).read_text()
        self.info = info  # TGI's GET /info body (None: no such endpoint, 404)
        self.model = model
        self.bump = bump
        self.stall_s = stall_s
        self.scrapes = 0
        self.url = ""

    async def metrics(self, request: web.Request) -> web.Response:
        self.scrapes += 1
        if self.stall_s:
            await asyncio.sleep(self.stall_s)
        text = self.text
        if self.bump:  # e.g. "tgi_request_generated_tokens_sum 35000" grows 100 per scrape
            name, value = self.bump.rsplit(" ", 1)
            text = text.replace(self.bump, f"{name} {float(value) + 100 * self.scrapes}")
        return web.Response(text=text, content_type="text/plain")

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model"}]})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def info_page(self, request: web.Request) -> web.Response:
        if self.info is None:
            raise web.HTTPNotFound()
        return web.json_response(self.info)

    async def start(self) -> web.AppRunner:
        app = web.Application()
        for path in self.metrics_paths:
            app.router.add_get(path, self.metrics)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/info", self.info_page)
        runner, self.url = await serve(app)
        return runner


async def _until(pred) -> None:
    """Poll a condition on scheduler state (bounded: 10 s)."""
    for _ in range(500):
        if pred():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not reached in 10 s")


async def test_every_dialect_over_http_and_stalled_metrics():
    stand_ins = {
        "sglang": StandIn("sglang_colon.txt", "qwen"),
        "sglang_": StandIn("sglang_underscore.txt", "qwen"),
        "tgi": StandIn("tgi.txt", "llama", bump="tgi_request_generated_tokens_sum 35000"),
        "triton": StandIn("triton.txt", "llama"),
        "trtllm": StandIn("trtllm.txt", "llama"),
        "triton_vllm": StandIn("triton_vllm.txt", "llama"),
        "vllm_v0": StandIn("vllm_v0.txt", "llama"),
        "bladellm": StandIn("bladellm.txt", "llama"),
        "vllm_v1": StandIn("vllm-0.32-cpu-running20.txt", "smollm2"),
    }
    stalled = StandIn("vllm-0.32-cpu-idle.txt", "stally")
    runners = [await s.start() for s in [*stand_ins.values(), stalled]]
    cfg = SchedulerConfig(scrape_interval_ms=50, scrape_timeout_ms=300, stale_after_ms=600)
    svc = SchedulerService(cfg)
    add_static_workers(svc, [s.url for s in [*stand_ins.values(), stalled]])
    async with scraping([svc], runners):
        by_url = {w.url: w for w in svc.registry.workers.values()}
        await _until(lambda: all(by_url[s.url].dialect == name for name, s in stand_ins.items()))
        tgi = by_url[stand_ins["tgi"].url]
        await _until(lambda: (tgi.snapshot.gen_tps or 0) > 0)
        assert tgi.snapshot.running == 12 and tgi.snapshot.waiting == 3
        sg = by_url[stand_ins["sglang"].url].snapshot
        assert (sg.running, sg.waiting, sg.block_size, sg.num_blocks) == (12, 3, 1, 200000)
        assert by_url[stand_ins["trtllm"].url].snapshot.kv_usage == 0.25
        # Served models come from each worker's /v1/models.
        assert svc.registry.by_model.keys() >= {"qwen", "llama", "smollm2", "stally"}

        # The stalled worker: first scrape ok, then /metrics hangs past the timeout.
        w = by_url[stalled.url]
        await _until(lambda: w.snapshot is not None)
        stalled.stall_s = 5.0
        await asyncio.sleep(1.2)  # > stale_after_ms, several timed-out scrapes
        assert w.health.routable, "a slow /metrics must not evict a worker whose /health answers"
        out = svc.decide(Request("stally", 10, 10), time.monotonic())
        assert isinstance(out, Wait), "stale load data counts as saturated, not idle"
        stalled.stall_s = 0.0
        await _until(lambda: isinstance(svc.decide(Request("stally", 10, 10), time.monotonic()), dict))


async def test_tgi_kv_usage_comes_from_its_batch_reservation_and_info_budget():
    """TGI publishes the tokens its running batch reserves (tgi_batch_current_max_tokens 20480
    in the fixture) but not its budget; /info's max_batch_total_tokens gives it. Without /info
    the usage stays unknown rather than guessed."""
    with_info = StandIn("tgi.txt", "llama", info={"model_id": "llama", "max_batch_total_tokens": 81920,
                                                  "max_batch_size": 16})
    without = StandIn("tgi.txt", "llama")
    runners = [await s.start() for s in (with_info, without)]
    svc = SchedulerService(SchedulerConfig(scrape_interval_ms=50, scrape_timeout_ms=300))
    add_static_workers(svc, [with_info.url, without.url])
    async with scraping([svc], runners):
        by_url = {w.url: w for w in svc.registry.workers.values()}
        tgi, blind = by_url[with_info.url], by_url[without.url]
        await _until(lambda: tgi.snapshot is not None and tgi.snapshot.kv_usage is not None)
        s = tgi.snapshot
        assert (s.kv_usage, s.block_size, s.num_blocks) == (0.25, 1, 81920)
        assert tgi.running_cap.cap == 16  # /info's max_batch_size: the batch holds no more
        await _until(lambda: blind.snapshot is not None and blind.info_fetched_at > 0)
        await asyncio.sleep(0.12)  # scrapes after the failed /info read
        assert blind.snapshot.kv_usage is None and blind.snapshot.num_blocks is None
        assert blind.running_cap.cap == math.inf


class FilteringStandIn(StandIn):
    """A stand-in serving its page through prometheus_client's exposition, routed as vLLM 0.32
    routes it (measured against a real vLLM on this machine): the exact path `/metrics` renders
    the whole page whatever the query (prometheus-fastapi-instrumentator's handler), and
    `/metrics/` reaches the prometheus_client app, which honours `?name[]=`. Variants:
    `honour_on_slash=False` ignores the query on both paths, `slash_path=False` has no
    `/metrics/` at all (404), `empty_when_filtered` accepts the filter and serves none of the
    series. Like that app, it gzips for a client that accepts gzip. Records, per scrape, the
    path and the names asked for, and how many pages went out gzipped."""

    metrics_paths = ("/metrics", "/metrics/")

    def __init__(self, fixture: str, model: str, *, honour_on_slash: bool = True,
                 slash_path: bool = True, empty_when_filtered: bool = False) -> None:
        super().__init__(fixture, model)
        self.honour_on_slash = honour_on_slash
        self.slash_path = slash_path
        self.empty_when_filtered = empty_when_filtered
        self.asked: list[tuple[str, list[str]]] = []
        self.gzipped = 0
        families = list(text_string_to_metric_families(self.text))
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(type("Fixture", (), {"collect": lambda _self: iter(families)})())

    async def metrics(self, request: web.Request) -> web.Response:
        names = request.query.getall("name[]", [])
        self.asked.append((request.path, names))
        honoured = request.path == "/metrics/" and self.honour_on_slash
        if request.path == "/metrics/" and not self.slash_path:
            raise web.HTTPNotFound()
        if names and honoured and self.empty_when_filtered:
            return web.Response(text="", content_type="text/plain")
        registry = self.registry.restricted_registry(names) if names and honoured else self.registry
        if gzip_accepted(request.headers.get("Accept-Encoding", "")):
            self.gzipped += 1
            return web.Response(body=gzip.compress(generate_latest(registry)), content_type="text/plain",
                                headers={"Content-Encoding": "gzip"})
        return web.Response(body=generate_latest(registry), content_type="text/plain")

    def filtered(self) -> list[list[str]]:
        return [names for path, names in self.asked if names]


async def test_vllm_is_scraped_for_its_series_alone_and_whole_where_that_fails():
    """After the first (whole) page has told the dialect, a vLLM worker is asked, on the path
    where vLLM honours it, for the series the scheduler reads and nothing else, and its load
    reads the same as from the whole page. A worker whose filtered scrape fails (404), lacks
    the series, or is not filtered is read whole on the next scrape, and for good after
    FILTERED_MISSES_MAX such scrapes, without going stale; TGI (which would ignore the filter)
    and a scheduler configured with scrape_only_used_series off are never sent it."""
    fixture = "vllm-0.32-cpu-running4-waiting8.txt"
    honours = FilteringStandIn(fixture, "a")
    whole = StandIn(fixture, "b")  # plain /metrics, the whole page: the reference load
    ignores = FilteringStandIn(fixture, "c", honour_on_slash=False)
    no_slash = FilteringStandIn(fixture, "d", slash_path=False)
    misreads = FilteringStandIn(fixture, "e", empty_when_filtered=True)
    tgi = FilteringStandIn("tgi.txt", "f")
    unfiltered = FilteringStandIn(fixture, "g")
    stand_ins = (honours, whole, ignores, no_slash, misreads, tgi, unfiltered)
    runners = [await s.start() for s in stand_ins]
    services = [SchedulerService(SchedulerConfig(scrape_interval_ms=20, scrape_timeout_ms=300)),
                SchedulerService(SchedulerConfig(scrape_interval_ms=20, scrape_timeout_ms=300,
                                                 scrape_only_used_series=False))]
    add_static_workers(services[0], [s.url for s in stand_ins[:-1]])
    add_static_workers(services[1], [unfiltered.url])
    async with scraping(services, runners):
        counted = (honours, ignores, no_slash, misreads, tgi, unfiltered)
        await _until(lambda: min(len(s.asked) for s in counted) >= 2 * FILTERED_MISSES_MAX + 4)
        by_url = {w.url: w for w in services[0].registry.workers.values()}
        assert honours.asked[0] == ("/metrics", [])  # the first page tells the dialect
        assert all(path == "/metrics/" and set(names) == set(VLLM_V1.wanted)
                   for path, names in honours.asked[1:])
        assert by_url[honours.url].filtered_misses == 0
        # Not gzipped: compressing costs the API server's CPU on every scrape (a real vLLM's
        # filtered scrape: 2.3 ms with gzip, 1.9 without), to save bytes on a local network.
        assert honours.gzipped == 0
        assert by_url[honours.url].view(time.monotonic())["metrics_filtered"] is True
        read = by_url[honours.url].snapshot
        full = by_url[whole.url].snapshot
        assert (read.running, read.waiting) == (4, 8)
        for field in ("running", "waiting", "kv_usage", "block_size", "num_blocks"):
            assert getattr(read, field) == getattr(full, field), field

        for stand_in in (ignores, no_slash, misreads):
            state = by_url[stand_in.url]
            assert len(stand_in.filtered()) == FILTERED_MISSES_MAX, stand_in.model
            assert stand_in.asked[-3:] == [("/metrics", [])] * 3, stand_in.model
            assert state.filtered_misses == FILTERED_MISSES_MAX
            assert state.view(time.monotonic())["metrics_filtered"] is False
            assert time.monotonic() - state.snapshot.taken_at < 1.0, stand_in.model
            assert state.snapshot.running == 4 and state.health.routable, stand_in.model
        misses = services[0].metrics.scrape_filter_misses
        assert misses.labels(by_url[no_slash.url].worker_id)._value.get() == FILTERED_MISSES_MAX

        assert TGI.filtered_metrics_path == "" and tgi.filtered() == []
        assert by_url[tgi.url].dialect == "tgi"
        assert unfiltered.filtered() == []


class OversizedPages:
    """Two stand-ins whose /metrics is far too big: one sized (Content-Length), one streamed
    without a length, 64 MiB in 1 MiB chunks (counts what it managed to send)."""

    def __init__(self) -> None:
        self.streamed_bytes = 0
        self.urls: list[str] = []

    async def sized(self, request: web.Request) -> web.Response:
        return web.Response(body=b"# " + b"x" * (MAX_PAGE_BYTES + 10) + b"\n", content_type="text/plain")

    async def streamed(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/plain"})
        await resp.prepare(request)
        chunk = b"# " + b"x" * (1024 * 1024 - 3) + b"\n"
        try:
            for _ in range(64):
                await resp.write(chunk)
                self.streamed_bytes += len(chunk)
        except (ConnectionResetError, RuntimeError):
            pass  # the scraper hung up
        return resp

    async def start(self) -> list[web.AppRunner]:
        runners = []
        for handler in (self.sized, self.streamed):
            app = web.Application()
            app.router.add_get("/metrics", handler)
            runner, url = await serve(app)
            self.urls.append(url)
            runners.append(runner)
        return runners


async def test_a_page_over_the_size_cap_fails_the_scrape_instead_of_filling_memory():
    """A worker URL that points at something answering far more than a metrics page: the scrape
    fails as an HTTP-level error (no load data, so the worker counts as saturated), and the
    scraper stops reading at the cap."""
    pages = OversizedPages()
    runners = await pages.start()
    svc = SchedulerService(SchedulerConfig(scrape_interval_ms=100, scrape_timeout_ms=5000))
    add_static_workers(svc, pages.urls)
    async with scraping([svc], runners):
        workers = list(svc.registry.workers.values())
        await _until(lambda: all(w.health.last_error == "PageTooLarge" for w in workers))
        assert all(w.snapshot is None for w in workers)
        assert pages.streamed_bytes < 32 * 1024 * 1024  # cut off near the 16 MiB cap, not read whole


async def test_a_gzipped_page_is_capped_at_its_unpacked_size():
    """A server that gzips whatever the scraper accepts (it asks for identity) and sends a
    Content-Length: aiohttp unpacks the body, so the cap must count the unpacked bytes. The
    compressed length (about 1/1000 of a page of zeros) let a page far over the cap be read whole.
    A gzipped page under the cap is read as it was meant."""
    page = b"vllm:num_requests_running 3\n" + b"#" * (4 * 1024 * 1024) + b"\n"
    body = gzip.compress(page)

    async def handler(request: web.Request) -> web.Response:
        return web.Response(body=body, headers={"Content-Encoding": "gzip", "Content-Type": "text/plain"})

    app = web.Application()
    app.router.add_get("/metrics", handler)
    runner, url = await serve(app)
    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(url + "/metrics") as resp:
                assert resp.content_length == len(body) < 1024 * 1024
                with pytest.raises(PageTooLarge):
                    await read_capped(resp, limit=1024 * 1024)
            async with session.get(url + "/metrics") as resp:
                assert await read_capped(resp, limit=len(page)) == page
    finally:
        await runner.cleanup()


async def test_a_tick_that_raises_does_not_end_the_scraping(caplog):
    """The scrape loop is the scheduler's only view of its workers. A bug in one tick's
    housekeeping (here: lease expiry raising, twice) is logged and the loop goes on: the
    worker's later load still reaches the policy, instead of its snapshot going stale for good
    while the process looks alive."""
    worker = StandIn("tgi.txt", "llama", bump="tgi_request_generated_tokens_sum 35000")
    runners = [await worker.start()]
    svc = SchedulerService(SchedulerConfig(scrape_interval_ms=50, scrape_timeout_ms=300))
    add_static_workers(svc, [worker.url])
    failures = 2
    expire_leases = svc.expire_leases

    def flaky_expire_leases(now: float) -> int:
        nonlocal failures
        if failures:
            failures -= 1
            raise RuntimeError("a bug in lease expiry")
        return expire_leases(now)

    svc.expire_leases = flaky_expire_leases
    async with scraping([svc], runners):
        await _until(lambda: failures == 0)  # housekeeping runs once a second
        scrapes_after_the_failures = worker.scrapes
        await _until(lambda: worker.scrapes >= scrapes_after_the_failures + 3)
    assert caplog.text.count("scrape loop tick failed; going on") == 2


@pytest.mark.parametrize("answer", ["page", "timeout"])
async def test_a_scrape_that_ends_after_its_worker_left_leaves_no_trace(answer):
    """A worker removed (its pod gone, its registration withdrawn) while a scrape of it was
    out: when that scrape ends, with a page or a timeout, nothing of it is counted. The
    worker's scrape latency and failure series stay gone (they came back, for good, on the
    scheduler's /metrics as a worker that no longer exists) and no health verdict runs."""
    stall = 0.6 if answer == "page" else 5.0
    gone = StandIn("vllm-0.32-cpu-idle.txt", "m")
    runners = [await gone.start()]
    svc = SchedulerService(SchedulerConfig(scrape_interval_ms=50, scrape_timeout_ms=1000))
    add_static_workers(svc, [gone.url])
    [w] = svc.registry.workers.values()
    async with scraping([svc], runners):
        await _until(lambda: w.snapshot is not None)
        gone.stall_s = stall
        scrapes = gone.scrapes
        await _until(lambda: gone.scrapes > scrapes)  # one is out now, held by the worker
        assert svc.remove_worker(w.worker_id)
        assert w.worker_id.encode() not in generate_latest(svc.metrics.registry)
        await asyncio.sleep(1.3)  # the held scrape ends (a page at 0.6 s, a timeout at 1 s)
        assert not w.scraping
    assert w.worker_id.encode() not in generate_latest(svc.metrics.registry)
