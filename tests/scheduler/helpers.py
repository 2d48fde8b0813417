"""Shared helpers for scheduler tests: in-process services with synthetic snapshots."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterable

from aiohttp import web

from scheduler.config import SchedulerConfig
from scheduler.registry import WorkerState
from scheduler.scrape.snapshot import LoadSnapshot
from scheduler.service import SchedulerService


def make_service(policy: str = "llm_aware", n: int = 3, model: str = "m", config: dict | None = None,
                 **params) -> SchedulerService:
    """n workers w0.. at http://127.0.0.1:9000.., healthy, idle; `config`: more SchedulerConfig fields."""
    svc = SchedulerService(SchedulerConfig(policy=policy, policy_params=params, **(config or {})))
    for i in range(n):
        w = svc.add_worker(WorkerState(f"http://127.0.0.1:{9000 + i}", worker_id=f"w{i}", models=[model]))
        w.health.on_success(time.monotonic(), 1)
        feed(svc, w)
    return svc


def feed(svc: SchedulerService, w: WorkerState, running=0.0, waiting=0.0, kv=0.0, num_blocks=1000,
         block_size=16, taken_at: float | None = None, prompt_total: float | None = None,
         prefill_tps: float | None = None, waiting_deferred: float = 0.0) -> None:
    now = time.monotonic() if taken_at is None else taken_at
    snap = LoadSnapshot(running=running, waiting=waiting, kv_usage=kv, prompt_tps=None, gen_tps=None,
                        prefix_hit_rate=None, block_size=block_size, num_blocks=num_blocks, ttft_mean_s=None,
                        itl_mean_s=None, taken_at=now, wall_time=time.time(), dialect="vllm_v1",
                        prefilled_tokens_total=prompt_total, prefill_tps=prefill_tps,
                        waiting_deferred=waiting_deferred)
    svc.on_snapshot(w, snap)


def worker(svc: SchedulerService, wid: str) -> WorkerState:
    return svc.registry.workers[wid]


async def parser_refusals(runner: web.AppRunner, targets: Iterable[str]) -> list[dict]:
    """Serve `runner` on 127.0.0.1 and send, each on its own connection, a CONNECT to each of
    `targets` (an authority that is no host:port: aiohttp's parser refuses it); the OpenAI
    error of each 400, in order. The runner is cleaned up."""
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    errors = []
    try:
        for target in targets:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(f"CONNECT {target} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            answer = await asyncio.wait_for(reader.read(), 10)  # closed after it
            writer.close()
            head, _, body = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.0 400"), head
            errors.append(json.loads(body)["error"])
    finally:
        await runner.cleanup()
    return errors
