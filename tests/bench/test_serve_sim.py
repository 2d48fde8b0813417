"""The benchmark client against a real sim worker process (`--backend sim --sim-profile tiny`).

ShareGPT prompts are sampled for real (SmolLM2 token counts) with the length
filters tightened to the tiny profile's 512-token context, so every request
must succeed.
"""

from __future__ import annotations

import importlib.util

import pytest

from benchmarks.serve import prepare_workload, run_benchmark

pytestmark = pytest.mark.skipif(importlib.util.find_spec("inference_worker.sim") is None,
                                reason="the sim backend (inference_worker.sim) is not in this tree")

MODEL = "llama2"
LIMITS = {"max_prompt_len": 256, "max_total_len": 512}  # the tiny profile's max_model_len is 512


@pytest.fixture(scope="module")
def worker():
    from tests.worker.conftest import launch_worker

    with launch_worker("--backend", "sim", "--sim-profile", "tiny", model=MODEL) as w:
        yield w


async def test_sharegpt_run_against_sim_worker_produces_every_key(worker):
    reqs, _ = prepare_workload("sharegpt", 20, seed=0, **LIMITS)
    result = await run_benchmark(worker.base_url, MODEL, workload=reqs, max_concurrency=8,
                                 show_progress=False, print_summary=False, metric_percentiles=[50, 99])
    for stat in ("mean", "median", "std", "p50", "p99"):
        for metric in ("ttft", "tpot", "itl", "e2el"):
            assert f"{stat}_{metric}_ms" in result
    for key in ("duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
                "request_throughput", "output_throughput", "total_token_throughput",
                "max_output_tokens_per_s", "max_concurrent_requests", "ttfts", "itls", "input_lens",
                "output_lens", "errors"):
        assert key in result
    assert result["completed"] == 20 and result["failed"] == 0, result["errors"]
    # ignore_eos + max_tokens: the worker produced exactly the ShareGPT reference lengths
    assert result["output_lens"] == [r.expected_output_len for r in reqs]
    assert result["input_lens"] == [r.prompt_len for r in reqs]
    assert result["total_output_tokens"] == sum(r.expected_output_len for r in reqs)
    assert result["total_token_throughput"] == pytest.approx(
        (result["total_input_tokens"] + result["total_output_tokens"]) / result["duration"])
    for n_out, itl, tpot in zip(result["output_lens"], result["itls"], result["tpots"], strict=True):
        assert 1 <= len(itl) + 1 <= n_out  # chunks never outnumber tokens
        assert tpot > 0
    assert 0 < result["median_ttft_ms"] <= result["p99_ttft_ms"]


async def test_multiturn_run_hits_the_workers_prefix_cache(worker):
    convs, _ = prepare_workload("sharegpt-multiturn", 16, seed=1, max_turns=4, **LIMITS)
    assert sum(len(c.turns) for c in convs) == 16
    before = worker.metrics()
    result = await run_benchmark(worker.base_url, MODEL, dataset="sharegpt-multiturn", workload=convs,
                                 max_concurrency=2, show_progress=False, print_summary=False)
    after = worker.metrics()
    assert result["completed"] == 16 and result["failed"] == 0, result["errors"]
    assert result["turn_indices"].count(0) == len(convs)

    def hits(samples):
        return sum(v for (name, _), v in samples.items() if name == "vllm:prefix_cache_hits_total")

    # later turns resend the earlier history, which the worker finds in its prefix cache
    assert hits(after) > hits(before)
