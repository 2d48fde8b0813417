"""Interactive traffic beside a batch backlog: what request `priority`, or fair turns
between the two clients, buys.

Two clients share one cluster (sim workers, scheduler, gateway) at once: a "batch" client
that keeps many requests in flight (the backlog: the cluster saturates and the gateway
queues) and an "interactive" client that sends short chat-like requests at a steady rate
(open loop, Poisson arrivals), starting once the backlog has built up. The run is done
in each mode, same workloads and arrival times:
- `fcfs`: no priorities anywhere (what a router without them does);
- `gateway`: interactive requests say `priority: -1`, batch ones `priority: 5`; the
  gateway's queue orders by it, the workers stay fcfs (they ignore the field);
- `priority`: the same, and the workers run `--scheduling-policy priority`;
- `fair`: no priorities; each client names its own flow (the fairness header a tenant's
  gateway or API key would set), and the gateway's queue takes the flows in turn, a request
  each (router/queue.py, `--fair-share requests`);
- `fair-tokens`: the same, the flow served the fewest tokens goes next (`--fair-share tokens`).
The batch client runs until the interactive one is done (then it is stopped: its requests
still in flight count as interrupted, not as completed), so both modes offer the same load
for about the same time. Printed: each class's TTFT and TPOT, and the batch class's output
throughput, priority against fcfs.

    python -m benchmarks.priority_mix --workers 2 --batch-concurrency 160 \\
        --interactive-rate 0.5 --num-interactive 60 --time-scale 1
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

from benchmarks.cluster import Cluster, ClusterSpec
from benchmarks.serve import prepare_workload, run_benchmark, write_modes_json
from router.fairness import DEFAULT_FAIRNESS_HEADER

CLASSES = {"interactive": -1, "batch": 5}
ROWS = [("mean TTFT (ms)", "mean_ttft_ms"), ("median TTFT (ms)", "median_ttft_ms"),
        ("P99 TTFT (ms)", "p99_ttft_ms"), ("mean TPOT (ms)", "mean_tpot_ms"),
        ("P99 TPOT (ms)", "p99_tpot_ms"), ("output throughput (tok/s)", "output_throughput"),
        ("completed", "completed")]


async def run_mode(args: argparse.Namespace, mode: str, workloads: dict[str, list]) -> dict[str, dict]:
    worker_args = ["--scheduling-policy", "priority"] if mode == "priority" else []
    tagged = mode in ("gateway", "priority")
    fair = mode in ("fair", "fair-tokens")
    gateway_args = ["--fair-share", "tokens" if mode == "fair-tokens" else "requests"] if fair else []
    spec = ClusterSpec(profiles=[args.profile] * args.workers, policy=args.policy, model=args.model,
                       time_scale=args.time_scale, worker_args=[worker_args],
                       gateway_args=gateway_args, log_dir=Path(args.log_dir) / mode)
    async with Cluster(spec) as cluster:
        stop_batch = asyncio.Event()

        def client(name: str, concurrency: int | None, rate: float, stop: asyncio.Event | None):
            extra = {"priority": CLASSES[name]} if tagged else {}
            headers = {DEFAULT_FAIRNESS_HEADER: name} if fair else None
            return run_benchmark(
                base_urls=[cluster.gateway_url], model=args.model, workload=workloads[name],
                num_prompts=len(workloads[name]), max_concurrency=concurrency, request_rate=rate,
                seed=args.seed,
                time_scale=args.time_scale, extra_body=extra, show_progress=False,
                print_summary=False, stop_event=stop, deadline=args.max_seconds,
                percentile_metrics=("ttft", "tpot"), label=f"{mode}-{name}", headers=headers)

        batch = asyncio.ensure_future(client("batch", args.batch_concurrency, float("inf"), stop_batch))
        await asyncio.sleep(args.warmup_s * args.time_scale)  # the backlog builds up first
        interactive = await client("interactive", None, args.interactive_rate, None)
        stop_batch.set()
        return {"interactive": interactive, "batch": await batch}


def table(results: dict[str, dict[str, dict]]) -> str:
    """Each class's rows, each mode's value, and its change against fcfs."""
    modes = [m for m in results if m != "fcfs"]
    head = f"{'class':<12} {'metric':<26} {'fcfs':>10}" + "".join(f" {m:>10} {'change':>7}" for m in modes)
    lines = [head]
    for name in CLASSES:
        for label, key in ROWS:
            values = [results[m][name].get(key) for m in modes]
            base = results["fcfs"][name].get(key)
            if base is None or None in values:
                continue  # not measured (no request of the class finished)
            line = f"{name:<12} {label:<26} {base:>10.1f}"
            for value in values:
                change = f"{(value - base) / base * 100:+.0f}%" if base else ""
                line += f" {value:>10.1f} {change:>7}"
            lines.append(line)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", default="llama2-7b-a10")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--policy", default="llm_aware")
    p.add_argument("--model", default="llama2")
    p.add_argument("--batch-concurrency", type=int, default=160)
    p.add_argument("--interactive-rate", type=float, default=0.5, help="requests per simulated second")
    p.add_argument("--num-interactive", type=int, default=60)
    p.add_argument("--interactive-max-output", type=int, default=128,
                   help="cap on an interactive answer's length (chat turns are short)")
    p.add_argument("--num-batch", type=int, default=3000, help="more than the run can finish")
    p.add_argument("--warmup-s", type=float, default=20.0, help="simulated seconds of batch alone")
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument("--max-seconds", type=float, default=600.0, help="wall-clock bound per mode")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", default="/tmp/priority-mix-logs")
    p.add_argument("--modes", default="fcfs,gateway,priority", help="fcfs first: the baseline")
    p.add_argument("--output", help="write every mode's results as JSON")
    args = p.parse_args(argv)
    if args.modes.split(",")[0] != "fcfs":
        p.error("--modes must start with fcfs: the others are compared with it")

    batch, _ = prepare_workload("sharegpt", args.num_batch, args.seed)
    interactive, _ = prepare_workload("sharegpt", args.num_interactive, args.seed + 1)
    for req in interactive:
        req.expected_output_len = min(req.expected_output_len, args.interactive_max_output)
    workloads = {"batch": batch, "interactive": interactive}
    results = {}
    for mode in args.modes.split(","):
        t0 = time.monotonic()
        results[mode] = asyncio.run(run_mode(args, mode, workloads))
        print(f"{mode}: {time.monotonic() - t0:.0f} s wall", file=sys.stderr)
    print(table(results))
    if args.output:
        write_modes_json(args.output, args, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
