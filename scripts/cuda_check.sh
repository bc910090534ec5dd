#!/usr/bin/env bash
# The device check (scripts/cuda_check.py, its options pass through): with $PYTHON, else .venv/bin/python, else python3.
# Needs a CUDA build of torch and the assets ($MTPSPEC_ASSETS).
# Smoke test on a CPU: scripts/cuda_check.sh --device cpu --tests device --tokens 16
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${PYTHON:-}" ]; then py=$PYTHON; elif [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
exec "$py" scripts/cuda_check.py "$@"
