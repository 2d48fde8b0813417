"""Output tokens/s of the worker engine vs static-batch `model.generate`, same model, one run.

For each concurrency C in --concurrency (default 1, 4, 16, 64):
- engine: C client streams against the AsyncEngine (continuous batching), each stream
  taking the next request of a fixed list of mixed prompt/output lengths as soon as its
  previous one ends;
- static: the same requests in consecutive batches of C through HF `generate` (left
  padding; every row runs to the batch's longest output, as a static server must).
Both count *useful* output tokens (each request's own max_tokens) over wall time; the
static row also shows its raw rate (all generated tokens, padding included). Both are
greedy with ignore-eos semantics, so every request yields exactly its max_tokens.
Engine and static alternate per level, so background load on a shared machine hits both.

    python -m benchmarks.worker_throughput [--concurrency 1 4 16 64] [--no-write]
        [--model smollm2] [--device auto] [--dtype auto] [--enforce-eager]

On a GPU (`--device cuda`, run by benchmarks/cuda_check.sh) both sides run there, and the
clock reads after each side's work has reached the device (a CUDA launch returns at once).
There the engine replays decode steps from CUDA graphs, as the worker does; `--enforce-eager`
measures it without them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from inference_worker.config import WorkerConfig
from inference_worker.engine.factory import build_engine, default_num_threads, resolve_device_dtype
from inference_worker.engine.types import SamplingParams
from inference_worker.model.loader import load_model

PROMPT_LENS = (16, 48, 96, 192)
OUTPUT_LENS = (8, 16, 32, 64)
WORDS = "the of and a to in is you that it he was for on are as with his they at be this from".split()
RESULTS = Path(__file__).with_name("RESULTS.md")
HEADING = "## Inference worker engine (`benchmarks/worker_throughput.py`)"


@dataclass
class Row:
    concurrency: int
    requests: int
    useful_tokens: int
    engine_tok_s: float
    static_tok_s: float
    static_raw_tok_s: float
    engine_cpu_tok_s: float
    static_cpu_tok_s: float
    # Forward passes: the engine's steps (prefill chunks and decodes together), and static
    # generate's (one per generated position of each batch). On a GPU, where a small model's
    # step costs about the same at any batch size, they explain the throughput.
    engine_steps: int = 0
    static_steps: int = 0

    def ms_per_step(self, tok_s: float, steps: int) -> float:
        return 1000 * self.useful_tokens / tok_s / steps if steps else float("nan")

    @property
    def ratio(self) -> float:
        return self.engine_tok_s / self.static_tok_s


def make_requests(tokenizer, n: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        target = rng.choice(PROMPT_LENS)
        ids = tokenizer.encode(f"Request {i}: " + " ".join(rng.choice(WORDS) for _ in range(target * 2)))
        reqs.append((ids[:target], rng.choice(OUTPUT_LENS)))
    return reqs


async def run_engine(engine, requests, concurrency: int) -> tuple[float, float, int]:
    queue = list(enumerate(requests))
    produced = 0

    async def stream() -> None:
        nonlocal produced
        while queue:
            i, (prompt, max_tokens) = queue.pop(0)
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            async for out in engine.generate(f"bench-{concurrency}-{i}", prompt, params):
                produced += len(out.token_ids)

    t0, c0 = time.perf_counter(), time.process_time()
    await asyncio.gather(*(stream() for _ in range(concurrency)))
    return time.perf_counter() - t0, time.process_time() - c0, produced


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_static(model, pad_id: int, requests, batch_size: int) -> tuple[float, float, int, int]:
    """Wall and CPU seconds, tokens generated (padding rows included), forward passes."""
    raw = steps = 0
    device = model.device
    synchronize(device)
    t0, c0 = time.perf_counter(), time.process_time()
    with torch.inference_mode():
        for start in range(0, len(requests), batch_size):
            group = requests[start : start + batch_size]
            width = max(len(p) for p, _ in group)
            ids = torch.tensor([[pad_id] * (width - len(p)) + p for p, _ in group], device=device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in group], device=device)
            new = max(m for _, m in group)
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=pad_id,
            )
            raw += new * len(group)
            steps += new
    synchronize(device)
    return time.perf_counter() - t0, time.process_time() - c0, raw, steps


def engine_config(
    model: str, device: str, dtype: str, max_num_seqs: int, enforce_eager: bool = False
) -> WorkerConfig:
    """The engine this benchmark measures (engine_profile.py profiles the same one)."""
    return WorkerConfig(
        model=model,
        device=device,
        dtype=dtype,
        enforce_eager=enforce_eager,
        max_num_seqs=max(max_num_seqs, 1),
        max_num_batched_tokens=2048,
        max_model_len=1024,
    )


async def bench(
    levels: list[int], seed: int, model: str, device: str, dtype: str, enforce_eager: bool = False
) -> list[Row]:
    config = engine_config(model, device, dtype, max(levels), enforce_eager)
    engine = build_engine(config)
    torch_device, torch_dtype = resolve_device_dtype(config.device, config.dtype)
    hf = load_model(config.model, device=str(torch_device), dtype=torch_dtype).hf_model
    tokenizer = engine.tokenizer
    pad_id = min(tokenizer.eos_token_ids)
    await engine.start()
    rows = []
    try:
        warm = make_requests(tokenizer, 2, seed + 99)
        await run_engine(engine, warm, 2)
        run_static(hf, pad_id, warm, 2)  # also the GPU's first kernels (cuBLAS start-up)
        for c in levels:
            # 2 x C requests: each stream refills once, as a server's batch would; static runs 2 batches.
            requests = make_requests(tokenizer, max(4, 2 * c), seed + c)
            useful = sum(m for _, m in requests)
            steps_before = engine.engine.num_model_steps
            e_wall, e_cpu, produced = await run_engine(engine, requests, c)
            assert produced == useful, (produced, useful)
            engine_steps = engine.engine.num_model_steps - steps_before
            s_wall, s_cpu, raw, static_steps = run_static(hf, pad_id, requests, c)
            row = Row(
                c,
                len(requests),
                useful,
                useful / e_wall,
                useful / s_wall,
                raw / s_wall,
                useful / e_cpu,
                useful / s_cpu,
                engine_steps,
                static_steps,
            )
            rows.append(row)
            print(
                f"C={c:3d}: engine {row.engine_tok_s:7.1f} tok/s, static {row.static_tok_s:7.1f} tok/s "
                f"(raw {row.static_raw_tok_s:.1f}), ratio {row.ratio:.2f}x",
                flush=True,
            )
        runner = engine.engine.runner
        graph_steps = getattr(runner, "num_graph_steps", 0)
        print(f"engine steps from CUDA graphs: {graph_steps} of {engine.engine.num_model_steps}", flush=True)
    finally:
        await engine.shutdown()
    return rows


def table(rows: list[Row]) -> str:
    lines = [
        "| streams | requests | output tokens | engine tok/s | static tok/s (useful) | static tok/s (raw) "
        "| engine / static | engine / static per CPU-s | engine ms/step (steps) | static ms/step (steps) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.concurrency} | {r.requests} | {r.useful_tokens} | {r.engine_tok_s:.1f} | "
            f"{r.static_tok_s:.1f} | {r.static_raw_tok_s:.1f} | **{r.ratio:.2f}x** | "
            f"{r.engine_cpu_tok_s / r.static_cpu_tok_s:.2f}x | "
            f"{r.ms_per_step(r.engine_tok_s, r.engine_steps):.1f} ({r.engine_steps}) | "
            f"{r.ms_per_step(r.static_tok_s, r.static_steps):.1f} ({r.static_steps}) |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")
    parser.add_argument("--model", default="smollm2", help="alias or model directory (the worker's --model)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto")
    parser.add_argument("--no-write", action="store_true", help=f"do not append to {RESULTS.name}")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (the worker's flag)")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads or default_num_threads())
    if args.threads:  # build_engine sets the thread count too: make it keep ours
        os.environ["WORKER_TORCH_THREADS"] = str(args.threads)
    load0 = os.getloadavg()[0]
    rows = asyncio.run(
        bench(args.concurrency, args.seed, args.model, args.device, args.dtype, args.enforce_eager)
    )
    load1 = os.getloadavg()[0]
    text = table(rows)
    device, dtype = resolve_device_dtype(args.device, args.dtype)
    machine = describe_machine(device, dtype) + f"; load average {load0:.1f} before, {load1:.1f} after"
    print(f"{machine}\n{text}")
    if args.json:
        args.json.write_text(json.dumps([asdict(r) | {"ratio": r.ratio} for r in rows], indent=2))
    if not args.no_write:
        command = "python -m benchmarks.worker_throughput " + " ".join(sys.argv[1:])
        entry = (
            f"\n### Run of {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n\n"
            f"Command: `{command.strip()}`\nMachine: {machine}\n\n{text}\n"
        )
        append_to_section(entry)


def describe_machine(device: torch.device, dtype: torch.dtype) -> str:
    dtype_name = str(dtype).removeprefix("torch.")
    if device.type == "cuda":
        return (
            f"{torch.cuda.get_device_name(device)}, {platform.machine()} host with {os.cpu_count()} cores, "
            f"torch {torch.__version__}, {dtype_name}"
        )
    return (
        f"{platform.machine()} CPU VM, {os.cpu_count()} cores, torch {torch.__version__} with "
        f"{torch.get_num_threads()} threads, {dtype_name}"
    )


def append_to_section(entry: str) -> None:
    """Append under our own heading; other engineers' sections are left as they are."""
    existing = RESULTS.read_text() if RESULTS.exists() else ""
    if HEADING not in existing:
        RESULTS.write_text(existing.rstrip("\n") + f"\n\n{HEADING}\n" + entry)
        return
    start = existing.index(HEADING)
    nxt = existing.find("\n## ", start + len(HEADING))
    end = len(existing) if nxt < 0 else nxt
    RESULTS.write_text(existing[:end].rstrip("\n") + "\n" + entry + existing[end:])


if __name__ == "__main__":
    main()
