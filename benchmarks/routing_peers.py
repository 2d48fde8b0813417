"""Peer routers (from PyPI) as routing-experiment policies, in front of the same workers.

`peer:sglang-<policy>` runs `sglang-router launch --policy <policy>`, `peer:vllm-router-<policy>`
runs `vllm-router --policy <policy>` (both Rust), and `peer:litellm-<strategy>` runs the LiteLLM
proxy (Python) with `router_settings.routing_strategy: <strategy>` (e.g. least-busy,
simple-shuffle, usage-based-routing, latency-based-routing) over one deployment per worker.
They live in a separate virtual environment (never in .venv); its bin directory comes from
$PEER_ROUTER_BIN (default /tmp/rvenv/bin). Any tokenizer or cost-map download they might attempt
goes to a dead local port or is turned off (no network here anyway).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from benchmarks.cluster import HOST, free_port

PEERS = {"sglang": "sglang-router", "vllm-router": "vllm-router", "litellm": "litellm"}


def peer_bin() -> Path:
    return Path(os.environ.get("PEER_ROUTER_BIN", "/tmp/rvenv/bin"))


def parse_peer(policy: str) -> tuple[str, str]:
    """'peer:sglang-cache_aware' -> ('sglang-router', 'cache_aware')."""
    body = policy.removeprefix("peer:")
    for prefix, exe in sorted(PEERS.items(), key=lambda kv: -len(kv[0])):
        if body.startswith(prefix + "-"):
            return exe, body[len(prefix) + 1:]
    raise ValueError(f"unknown peer router {policy!r}: use peer:sglang-<policy>, "
                     "peer:vllm-router-<policy> or peer:litellm-<strategy>")


def peer_argv(policy: str, port: int, worker_urls: list[str], model: str,
              config_dir: Path) -> tuple[list[str], str]:
    """Command line and readiness path (a GET that answers 200 once workers are usable)."""
    exe, peer_policy = parse_peer(policy)
    path = peer_bin() / exe
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: install {exe} into a venv and set PEER_ROUTER_BIN")
    if exe == "litellm":
        config = config_dir / "litellm.yaml"
        config.parent.mkdir(parents=True, exist_ok=True)
        config.write_text(litellm_config(peer_policy, worker_urls, model))
        return [str(path), "--config", str(config), "--host", HOST, "--port", str(port)], "/health/liveliness"
    common = ["--host", HOST, "--port", str(port), "--worker-urls", *worker_urls, "--policy", peer_policy,
              "--prometheus-port", str(free_port())]
    argv = [str(path), "launch", *common] if exe == "sglang-router" else [str(path), *common]
    return argv, "/v1/models"


def litellm_config(strategy: str, worker_urls: list[str], model: str) -> str:
    """One deployment per worker under the served model's name (JSON is YAML)."""
    deployments = [{"model_name": model, "litellm_params": {
                        "model": f"openai/{model}", "api_base": f"{url}/v1", "api_key": "none"}}
                   for url in worker_urls]
    return json.dumps({"model_list": deployments, "router_settings": {"routing_strategy": strategy},
                       "litellm_settings": {"telemetry": False}}, indent=1)


def peer_env() -> dict[str, str]:
    return {"HF_HUB_OFFLINE": "1", "HF_ENDPOINT": f"http://{HOST}:{free_port()}",
            # LiteLLM: the bundled model cost map instead of a download, and no master key (a
            # local benchmark; the proxy refuses to start keyless otherwise).
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
            "LITELLM_DANGEROUSLY_PERMIT_WEAK_OR_UNSET_MASTER_KEY": "true"}
