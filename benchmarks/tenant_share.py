"""Two tenants of unequal request sizes, both with a backlog: what share of the cluster
each gets, and what its requests wait, with the gateway's queue in each of its modes.

Two clients share one cluster (sim workers, scheduler, gateway), each closed loop with a
fixed number of requests in flight, both for the same time:
- "documents": ShareGPT requests with long prompts (`--heavy-min-prompt` tokens or more),
  answers as in the data (summaries, rewrites);
- "chat": ShareGPT requests with short prompts (`--light-max-prompt` or fewer) and answers
  capped at `--light-max-output`.
Together they keep more requests in flight than the workers run, so the gateway queues. Modes:
- `one-line`: the clients send no fairness id: one flow (the queue's own order only);
- `requests`: each client names its flow (x-gateway-inference-fairness-id); a turn is one
  request (`--fair-share requests`, the default);
- `tokens`: the same flows, the flow served the fewest tokens goes next (`--fair-share tokens`:
  prompt tokens + 2 x output tokens), in each gateway's queue and, across gateways, in the
  scheduler's order of held calls;
- `tokens-local`: as `tokens` with the scheduler's `--no-fair-share`: only each gateway's own
  queue counts tokens, and the scheduler serves the gateways' held calls in arrival order.
With `--gateways 2` the gateway has two replicas in front of the one scheduler, and each
tenant's requests all go through its own replica (its connections landed there), so only the
scheduler can give them turns.
Printed per tenant: requests completed, tokens per second (prompt, output, and weighted as the
queue counts them), its share of the weighted tokens, TTFT.

    python -m benchmarks.tenant_share --workers 2 --concurrency 40 --seconds 90
    python -m benchmarks.tenant_share --gateways 2 --modes requests,tokens-local,tokens
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

from benchmarks.cluster import Cluster, ClusterSpec
from benchmarks.serve import prepare_workload, run_benchmark
from router.fairness import DEFAULT_FAIRNESS_HEADER
from scheduler.fair_share import DEFAULT_OUTPUT_TOKEN_WEIGHT

TENANTS = ("documents", "chat")
# mode -> (the gateways' --fair-share, the scheduler's fair share of held calls)
MODES = {"one-line": (None, True), "requests": ("requests", True), "tokens": ("tokens", True),
         "tokens-local": ("tokens", False)}


def weighted(result: dict) -> float:
    """Tokens per second as the queue's token turns count them."""
    tokens = result["total_input_tokens"] + DEFAULT_OUTPUT_TOKEN_WEIGHT * result["total_output_tokens"]
    return tokens / result["duration"]


def summary(by_tenant: dict[str, dict]) -> dict[str, dict]:
    total = sum(weighted(r) for r in by_tenant.values()) or 1.0
    return {name: {
        "completed": r["completed"],
        "prompt tok/s": r["total_input_tokens"] / r["duration"],
        "output tok/s": r["total_output_tokens"] / r["duration"],
        "weighted tok/s": weighted(r),
        "share of weighted tokens (%)": 100 * weighted(r) / total,
        "mean TTFT (ms)": r.get("mean_ttft_ms"),
        "P99 TTFT (ms)": r.get("p99_ttft_ms"),
    } for name, r in by_tenant.items()}


async def run_mode(args: argparse.Namespace, mode: str, workloads: dict[str, list]) -> dict[str, dict]:
    fair_share, scheduler_fair = MODES[mode]
    spec = ClusterSpec(profiles=[args.profile] * args.workers, policy=args.policy, model=args.model,
                       time_scale=args.time_scale, log_dir=Path(args.log_dir) / mode,
                       gateway_args=(["--fair-share", fair_share] if fair_share else [])
                       + ["--queue-askers", str(args.queue_askers)],
                       scheduler_args=[] if scheduler_fair else ["--no-fair-share"],
                       gateways=args.gateways)
    async with Cluster(spec) as cluster:
        stop = asyncio.Event()

        def client(name: str):
            headers = {DEFAULT_FAIRNESS_HEADER: name} if fair_share else None
            gateway = cluster.gateway_urls[TENANTS.index(name) % len(cluster.gateway_urls)]
            return run_benchmark(
                base_urls=[gateway], model=args.model, workload=workloads[name],
                num_prompts=len(workloads[name]), max_concurrency=args.concurrency, seed=args.seed,
                time_scale=args.time_scale, show_progress=False, print_summary=False,
                stop_event=stop, deadline=args.seconds * args.time_scale + 120,
                percentile_metrics=("ttft",), label=f"{mode}-{name}", headers=headers)

        runs = [asyncio.ensure_future(client(name)) for name in TENANTS]
        await asyncio.sleep(args.seconds * args.time_scale)
        stop.set()  # both stop together: requests still running count as interrupted
        return dict(zip(TENANTS, await asyncio.gather(*runs), strict=True))


def table(results: dict[str, dict[str, dict]]) -> str:
    rows = list(next(iter(next(iter(results.values())).values())).keys())
    lines = [f"{'tenant':<10} {'metric':<28}" + "".join(f" {m:>10}" for m in results)]
    for tenant in TENANTS:
        for row in rows:
            values = [results[m][tenant][row] for m in results]
            lines.append(f"{tenant:<10} {row:<28}" + "".join(
                f" {v:>10.1f}" if v is not None else f" {'-':>10}" for v in values))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", default="llama2-7b-a10")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--policy", default="llm_aware")
    p.add_argument("--queue-askers", type=int, default=1,
                   help="each gateway's --queue-askers: how many of its queue's best ask the scheduler")
    p.add_argument("--gateways", type=int, default=1, choices=(1, 2),
                   help="gateway replicas; with 2, each tenant's requests all go through its own")
    p.add_argument("--model", default="llama2")
    p.add_argument("--concurrency", type=int, default=40, help="requests in flight per tenant")
    p.add_argument("--seconds", type=float, default=90.0, help="simulated seconds per mode")
    p.add_argument("--heavy-min-prompt", type=int, default=500)
    p.add_argument("--light-max-prompt", type=int, default=150)
    p.add_argument("--light-max-output", type=int, default=128)
    p.add_argument("--heavy-max-output", type=int, default=0, help="0: as in the data")
    p.add_argument("--sample", type=int, default=6000, help="ShareGPT requests to pick from")
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", default="/tmp/tenant-share-logs")
    p.add_argument("--modes", default="one-line,requests,tokens")
    p.add_argument("--output", help="write every mode's summary as JSON")
    args = p.parse_args(argv)
    modes = args.modes.split(",")
    if unknown := [m for m in modes if m not in MODES]:
        p.error(f"unknown modes {unknown}: choose from {list(MODES)}")

    pool, _ = prepare_workload("sharegpt", args.sample, args.seed)
    heavy = [r for r in pool if r.prompt_len >= args.heavy_min_prompt]
    light = [r for r in pool if r.prompt_len <= args.light_max_prompt]
    for req in light:
        req.expected_output_len = min(req.expected_output_len, args.light_max_output)
    for req in heavy if args.heavy_max_output else ():
        req.expected_output_len = min(req.expected_output_len, args.heavy_max_output)
    workloads = {"documents": heavy, "chat": light}
    print(f"documents: {len(heavy)} requests, chat: {len(light)}", file=sys.stderr)
    results = {}
    for mode in modes:
        t0 = time.monotonic()
        results[mode] = summary(asyncio.run(run_mode(args, mode, workloads)))
        print(f"{mode}: {time.monotonic() - t0:.0f} s wall", file=sys.stderr)
    print(table(results))
    if args.output:
        doc = {"scenario": {**vars(args), "command": " ".join(sys.argv)}, "modes": results}
        Path(args.output).write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
