#!/usr/bin/env bash
# One-TPU-chip check of the splash hop kernel (hop_kernel="splash") against splash attention
# and the XLA kernel: TFLOP/s, bf16, causal and non-causal, 8K-64K, ring size 1. Finishes in < 8 min.
# Run from anywhere:                bash benchmarks/tpu_check.sh
# CPU smoke test (tiny, interpret): TPU_CHECK_DRY=1 bash benchmarks/tpu_check.sh
# Knobs: TPU_CHECK_LENGTHS (comma list), TPU_CHECK_BLOCK (default 512), TPU_CHECK_BUDGET_S
# (default 450), TPU_CHECK_OUT (JSON path; default benchmarks/results/tpu_check.json).
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="${PYTHONPATH:-}:."
if [ "${TPU_CHECK_DRY:-0}" != "0" ]; then
  export JAX_PLATFORMS=cpu
fi
timeout --signal=INT --kill-after=15 470 python -u benchmarks/accelerator_check.py tpu
rc=$?
echo "accelerator_check.py tpu exit code $rc"
exit $rc
