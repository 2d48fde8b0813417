"""Sim profiles: the numbers that make a sim worker behave like one GPU serving one model.

A profile is a YAML file (bundled ones live in `inference_worker/profiles/`); `--sim-profile`
takes a bundled name (`llama2-7b-a10`) or a path to a user's file. Layout:

    name: my-gpu
    description: one line
    derivation: |            # free text: where every number comes from
      ...
    engine:                  # the worker's defaults for this setup (flags override them)
      block_size: 16
      max_num_seqs: 256
      max_num_batched_tokens: 2048
      max_model_len: 4096
      num_kv_blocks: 965     # either this, or a kv_memory section to derive it from
    kv_memory:
      gpu_memory_bytes: 24.0e+9
      gpu_memory_utilization: 0.9
      weights_bytes: 13.5e+9
      reserved_bytes: 0      # activations / CUDA graphs, if you want to count them
    latency: {...}           # see latency_model.LatencyParams
    mean_output_tokens: 256  # optional: the sim ends an answer with EOS at this mean length
                             # (geometric), unless the request sets ignore_eos

Every error names the file and the field, and stops start-up.
"""

from __future__ import annotations

import math
from importlib import resources
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from inference_worker.sim.latency_model import LatencyParams

PROFILES_DIR = "profiles"  # package data of inference_worker


class ProfileError(ValueError):
    """A profile that cannot be found, parsed or validated."""


class EngineDefaults(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    block_size: int = Field(16, ge=1, le=1024)
    num_kv_blocks: int | None = Field(None, ge=2)
    max_num_seqs: int = Field(ge=1)
    max_num_batched_tokens: int = Field(ge=16)
    max_model_len: int = Field(ge=16)


class KvMemory(BaseModel):
    """GPU memory left for the KV cache, the way vLLM sizes it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    gpu_memory_bytes: float = Field(gt=0)
    gpu_memory_utilization: float = Field(gt=0, le=1)
    weights_bytes: float = Field(ge=0)
    reserved_bytes: float = Field(0.0, ge=0, description="activations, CUDA graphs, ...")

    @property
    def kv_cache_bytes(self) -> float:
        return self.gpu_memory_bytes * self.gpu_memory_utilization - self.weights_bytes - self.reserved_bytes


class SimProfile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1)
    description: str = ""
    derivation: str = ""
    engine: EngineDefaults
    kv_memory: KvMemory | None = None
    latency: LatencyParams
    mean_output_tokens: float | None = Field(None, gt=1)

    @model_validator(mode="after")
    def _check(self) -> SimProfile:
        e = self.engine
        if (e.num_kv_blocks is None) == (self.kv_memory is None):
            raise ValueError("give exactly one of engine.num_kv_blocks and kv_memory")
        if self.kv_memory is not None and self.kv_memory.kv_cache_bytes <= 0:
            raise ValueError("kv_memory: weights and reserved bytes leave no room for the KV cache")
        if e.max_num_batched_tokens < e.max_num_seqs:
            raise ValueError("engine.max_num_batched_tokens must be >= engine.max_num_seqs")
        if self.num_kv_blocks < 2:
            raise ValueError(f"the KV cache holds {self.num_kv_blocks} blocks; at least 2 are needed")
        capacity = self.num_kv_blocks * e.block_size
        if capacity < e.max_model_len:
            # vLLM refuses to start in this case too: one full-length request must fit.
            raise ValueError(
                f"engine.max_model_len ({e.max_model_len}) exceeds the KV cache capacity ({capacity} tokens)"
            )
        return self

    @property
    def num_kv_blocks(self) -> int:
        if self.engine.num_kv_blocks is not None:
            return self.engine.num_kv_blocks
        assert self.kv_memory is not None
        return self.blocks_for_bytes(self.kv_memory.kv_cache_bytes)

    def blocks_for_bytes(self, kv_cache_bytes: float) -> int:
        """KV blocks that fit in `kv_cache_bytes` (for --kv-cache-memory-bytes)."""
        per_block = self.latency.kv_bytes_per_token * self.engine.block_size
        return math.floor(kv_cache_bytes / per_block)


def bundled_profiles() -> list[str]:
    """Names of the profiles shipped with the package."""
    root = resources.files("inference_worker") / PROFILES_DIR
    return sorted(p.name.removesuffix(".yaml") for p in root.iterdir() if p.name.endswith(".yaml"))


def load_profile(name_or_path: str) -> SimProfile:
    """A bundled profile by name, or a profile YAML file by path."""
    looks_like_path = name_or_path.endswith((".yaml", ".yml")) or "/" in name_or_path
    if looks_like_path:
        path = Path(name_or_path)
        if not path.is_file():
            raise ProfileError(f"sim profile file not found: {name_or_path}")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:  # else the message named the codec, not the file
            raise ProfileError(f"{path}: not UTF-8 text ({exc})") from None
        return parse_profile(text, source=str(path))
    resource = resources.files("inference_worker") / PROFILES_DIR / f"{name_or_path}.yaml"
    if not resource.is_file():
        known = ", ".join(bundled_profiles())
        raise ProfileError(f"unknown sim profile {name_or_path!r}: bundled ones are {known}, or give a path")
    return parse_profile(resource.read_text(encoding="utf-8"), source=f"bundled profile {name_or_path}")


def parse_profile(text: str, source: str = "profile") -> SimProfile:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        reason = " ".join(str(exc).split())  # YAML errors span lines; a start-up error is one
        raise ProfileError(f"{source}: not valid YAML: {reason}") from None
    if not isinstance(data, dict):
        raise ProfileError(f"{source}: expected a mapping at the top level")
    try:
        return SimProfile.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'profile'}: {err['msg']}" for err in exc.errors()
        )
        raise ProfileError(f"{source}: {problems}") from None
