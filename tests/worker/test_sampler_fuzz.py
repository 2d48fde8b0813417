"""benchmarks/sampler_fuzz.py in CI: one real-model worker (small limits) takes seeded requests
whose sampling parameters sit at or past their edges (denormal temperatures, top_p / min_p that
keep one token, huge top_k, a logit bias on every token, infinite penalties, int64 seeds,
thousands of stop strings, prompts and answers at the context limit, n up to 128, echo with
logprobs, NaN literals, ...), a few at a time, while two greedy canary streams run beside them:
every answer a clean 4xx or a proper answer, every canary the text it gave alone, and afterwards
the worker alive and serving with no traceback in its log. Besides the completions and chat
requests over HTTP: Responses API requests (streamed, whole, in the background, continuing a
stored response) and WebSockets carrying pipelined hostile bodies."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.worker.conftest import REPO

pytestmark = pytest.mark.slow

SEED = 1
REQUESTS = 40  # over HTTP; with the rest, about as long as 56 of them alone were (~40 s here)
RESPONSES = 12
SOCKETS = 3


def test_hostile_sampling_parameters_neither_fail_nor_disturb_their_batch():
    cmd = [sys.executable, "-m", "benchmarks.sampler_fuzz", "--seed", str(SEED), "--requests", str(REQUESTS),
           "--responses", str(RESPONSES), "--ws-sockets", str(SOCKETS), "--time-limit-s", "120",
           "--client-timeout-s", "120"]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=420)
    report = out.stdout + out.stderr
    assert f"sent {REQUESTS} requests" in report, report[-5000:]
    # The other two ways in were taken, each of their kinds among them (the seed's plan has them).
    resp = re.search(r"responses: (\d+) sent \((\d+) streamed, (\d+) background, (\d+) with previous", report)
    assert resp and int(resp[1]) == RESPONSES and all(int(n) > 0 for n in resp.groups()), report[-5000:]
    ws = re.search(r"websocket: (\d+) sockets, (\d+) bodies pipelined, (\d+) answered in order", report)
    assert ws and int(ws[1]) == SOCKETS and int(ws[2]) >= 2 * SOCKETS and ws[2] == ws[3], report[-5000:]
    assert "violations: 0 in answers, 0 canary, 0 after the run" in report, report[-20000:]
    assert out.returncode == 0, report[-5000:]
