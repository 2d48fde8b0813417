"""The gateway's CPU per streamed token, with tokens paced as an engine sends them.

`gateway_overhead` streams 16 chunks as fast as the stand-in workers can write them, so a
chunk often arrives with the next. Engines send one chunk per decode step, tens of
milliseconds apart, so every token is its own read, timer work and write in the gateway; over
a 200-token answer that per-token cost is most of what a stream costs (RESULTS.md: 12.4 ms
of gateway CPU per request in the routing runs). This program measures it: echo workers that
pace their tokens (`--token-delay-ms`), one gateway (round robin over them) per checkout given,
and the peer routers given (round robin too), the same bounded load through each in turn,
repeated and interleaved; CPU from /proc.

To compare two versions of the gateway in one run, give the other checkout too (e.g. a
`git worktree` of an earlier commit); each runs with its own code, the load and workers are
shared:

    .venv/bin/python -m benchmarks.gateway_stream_cpu --gateway head=. --gateway before=/tmp/wt-before \\
        --streams 600 --tokens 200 --concurrency 64 --repeat 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import time
from pathlib import Path

import aiohttp

from benchmarks.cluster import free_port
from benchmarks.gateway_overhead import external_routers, spawn, start_echo_workers, stop_all, wait_ready
from benchmarks.proc_cpu import cpu_seconds


async def paced_streams(url: str, pid: int, streams: int, tokens: int, concurrency: int) -> dict:
    """`streams` chat streams of `tokens` tokens each, `concurrency` at a time."""
    body = {"model": "m", "stream": True, "max_tokens": tokens,
            "messages": [{"role": "user", "content": "hi"}]}
    gate = asyncio.Semaphore(concurrency)
    failed = 0

    async def one(session: aiohttp.ClientSession) -> None:
        nonlocal failed
        async with gate:
            try:
                async with session.post(url + "/v1/chat/completions", json=body) as r:
                    data = await r.read()
                    failed += r.status != 200 or not data.endswith(b"data: [DONE]\n\n")
            except aiohttp.ClientError:
                failed += 1

    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        cpu0, t0 = cpu_seconds(pid), time.monotonic()
        await asyncio.gather(*(one(session) for _ in range(streams)))
        cpu1, t1 = cpu_seconds(pid), time.monotonic()
    cpu = cpu1 - cpu0
    return {
        "wall_s": round(t1 - t0, 2),
        "gateway_cpu_s": round(cpu, 3),
        "ms_per_stream": round(cpu / streams * 1000, 3),
        "us_per_token": round(cpu / (streams * tokens) * 1e6, 2),
        "failed": failed,
    }


async def main_async(args: argparse.Namespace) -> dict:
    logs = Path(args.log_dir)
    procs: list[subprocess.Popen] = []
    try:
        workers = await start_echo_workers(args.workers, logs, procs, args.token_delay_ms)
        wurls = [url for url, _ in workers]
        gateways: dict[str, tuple[str, int]] = {}
        for name, checkout in args.gateway:
            port = free_port()
            p = spawn(["-m", "router", "--port", str(port), "--workers", ",".join(wurls)],
                      logs / f"gateway-{name}.log", cwd=checkout)
            procs.append(p)
            url = f"http://127.0.0.1:{port}"
            await wait_ready(url + "/health", p)
            gateways[name] = (url, p.pid)
        for label, urls, pids in await external_routers(args, wurls, logs, procs):
            gateways[label] = (urls[0].removesuffix("/v1/completions"), pids["gateway"])
        runs: dict[str, list[dict]] = {name: [] for name in gateways}
        for rep in range(args.repeat):
            order = list(gateways) if rep % 2 == 0 else list(reversed(gateways))
            for name in order:
                url, pid = gateways[name]
                run = await paced_streams(url, pid, args.streams, args.tokens, args.concurrency)
                runs[name].append(run)
                print(f"repeat {rep + 1} {name}: {run}", flush=True)
        return {"settings": {k: v for k, v in vars(args).items() if k != "gateway"},
                "gateways": {name: str(path) for name, path in args.gateway}, "runs": runs}
    finally:
        stop_all(procs)


def print_table(result: dict) -> None:
    runs = result["runs"]
    first = next(iter(runs))
    print("| gateway | CPU per token (us), median | per repeat | CPU per stream (ms), median | vs "
          f"{first} | failed |")
    print("|---|---|---|---|---|---|")
    base = statistics.median(r["us_per_token"] for r in runs[first])
    for name, rs in runs.items():
        per_token = statistics.median(r["us_per_token"] for r in rs)
        each = " / ".join(f"{r['us_per_token']:.1f}" for r in rs)
        per_stream = statistics.median(r["ms_per_stream"] for r in rs)
        change = f"{(per_token / base - 1) * 100:+.1f} %" if name != first else ""
        print(f"| {name} | {per_token:.1f} | {each} | {per_stream:.2f} | {change} | "
              f"{sum(r['failed'] for r in rs)} |")


def _named_checkout(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not Path(path, "router", "__main__.py").is_file():
        raise argparse.ArgumentTypeError(f"expected NAME=CHECKOUT (a directory with router/), got {text!r}")
    return name, path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gateway", type=_named_checkout, action="append",
                    help="NAME=CHECKOUT: a gateway run from that checkout's code (repeatable; "
                    "default: this one, as 'ours'); the first is the baseline of the change column")
    ap.add_argument("--sglang-router", help="path of an installed sglang-router executable (a peer)")
    ap.add_argument("--vllm-router", help="path of an installed vllm-router executable (a peer)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--token-delay-ms", type=float, default=5.0, help="the workers' pace per token")
    ap.add_argument("--streams", type=int, default=600)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--log-dir", default="/tmp/gateway_stream_cpu")
    ap.add_argument("--json", help="write the runs here")
    args = ap.parse_args()
    args.gateway = [(name, Path(path).resolve()) for name, path in args.gateway or [("ours", ".")]]
    Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    result = asyncio.run(main_async(args))
    print_table(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
