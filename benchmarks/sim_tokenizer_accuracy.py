"""Token-count error of the sim's fake tokenizer against a real tokenizer on ShareGPT prompts.

    python -m benchmarks.sim_tokenizer_accuracy --num-prompts 3000 --seed 1 [--tokenizer DIR]

The reference is SmolLM2's tokenizer (a Llama-architecture model; bundled, offline) unless
a tokenizer directory is given. Prompts are the first turns of ShareGPT conversations in
vLLM's seeded shuffle order; counts exclude special tokens on both sides. The sim
tokenizer's constants were fitted on seed 0's first 1,500 prompts, so use another seed
for a held-out figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from benchmarks.datasets import load_sharegpt, load_tokenizer, shuffled_indices
from inference_worker.sim.tokenizer import SimTokenizer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--tokenizer", help="Hugging Face tokenizer directory (default: SmolLM2)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()

    entries = load_sharegpt()
    prompts = []
    for i in shuffled_indices(len(entries), args.seed):
        text = entries[i]["conversations"][0]["value"]
        if text.strip():
            prompts.append(text)
        if len(prompts) == args.num_prompts:
            break
    real = load_tokenizer(args.tokenizer)
    real_counts = [len(ids) for ids in real(prompts, add_special_tokens=False).input_ids]
    sim = SimTokenizer()
    start = time.perf_counter()
    sim_counts = [len(sim.encode(p, add_special_tokens=False)) for p in prompts]
    sim_seconds = time.perf_counter() - start

    rel = sorted(abs(s - r) / r for s, r in zip(sim_counts, real_counts, strict=True) if r > 0)
    signed = [(s - r) / r for s, r in zip(sim_counts, real_counts, strict=True) if r > 0]
    result = {
        "reference": args.tokenizer or "SmolLM2-135M-Instruct",
        "prompts": len(rel),
        "seed": args.seed,
        "mean_abs_rel_error": round(statistics.fmean(rel), 4),
        "median_abs_rel_error": round(statistics.median(rel), 4),
        "p90_abs_rel_error": round(rel[int(0.9 * len(rel))], 4),
        "p99_abs_rel_error": round(rel[int(0.99 * len(rel))], 4),
        "mean_signed_rel_error": round(statistics.fmean(signed), 4),
        "total_count_ratio": round(sum(sim_counts) / sum(real_counts), 4),
        "mean_real_tokens": round(statistics.fmean(real_counts), 1),
        "sim_encode_us_per_token": round(1e6 * sim_seconds / sum(sim_counts), 3),
    }
    for key, value in result.items():
        print(f"{key:<28}{value}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
