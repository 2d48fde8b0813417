"""benchmarks/cluster.py starts its processes on ports free_port() found free a moment before;
one taken meanwhile (another listener, an outgoing connection's ephemeral port) made a process
exit at start-up, and a whole routing run failed (seen once in a clean-clone CI run: a sim
worker's "address already in use"). The cluster now starts again on new ports."""

from __future__ import annotations

import socket

import aiohttp

import benchmarks.cluster as cluster_mod
from benchmarks.cluster import Cluster, ClusterSpec


async def test_a_port_taken_before_its_process_binds_it_costs_a_restart_not_the_run(tmp_path, monkeypatch):
    taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    taken.bind((cluster_mod.HOST, 0))
    taken.listen()
    taken_port = taken.getsockname()[1]
    real_free_port = cluster_mod.free_port
    handed = iter([taken_port, taken_port])  # the first two ports asked for: both lost races
    monkeypatch.setattr(cluster_mod, "free_port", lambda: next(handed, None) or real_free_port())
    spec = ClusterSpec(profiles=["tiny"], policy="round_robin", model="m", log_dir=tmp_path,
                       startup_timeout_s=60)
    try:
        async with Cluster(spec) as c:
            assert str(taken_port) not in c.worker_urls[0]
            async with aiohttp.ClientSession() as session:
                body = {"model": "m", "prompt": "hi", "max_tokens": 2}
                async with session.post(f"{c.gateway_url}/v1/completions", json=body) as r:
                    assert r.status == 200, await r.text()
        assert "address already in use" in (tmp_path / "round_robin" / "worker0.log").read_text()
    finally:
        taken.close()
