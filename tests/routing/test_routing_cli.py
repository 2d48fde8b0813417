"""Option handling of benchmarks.routing: per-policy scheduler configs, --append, peer names."""

from __future__ import annotations

import pytest

from benchmarks.routing import merge_into, parse_args, scheduler_configs, worker_profiles
from benchmarks.routing_peers import parse_peer


def test_scheduler_config_bare_path_tunes_llm_aware_only():
    assert scheduler_configs(None) == {}
    assert scheduler_configs("a.yaml") == {"llm_aware": "a.yaml"}
    assert scheduler_configs("llm_aware=a.yaml,prefix_affinity=b.yaml") == {
        "llm_aware": "a.yaml", "prefix_affinity": "b.yaml"}


def test_profiles_list_overrides_count_and_quick_forces_tiny():
    args = parse_args(["--profiles", "llama2-7b-a10,llama2-7b-a10,llama2-7b-l4"])
    assert worker_profiles(args) == ["llama2-7b-a10", "llama2-7b-a10", "llama2-7b-l4"]
    args = parse_args(["--workers", "3"])
    assert worker_profiles(args) == ["llama2-7b-a10"] * 3
    quick = parse_args(["--quick", "--profiles", "x,y,z"])
    assert worker_profiles(quick) == ["tiny", "tiny"]


def _scenario(**kw):
    base = {"profiles": ["a"], "backend": "sim", "dataset": "sharegpt", "num_prompts": 10, "concurrency": 2,
            "seed": 0, "time_scale": 1.0, "worker_args": [], "scrape_interval_ms": 100, "command": "c",
            "policies": ["x"], "scheduler_config": None, "scheduler_config_text": None, "gateway_args": "",
            "git_commit": "abc"}
    base.update(kw)
    return base


def test_append_keeps_earlier_policies_and_refuses_another_scenario():
    old = {"scenario": _scenario(), "policies": {"baseline": {"duration": 1.0}}, "timelines": {}}
    merged = merge_into(old, _scenario(policies=["llm_aware"]))
    assert merged["policies"] == {"baseline": {"duration": 1.0}}
    assert merged["scenario"]["appended"][0]["policies"] == ["llm_aware"]
    with pytest.raises(SystemExit, match="num_prompts"):
        merge_into(old, _scenario(num_prompts=11))


def test_peer_policy_names():
    assert parse_peer("peer:sglang-cache_aware") == ("sglang-router", "cache_aware")
    assert parse_peer("peer:vllm-router-power_of_two") == ("vllm-router", "power_of_two")
    assert parse_peer("peer:litellm-least-busy") == ("litellm", "least-busy")
    with pytest.raises(ValueError):
        parse_peer("peer:nginx-rr")


def test_declared_caps_come_from_each_workers_max_num_seqs():
    from benchmarks.cluster import Cluster, ClusterSpec

    per_worker = Cluster(ClusterSpec(profiles=["a", "b", "c"], policy="llm_aware", worker_args=[
        ["--max-num-seqs", "2"], ["--max-model-len", "512", "--max-num-seqs", "8"],
        ["--max-model-len", "512"]]))
    per_worker.worker_urls = ["http://h:1", "http://h:2", "http://h:3"]
    assert per_worker._declared_caps() == {"http://h:1": 2, "http://h:2": 8}  # h:3 has none to declare
    for_all = Cluster(ClusterSpec(profiles=["a", "b"], policy="llm_aware",
                                  worker_args=[["--max-num-seqs", "4"]]))
    for_all.worker_urls = ["http://h:1", "http://h:2"]
    assert for_all._declared_caps() == {"http://h:1": 4, "http://h:2": 4}
    assert parse_args(["--declare-running-caps"]).declare_running_caps


def test_a_session_header_goes_to_the_gateway_and_the_client_only_when_named():
    from benchmarks.routing import client_extra, gateway_args

    plain = parse_args(["--gateway-args", "--max-queue-size 9"])
    assert gateway_args(plain) == ["--max-queue-size", "9"] and "session_header" not in client_extra(plain)
    named = parse_args(["--gateway-args", "--max-queue-size 9", "--session-header", "x-session-id"])
    assert gateway_args(named) == ["--max-queue-size", "9", "--session-header", "x-session-id"]
    assert client_extra(named)["session_header"] == "x-session-id"
