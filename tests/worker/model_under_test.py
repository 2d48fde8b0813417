"""Which weights and device the real-model tests run: the bundled SmolLM2 on CPU here and in CI.

The GPU check (benchmarks/cuda_check.sh) sets WORKER_TEST_DEVICE=cuda and WORKER_TEST_MODEL to a
model directory: there, SmolLM2's architecture and tokenizer with random weights
(benchmarks/random_weights.py), since its real weights cannot travel to that machine. Such a
model runs every code path the same but says nothing sensible, so the few checks that need the
real model's judgement (an answer that ends by itself) are left out for it (RANDOM_WEIGHTS).
"""

from __future__ import annotations

import os
from pathlib import Path

from benchmarks.random_weights import MARKER

TEST_MODEL = os.environ.get("WORKER_TEST_MODEL", "smollm2")
TEST_DEVICE = os.environ.get("WORKER_TEST_DEVICE", "cpu")
# For a worker process: no flag means the worker's own default (auto: CPU here; bfloat16 on a
# GPU, where WORKER_TEST_DTYPE=float32 checks the exact answers the tests expect).
TEST_DEVICE_FLAGS: tuple[str, ...] = (
    (("--device", TEST_DEVICE) if "WORKER_TEST_DEVICE" in os.environ else ())
    + (("--dtype", os.environ["WORKER_TEST_DTYPE"]) if "WORKER_TEST_DTYPE" in os.environ else ())
)
RANDOM_WEIGHTS = (Path(TEST_MODEL).expanduser() / MARKER).exists()
