#!/usr/bin/env bash
# GPU check (the checks before the vLLM steps take under 5 minutes on one modern GPU, once the family is built): the `orchestra evaluate` table, the demo pipeline on CUDA and a family of adapters and torchao views in bfloat16,
# one device per member when several are present, and the same pipeline on the ray executor with each member's
# actor holding a (share of a) GPU when Ray is installed. Then, where `import vllm` works in --vllm-python (default: this
# python; else both are recorded as skipped, not failed), two vLLM steps under --vllm-budget-s (default 1800 s):
# vllm_connector (ORCHESTRA_VLLM_TESTS=1 pytest tests/vllm on CUDA engines) and vllm_family_bench
# (benchmarks/vllm_family.py --out $OUT/vllm: orchestra, orchestra on vLLM, LangGraph on plain vLLM; its headline
# numbers go into the summary). Results go to $OUT (default benchmarks/results/gpu_check). docs/vllm.md, "On a GPU".
#
#   bash scripts/gpu_check.sh [--out DIR] [--no-ray] [--no-own-family] [--prefix-tokens N] [--budget-s S]
#                             [--no-vllm] [--vllm-python PATH] [--vllm-budget-s S]
#
# Needs the bundled family built and calibrated (`orchestra family build && orchestra family calibrate`; the
# script runs both, which reuse what exists). Exits 2 when no CUDA device is visible.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python scripts/gpu_check.py "$@"
