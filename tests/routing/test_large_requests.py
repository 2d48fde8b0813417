"""benchmarks.large_requests: its workload and table (the run itself is in RESULTS.md)."""

from __future__ import annotations

from benchmarks.large_requests import large_workload, table
from inference_worker.sim.tokenizer import SimTokenizer
from router.tokens import CHARS_PER_TOKEN


def test_large_prompts_cost_what_they_say_for_the_sim_and_the_gateway():
    (req,) = large_workload(1, 3000, 64)
    assert abs(len(SimTokenizer().encode(req.prompt)) - 3000) <= 5
    assert abs(len(req.prompt) / CHARS_PER_TOKEN - 3000) <= 5
    assert req.expected_output_len == 64


def test_the_table_shows_no_latency_for_a_client_with_nothing_completed():
    starved = {"completed": 0, "failed": 8, "mean_ttft_ms": 0.0, "output_throughput": 0.0}
    served = {"completed": 8, "failed": 0, "mean_ttft_ms": 26000.0, "output_throughput": 4.8}
    small = {"completed": 100, "failed": 0, "mean_ttft_ms": 900.0, "output_throughput": 1200.0}
    lines = table({"off": {"large": starved, "small": small}, "on": {"large": served, "small": small}})
    ttft = next(line for line in lines.splitlines() if line.startswith("large") and "mean TTFT" in line)
    assert ttft.split()[-2:] == ["-", "26000.0"]
    done = next(line for line in lines.splitlines() if line.startswith("large") and "completed" in line)
    assert done.split()[-2:] == ["0.0", "8.0"]
