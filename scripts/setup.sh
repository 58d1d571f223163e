#!/usr/bin/env bash
# Installs numasched and what its tests need, on a fresh CPU machine or a GPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
pipi() { "$PY" -m pip install -q --disable-pip-version-check "$@"; }
# torch: a plain 'torch' requirement pulls a multi-GB CUDA build on a CPU machine; take the CPU
# wheel (2.13.0, on disk on these machines) unless a torch is already installed (GPU machines).
if ! "$PY" -c "import torch" 2>/dev/null; then
  pipi "torch==2.13.0" || pipi torch --index-url https://download.pytorch.org/whl/cpu
fi
# The GPU machines run triton 3.6.0; test on CPU with the same version (pinned in ci/constraints.txt).
pipi -c ci/constraints.txt -e ".[test]"
