"""What one /metrics scrape costs the worker that serves it: whole page against the series the
scheduler reads (`?name[]=...`, as vLLM's and SGLang's prometheus_client endpoints honour).

The scheduler scrapes every worker every 100 ms. Our worker renders /metrics on the event loop
that also runs its engine (vLLM renders it in its API server process, beside tokenisation and
streaming), so the render's CPU is taken from serving. One sim worker is started on 127.0.0.1,
given a few requests so that every histogram has observations, then scraped N times each way,
one scrape at a time; the worker's CPU (utime + stime from /proc) over each phase, less its
idle CPU, is divided by N.

    python -m benchmarks.metrics_scrape_cost --scrapes 300
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import aiohttp

from benchmarks.cluster import ManagedProcess, free_port
from benchmarks.proc_cpu import cpu_seconds
from scheduler.scrape.dialects import VLLM_V1


async def measure(scrapes: int, profile: str) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    worker = ManagedProcess("worker", [sys.executable, "-m", "inference_worker", "--backend", "sim",
                                       "--served-model-name", "llama2", "--host", "127.0.0.1",
                                       "--port", str(port), "--sim-profile", profile],
                            log_path=Path("/tmp/metrics-scrape-cost-worker.log"))
    await worker.start()
    try:
        async with aiohttp.ClientSession() as session:
            await worker.wait_ready(f"{url}/health", 60, session)
            body = {"model": "llama2", "prompt": "hello " * 50, "max_tokens": 20}
            for _ in range(3):
                async with session.post(f"{url}/v1/completions", json=body) as resp:
                    await resp.read()
            pid = worker.proc.pid
            idle0, t0 = cpu_seconds(pid), time.monotonic()
            await asyncio.sleep(2.0)
            idle_cores = (cpu_seconds(pid) - idle0) / (time.monotonic() - t0)
            out = {"profile": profile, "scrapes": scrapes, "idle_cores": round(idle_cores, 4)}
            for label, query in (("whole", ""), ("filtered", VLLM_V1.scrape_query)):
                size = 0
                c0, t0 = cpu_seconds(pid), time.monotonic()
                for _ in range(scrapes):
                    async with session.get(f"{url}/metrics{query}") as resp:
                        size = len(await resp.read())
                wall = time.monotonic() - t0
                cpu = cpu_seconds(pid) - c0 - idle_cores * wall
                out[label] = {"bytes": size, "worker_cpu_ms_per_scrape": round(1000 * cpu / scrapes, 3)}
            return out
    finally:
        await worker.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scrapes", type=int, default=300)
    p.add_argument("--profile", default="llama2-7b-a10")
    args = p.parse_args(argv)
    print(json.dumps(asyncio.run(measure(args.scrapes, args.profile)), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
