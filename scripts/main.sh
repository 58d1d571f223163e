#!/usr/bin/env bash
# The main job: setup, then `numasched report` (simulator report for MI300X-class GPUs and a kernel
# check: interpreted on a CPU-only machine, compiled on a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=${PYTHON:-python3}
exec "$PY" -m numasched.cli report "$@"
