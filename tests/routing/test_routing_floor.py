"""The floors of the routing experiment (what no placement beats), against the sim's own model."""

from __future__ import annotations

import pytest

from benchmarks.routing_floor import floor_table, floors, scenario_profiles
from inference_worker.sim.latency_model import LatencyModel
from inference_worker.sim.profile import load_profile


def run(input_lens: list[int], output_lens: list[int], duration: float = 100.0) -> dict:
    return {"input_lens": input_lens, "output_lens": output_lens, "duration": duration,
            "total_input_tokens": sum(input_lens), "mean_ttft_ms": 500.0, "p99_ttft_ms": 4000.0,
            "mean_tpot_ms": 60.0}


def test_without_a_burst_the_ttft_floor_is_each_prompt_alone():
    profile = load_profile("llama2-7b-a10")
    model = LatencyModel(profile.latency)
    lens = [100, 400, 1000, 30]
    f = floors(run(lens, [50] * 4), [profile] * 2, concurrency=0)
    alone = [model.prefill_time(n, profile.engine.max_num_batched_tokens) * 1000 for n in lens]
    assert f.mean_ttft_ms == pytest.approx(sum(alone) / 4)


def test_a_burst_queues_prompts_so_its_floor_is_above_each_alone():
    profile = load_profile("llama2-7b-a10")
    lens = [1000] * 20
    alone = floors(run(lens, [50] * 20), [profile] * 5, concurrency=0).mean_ttft_ms
    burst = floors(run(lens, [50] * 20), [profile] * 5, concurrency=20)
    # 4 prompts of 1,000 tokens per worker, one after the other: on average 2.5 prefill times.
    assert 2.0 * alone < burst.mean_ttft_ms < 2.6 * alone
    assert burst.p99_ttft_ms > 3.5 * alone


def test_tpot_floor_grows_with_clients_per_worker_and_context():
    profile = load_profile("llama2-7b-a10")
    small = floors(run([200] * 10, [100] * 10), [profile] * 5, concurrency=10).mean_tpot_ms
    big = floors(run([200] * 10, [100] * 10), [profile] * 5, concurrency=160).mean_tpot_ms
    longer = floors(run([2000] * 10, [100] * 10), [profile] * 5, concurrency=160).mean_tpot_ms
    assert small < big < longer
    # One sequence per worker: a weight-streaming decode step (~30 ms on an A10).
    assert 25.0 < small < 40.0


def test_floor_table_reports_best_possible_change_and_refuses_real_backends():
    doc = {"scenario": {"profiles": ["llama2-7b-a10"] * 5, "concurrency": 0, "backend": "sim"},
           "policies": {"baseline": run([250] * 50, [200] * 50)}}
    table = floor_table(doc)
    assert "| mean TTFT (ms) | 500.0 |" in table and "best change possible" in table
    doc["scenario"]["dataset"] = "sharegpt-multiturn"  # cached prefixes: no per-prompt floor
    with pytest.raises(ValueError):
        floor_table(doc)
    doc["scenario"].update(dataset="sharegpt", backend="torch")
    with pytest.raises(ValueError):
        floor_table(doc)


def test_floors_use_the_workers_flags_not_just_their_profile():
    """A run with --worker-args "--num-kv-blocks 680" decodes fewer streams per worker at once,
    so its TPOT floor differs from the profile's 965-block one; per-worker flags apply per worker."""
    long_run = run([1000] * 160, [800] * 160)
    base = {"profiles": ["llama2-7b-a10"] * 5, "concurrency": 160, "backend": "sim"}
    doc = {"scenario": base, "policies": {"baseline": long_run}}
    as_profile = floor_table(doc)
    doc["scenario"] = {**base, "worker_args": ["--num-kv-blocks 200 --max-num-seqs 64"]}
    assert floor_table(doc) != as_profile
    v0 = scenario_profiles({**base, "worker_args": ["--no-enable-chunked-prefill"]})
    assert {p.engine.max_num_batched_tokens for p in v0} == {4096}  # the worker's own default
    mixed = scenario_profiles({**base, "worker_args": ["--num-kv-blocks 300"] + [""] * 4})
    assert [p.num_kv_blocks for p in mixed] == [300, 965, 965, 965, 965]
