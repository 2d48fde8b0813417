"""benchmarks/cuda_check.sh, the one-call check for a lent GPU machine, run here on the CPU in
its smallest form (a tiny stand-in, one throughput level): GPU time is scarce, and a script that
breaks there wastes a whole lease. Its gating steps decide its exit status."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.random_weights import copy_without_weights
from inference_worker.model.loader import resolve_model_dir

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
TINY = ("hidden_size=64 intermediate_size=128 num_hidden_layers=2 num_attention_heads=4 "
        "num_key_value_heads=2 head_dim=16")
# The steps on SmolLM2's shape need its stand-in, which is left out (`stand-in`): without it the
# eager one only failed (not gating) after a torch start-up.
ONLY_THE_TINY_STAND_IN = ("stand-in tests-float32 tests-bfloat16 throughput-smollm2-shape "
                          "throughput-smollm2-eager profile-smollm2-shape")


def run_check(tmp_path: Path, files: Path, skip: str = ONLY_THE_TINY_STAND_IN) -> tuple[int, str]:
    env = {
        **os.environ,
        # the script's python3 is this one (with torch), as on the GPU machine it is that one's
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "DEVICE": "cpu",
        "WHEELS": str(tmp_path / "no-wheels"),
        "OUT": str(tmp_path / "out"),
        "WORK": str(tmp_path),
        "FILES": str(files),
        "LEVELS": "2",
        "BIG_SHAPE": TINY,
        "SKIP": skip,
    }
    done = subprocess.run(["bash", "benchmarks/cuda_check.sh"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    return done.returncode, done.stdout + done.stderr


def test_the_gpu_check_runs_its_steps_and_writes_its_results(tmp_path) -> None:
    files = tmp_path / "smollm2-files"
    files.mkdir()
    copy_without_weights(resolve_model_dir("smollm2"), files)
    rc, log = run_check(tmp_path, files)
    assert rc == 0, log[-3000:]
    assert "== tests-float32: skipped" in log and "== stand-in-1b: exit 0" in log
    assert "== throughput-1b-shape: exit 0" in log and "== cuda check: exit 0" in log
    (row,) = json.loads((tmp_path / "out" / "throughput-1b-shape.json").read_text())
    assert row["concurrency"] == 2 and row["engine_steps"] > 0 and row["static_steps"] > 0
    assert "== cuda check: exit 0" in (tmp_path / "out" / "cuda-check.log").read_text()


def test_a_failing_step_fails_the_check(tmp_path) -> None:
    empty = tmp_path / "nothing-here"
    empty.mkdir()
    # The steps after the failing one would fail too (no stand-in): one failure is the point.
    rc, log = run_check(tmp_path, empty, f"{ONLY_THE_TINY_STAND_IN} throughput-1b-shape throughput-1b-eager")
    assert rc == 1, log[-3000:]
    assert "== stand-in-1b: exit 1" in log and "== cuda check: exit 1" in log
