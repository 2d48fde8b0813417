"""benchmarks/sampler_fuzz.py in CI: one real-model worker (small limits) takes seeded requests
whose sampling parameters sit at or past their edges (denormal temperatures, top_p / min_p that
keep one token, huge top_k, a logit bias on every token, infinite penalties, int64 seeds,
thousands of stop strings, prompts and answers at the context limit, n up to 128, echo with
logprobs, NaN literals, ...), a few at a time, while two greedy canary streams run beside them:
every answer a clean 4xx or a proper answer, every canary the text it gave alone, and afterwards
the worker alive and serving with no traceback in its log."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.worker.conftest import REPO

pytestmark = pytest.mark.slow

SEED = 1
REQUESTS = 56


def test_hostile_sampling_parameters_neither_fail_nor_disturb_their_batch():
    cmd = [sys.executable, "-m", "benchmarks.sampler_fuzz", "--seed", str(SEED), "--requests", str(REQUESTS),
           "--time-limit-s", "120", "--client-timeout-s", "120"]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=420)
    report = out.stdout + out.stderr
    assert f"sent {REQUESTS} requests" in report, report[-5000:]
    assert "violations: 0 in answers, 0 canary, 0 after the run" in report, report[-20000:]
    assert out.returncode == 0, report[-5000:]
