"""`python -m benchmarks.routing --quick` end to end: real sim workers, scheduler and gateway on 127.0.0.1.

No timing assertions: it checks that every policy ran every request, that every table row and
the goal verdicts are printed, that the JSON has the documented shape and the PNGs exist.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.routing_report import ROWS

POLICIES = ["baseline", "round_robin", "least_request", "power_of_two", "llm_aware", "prefix_affinity"]


@pytest.mark.slow
def test_quick_run_produces_tables_json_and_figures(tmp_path: Path):
    out = tmp_path / "routing-quick.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.routing", "--quick", "--policies", ",".join(POLICIES),
         "--output", str(out), "--log-dir", str(tmp_path / "logs")],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    sections = {part.split("\n", 1)[0]: part for part in proc.stdout.split("### ")[1:]}
    for name in POLICIES[1:]:
        table = sections[f"{name} vs baseline"]
        for row in ROWS:
            assert f"| {row.label} |" in table, (name, row.label)
        # The derived rows have values, from the per-request lists the JSON keeps.
        for label in ("mean TPOT from the 2nd token", "first two tokens delivered together"):
            cells = next(line for line in table.splitlines() if line.startswith(f"| {label} |")).split("|")
            assert "n/a" not in cells[2] and "n/a" not in cells[3], (name, label, cells)
    assert any(title.startswith("steady state") for title in sections)
    assert "throughput kept vs baseline" in proc.stdout
    assert any(title.startswith("what the engines did") for title in sections)
    assert any(title.startswith("time held in the gateway") for title in sections)

    doc = json.loads(out.read_text())
    assert doc["scenario"]["quick"] is True
    assert doc["scenario"]["num_prompts"] == 24
    assert list(doc["policies"]) == POLICIES
    for name, result in doc["policies"].items():
        assert result["completed"] == 24, (name, result.get("errors"))
        assert result.get("failed", 0) == 0, name
        for key in ("duration", "output_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
                    "mean_tpot_ms", "p99_tpot_ms", "total_input_tokens", "ttfts",
                    "first_gaps", "tpots_from_second"):
            assert key in result, (name, key)
        # The load sampler saw every worker while the run was going.
        samples = doc["timelines"][name]
        assert samples and all(len(s["workers"]) == 2 for s in samples)
        assert any(w.get("running", 0) > 0 for s in samples for w in s["workers"]), name
        # The engines' own counters, read at the end, account for every output token.
        engines = doc["engines"][name]
        assert len(engines) == 2, name
        assert sum(w["generation_tokens"] for w in engines) == sum(result["output_lens"]), name
    # Every request through our gateway waited for a worker once (no retries in a quiet run);
    # baseline has no gateway.
    assert doc["gateway"]["baseline"] == {}
    for name in POLICIES[1:]:
        assert doc["gateway"][name]["count"] == 24, name
    # Every part's CPU while the client ran: the sim workers and the client always work; our
    # scheduler and gateway only exist (and work) in front of the routed policies.
    assert any(title.startswith("CPU used while the client ran") for title in sections)
    assert set(doc["cpu"]["baseline"]) == {"workers", "client", "wall_s"}
    for name in POLICIES:
        used = doc["cpu"][name]
        assert used["workers"] > 0 and used["client"] > 0 and used["wall_s"] > 0, (name, used)
        if name != "baseline":
            assert used["gateway"] > 0 and used["scheduler"] > 0, (name, used)
    # Prompts are counted by the worker's tokenizer (the sim's approximates the client's), so
    # they are compared between policies: the same prompts, wherever they were sent.
    engine_prompts = {sum(w["prompt_tokens"] for w in doc["engines"][n]) for n in POLICIES}
    assert len(engine_prompts) == 1, engine_prompts
    for suffix in ("ttft-cdf", "tpot-cdf", "load"):
        png = tmp_path / f"routing-quick-{suffix}.png"
        assert png.read_bytes()[:4] == b"\x89PNG", suffix
