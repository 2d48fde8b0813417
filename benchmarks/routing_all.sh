#!/usr/bin/env bash
# The three routing scenarios of benchmarks/RESULTS.md ("Routing quality"), peers included,
# one after the other (they must not share this machine's cores), with the wall time of each.
# Usage: bash benchmarks/routing_all.sh [extra flags for every run, e.g. --time-scale 1.5]
# Peer routers come from $PEER_ROUTER_BIN (default /tmp/rvenv/bin); leave them out with
# POLICIES=baseline,round_robin,least_request,power_of_two,llm_aware,prefix_affinity.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
POLICIES=${POLICIES:-baseline,round_robin,least_request,power_of_two,llm_aware,prefix_affinity,peer:sglang-cache_aware,peer:vllm-router-cache_aware}
COMMON=(--concurrency 160 --time-scale 1.0 --policies "$POLICIES"
        --scheduler-config benchmarks/configs/llm_aware.yaml "$@")
OUT=${OUT:-benchmarks/results}
start=$(date +%s)
run() {  # name, flags...
  local name=$1; shift
  local t0; t0=$(date +%s)
  "$PY" -m benchmarks.routing "$@" "${COMMON[@]}" --output "$OUT/routing-$name.json"
  echo "[routing_all] $name: $(( $(date +%s) - t0 )) s wall"
}
run homogeneous --profile llama2-7b-a10 --workers 5 --num-prompts 1000
run heterogeneous --profiles llama2-7b-a10,llama2-7b-a10,llama2-7b-l4,llama2-7b-l4,llama2-7b-l4 --num-prompts 500
run multiturn --profile llama2-7b-a10 --workers 5 --dataset sharegpt-multiturn --num-prompts 600
echo "[routing_all] all three scenarios: $(( $(date +%s) - start )) s wall"
