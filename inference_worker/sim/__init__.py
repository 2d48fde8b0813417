"""The sim backend: the real engine and server with a latency model instead of a model.

The engine factory calls `build_sim_setup(config)` when `--backend sim` and gets the
runner, the tokenizer and the engine limits to use. The limits are the profile's
defaults, except where the user set the flag explicitly (`--max-num-seqs`,
`--max-num-batched-tokens`, `--max-model-len`, `--block-size`, `--num-kv-blocks` or
`--kv-cache-memory-bytes`), so the factory can use the SimSetup values as they are.
`clock` is the engine clock to use for metrics: monotonic seconds / time_scale, so that
/metrics reports simulated seconds.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from inference_worker.config import WorkerConfig
from inference_worker.engine.types import ModelRunner, WorkerTokenizer
from inference_worker.sim.latency_model import LatencyModel
from inference_worker.sim.profile import ProfileError, SimProfile, load_profile
from inference_worker.sim.runner import SimModelRunner
from inference_worker.sim.tokenizer import SimTokenizer

__all__ = ["ProfileError", "SimProfile", "SimSetup", "build_sim_setup", "load_profile"]


@dataclass(slots=True)
class SimSetup:
    runner: ModelRunner
    tokenizer: WorkerTokenizer
    num_kv_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int
    time_scale: float
    profile: SimProfile
    clock: Callable[[], float] = field(default=time.monotonic)


def _scaled_monotonic(time_scale: float) -> float:
    return time.monotonic() / time_scale


def build_sim_setup(config: WorkerConfig) -> SimSetup:
    """Runner, tokenizer and engine limits for `config.sim_profile` (ProfileError if bad)."""
    profile = load_profile(config.sim_profile)
    explicit = config.model_fields_set
    engine = profile.engine

    def pick(name: str, profile_value: int) -> int:
        return getattr(config, name) if name in explicit else profile_value

    max_num_seqs = pick("max_num_seqs", engine.max_num_seqs)
    max_num_batched_tokens = pick("max_num_batched_tokens", engine.max_num_batched_tokens)
    max_model_len = pick("max_model_len", engine.max_model_len)
    block_size = pick("block_size", engine.block_size)
    if config.num_kv_blocks is not None:
        num_kv_blocks = config.num_kv_blocks
    elif config.kv_cache_memory_bytes is not None:
        num_kv_blocks = config.kv_cache_memory_bytes // int(profile.latency.kv_bytes_per_token * block_size)
    elif block_size != engine.block_size:
        num_kv_blocks = profile.num_kv_blocks * engine.block_size // block_size  # same KV bytes
    else:
        num_kv_blocks = profile.num_kv_blocks
    if max_num_batched_tokens < max_num_seqs:
        raise ProfileError(
            f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= max_num_seqs ({max_num_seqs}) "
            f"(profile {profile.name} with the flags given)"
        )
    if num_kv_blocks < 2:
        raise ProfileError(f"num_kv_blocks: the KV cache would hold {num_kv_blocks} blocks; 2 at least")

    tokenizer = SimTokenizer()
    runner = SimModelRunner(
        LatencyModel(profile.latency),
        tokenizer.generation_token_ids,
        block_size=block_size,
        num_kv_blocks=num_kv_blocks,
        time_scale=config.time_scale,
        mean_output_tokens=profile.mean_output_tokens,
    )
    return SimSetup(
        runner=runner,
        tokenizer=tokenizer,
        num_kv_blocks=num_kv_blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        block_size=block_size,
        time_scale=config.time_scale,
        profile=profile,
        clock=partial(_scaled_monotonic, config.time_scale),
    )
