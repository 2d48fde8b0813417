"""What one /metrics scrape costs the worker that serves it: the whole page against the series
the scheduler reads (`?name[]=...`, which prometheus_client's exposition honours).

The scheduler scrapes every worker every 100 ms. Our worker renders /metrics on the event loop
that also runs its engine (vLLM renders it in its API server process, beside tokenisation and
streaming), so the render's CPU is taken from serving. Three ways of asking are measured:
- `whole`: `/metrics`;
- `query_on_exact_path`: `/metrics?name[]=...` (what the scheduler sent before it learnt that
  vLLM serves the exact path with a handler that ignores the query);
- `filtered`: the scheduler's filtered path, `/metrics/?name[]=...`.
Each is asked twice: as aiohttp asks by default (`Accept-Encoding: gzip, deflate`, which
prometheus_client's exposition answers gzipped, compressing on the server's CPU) and with
`Accept-Encoding: identity` (`_identity`), as the scheduler asks since it stopped taking gzip.

By default one sim worker is started on 127.0.0.1 and given a few requests so that every
histogram has observations. `--url` with `--pid` measures a server that is already running
instead (e.g. a real vLLM: `--pid` its API server process, which renders the page). Each way is
scraped N times, one scrape at a time; the server's CPU (utime + stime from /proc) over each
phase, less its idle CPU, is divided by N.

    python -m benchmarks.metrics_scrape_cost --scrapes 300
    python -m benchmarks.metrics_scrape_cost --scrapes 300 --url http://127.0.0.1:8300 --pid 1234 \\
        --model smollm2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp

from benchmarks.cluster import ManagedProcess, free_port
from benchmarks.proc_cpu import cpu_seconds
from scheduler.scrape.dialects import VLLM_V1


async def scrape_costs(session: aiohttp.ClientSession, url: str, pid: int, model: str,
                       scrapes: int) -> dict:
    """Warm the server with a few requests, then charge it for each way of scraping."""
    body = {"model": model, "prompt": "hello " * 50, "max_tokens": 20}
    for _ in range(3):
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            await resp.read()
    idle0, t0 = cpu_seconds(pid), time.monotonic()
    await asyncio.sleep(2.0)
    idle_cores = (cpu_seconds(pid) - idle0) / (time.monotonic() - t0)
    filtered = VLLM_V1.filtered_metrics_path
    ways = (("whole", "/metrics"),
            ("query_on_exact_path", "/metrics" + filtered[len("/metrics/"):]),
            ("filtered", filtered))
    identity = {"Accept-Encoding": "identity"}
    out: dict = {"url": url, "scrapes": scrapes, "idle_cores": round(idle_cores, 4)}
    for label, path in ways:
        for suffix, headers in (("", None), ("_identity", identity)):
            size, wire, encoding = 0, 0, "identity"
            c0, t0 = cpu_seconds(pid), time.monotonic()
            for _ in range(scrapes):
                async with session.get(url + path, headers=headers) as resp:
                    resp.raise_for_status()
                    size = len(await resp.read())
                    wire = int(resp.headers.get("Content-Length", size))
                    encoding = resp.headers.get("Content-Encoding", "identity")
            wall = time.monotonic() - t0
            cpu = cpu_seconds(pid) - c0 - idle_cores * wall
            out[label + suffix] = {"bytes": size, "bytes_on_the_wire": wire, "content_encoding": encoding,
                                   "server_cpu_ms_per_scrape": round(1000 * cpu / scrapes, 3)}
    return out


async def measure_sim(scrapes: int, profile: str) -> dict:
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
            return {"server": f"sim worker, profile {profile}",
                    **await scrape_costs(session, url, worker.proc.pid, "llama2", scrapes)}
    finally:
        await worker.stop()


async def measure_running(scrapes: int, url: str, pid: int, model: str) -> dict:
    async with aiohttp.ClientSession() as session:
        return {"server": f"running server, pid {pid}",
                **await scrape_costs(session, url.rstrip("/"), pid, model, scrapes)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scrapes", type=int, default=300)
    p.add_argument("--profile", default="llama2-7b-a10", help="sim profile (without --url)")
    p.add_argument("--url", help="a running OpenAI server on 127.0.0.1 to measure instead of a sim")
    p.add_argument("--pid", type=int, help="with --url: the process that renders its /metrics")
    p.add_argument("--model", default="llama2", help="with --url: a model it serves")
    args = p.parse_args(argv)
    if args.scrapes < 1:
        p.error("--scrapes must be at least 1")
    if args.url:
        if urlsplit(args.url).hostname not in ("127.0.0.1", "localhost"):
            p.error("--url must be on 127.0.0.1 (benchmarks talk to this machine only)")
        if args.pid is None:
            p.error("--url needs --pid (the process whose CPU a scrape costs)")
        result = asyncio.run(measure_running(args.scrapes, args.url, args.pid, args.model))
    else:
        result = asyncio.run(measure_sim(args.scrapes, args.profile))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
