"""benchmarks/random_weights.py: the stand-in the GPU check runs the real-model tests on. It must
have the real model's tokenizer and the shape asked for, load through the worker's own loader,
be the same for the same seed (a failure on the GPU can be replayed here), and say what it is."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.random_weights import MARKER, build, parse_setting
from inference_worker.model.loader import load_model, resolve_model_dir

pytestmark = pytest.mark.slow
SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}


def test_a_seeded_stand_in_of_the_real_models_shape_and_tokenizer(tmp_path) -> None:
    real = resolve_model_dir("smollm2")
    params = build(real, tmp_path / "a", 7, "float32", "cpu", SMALL)
    build(real, tmp_path / "b", 7, "float32", "cpu", SMALL)
    build(real, tmp_path / "c", 8, "float32", "cpu", SMALL)
    assert not list((tmp_path / "a").glob("*.gguf"))
    marker = json.loads((tmp_path / "a" / MARKER).read_text())
    assert marker["seed"] == 7 and marker["set"] == SMALL and marker["params"] == params

    a, b, c = (load_model(str(tmp_path / name)) for name in "abc")
    layers = a.hf_model.model.layers
    assert len(layers) == 2 and layers[0].self_attn.k_proj.weight.shape == (2 * 16, 64)
    assert sum(p.numel() for p in a.hf_model.parameters()) == params
    weights = [m.hf_model.model.layers[1].mlp.up_proj.weight for m in (a, b, c)]
    assert torch.equal(weights[0], weights[1]) and not torch.equal(weights[0], weights[2])
    text = "What is the capital of France?"
    assert a.hf_tokenizer.encode(text) == load_model("smollm2").hf_tokenizer.encode(text)


def test_settings_are_json_where_they_parse() -> None:
    assert parse_setting("num_hidden_layers=16") == ("num_hidden_layers", 16)
    assert parse_setting("rms_norm_eps=1e-5") == ("rms_norm_eps", 1e-5)
    assert parse_setting("hidden_act=gelu") == ("hidden_act", "gelu")
    with pytest.raises(Exception, match="key=value"):
        parse_setting("no-equals-sign")


def test_an_unknown_field_is_refused(tmp_path) -> None:
    with pytest.raises(SystemExit, match="no such field"):
        build(resolve_model_dir("smollm2"), tmp_path / "x", 0, "float32", "cpu", {"hidden_sise": 64})
