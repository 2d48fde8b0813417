"""Samples each worker's load gauges during a benchmark run, for the timeline plots.

Reads `vllm:num_requests_waiting`, `vllm:num_requests_running` and `vllm:kv_cache_usage_perc`
(falling back to the v0 name `vllm:gpu_cache_usage_perc`) from every worker's `/metrics` about
every 0.5 s. Times are reported in simulated seconds (wall seconds / time_scale), the same clock
as the benchmark client's figures.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import aiohttp

from scheduler.scrape.parse import parse_selected

GAUGES = {
    "vllm:num_requests_waiting": "waiting",
    "vllm:num_requests_running": "running",
    "vllm:kv_cache_usage_perc": "kv",
    "vllm:gpu_cache_usage_perc": "kv_v0",
}


def parse_gauges(text: str) -> dict[str, float]:
    """Sum each wanted gauge over its label sets (data-parallel engines report one series each),
    read with the scheduler's own Prometheus parser."""
    out = {key: sum(value for _, value in samples)
           for key, samples in parse_selected(text, GAUGES).items() if samples}
    if "kv" not in out and "kv_v0" in out:
        out["kv"] = out["kv_v0"]
    out.pop("kv_v0", None)
    return out


async def fetch_metrics(session: aiohttp.ClientSession, url: str, timeout_s: float) -> str | None:
    """A worker's `/metrics` page, or None when it cannot be read (down, slow, not 200)."""
    with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, OSError):
        async with session.get(f"{url}/metrics", timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status == 200:
                return await resp.text()
    return None


class LoadSampler:
    """`async with LoadSampler(urls, ...) as s:` ... then s.samples: list of per-tick dicts."""

    def __init__(self, worker_urls: list[str], interval_s: float = 0.5, time_scale: float = 1.0,
                 max_samples: int = 20_000):
        self.worker_urls = worker_urls
        self.interval_s = interval_s
        self.time_scale = time_scale
        self.max_samples = max_samples  # bounds memory if a run hangs
        self.samples: list[dict] = []
        self._task: asyncio.Task | None = None
        self._t0 = 0.0

    async def __aenter__(self) -> LoadSampler:
        self._t0 = time.monotonic()
        self._task = asyncio.create_task(self._loop())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _scrape(self, session: aiohttp.ClientSession, url: str) -> dict[str, float] | None:
        text = await fetch_metrics(session, url, timeout_s=2)
        return None if text is None else parse_gauges(text)

    async def _loop(self) -> None:
        async with aiohttp.ClientSession() as session:
            while len(self.samples) < self.max_samples:
                tick = time.monotonic()
                results = await asyncio.gather(*(self._scrape(session, u) for u in self.worker_urls))
                t_sim = (tick - self._t0) / self.time_scale
                self.samples.append({
                    "t": round(t_sim, 3),
                    "workers": [r if r is not None else {} for r in results],
                })
                await asyncio.sleep(max(0.0, self.interval_s - (time.monotonic() - tick)))
