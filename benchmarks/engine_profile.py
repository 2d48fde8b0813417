"""Where one engine step's time goes: the step loop under cProfile and torch's profiler.

`worker_throughput` says how fast the engine is; this says why. It drives the engine's step
loop directly (no asyncio, no server) over the same requests, C at a time (C = 2 x
--concurrency requests, as there), and prints:
- wall time per step, and how much of it the forward (`runner.execute`) takes;
- the Python functions with the most cumulative time (cProfile);
- torch's operators by host time and, on a GPU, by device time: when the device's total is
  far below the wall time, the GPU waits for the host (launches, Python) and a faster kernel
  would not help, while fewer launches per step (CUDA graphs) would.

    python -m benchmarks.engine_profile [--model smollm2] [--device auto] [--dtype auto]
        [--concurrency 64] [--top 25]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import time

import torch

from benchmarks.worker_throughput import engine_config, make_requests
from inference_worker.engine.factory import build_engine
from inference_worker.engine.llm_engine import LLMEngine
from inference_worker.engine.types import SamplingParams


def run_steps(engine: LLMEngine, requests) -> tuple[int, int]:
    """Add every request, step until all are done; return (steps, output tokens)."""
    for i, (prompt, max_tokens) in enumerate(requests):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        engine.add_request(f"profile-{i}", prompt, params)
    steps = tokens = 0
    while engine.has_unfinished:
        tokens += sum(len(out.token_ids) for out in engine.step())
        steps += 1
    return steps, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto")
    parser.add_argument("--concurrency", type=int, default=64, help="sequences running at once")
    parser.add_argument("--top", type=int, default=25, help="rows of each table")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (the worker's flag)")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    c = args.concurrency
    engine = build_engine(engine_config(args.model, args.device, args.dtype, c, args.enforce_eager)).engine
    on_gpu = engine.runner.device.type == "cuda"
    with torch.inference_mode():
        run_steps(engine, make_requests(engine.tokenizer, 4, 99))  # warm-up: first kernels, allocator
        requests = make_requests(engine.tokenizer, 2 * c, c)

        profile = cProfile.Profile()
        start = time.perf_counter()
        profile.enable()
        steps, tokens = run_steps(engine, requests)
        profile.disable()
        wall = time.perf_counter() - start
        report = io.StringIO()
        stats = pstats.Stats(profile, stream=report)
        forward = next(
            (v[3] for k, v in stats.stats.items() if k[2] == "execute" and "torch_runner" in k[0]), 0.0
        )
        print(f"{c} at a time, {2 * c} requests: {steps} steps, {tokens} tokens, {wall:.2f} s, "
              f"{1000 * wall / steps:.1f} ms per step, forward {100 * forward / wall:.0f}% of it "
              "(times under cProfile, which slows Python)")
        stats.sort_stats("cumulative").print_stats(args.top)
        print(report.getvalue())

        activities = [torch.profiler.ProfilerActivity.CPU]
        if on_gpu:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            start = time.perf_counter()
            steps, _ = run_steps(engine, make_requests(engine.tokenizer, 2 * c, c + 1))
            if on_gpu:
                torch.cuda.synchronize()
            wall = time.perf_counter() - start
    events = prof.key_averages()
    print(f"torch profiler: {steps} steps in {wall:.2f} s ({1000 * wall / steps:.1f} ms per step)")
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.top))
    if on_gpu:
        device_us = sum(e.self_device_time_total for e in events)
        print(f"GPU busy {device_us / 1e3:.0f} ms of {1000 * wall:.0f} ms wall "
              f"({100 * device_us / 1e6 / wall:.0f}%)")
        print(events.table(sort_by="self_device_time_total", row_limit=args.top))


if __name__ == "__main__":
    main()
