"""Profile loading and validation, and how build_sim_setup merges a profile with the flags."""

import pytest

from inference_worker.config import WorkerConfig
from inference_worker.sim import build_sim_setup
from inference_worker.sim.profile import ProfileError, bundled_profiles, load_profile, parse_profile

VALID = """
name: mine
engine: {max_num_seqs: 8, max_num_batched_tokens: 64, max_model_len: 128, num_kv_blocks: 32}
latency:
  step_overhead_s: 0.001
  weight_bytes: 1.0e+9
  kv_bytes_per_token: 1024
  memory_bandwidth: 1.0e+11
  memory_efficiency: 0.5
  flops_per_token: 1.0e+9
  peak_flops: 1.0e+12
  compute_efficiency: 0.5
"""


def test_bundled_profiles_load_and_explain_themselves():
    names = bundled_profiles()
    assert {"llama2-7b-a10", "llama3-8b-h100", "tiny"} <= set(names)
    for name in names:
        profile = load_profile(name)
        assert profile.name == name
        assert len(profile.derivation) > 100


def test_user_profile_by_path(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text(VALID)
    profile = load_profile(str(path))
    assert profile.name == "mine" and profile.num_kv_blocks == 32


@pytest.mark.parametrize(
    ("text", "names"),
    [
        (VALID.replace("memory_efficiency: 0.5", "memory_efficiency: 1.5"), "latency.memory_efficiency"),
        (VALID.replace("peak_flops: 1.0e+12", "peak_flops: fast"), "latency.peak_flops"),
        (VALID.replace("name: mine", "name: mine\ncolour: red"), "colour"),
        (VALID.replace("  weight_bytes: 1.0e+9\n", ""), "latency.weight_bytes"),
        (VALID.replace("max_model_len: 128", "max_model_len: 4096"), "max_model_len"),
        (VALID.replace("max_num_seqs: 8", "max_num_seqs: 100"), "max_num_batched_tokens"),
        (VALID.replace("num_kv_blocks: 32}", "num_kv_blocks: 32}\nkv_memory: {gpu_memory_bytes: 1.0e+9, "
                       "gpu_memory_utilization: 0.9, weights_bytes: 1.0}"), "num_kv_blocks"),
        (VALID.replace(", num_kv_blocks: 32}", "}\nkv_memory: {gpu_memory_bytes: 1.0e+9, "
                       "gpu_memory_utilization: 0.9, weights_bytes: 2.0e+9}"), "kv_memory"),
        ("engine: [1, 2", "not valid YAML"),
        ("- a list", "mapping"),
    ],
)
def test_invalid_profiles_name_the_field(text, names):
    with pytest.raises(ProfileError, match=names.replace(".", r"\.")):
        parse_profile(text, source="test.yaml")


def test_unknown_name_lists_the_bundled_ones():
    with pytest.raises(ProfileError, match="llama2-7b-a10"):
        load_profile("no-such-gpu")
    with pytest.raises(ProfileError, match="not found"):
        load_profile("/no/such/profile.yaml")


def test_setup_uses_profile_defaults_unless_flags_are_given():
    profile = load_profile("llama2-7b-a10")
    setup = build_sim_setup(WorkerConfig(backend="sim", sim_profile="llama2-7b-a10"))
    assert (setup.max_num_seqs, setup.max_num_batched_tokens, setup.max_model_len) == (256, 2048, 4096)
    assert setup.num_kv_blocks == setup.runner.num_kv_blocks == profile.num_kv_blocks
    assert setup.runner.block_size == 16

    explicit = WorkerConfig(backend="sim", sim_profile="llama2-7b-a10", max_num_seqs=32, num_kv_blocks=100)
    setup = build_sim_setup(explicit)
    assert (setup.max_num_seqs, setup.max_num_batched_tokens, setup.num_kv_blocks) == (32, 2048, 100)

    # --kv-cache-memory-bytes is converted with the profile's bytes per token: 1 GiB = 128 blocks.
    by_bytes = WorkerConfig(backend="sim", sim_profile="llama2-7b-a10", kv_cache_memory_bytes=1 << 30)
    assert build_sim_setup(by_bytes).num_kv_blocks == 128


def test_setup_rejects_flags_that_contradict_the_profile():
    config = WorkerConfig(backend="sim", sim_profile="tiny", max_num_seqs=1000, max_num_batched_tokens=2048)
    build_sim_setup(config)  # both given explicitly and consistent
    config = WorkerConfig(backend="sim", sim_profile="tiny", max_num_seqs=1000)
    with pytest.raises(ProfileError, match="max_num_batched_tokens"):
        build_sim_setup(config)  # tiny's 256 batched tokens < 1000 seqs


def test_setup_clock_reports_simulated_seconds():
    setup = build_sim_setup(WorkerConfig(backend="sim", sim_profile="tiny", time_scale=10.0))
    import time

    assert setup.clock() == pytest.approx(time.monotonic() / 10.0, abs=0.01)
