"""Print what a sim profile implies: KV capacity, decode step times, prefill times.

    python -m inference_worker.sim.describe [PROFILE_OR_PATH ...]   (default: every bundled one)

Useful when writing a profile of your own: check the figures against what you know of
the real engine (single-stream tokens/s, TTFT of a long prompt) before using it.
"""

from __future__ import annotations

import sys

from inference_worker.sim.latency_model import LatencyModel
from inference_worker.sim.profile import SimProfile, bundled_profiles, load_profile

DECODE_BATCHES = (1, 8, 16, 32, 64, 128, 256)
DECODE_CONTEXT = 512  # tokens per sequence
PROMPTS = (128, 512, 1024, 2048)


def describe(profile: SimProfile) -> str:
    model = LatencyModel(profile.latency)
    e = profile.engine
    capacity = profile.num_kv_blocks * e.block_size
    lines = [
        f"## {profile.name}: {profile.description}",
        f"KV cache: {profile.num_kv_blocks} blocks x {e.block_size} = {capacity} tokens; "
        f"max_num_seqs {e.max_num_seqs}, max_num_batched_tokens {e.max_num_batched_tokens}, "
        f"max_model_len {e.max_model_len}",
        f"decode step, {DECODE_CONTEXT} tokens of context per sequence (less where the KV cache is full):",
    ]
    for batch in DECODE_BATCHES:
        if batch > e.max_num_seqs:
            break
        context = min(DECODE_CONTEXT, capacity // batch)  # what the engine could actually hold
        step = model.decode_step_time(batch, context)
        lines.append(
            f"  batch {batch:>4} x {context:>4} ctx: {1e3 * step:8.2f} ms/step  {batch / step:9.0f} tok/s"
        )
    lines.append(f"prefill of one prompt (chunks of {e.max_num_batched_tokens}) = TTFT on an idle engine:")
    for n in PROMPTS:
        if n <= e.max_model_len:
            lines.append(f"  {n:>5} tokens: {1e3 * model.prefill_time(n, e.max_num_batched_tokens):8.1f} ms")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    names = (sys.argv[1:] if argv is None else argv) or bundled_profiles()
    print("\n\n".join(describe(load_profile(name)) for name in names))


if __name__ == "__main__":
    main()
