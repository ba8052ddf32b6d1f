#!/usr/bin/env bash
# The CUDA path on one GPU, in under five minutes: kills in backward and mid-snapshot-copy with a spare that
# takes the GPU over, bit-for-bit checks with and without the deterministic switch, pinned slots, the
# device-to-host bandwidth, and the every-step snapshot overhead (scripts/gpu_check.py says what each is).
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
"$PYTHON" -c 'import numpy, torch; assert torch.cuda.is_available(), "no GPU visible"' \
  || { echo "gpu_check: needs python3 with torch (CUDA) and numpy" >&2; exit 2; }
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
exec timeout 330 "$PYTHON" scripts/gpu_check.py --out "$OUT"
