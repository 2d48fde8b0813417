"""Large requests beside a saturating stream of small ones: whether they are served at all.

A request whose prompt fits a worker's whole KV pool but what is free on none waits for a
worker to drain. With several askers (gateway replicas' heads, `--queue-askers`), the room
each release frees goes to the smaller requests that fit it, so without the scheduler's kept
room (scheduler/kept_room.py) a large request can wait until its gateway's queue timeout.

One cluster per mode (sim workers, the scheduler, `--gateways` replicas with `--queue-askers`
each, as the replicated deployments run): a "small" client keeps many ShareGPT requests in
flight through every replica (KV-bound), and a "large" client sends prompts of
`--large-prompt-tokens` at a steady rate, once the small load has built up. Modes:
- `off`: the scheduler's `--keep-room-after-s 0`;
- `on`: its default (a worker is kept for a large request that waited 5 s).
Printed per client: completed and failed requests (a 429 from the queue timeout counts
failed), TTFT, and the small client's output throughput.

    python -m benchmarks.large_requests --workers 2 --gateways 2 --queue-askers 4
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

from benchmarks.cluster import Cluster, ClusterSpec
from benchmarks.datasets import SampleRequest
from benchmarks.serve import prepare_workload, run_benchmark, write_modes_json

MODES = {"off": ["--keep-room-after-s", "0"], "on": []}
ROWS = [("completed", "completed"), ("failed", "failed"), ("mean TTFT (ms)", "mean_ttft_ms"),
        ("median TTFT (ms)", "median_ttft_ms"), ("max TTFT (ms)", "max_ttft_ms"),
        ("P99 TTFT (ms)", "p99_ttft_ms"), ("output throughput (tok/s)", "output_throughput")]


def large_workload(n: int, prompt_tokens: int, output_tokens: int) -> list[SampleRequest]:
    """Prompts of about `prompt_tokens` tokens for the sim's tokenizer (a 3-letter word with its
    space is one token) and for the gateway's estimate (4 characters a token)."""
    words = ("abc", "def", "ghi", "jkl")

    def prompt(i: int) -> str:
        return f"Request {i}:" + "".join(f" {words[(i + k) % 4]}" for k in range(prompt_tokens))

    return [SampleRequest(prompt=prompt(i), prompt_len=prompt_tokens, expected_output_len=output_tokens,
                          request_id=f"large-{i}") for i in range(n)]


async def run_mode(args: argparse.Namespace, mode: str, small: list, large: list) -> dict[str, dict]:
    spec = ClusterSpec(profiles=[args.profile] * args.workers, policy="llm_aware", model=args.model,
                       time_scale=args.time_scale, gateways=args.gateways,
                       gateway_args=["--queue-askers", str(args.queue_askers)],
                       scheduler_args=MODES[mode], log_dir=Path(args.log_dir) / mode)
    async with Cluster(spec) as cluster:
        stop_small = asyncio.Event()

        def client(name: str, workload: list, concurrency: int | None, rate: float,
                   stop: asyncio.Event | None):
            return run_benchmark(
                base_urls=cluster.gateway_urls, model=args.model, workload=workload,
                num_prompts=len(workload), max_concurrency=concurrency, request_rate=rate,
                seed=args.seed, time_scale=args.time_scale, show_progress=False, print_summary=False,
                stop_event=stop, deadline=args.max_seconds, percentile_metrics=("ttft",),
                label=f"{mode}-{name}")

        small_run = asyncio.ensure_future(client("small", small, args.small_concurrency, float("inf"),
                                                 stop_small))
        await asyncio.sleep(args.warmup_s * args.time_scale)  # the small load saturates first
        large_done = await client("large", large, None, args.large_rate, None)
        stop_small.set()
        return {"large": large_done, "small": await small_run}


def _max_ttft(result: dict) -> float | None:
    ttfts = [t for t in result.get("ttfts", []) if t]
    return max(ttfts) * 1000.0 if ttfts else None


def table(results: dict[str, dict[str, dict]]) -> str:
    lines = [f"{'client':<7} {'metric':<26}" + "".join(f" {m:>10}" for m in results)]
    for name in ("large", "small"):
        for label, key in ROWS:
            # Latencies of no completed request are no latencies (the client reports 0).
            values = [results[m][name].get(key) if results[m][name].get("completed") or "TTFT" not in label
                      else None for m in results]
            lines.append(f"{name:<7} {label:<26}" + "".join(
                f" {v:>10.1f}" if isinstance(v, (int, float)) else f" {'-':>10}" for v in values))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", default="llama2-7b-a10")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--gateways", type=int, default=2, choices=(1, 2))
    p.add_argument("--queue-askers", type=int, default=4)
    p.add_argument("--model", default="llama2")
    p.add_argument("--small-concurrency", type=int, default=160)
    p.add_argument("--num-small", type=int, default=3000, help="more than the run can finish")
    p.add_argument("--num-large", type=int, default=8)
    p.add_argument("--large-prompt-tokens", type=int, default=3500,
                   help="fits a worker's KV pool (15,440 tokens on the A10 profile) and its 4,096 "
                   "context, but not what is free while the small load runs")
    p.add_argument("--large-output-tokens", type=int, default=64)
    p.add_argument("--large-rate", type=float, default=0.1, help="large requests per simulated second")
    p.add_argument("--warmup-s", type=float, default=15.0, help="simulated seconds of small load alone")
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument("--max-seconds", type=float, default=300.0, help="wall-clock bound per client")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", default="/tmp/large-requests-logs")
    p.add_argument("--modes", default="off,on")
    p.add_argument("--output", help="write every mode's results as JSON")
    args = p.parse_args(argv)

    small, _ = prepare_workload("sharegpt", args.num_small, args.seed)
    large = large_workload(args.num_large, args.large_prompt_tokens, args.large_output_tokens)
    results = {}
    for mode in args.modes.split(","):
        t0 = time.monotonic()
        results[mode] = asyncio.run(run_mode(args, mode, small, large))
        for r in results[mode].values():
            r["max_ttft_ms"] = _max_ttft(r)
        print(f"{mode}: {time.monotonic() - t0:.0f} s wall", file=sys.stderr)
    print(table(results))
    if args.output:
        write_modes_json(args.output, args, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
