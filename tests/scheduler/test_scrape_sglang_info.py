"""SGLang's rank layout from its server info, over real HTTP against stand-in SGLang workers on
127.0.0.1. A page without a dp_rank label cannot say whether its TP ranks repeat one group
(plain TP with --enable-metrics-for-all-schedulers) or are groups of their own (dp attention):
the server info's tp_size, dp_size and enable_dp_attention can.

The server info body is `fixtures/sglang_server_info.json`, trimmed from the one SGLang's own
docs notebook prints (server arguments flat at the top level, then the scheduler info and one
internal state per DP rank); each stand-in overrides the parallelism arguments it runs with."""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path

from aiohttp import web

from scheduler.config import SchedulerConfig
from scheduler.discovery.static import add_static_workers
from scheduler.registry import WorkerState
from scheduler.service import SchedulerService
from tests.scheduler.test_scrape_http import _until, scraping

SERVER_INFO = json.loads((Path(__file__).parent / "fixtures" / "sglang_server_info.json").read_text())
Row = tuple[int, float, float, float]  # (tp_rank, running, queued, token_usage) per reporting rank


def sglang_page(rows: list[Row], prompt_tokens: float = 1000.0) -> str:
    """Scheduler gauges as SGLang writes them, one series per reporting scheduler and no dp_rank
    label (dp attention, or plain TP), each rank's pool 100,000 tokens; and the tokenizer's
    prompt-token counter (no rank labels: one series)."""
    lines = []
    for name, col in (("num_running_reqs", 1), ("num_queue_reqs", 2), ("token_usage", 3),
                      ("max_total_num_tokens", None)):
        lines.append(f"# TYPE sglang:{name} gauge")
        for row in rows:
            labels = (f'model_name="qwen",engine_type="unified",tp_rank="{row[0]}",pp_rank="0",'
                      f'moe_ep_rank="{row[0]}"')
            lines.append(f"sglang:{name}{{{labels}}} {100000.0 if col is None else row[col]}")
    lines += ["# TYPE sglang:prompt_tokens_total counter",
              f'sglang:prompt_tokens_total{{model_name="qwen"}} {prompt_tokens}']
    return "\n".join(lines) + "\n"


class SGLangStandIn:
    """/metrics, /v1/models, /health, and the server info under `routes` (newest SGLang:
    /server_info, which still answers /get_server_info; older: /get_server_info alone)."""

    def __init__(self, rows: list[Row], *, routes: tuple[str, ...] = ("/server_info", "/get_server_info"),
                 **args: object) -> None:
        self.page = sglang_page(rows)
        self.routes = routes
        self.info = {**SERVER_INFO, **args}
        self.asked: dict[str, int] = {}
        self.scrapes = 0
        self.hold_info = False  # hold each server info answer until released (at most 5 s)
        self.held: list[asyncio.Event] = []  # one per held answer, in the order asked
        self.url = ""

    async def metrics(self, request: web.Request) -> web.Response:
        self.scrapes += 1
        return web.Response(text=self.page, content_type="text/plain")

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "qwen", "object": "model"}]})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def server_info(self, request: web.Request) -> web.Response:
        self.asked[request.path] = self.asked.get(request.path, 0) + 1
        body = self.info  # what this server runs with when asked
        if self.hold_info:
            release = asyncio.Event()
            self.held.append(release)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(release.wait(), 5.0)
        return web.json_response(body)

    def release_all(self) -> None:
        self.hold_info = False
        for release in self.held:
            release.set()

    async def start(self, port: int = 0) -> web.AppRunner:
        app = web.Application()
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        for path in self.routes:
            app.router.add_get(path, self.server_info)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", port, reuse_address=True)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        return runner


def _config(**overrides: object) -> SchedulerConfig:
    # The whole page every scrape: the stand-ins do not filter by `?name[]=`.
    return SchedulerConfig(**{"scrape_interval_ms": 50, "scrape_timeout_ms": 300,
                              "scrape_only_used_series": False, **overrides})


def _workers(svc: SchedulerService) -> dict[str, WorkerState]:
    return {w.url: w for w in svc.registry.workers.values()}


# --tp 2, metrics from every scheduler: rank 1 repeats rank 0's group.
PLAIN_TP2 = [(0, 7.0, 2.0, 0.5), (1, 7.0, 2.0, 0.5)]
PLAIN_TP2_ARGS = {"tp_size": 2, "dp_size": 1, "enable_dp_attention": False,
                  "enable_metrics_for_all_schedulers": True}


async def test_server_info_tells_repeated_ranks_from_dp_attention_groups():
    """Plain --tp 2 with --enable-metrics-for-all-schedulers was read as two groups: twice its
    running requests, queue and KV pool. --tp 4 --dp 2 --enable-dp-attention with the same flag
    as four groups (ranks 0-1 are one attention group, 2-3 the other). SGLang before /server_info
    answers /get_server_info. A server with neither is read as before: every TP rank a group."""
    plain = SGLangStandIn(PLAIN_TP2, **PLAIN_TP2_ARGS)
    dp_attention = SGLangStandIn(
        [(0, 7.0, 2.0, 0.5), (1, 7.0, 2.0, 0.5), (2, 5.0, 1.0, 0.3), (3, 5.0, 1.0, 0.3)],
        tp_size=4, dp_size=2, enable_dp_attention=True, enable_metrics_for_all_schedulers=True)
    older = SGLangStandIn(PLAIN_TP2, routes=("/get_server_info",), **PLAIN_TP2_ARGS)
    # --tp 4 --dp 2 --enable-dp-attention, default metrics: each group's first rank alone.
    no_info = SGLangStandIn([(0, 7.0, 2.0, 0.5), (2, 5.0, 1.0, 0.3)], routes=())
    stand_ins = (plain, dp_attention, older, no_info)
    runners = [await s.start() for s in stand_ins]
    svc = SchedulerService(_config())
    add_static_workers(svc, [s.url for s in stand_ins])
    async with scraping([svc], runners):
        workers = _workers(svc)

        def reads(s: SGLangStandIn) -> tuple[float, float, int | None, float | None] | None:
            snap = workers[s.url].snapshot
            return None if snap is None else (snap.running, snap.waiting, snap.num_blocks, snap.kv_usage)

        await _until(lambda: reads(plain) == (7.0, 2.0, 100000, 0.5))
        await _until(lambda: reads(dp_attention) == (12.0, 3.0, 200000, 0.4))
        await _until(lambda: reads(older) == (7.0, 2.0, 100000, 0.5))
        await _until(lambda: reads(no_info) == (12.0, 3.0, 200000, 0.4) and no_info.scrapes >= 10)
        # Read once per worker, not per scrape; the older route only where the newer is missing.
        await _until(lambda: min(s.scrapes for s in stand_ins) >= 10)
        assert plain.asked == {"/server_info": 1} and dp_attention.asked == {"/server_info": 1}
        assert older.asked == {"/get_server_info": 1}


async def test_server_info_is_read_again_when_the_worker_restarts():
    """A worker restarted with other arguments (plain --tp 2 before, --tp 2 --dp 2
    --enable-dp-attention after: ranks 0 and 1 are two groups now) was read in its first layout
    for good: half its requests. The layout is read again after the worker was seen down, and
    after a counter of its page went back (restarted between two scrapes)."""
    before = SGLangStandIn(PLAIN_TP2, **PLAIN_TP2_ARGS)
    runner = await before.start()
    port = int(before.url.rsplit(":", 1)[1])
    svc = SchedulerService(_config())
    add_static_workers(svc, [before.url])
    runners = [runner]
    async with scraping([svc], runners):
        w = _workers(svc)[before.url]
        await _until(lambda: w.snapshot is not None and w.snapshot.running == 7.0 and before.asked)

        # Down (connections refused), then up again at the same address.
        await runner.cleanup()
        await _until(lambda: w.health.consecutive_failures >= 3)  # refused scrapes
        after = SGLangStandIn([(0, 7.0, 2.0, 0.5), (1, 5.0, 1.0, 0.3)], tp_size=2, dp_size=2,
                              enable_dp_attention=True, enable_metrics_for_all_schedulers=False)
        runners.append(await after.start(port))
        await _until(lambda: w.snapshot.running == 12.0 and after.asked == {"/server_info": 1})

        # Restarted between two scrapes (no refused one): its prompt counter went back.
        after.info = {**after.info, **PLAIN_TP2_ARGS}
        after.page = sglang_page(PLAIN_TP2, prompt_tokens=10.0)
        await _until(lambda: w.snapshot.running == 7.0 and after.asked == {"/server_info": 2})


async def test_a_slow_server_info_holds_no_scrape_and_is_tried_again():
    """SGLang answers its server info after asking every DP scheduler for its state, which a busy
    one can take long to give: the read runs beside the scrapes, bounded by the scrape timeout,
    and is tried again (models_refresh_ms later) until it answers. Meanwhile the page is read
    without a layout."""
    slow = SGLangStandIn(PLAIN_TP2, **PLAIN_TP2_ARGS)
    slow.hold_info = True
    runners = [await slow.start()]
    svc = SchedulerService(_config(scrape_timeout_ms=400, models_refresh_ms=100))
    add_static_workers(svc, [slow.url])
    async with scraping([svc], runners):
        w = _workers(svc)[slow.url]
        await _until(lambda: slow.asked.get("/server_info", 0) >= 1)
        scrapes = slow.scrapes
        await asyncio.sleep(1.0)
        # Scraped every 50 ms all along (one held by each 400 ms read would make ~3).
        assert slow.scrapes - scrapes >= 8
        assert slow.asked["/server_info"] >= 2  # timed out and tried again
        assert w.snapshot.running == 14.0  # no layout yet: each rank read as a group
        slow.release_all()
        await _until(lambda: w.snapshot.running == 7.0)


async def test_a_read_begun_before_a_restart_does_not_settle_the_layout_after_it():
    """A server info read was under way when the worker restarted with other arguments: its
    answer (the old engine's plain --tp 2) settled the layout for good, and the restarted
    engine's four dp-attention groups were read as two (10 running requests of 16). The answer
    is dropped; the read begun after the restart settles the layout."""
    w_in = SGLangStandIn(PLAIN_TP2, **PLAIN_TP2_ARGS)
    w_in.hold_info = True
    runners = [await w_in.start()]
    svc = SchedulerService(_config(scrape_timeout_ms=3000))
    add_static_workers(svc, [w_in.url])
    async with scraping([svc], runners):
        w = _workers(svc)[w_in.url]
        await _until(lambda: len(w_in.held) == 1)
        # Restarted between two scrapes as --tp 4 --dp 4 --enable-dp-attention: its prompt
        # counter went back, and the next read asks the new engine.
        w_in.info = {**w_in.info, "tp_size": 4, "dp_size": 4, "enable_dp_attention": True}
        groups = [(0, 7.0, 2.0, 0.5), (1, 5.0, 1.0, 0.3), (2, 3.0, 0.0, 0.2), (3, 1.0, 0.0, 0.1)]
        w_in.page = sglang_page(groups, prompt_tokens=10.0)
        await _until(lambda: len(w_in.held) == 2)
        w_in.held[0].set()  # the old engine's answer comes back first
        for _ in range(10):  # bounded: 10 scrapes' worth
            await asyncio.sleep(0.05)
            assert w.snapshot.running == 16.0, "the old engine's layout read the new one's groups in pairs"
        w_in.release_all()
        await _until(lambda: w_in.asked == {"/server_info": 2} and not w_in.hold_info)
        for _ in range(4):
            await asyncio.sleep(0.05)
            assert w.snapshot.running == 16.0
