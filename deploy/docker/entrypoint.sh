#!/bin/sh
# Container entrypoint: the first argument names the service, the rest are its flags.
#   worker ...     -> python -m inference_worker ...
#   scheduler ...  -> python -m scheduler ...
#   gateway ...    -> python -m router ...
# Every service also reads its flags from environment variables (WORKER_*, SCHEDULER_*,
# ROUTER_*) and an optional YAML file (--config), which is what the Kubernetes manifests use.
set -e
service="${1:-}"
[ $# -gt 0 ] && shift
case "$service" in
  worker)    exec python -m inference_worker "$@" ;;
  scheduler) exec python -m scheduler "$@" ;;
  gateway)   exec python -m router "$@" ;;
  "")        echo "usage: llm-router worker|scheduler|gateway [flags...]" >&2; exit 64 ;;
  *)         exec "$service" "$@" ;;
esac
