"""The scraper over real HTTP against stand-in workers of other engines (small aiohttp
servers on 127.0.0.1 serving the hand-written dialect fixtures and /v1/models): dialect
detection, rates from counter deltas, and a worker whose /metrics stalls while /health
answers (busy, not dead: kept in rotation but treated as saturated)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from aiohttp import web

from scheduler.config import SchedulerConfig
from scheduler.discovery.static import add_static_workers
from scheduler.policies import Request
from scheduler.scrape.scraper import Scraper
from scheduler.service import SchedulerService, Wait

FIXTURES = Path(__file__).parent / "fixtures"


class StandIn:
    """One stand-in worker: /metrics from a fixture (counters advanced by `bump` per scrape)."""

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
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/info", self.info_page)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
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
    scraper = Scraper(svc)
    task = asyncio.create_task(scraper.run())
    try:
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
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await scraper.stop()
        for r in runners:
            await r.cleanup()


async def test_tgi_kv_usage_comes_from_its_batch_reservation_and_info_budget():
    """TGI publishes the tokens its running batch reserves (tgi_batch_current_max_tokens 20480
    in the fixture) but not its budget; /info's max_batch_total_tokens gives it. Without /info
    the usage stays unknown rather than guessed."""
    with_info = StandIn("tgi.txt", "llama", info={"model_id": "llama", "max_batch_total_tokens": 81920})
    without = StandIn("tgi.txt", "llama")
    runners = [await s.start() for s in (with_info, without)]
    svc = SchedulerService(SchedulerConfig(scrape_interval_ms=50, scrape_timeout_ms=300))
    add_static_workers(svc, [with_info.url, without.url])
    scraper = Scraper(svc)
    task = asyncio.create_task(scraper.run())
    try:
        by_url = {w.url: w for w in svc.registry.workers.values()}
        tgi, blind = by_url[with_info.url], by_url[without.url]
        await _until(lambda: tgi.snapshot is not None and tgi.snapshot.kv_usage is not None)
        s = tgi.snapshot
        assert (s.kv_usage, s.block_size, s.num_blocks) == (0.25, 1, 81920)
        await _until(lambda: blind.snapshot is not None and blind.info_fetched_at > 0)
        await asyncio.sleep(0.12)  # scrapes after the failed /info read
        assert blind.snapshot.kv_usage is None and blind.snapshot.num_blocks is None
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await scraper.stop()
        for r in runners:
            await r.cleanup()
