"""The latency model's arithmetic, checked against the derivations written in the profiles."""

import math

import pytest

from inference_worker.sim.latency_model import LatencyModel, LatencyParams, StepShape
from inference_worker.sim.profile import load_profile

A10_BANDWIDTH = 600e9 * 0.8  # B/s achieved
A10_FLOPS = 125e12 * 0.45  # FLOP/s achieved
LLAMA2_WEIGHTS_READ = 13.21e9  # (6.738e9 - 0.131e9) x 2 B, rounded as in the profile
LLAMA2_KV_PER_TOKEN = 2 * 32 * 4096 * 2


@pytest.fixture(scope="module")
def a10() -> LatencyModel:
    return LatencyModel(load_profile("llama2-7b-a10").latency)


def test_llama2_a10_kv_capacity_follows_the_derivation():
    profile = load_profile("llama2-7b-a10")
    assert profile.latency.kv_bytes_per_token == LLAMA2_KV_PER_TOKEN == 512 * 1024
    expected = math.floor((24e9 * 0.9 - 13.5e9) / (LLAMA2_KV_PER_TOKEN * 16))
    assert profile.num_kv_blocks == expected == 965
    assert profile.engine.max_num_seqs == 256
    assert profile.engine.max_num_batched_tokens == 2048
    assert profile.engine.max_model_len == 4096


def test_llama3_h100_kv_capacity_follows_the_derivation():
    profile = load_profile("llama3-8b-h100")
    assert profile.latency.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2
    assert profile.num_kv_blocks == math.floor((80e9 * 0.9 - 16.06e9) / (131072 * 16))


def test_single_stream_decode_is_weights_plus_kv_over_bandwidth(a10):
    ctx = 512
    expected = 0.002 + 1e-5 + (LLAMA2_WEIGHTS_READ + LLAMA2_KV_PER_TOKEN * ctx) / A10_BANDWIDTH
    assert a10.decode_step_time(1, ctx) == pytest.approx(expected, rel=1e-9)
    assert 1 / a10.decode_step_time(1, ctx) == pytest.approx(33, abs=2)  # ~33 tok/s, as derived


def test_decode_is_memory_bound_so_batching_is_nearly_free(a10):
    one = a10.decode_step_time(1, 100)
    sixteen = a10.decode_step_time(16, 100)
    # The only extra cost of 15 more sequences is their KV read and per-sequence overhead.
    extra = 15 * (100 * LLAMA2_KV_PER_TOKEN / A10_BANDWIDTH + 1e-5)
    assert sixteen - one == pytest.approx(extra, rel=1e-9)
    assert sixteen < 1.2 * one


def test_long_prefill_is_compute_bound(a10):
    n = 1000
    shape = StepShape(computed_tokens=n, num_sequences=1, context_tokens=n, attention_pairs=n * (n + 1) // 2)
    flops = 13.21e9 * n + 4 * 32 * 4096 * n * (n + 1) // 2
    assert a10.compute_time(shape) > a10.memory_time(shape)
    assert a10.step_time(shape) == pytest.approx(0.002 + 1e-5 + flops / A10_FLOPS, rel=1e-9)


def test_prefill_time_chunks_by_max_num_batched_tokens(a10):
    whole = a10.prefill_time(3000, 4096)
    chunked = a10.prefill_time(3000, 1024)
    # Three chunks pay the step overhead three times and re-read the weights, nothing else:
    # the attention pairs of a causal prompt are the same however it is chunked.
    assert chunked == pytest.approx(whole + 2 * (0.002 + 1e-5), rel=1e-6)


def test_raw_and_shape_forms_agree(a10):
    shape = StepShape(computed_tokens=300, num_sequences=40, context_tokens=9000, attention_pairs=50_000)
    assert a10.step_time_raw(300, 40, 9000, 50_000) == a10.step_time(shape)


def test_empty_step_takes_no_time(a10):
    assert a10.step_time(StepShape(0, 0, 0, 0)) == 0.0
    assert a10.step_time_raw(0, 0, 0, 0) == 0.0


def test_roofline_takes_the_larger_bound():
    params = LatencyParams(
        step_overhead_s=0.0, weight_bytes=1e9, kv_bytes_per_token=1.0, memory_bandwidth=1e12,
        memory_efficiency=1.0, flops_per_token=1e9, peak_flops=1e12, compute_efficiency=1.0,
    )
    model = LatencyModel(params)
    # 1 ms of memory; compute is 1 ms per token: 1 token ties, 5 tokens are compute bound.
    assert model.step_time(StepShape(1, 1, 0, 0)) == pytest.approx(1e-3)
    assert model.step_time(StepShape(5, 1, 0, 0)) == pytest.approx(5e-3)


def test_describe_prints_the_derived_figures():
    from inference_worker.sim.describe import describe

    text = describe(load_profile("llama2-7b-a10"))
    assert "965 blocks x 16 = 15440 tokens" in text
    assert "batch    1 x  512 ctx:    30.09 ms/step         33 tok/s" in text
    # Batches the KV cache cannot hold at 512 tokens each are shown with the context that fits.
    assert "batch  256 x   60 ctx" in text
