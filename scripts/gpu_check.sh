#!/usr/bin/env bash
# GPU check (the checks take under 5 minutes on one modern GPU, once the family is built): the `orchestra evaluate` table, the demo pipeline on CUDA and a family of adapters and torchao views in bfloat16,
# one device per member when several are present, and the same pipeline on the ray executor with each member's
# actor holding a (share of a) GPU when Ray is installed. Results go to $OUT (default benchmarks/results/gpu_check).
#
#   bash scripts/gpu_check.sh [--out DIR] [--no-ray] [--prefix-tokens N]
#
# Needs the bundled family built and calibrated (`orchestra family build && orchestra family calibrate`; the
# script runs both, which reuse what exists). Exits 2 when no CUDA device is visible.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python scripts/gpu_check.py "$@"
