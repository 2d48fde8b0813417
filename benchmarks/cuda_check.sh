#!/usr/bin/env bash
# The worker on a CUDA GPU, in one run (made for the device tool's machine: python3 with a CUDA
# torch and transformers, no network; RESULTS.md, "The worker on a GPU", has what it showed).
#
# It needs, beside the repo: .whl/ with wheels of what that python3 lacks (pydantic,
# pydantic-settings, pytest-asyncio, openai, ...), and $FILES, SmolLM2's config and tokenizer
# (its weights are 98 MB and do not travel). `bash benchmarks/cuda_prepare.sh` makes both here;
# the device tool then carries ".whl" and ".cuda". Steps:
#   1. a stand-in with SmolLM2's shape and random weights (benchmarks/random_weights.py);
#   2. the real-model test modules on the GPU, float32: the engine against transformers' own
#      forward and greedy answers (alone, batched, prefix hits, preemption), the OpenAI server,
#      the Responses API and the live /metrics (tests/worker/model_under_test.py);
#   3. the server tests again in the GPU's default bfloat16, for the record (not gating:
#      bfloat16 answers may differ between batched and alone);
#   4. benchmarks.worker_throughput on the GPU in bfloat16 (engine vs static generate), with the
#      decode steps' CUDA graphs and without (--enforce-eager), and benchmarks.engine_profile
#      (where a step's time goes), for SmolLM2's shape; the throughput again for a 1B Llama shape.
# Logs and JSON go to $OUT. Exit status: that of the gating steps. SKIP="name ..." leaves steps
# out (to rerun part of it within the GPU lease).
set -uo pipefail
OUT=${OUT:-/tmp/cuda-check}
WORK=${WORK:-/tmp}  # where the stand-in models are written
DEVICE=${DEVICE:-cuda}
FILES=${FILES:-.cuda/smollm2-files}
LEVELS=${LEVELS:-1 16 64 256}
WHEELS=${WHEELS:-.whl}
# Llama-3.2-1B's shape with SmolLM2's vocabulary (a smaller one for a trial run on CPU).
BIG_SHAPE=${BIG_SHAPE:-hidden_size=2048 intermediate_size=8192 num_hidden_layers=16 num_attention_heads=32
  num_key_value_heads=8}
mkdir -p "$OUT"
exec > >(tee "$OUT/cuda-check.log") 2>&1
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
status=0

step() {  # step NAME GATING COMMAND...: run it, time it, remember a gating failure
  local name=$1 gating=$2 t0=$SECONDS rc
  shift 2
  case " ${SKIP:-} " in *" $name "*) echo "== $name: skipped"; return ;; esac
  echo "== $name: $*"
  "$@"
  rc=$?
  echo "== $name: exit $rc after $((SECONDS - t0)) s"
  if [ "$rc" -ne 0 ] && [ "$gating" = yes ]; then status=1; fi
}

if compgen -G "$WHEELS/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$WHEELS"/*.whl || exit 1
  export PYTHONPATH=/tmp/site
  # The project's own metadata, for /version (its code runs from this tree, first on sys.path).
  python3 -m pip install -q --no-deps --no-index --no-build-isolation --target /tmp/site . || exit 1
  rm -rf build
fi
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import torch, transformers, sys; print('python', sys.version.split()[0], 'torch', torch.__version__,
  'cuda', torch.version.cuda, torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU',
  'transformers', transformers.__version__)"

SMALL=$WORK/cuda-check-smollm2-shape
step stand-in yes timeout 120 python3 -m benchmarks.random_weights --like "$FILES" --out "$SMALL"

TESTS="tests/worker/test_decode_graphs.py tests/worker/test_engine_model.py tests/worker/test_server_openai.py
  tests/worker/test_server_responses.py tests/worker/test_metrics_exactness.py"
# shellcheck disable=SC2086
step tests-float32 yes env WORKER_TEST_DEVICE="$DEVICE" WORKER_TEST_DTYPE=float32 WORKER_TEST_MODEL="$SMALL" \
  timeout 420 python3 -m pytest -q -p no:cacheprovider -rs $TESTS --junitxml "$OUT/tests-float32.xml"
step tests-bfloat16 no env WORKER_TEST_DEVICE="$DEVICE" WORKER_TEST_MODEL="$SMALL" \
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/worker/test_server_openai.py \
  --junitxml "$OUT/tests-bfloat16.xml"

# shellcheck disable=SC2086
step throughput-smollm2-shape yes timeout 240 python3 -m benchmarks.worker_throughput --model "$SMALL" \
  --device "$DEVICE" --dtype bfloat16 --concurrency $LEVELS --no-write --json "$OUT/throughput-smollm2-shape.json"

# shellcheck disable=SC2086
step throughput-smollm2-eager no timeout 240 python3 -m benchmarks.worker_throughput --model "$SMALL" \
  --device "$DEVICE" --dtype bfloat16 --concurrency $LEVELS --no-write --enforce-eager \
  --json "$OUT/throughput-smollm2-eager.json"

# shellcheck disable=SC2086
step profile-smollm2-shape no timeout 120 python3 -m benchmarks.engine_profile --model "$SMALL" \
  --device "$DEVICE" --dtype bfloat16 --concurrency ${LEVELS##* } --top 20

BIG=$WORK/cuda-check-1b-shape
# shellcheck disable=SC2046,SC2086
step stand-in-1b yes timeout 180 python3 -m benchmarks.random_weights --like "$FILES" --out "$BIG" \
  --dtype bfloat16 --device "$DEVICE" $(printf -- '--set %s ' $BIG_SHAPE)
# shellcheck disable=SC2086
step throughput-1b-shape yes timeout 240 python3 -m benchmarks.worker_throughput --model "$BIG" \
  --device "$DEVICE" --dtype bfloat16 --concurrency $LEVELS --no-write --json "$OUT/throughput-1b-shape.json"
# shellcheck disable=SC2086
step throughput-1b-eager no timeout 240 python3 -m benchmarks.worker_throughput --model "$BIG" \
  --device "$DEVICE" --dtype bfloat16 --concurrency $LEVELS --no-write --enforce-eager \
  --json "$OUT/throughput-1b-eager.json"
echo "== cuda check: exit $status"
exit $status
