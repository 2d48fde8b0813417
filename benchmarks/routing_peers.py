"""Peer routers (Rust, from PyPI) as routing-experiment policies, in front of the same workers.

`peer:sglang-<policy>` runs `sglang-router launch --policy <policy>`, `peer:vllm-router-<policy>`
runs `vllm-router --policy <policy>`. They live in a separate virtual environment (never in
.venv); its bin directory comes from $PEER_ROUTER_BIN (default /tmp/rvenv/bin). Any tokenizer
download they might attempt goes to a dead local port (no network here anyway).
"""

from __future__ import annotations

import os
from pathlib import Path

from benchmarks.cluster import HOST, free_port

PEERS = {"sglang": "sglang-router", "vllm-router": "vllm-router"}


def peer_bin() -> Path:
    return Path(os.environ.get("PEER_ROUTER_BIN", "/tmp/rvenv/bin"))


def parse_peer(policy: str) -> tuple[str, str]:
    """'peer:sglang-cache_aware' -> ('sglang-router', 'cache_aware')."""
    body = policy.removeprefix("peer:")
    for prefix, exe in sorted(PEERS.items(), key=lambda kv: -len(kv[0])):
        if body.startswith(prefix + "-"):
            return exe, body[len(prefix) + 1:]
    raise ValueError(f"unknown peer router {policy!r}: use peer:sglang-<policy> or peer:vllm-router-<policy>")


def peer_argv(policy: str, port: int, worker_urls: list[str]) -> tuple[list[str], str]:
    """Command line and readiness path (a GET that answers 200 once workers are usable)."""
    exe, peer_policy = parse_peer(policy)
    path = peer_bin() / exe
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: install {exe} into a venv and set PEER_ROUTER_BIN")
    common = ["--host", HOST, "--port", str(port), "--worker-urls", *worker_urls, "--policy", peer_policy,
              "--prometheus-port", str(free_port())]
    argv = [str(path), "launch", *common] if exe == "sglang-router" else [str(path), *common]
    return argv, "/v1/models"


def peer_env() -> dict[str, str]:
    return {"HF_HUB_OFFLINE": "1", "HF_ENDPOINT": f"http://{HOST}:{free_port()}"}
