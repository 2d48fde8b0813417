"""The end-of-run engine counters of the routing experiment, read from real vLLM output."""

from __future__ import annotations

from pathlib import Path

from benchmarks.routing_engine_counters import engine_table, gateway_table, parse_counters, parse_queue_wait
from router.metrics import RouterMetrics

VLLM_RUNNING = Path(__file__).parents[1] / "scheduler" / "fixtures" / "vllm-0.32-cpu-running20.txt"


def test_counters_from_a_real_vllm_page():
    counters = parse_counters(VLLM_RUNNING.read_text())
    assert counters == {
        "prefix_queried_tokens": 454.0, "prefix_hit_tokens": 0.0, "preemptions": 0.0,
        "prompt_tokens": 454.0, "computed_prompt_tokens": 454.0, "generation_tokens": 386.0,
    }


def test_counters_sum_label_sets_and_ignore_other_series():
    page = "\n".join([
        '# HELP vllm:num_preemptions_total x',
        'sim:stretch_seconds_total{engine="0",model_name="m"} 0.25',
        'vllm:num_preemptions_total{engine="0"} 3.0',
        'vllm:num_preemptions_total{engine="1"} 4.0',
        'vllm:num_preemptions_created{engine="0"} 1.7e+09',
        'vllm:prompt_tokens_by_source_total{source="local_cache_hit"} 90.0',
        'vllm:prompt_tokens_by_source_total{source="local_compute"} 10.0',
        'vllm:prompt_tokens_cached_total 90.0',
    ])
    assert parse_counters(page) == {"preemptions": 7.0, "computed_prompt_tokens": 10.0,
                                    "sim_stretch_s": 0.25}


def test_table_totals_the_cluster_per_policy():
    engines = {
        "baseline": [{"preemptions": 5, "prefix_queried_tokens": 100, "prefix_hit_tokens": 20,
                      "computed_prompt_tokens": 80, "prompt_tokens": 100},
                     {"preemptions": 1, "prefix_queried_tokens": 100, "prefix_hit_tokens": 30,
                      "computed_prompt_tokens": 70, "prompt_tokens": 100}],
        "peer": [{}, {}],  # pages that could not be read
    }
    engines["baseline"][0].update(sim_modelled_s=60.0, sim_stretch_s=0.5, sim_late_s=0.1)
    engines["baseline"][1].update(sim_modelled_s=40.0, sim_stretch_s=0.4, sim_late_s=0.0)
    rows = engine_table(engines).splitlines()
    # 1.0 s of 100 modelled: the sim's "GPU" ran 1 % slower than modelled.
    assert rows[2] == "| baseline | 6 | 25.0 | 150 | 200 | 1.00 |"
    assert rows[3] == "| peer | 0 | - | - | 0 | - |"


def test_queue_wait_from_the_gateways_own_page():
    metrics = RouterMetrics()
    for waited in (0.0005, 0.2, 3.0, 7.0, 12.0):
        metrics.queue_wait.observe(waited)
    q = parse_queue_wait(metrics.render().decode())
    assert q["count"] == 5
    assert abs(q["sum_s"] - 22.2005) < 1e-9
    rows = gateway_table({"llm_aware": q, "peer:sglang-cache_aware": {}}).splitlines()
    # held > 1 s, > 5 s, > 10 s; the peer (no such series) gets no row.
    assert rows[2] == "| llm_aware | 5 | 4440.1 | 3 | 2 | 1 |"
    assert len(rows) == 3


def test_queue_wait_absent_from_a_worker_page():
    assert parse_queue_wait(VLLM_RUNNING.read_text()) == {}
    assert gateway_table({"baseline": {}}) == ""
