"""engine.factory: device/dtype resolution, KV pool sizing, and the sim backend wiring (no model load)."""

from __future__ import annotations

import time

import pytest
import torch

from inference_worker.config import WorkerConfig
from inference_worker.engine.factory import _num_kv_blocks, build_engine, resolve_device_dtype
from inference_worker.engine.types import SamplingParams

CPU = torch.device("cpu")


def test_device_and_dtype_resolution():
    device, dtype = resolve_device_dtype("cpu", "auto")
    assert device.type == "cpu" and dtype is torch.float32
    assert resolve_device_dtype("cpu", "bfloat16")[1] is torch.bfloat16
    if not torch.cuda.is_available():
        assert resolve_device_dtype("auto", "auto") == (CPU, torch.float32)
        with pytest.raises(ValueError, match="cuda"):
            resolve_device_dtype("cuda", "auto")


def test_auto_dtype_on_a_gpu_is_bfloat16_where_it_computes_it(monkeypatch):
    """No GPU here: torch.cuda's answers are stood in for (the only fake in this module)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for native, expected in ((True, torch.bfloat16), (False, torch.float16)):
        # An older card answers yes when emulation counts (torch's default), no when it does not.
        monkeypatch.setattr(torch.cuda, "is_bf16_supported",
                            lambda including_emulation=True, n=native: n or including_emulation)
        assert resolve_device_dtype("auto", "auto") == (torch.device("cuda"), expected)
        assert resolve_device_dtype("cuda", "float32")[1] is torch.float32  # asked for: kept


def test_kv_pool_sizing_from_flags():
    per_block = 1000
    assert _num_kv_blocks(WorkerConfig(num_kv_blocks=7), per_block, CPU) == 7
    assert _num_kv_blocks(WorkerConfig(kv_cache_memory_bytes=25_500), per_block, CPU) == 25
    with pytest.raises(ValueError, match="two blocks"):
        _num_kv_blocks(WorkerConfig(kv_cache_memory_bytes=1500), per_block, CPU)
    # Default: enough for max_num_seqs full-length sequences, unless that exceeds the memory budget.
    small = WorkerConfig(max_num_seqs=2, max_model_len=64, max_num_batched_tokens=64, block_size=16)
    assert _num_kv_blocks(small, per_block, CPU) == 2 * 4
    big = WorkerConfig(max_num_seqs=64, max_model_len=2048)
    assert _num_kv_blocks(big, 10**6, CPU) < 64 * 128


async def test_sim_backend_runs_on_the_engine_with_a_scaled_clock():
    config = WorkerConfig(backend="sim", sim_profile="tiny", time_scale=0.01, max_num_seqs=3)
    engine = build_engine(config)
    assert engine.engine.scheduler.max_num_seqs == 3  # an explicit flag beats the profile
    assert engine.cache_info.num_gpu_blocks == engine.engine.block_manager.num_blocks
    # The engine clock reports simulated seconds: monotonic / time_scale.
    assert engine.engine.clock() == pytest.approx(time.monotonic() / 0.01, rel=1e-3)
    await engine.start()
    try:
        prompt = engine.tokenizer.encode("hello there, how are you today?")
        outs = [o async for o in engine.generate("s", prompt, SamplingParams(max_tokens=5, ignore_eos=True))]
        assert outs[-1].finished and outs[-1].num_output_tokens == 5
    finally:
        await engine.shutdown()


def test_without_chunked_prefill_the_step_budget_defaults_to_the_context_length():
    """vLLM V0's default: max_num_batched_tokens = max(max_model_len, 2048) when prompts are
    not chunked; an explicit flag smaller than that is refused, as vLLM refuses it."""
    v0 = build_engine(WorkerConfig(backend="sim", sim_profile="llama2-7b-a10", enable_chunked_prefill=False))
    assert v0.engine.max_model_len == 4096
    assert v0.engine.max_num_batched_tokens == 4096 and not v0.engine.scheduler.chunked_prefill
    v1 = build_engine(WorkerConfig(backend="sim", sim_profile="llama2-7b-a10"))
    assert v1.engine.max_num_batched_tokens == 2048 and v1.engine.scheduler.chunked_prefill
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        build_engine(WorkerConfig(backend="sim", sim_profile="llama2-7b-a10", enable_chunked_prefill=False,
                                  max_num_batched_tokens=2048))
