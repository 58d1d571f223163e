#!/usr/bin/env bash
# The test command: setup, then the whole suite. On a machine without a GPU the Triton kernels run
# through the interpreter (TRITON_INTERPRET=1, set by tests/conftest.py) and GPU tests are skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=${PYTHON:-python3}
exec "$PY" -m pytest -n "${NUMASCHED_TEST_WORKERS:-2}" -q "$@"
