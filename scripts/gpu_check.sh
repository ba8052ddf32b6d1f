#!/usr/bin/env bash
# The CUDA path on one GPU, in under five minutes: the unit tests marked gpu, then kills in backward and
# mid-snapshot-copy with a spare that takes the GPU over, bit-for-bit checks with and without the
# deterministic switch, pinned slots, the device-to-host bandwidth, and the every-step snapshot overhead
# (scripts/gpu_check.py says what each is).
#
#   bash scripts/gpu_check.sh [OUT]      (default OUT: runs/gpu-check; the report is OUT/gpu_check.json)
#
# Uses the python3 and torch already installed (made for the project's H200 machine: Python 3.12 and torch
# 2.11, which DeadPool runs on as well as on 2.13); DeadPool itself is taken from this checkout through
# PYTHONPATH, so nothing is downloaded. Set PYTHON to use another interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-runs/gpu-check}"
PYTHON="${PYTHON:-python3}"
"$PYTHON" -c 'import numpy, torch, xxhash; assert torch.cuda.is_available(), "no GPU visible"' \
  || { echo "gpu_check: needs python3 with torch (CUDA), numpy and xxhash (pip install xxhash)" >&2; exit 2; }
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
# First the unit tests marked `gpu` (they skip where no GPU is), where this Python has pytest.
tests=0
if "$PYTHON" -c 'import pytest' 2>/dev/null; then
  timeout 120 "$PYTHON" -m pytest -q -p no:cacheprovider -o addopts=-ra -m gpu \
    tests/unit/runtime/test_digest.py tests/unit/runtime/test_slots.py || tests=$?
else
  echo "gpu_check: $PYTHON lacks pytest: the unit tests marked gpu did not run" >&2
fi
timeout 330 "$PYTHON" scripts/gpu_check.py --out "$OUT"
[ "$tests" -eq 0 ] || { echo "gpu_check: the unit tests marked gpu failed (pytest exit $tests)" >&2; exit 1; }
