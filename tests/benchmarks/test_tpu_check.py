"""`TPU_CHECK_DRY=1 bash benchmarks/tpu_check.sh`: the TPU check script end to end on CPU
(tiny shapes, Pallas interpret mode; timings meaningless, the plumbing and JSON checked)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import train_procs

# What the accelerator image runs, on leg 2 of .ci/run too (tests/conftest.py).
pytestmark = pytest.mark.newest_jax

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
IMPLS = ["splash", "ring_jax ring=1 [xla]", "ring_jax ring=1 [splash]"]


def test_tpu_check_dry_run(tmp_path):
  out = tmp_path / "tpu_check.json"
  env = train_procs.env()
  env.update(TPU_CHECK_DRY="1", TPU_CHECK_OUT=str(out),
             PATH=os.path.dirname(sys.executable) + ":" + env["PATH"])
  proc = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "tpu_check.sh")], env=env,
                        capture_output=True, text=True, timeout=600)
  log = proc.stdout + proc.stderr
  assert proc.returncode == 0, log[-3000:]
  result = json.loads(out.read_text())
  assert result["dry"] and result["backend"] == "cpu"
  rows = {(r["causal"], r["impl"]): r for r in result["rows"]}
  for causal in (True, False):
    for impl in IMPLS:
      row = rows[(causal, impl)]
      assert row["note"] == "", (impl, row["note"])
      assert row["fwd_tflops"] > 0 and row["fb_tflops"] > 0
  # Our splash hop and splash attention agree on the forward (bf16 outputs: a few ulps).
  assert len(result["checks"]) == 2
  assert all(c["impl"] == "ring_jax ring=1 [splash]" and c["against"] == "splash"
             and c["max_abs_diff"] < 5e-2 for c in result["checks"])
  assert "x" in log and "of splash" in log
  assert result["auto"] == "hop kernel: xla (auto: no fused kernel is picked on cpu)"
