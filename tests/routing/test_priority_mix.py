"""benchmarks.priority_mix: the table's arithmetic, and one small run end to end (real sim
workers, scheduler and gateway; no timing asserted)."""

from __future__ import annotations

import json

import pytest

from benchmarks.priority_mix import main, table


def test_the_table_compares_every_mode_with_fcfs():
    def mode(ttft: float) -> dict:
        return {"mean_ttft_ms": ttft, "completed": 10}

    results = {"fcfs": {"interactive": mode(1000.0), "batch": mode(2000.0)},
               "priority": {"interactive": mode(100.0), "batch": mode(2200.0)}}
    lines = table(results).splitlines()
    interactive = next(line for line in lines if line.startswith("interactive") and "mean TTFT" in line)
    batch = next(line for line in lines if line.startswith("batch") and "mean TTFT" in line)
    assert interactive.split()[-2:] == ["100.0", "-90%"]
    assert batch.split()[-2:] == ["2200.0", "+10%"]


def test_modes_must_start_with_the_baseline():
    with pytest.raises(SystemExit):
        main(["--modes", "priority,fcfs"])


def test_a_small_run_gives_every_class_in_every_mode(tmp_path, capsys):
    out = tmp_path / "mix.json"
    assert main(["--profile", "tiny", "--workers", "1", "--batch-concurrency", "8", "--num-batch", "60",
                 "--num-interactive", "3", "--interactive-rate", "5", "--interactive-max-output", "8",
                 "--warmup-s", "0.5", "--modes", "fcfs,priority,fair", "--log-dir", str(tmp_path),
                 "--output", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert set(doc["modes"]) == {"fcfs", "priority", "fair"}
    for by_class in doc["modes"].values():
        assert by_class["interactive"]["completed"] == 3 and by_class["interactive"]["failed"] == 0
        assert by_class["batch"]["completed"] > 0
    assert "P99 TTFT (ms)" in capsys.readouterr().out
