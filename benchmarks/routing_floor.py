"""What no router can beat: floors of TTFT and TPOT for a routing run on sim workers.

The reference's table reports changes against round robin. How large a change is possible
depends on how far round robin sits above the floor that every placement shares:
- TTFT floor of a request: its prompt prefilled alone on an idle worker of the fastest
  profile, in chunks of max_num_batched_tokens. No queue, no decode batch, no network.
  Except the first `concurrency` requests, which the clients send together at t=0: those
  must share the workers: shortest prompt first, each to the worker that is free first,
  each prompt costing only its compute time (what batching cannot remove) and finishing no
  sooner than alone. Shortest-first minimises the mean over parallel workers, so the mean
  is a true floor; the P99 of that schedule is close to the best but not a strict bound.
- TPOT floor: one decode step of the run's clients spread evenly over the workers (no more
  per worker than its KV cache holds at that context), at the run's mean context per
  sequence, stretched by the share of each worker's time that the run's prompt tokens take
  to prefill (every placement must prefill the same prompts).
Both come from the sim's own latency model and profiles, so they bound the sim runs exactly
(up to the mean-context approximation of TPOT), not real GPUs.

    python -m benchmarks.routing_floor benchmarks/results/routing-homogeneous.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from inference_worker.config import load_worker_config
from inference_worker.engine.factory import step_token_budget
from inference_worker.sim import build_sim_setup
from inference_worker.sim.latency_model import LatencyModel
from inference_worker.sim.profile import SimProfile


@dataclass
class Floors:
    mean_ttft_ms: float
    p99_ttft_ms: float
    mean_tpot_ms: float


def _wave_schedule(alone_ms: list[float], compute_ms: list[float], n_workers: int) -> list[float]:
    """First-token times of a burst under shortest-first list scheduling on n workers."""
    free_at = [0.0] * n_workers
    done = []
    for alone, compute in sorted(zip(alone_ms, compute_ms, strict=True), key=lambda ac: ac[1]):
        i = free_at.index(min(free_at))
        free_at[i] += compute
        done.append(max(alone, free_at[i]))
    return done


def floors(result: dict, profiles: list[SimProfile], concurrency: int) -> Floors:
    """Floors for the requests of one benchmark-client result run on `profiles`."""
    models = [LatencyModel(p.latency) for p in profiles]
    # The fastest worker bounds TTFT: a request could at best have gone there, alone.
    fastest, fast_profile = min(zip(models, profiles, strict=True),
                                key=lambda mp: mp[0].prefill_time(512, mp[1].engine.max_num_batched_tokens))
    budget = fast_profile.engine.max_num_batched_tokens
    lens = [n for n in result["input_lens"] if n > 0]
    alone = [fastest.prefill_time(n, budget) * 1000.0 for n in lens]
    lat = fast_profile.latency
    per_flop_ms = 1000.0 / (lat.peak_flops * lat.compute_efficiency)
    compute = [(lat.flops_per_token * n + lat.attention_flops_per_pair * n * (n + 1) / 2) * per_flop_ms
               for n in lens[:concurrency]]
    ttfts = _wave_schedule(alone[:concurrency], compute, len(profiles)) + alone[concurrency:]
    # TPOT: the same clients over the same workers, evenly; context halfway through the answer.
    # A worker decodes no more sequences than its KV cache holds at that context (in a KV-bound
    # run the rest wait, whatever the router does).
    n_workers = len(profiles)
    context = statistics.fmean(result["input_lens"]) + statistics.fmean(result["output_lens"]) / 2.0
    steps = []
    for m, p in zip(models, profiles, strict=True):
        fits = p.num_kv_blocks * p.engine.block_size / max(context, 1.0)
        batch = max(1, round(min(concurrency / n_workers, fits)))
        steps.append(m.decode_step_time(batch, round(context)))
    # Share of a worker's time spent on prompt tokens at the run's input rate (compute bound).
    prompt_rate = result["total_input_tokens"] / result["duration"] / n_workers
    busy = [prompt_rate * p.latency.flops_per_token / (p.latency.peak_flops * p.latency.compute_efficiency)
            for p in profiles]
    tpot = statistics.fmean(s / max(1e-9, 1.0 - b) for s, b in zip(steps, busy, strict=True)) * 1000.0
    # P99 as the benchmark client computes it (numpy, linear), so it compares with baseline's.
    return Floors(statistics.fmean(ttfts), float(np.percentile(ttfts, 99)), tpot)


def with_worker_flags(profile_name: str, flags: str) -> SimProfile:
    """The profile as a sim worker started with `flags` runs it: the worker's own config
    resolution (profile defaults, flags, its step-budget rule) gives the engine sizes."""
    config = load_worker_config(["--backend", "sim", "--sim-profile", profile_name, *shlex.split(flags)])
    setup = build_sim_setup(config)
    budget = step_token_budget(config, setup.max_num_batched_tokens, setup.max_model_len)
    engine = setup.profile.engine.model_copy(update={
        "block_size": setup.block_size,
        "num_kv_blocks": setup.num_kv_blocks,
        "max_num_seqs": setup.max_num_seqs,
        "max_model_len": setup.max_model_len,
        "max_num_batched_tokens": budget,
    })
    return setup.profile.model_copy(update={"engine": engine, "kv_memory": None})


def scenario_profiles(scenario: dict) -> list[SimProfile]:
    """Each worker's profile with its --worker-args applied (one entry: every worker's)."""
    names = scenario["profiles"]
    flags = scenario.get("worker_args") or []
    per_worker = flags if len(flags) > 1 else [flags[0] if flags else ""] * len(names)
    return [with_worker_flags(n, f) for n, f in zip(names, per_worker, strict=True)]


def floor_table(doc: dict, baseline: str = "baseline") -> str:
    """Markdown: baseline, the best policy, and the floor, with the best change possible."""
    scenario = doc["scenario"]
    if scenario.get("backend", "sim") != "sim":
        raise ValueError("floors need sim workers (their latency model is the ground truth)")
    if scenario.get("dataset", "sharegpt") != "sharegpt":
        # Shared prefixes hit the prefix cache: how much of each prompt needs computing
        # depends on the placement itself, so "each prompt alone" is no floor there.
        raise ValueError("floors assume prompts that miss the prefix cache (single-turn datasets)")
    profiles = scenario_profiles(scenario)
    base = doc["policies"][baseline]
    f = floors(base, profiles, int(scenario["concurrency"]))
    rows = [("mean TTFT (ms)", "mean_ttft_ms", f.mean_ttft_ms),
            ("P99 TTFT (ms)", "p99_ttft_ms", f.p99_ttft_ms),
            ("mean TPOT (ms)", "mean_tpot_ms", f.mean_tpot_ms)]
    lines = ["| metric | baseline | floor (best any placement can do) | best change possible |",
             "|---|---|---|---|"]
    for label, key, floor in rows:
        b = float(base[key])
        lines.append(f"| {label} | {b:.1f} | {floor:.1f} | {100.0 * (floor - b) / b:+.0f}% |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", type=Path, help="a benchmarks.routing JSON (sim backend)")
    ap.add_argument("--baseline", default="baseline")
    args = ap.parse_args(argv)
    print(floor_table(json.loads(args.results.read_text()), args.baseline))


if __name__ == "__main__":
    main()
