"""A stand-in model: a real model's architecture and tokenizer with seeded random weights.

The GPU check (`benchmarks/cuda_check.sh`) runs on a machine that reaches no model hub and
takes 64 MiB of files, less than SmolLM2's 98 MB GGUF. It gets the model's config and
tokenizer (4 MB) and builds the weights there: every path of the worker's forward, paged
KV cache, sampler and server runs as on the real weights; only the text means nothing.
`--set` reshapes the architecture (e.g. a 1B-parameter Llama to time the GPU at a size where
the matmuls, not the kernel launches, take the time).

A `random_weights.json` marker in the directory says what it is, so a test can skip the one
kind of check that needs the real model's judgement (that an answer ends with EOS).

    python -m benchmarks.random_weights --like DIR --out DIR [--seed 0] [--dtype float32]
        [--device cpu] [--set hidden_size=2048 --set num_hidden_layers=16 ...]
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

MARKER = "random_weights.json"
# What a model directory holds besides its weights (and the loader's own completion marker).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt")


def parse_setting(text: str) -> tuple[str, object]:
    """`key=value` with value read as JSON where it parses (numbers, true, null), else a string."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--set wants key=value, got {text!r}")
    try:
        return key, json.loads(raw)
    except json.JSONDecodeError:
        return key, raw


def copy_without_weights(like: Path, out: Path) -> list[str]:
    """Copy config, tokenizer and templates of `like` into `out`; return the names copied."""
    copied = []
    for path in sorted(like.iterdir()):
        if path.is_file() and not path.name.startswith(".") and not path.name.endswith(WEIGHT_SUFFIXES):
            shutil.copy2(path, out / path.name)
            copied.append(path.name)
    if "config.json" not in copied:
        raise SystemExit(f"{like} has no config.json")
    return copied


def build(like: Path, out: Path, seed: int, dtype: str, device: str, settings: dict) -> int:
    """Write the stand-in model into `out`; return its parameter count."""
    import torch  # here, not at the top: the tests read MARKER without loading torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    copy_without_weights(like, out)
    config = AutoConfig.from_pretrained(str(out))
    for key, value in settings.items():
        if not hasattr(config, key):
            raise SystemExit(f"--set {key}: the config has no such field")
        setattr(config, key, value)
    torch.manual_seed(seed)
    with torch.device(device):  # a 1B model initialises in seconds on a GPU, a minute on CPU
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.save_pretrained(str(out), safe_serialization=True)
    params = sum(p.numel() for p in model.parameters())
    (out / MARKER).write_text(
        json.dumps({"like": str(like), "seed": seed, "dtype": dtype, "set": settings, "params": params})
    )
    return params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--like", type=Path, required=True, help="model dir: config, tokenizer")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument("--device", default="cpu", help="where to initialise the weights")
    parser.add_argument("--set", type=parse_setting, action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    params = build(args.like, args.out, args.seed, args.dtype, args.device, dict(args.set))
    print(f"{args.out}: {params / 1e6:.1f}M parameters, random ({args.dtype}, seed {args.seed})")


if __name__ == "__main__":
    main()
