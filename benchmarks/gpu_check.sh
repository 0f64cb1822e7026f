#!/usr/bin/env bash
# One-GPU check (single NVIDIA H200, jax 0.11 + CUDA, Python 3.12). Finishes in < 8 minutes.
# Run from the repository root:   bash benchmarks/gpu_check.sh
# CPU smoke test (tiny sizes):     GPU_CHECK_DRY=1 bash benchmarks/gpu_check.sh
# Writes the attention table to benchmarks/results/gpu_check_h200.json (GPU_CHECK_OUT).
# Knobs: GPU_CHECK_BUDGET_S (default 450 s of work), GPU_CHECK_RUN_MAX (longest context actually
# run, default 65536; longer ones are judged from compiled memory only), GPU_CHECK_BLOCK (ring
# block size), GPU_PEAK_TFLOPS (MFU denominator; default: the device kind's dense bf16 peak in
# ring_jax/hardware.py).
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="${PYTHONPATH:-}:."
if [ "${GPU_CHECK_DRY:-0}" != "0" ]; then
  export JAX_PLATFORMS=cpu
else
  # Let XLA take most of the GPU; keep the command from hanging past the 8-minute slot.
  export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
fi
timeout --signal=INT --kill-after=15 470 python -u benchmarks/accelerator_check.py gpu
rc=$?
echo "accelerator_check.py gpu exit code $rc"
exit $rc
