"""CPU cost of a cluster of sim workers under the reference load.

Starts N sim workers (default 5 x llama2-7b-a10), drives them with C concurrent streaming
completions (default 160, spread round robin) of ShareGPT prompts sampled as vLLM does
(reply length as max_tokens, ignore_eos), and measures the user+sys CPU time the worker
processes spend (from /proc/<pid>/stat) over a fixed window after a warm-up. The load
loop is bounded in time (window + warm-up + drain deadline) and in requests.

    python -m benchmarks.sim_cost --workers 5 --concurrency 160 --time-scale 1 \
        --warmup 10 --duration 30 --json out.json

It prints worker CPU in cores (the goal: well under one core for the 5 workers
together), CPU microseconds per generated token, the token rate, and the TTFT / TPOT the
clients saw (in simulated ms: wall ms / time scale).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

import aiohttp

from benchmarks.cluster import free_port
from benchmarks.datasets import load_sharegpt, sample_sharegpt
from benchmarks.proc_cpu import cpu_seconds, own_cpu_seconds
from inference_worker.sim.tokenizer import SimTokenizer


@dataclass
class Window:
    """What finished requests reported, and the token count streamed inside the window."""

    tokens_in_window: int = 0
    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    completed: int = 0
    failed: int = 0
    measuring: bool = False


async def one_request(session, url, model, prompt, max_tokens, window: Window) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True, "temperature": 0}
    start = time.perf_counter()
    first = last = None
    n = 0
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                window.failed += 1
                return
            async for line in resp.content:
                if not line.startswith(b"data: {"):
                    continue
                last = time.perf_counter()
                first = first or last
                n += 1
                if window.measuring:
                    window.tokens_in_window += 1
    except (TimeoutError, aiohttp.ClientError):
        window.failed += 1
        return
    if first is None:
        window.failed += 1
        return
    window.completed += 1
    if window.measuring:
        window.ttft.append(first - start)
        if n > 1:
            window.tpot.append((last - first) / (n - 1))


async def drive(urls, model, samples, concurrency, warmup, duration, drain) -> tuple[Window, float]:
    """Keep `concurrency` streams busy; returns the window stats and the window's wall time."""
    window = Window()
    work = itertools.cycle(samples)
    targets = itertools.cycle(urls)
    stop_at = time.monotonic() + warmup + duration
    timeout = aiohttp.ClientTimeout(total=warmup + duration + drain)
    async with aiohttp.ClientSession(timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=concurrency + 8)) as session:

        async def stream_slot() -> None:
            while time.monotonic() < stop_at:
                s = next(work)
                await one_request(session, next(targets), model, s.prompt, s.expected_output_len, window)

        slots = [asyncio.create_task(stream_slot()) for _ in range(concurrency)]
        await asyncio.sleep(warmup)
        window.measuring = True
        window_start = time.monotonic()
        await asyncio.sleep(duration)
        window.measuring = False
        elapsed = time.monotonic() - window_start
        # Slots stop starting new requests now; let the running ones finish (bounded).
        _, pending = await asyncio.wait(slots, timeout=drain)
        for task in pending:
            task.cancel()
    return window, elapsed


def start_workers(n: int, profile: str, time_scale: float, model: str) -> list[tuple[subprocess.Popen, str]]:
    procs = []
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    for _ in range(n):
        port = free_port()
        args = [sys.executable, "-m", "inference_worker", "--backend", "sim", "--sim-profile", profile,
                "--served-model-name", model, "--host", "127.0.0.1", "--port", str(port),
                "--time-scale", str(time_scale)]
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        procs.append((proc, f"http://127.0.0.1:{port}"))
    return procs


async def wait_healthy(base_urls: list[str], timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        for base in base_urls:
            while True:
                try:
                    async with session.get(f"{base}/health") as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{base} not healthy after {timeout_s}s")
                await asyncio.sleep(0.2)


def mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=5)
    ap.add_argument("--concurrency", type=int, default=160)
    ap.add_argument("--profile", default="llama2-7b-a10")
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--warmup", type=float, default=10.0, help="seconds before the measured window")
    ap.add_argument("--duration", type=float, default=30.0, help="measured window, seconds")
    ap.add_argument("--drain", type=float, default=60.0, help="max seconds to let running requests end")
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()

    tok = SimTokenizer()
    samples = sample_sharegpt(load_sharegpt(), lambda texts: [len(tok.encode(t)) for t in texts],
                              args.num_prompts, seed=args.seed)
    model = "llama2"
    procs = start_workers(args.workers, args.profile, args.time_scale, model)
    try:
        bases = [base for _, base in procs]
        asyncio.run(wait_healthy(bases))
        # For attaching a profiler (py-spy record --pid ...) to a worker during the run.
        print("workers: " + " ".join(f"{p.pid}={base}" for p, base in procs), file=sys.stderr, flush=True)
        urls = [f"{b}/v1/completions" for b in bases]

        async def run() -> tuple[Window, float, float, float]:
            loop_task = drive(urls, model, samples, args.concurrency, args.warmup, args.duration, args.drain)
            # Sample worker CPU exactly at the window edges, from inside the same loop.
            task = asyncio.ensure_future(loop_task)
            await asyncio.sleep(args.warmup)
            cpu0 = sum(cpu_seconds(p.pid) for p, _ in procs)
            self0 = own_cpu_seconds()
            await asyncio.sleep(args.duration)
            cpu1 = sum(cpu_seconds(p.pid) for p, _ in procs)
            client = own_cpu_seconds() - self0
            window, elapsed = await task
            return window, elapsed, cpu1 - cpu0, client

        window, elapsed, worker_cpu, client_cpu = asyncio.run(run())
    finally:
        for proc, _ in procs:
            proc.terminate()
        for proc, _ in procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()

    scale = args.time_scale
    result = {
        "workers": args.workers, "concurrency": args.concurrency, "profile": args.profile,
        "time_scale": scale, "window_s": round(elapsed, 2),
        "worker_cpu_cores": round(worker_cpu / elapsed, 3),
        "worker_cpu_cores_per_worker": round(worker_cpu / elapsed / args.workers, 3),
        "client_cpu_cores": round(client_cpu / elapsed, 3),
        "output_tokens_per_s_wall": round(window.tokens_in_window / elapsed, 1),
        "output_tokens_per_s_simulated": round(window.tokens_in_window / elapsed * scale, 1),
        "worker_cpu_us_per_token": round(1e6 * worker_cpu / max(window.tokens_in_window, 1), 1),
        "requests_completed_in_window": len(window.ttft), "failed": window.failed,
        "mean_ttft_ms_simulated": round(1e3 * mean(window.ttft) / scale, 1),
        "p99_ttft_ms_simulated": round(1e3 * pct(window.ttft, 0.99) / scale, 1),
        "mean_tpot_ms_simulated": round(1e3 * mean(window.tpot) / scale, 2),
        "p99_tpot_ms_simulated": round(1e3 * pct(window.tpot, 0.99) / scale, 2),
    }
    print(f"{'metric':<36}value")
    for key, value in result.items():
        print(f"{key:<36}{value}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
