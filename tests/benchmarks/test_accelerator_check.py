"""`<P>_CHECK_DRY=1 bash benchmarks/{gpu,tpu}_check.sh`: benchmarks/accelerator_check.py end to
end on CPU (tiny shapes, TPU kernels in Pallas interpret mode; timings meaningless, the
plumbing and JSON checked)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import train_procs

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
AUTO_ON_CPU = "hop kernel: xla (auto: no fused kernel is picked on cpu)"


def dry_run(platform, tmp_path, **env_vars):
  """Runs ``benchmarks/<platform>_check.sh`` dry; returns (its log, its JSON)."""
  out = tmp_path / f"{platform}_check.json"
  prefix = f"{platform.upper()}_CHECK_"
  env = train_procs.env()
  env.update({prefix + "DRY": "1", prefix + "OUT": str(out), **env_vars},
             PATH=os.path.dirname(sys.executable) + ":" + env["PATH"])
  proc = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", f"{platform}_check.sh")],
                        env=env, capture_output=True, text=True, timeout=600)
  log = proc.stdout + proc.stderr
  assert proc.returncode == 0, log[-3000:]
  assert "SECTION FAILED" not in log, log[-3000:]
  return log, json.loads(out.read_text())


def test_gpu_check_dry_run(tmp_path):
  """Every section on CPU at tiny sizes (the XLA hop kernel and jax's XLA attention; tokamax
  and cuDNN cannot run there and say so)."""
  log, result = dry_run("gpu", tmp_path, GPU_CHECK_MAX_LEN="1024")
  assert "models/llama.py" in log and "tokens/s" in log
  assert "LONGEST CONTEXT THAT FITS (1 GPU, 1B-class, batch 1, compiled memory): 1024" in log
  assert result["dry"] and result["backend"] == "cpu" and result["shape"]["dtype"] == "float32"
  timed = {(r["impl"], r["causal"]) for r in result["rows"] if r.get("fb_tflops", 0) > 0}
  for causal in (True, False):
    assert ("ring_jax ring=1 [xla]", causal) in timed
    assert ("dot_product_attention[xla]", causal) in timed
  assert result["ratios"] == [] and result["checks"] == []  # no fused GPU kernel runs on CPU
  # tokamax cannot run on CPU: its row says so (check()'s error); auto says what ran
  notes = [r["note"] for r in result["rows"] if r["impl"] == "ring_jax ring=1 [tokamax]"]
  assert len(notes) == 2 and all("ValueError: hop_kernel='tokamax': " in n for n in notes), notes
  assert result["auto"] == AUTO_ON_CPU


# What the accelerator image runs, on leg 2 of .ci/run too (tests/conftest.py).
@pytest.mark.newest_jax
def test_tpu_check_dry_run(tmp_path):
  """Splash attention, the XLA ring and the splash hop all run (interpreted), agree, and
  their ratios are recorded."""
  impls = ["splash", "ring_jax ring=1 [xla]", "ring_jax ring=1 [splash]"]
  _, result = dry_run("tpu", tmp_path)
  assert result["dry"] and result["backend"] == "cpu"
  rows = {(r["causal"], r["impl"]): r for r in result["rows"]}
  assert len(rows) == len(result["rows"]) == 6
  for causal in (True, False):
    for impl in impls:
      row = rows[(causal, impl)]
      assert row["note"] == "", (impl, row["note"])
      assert row["fwd_tflops"] > 0 and row["fb_tflops"] > 0
  # Our splash hop and splash attention agree on the forward (bf16 outputs: a few ulps).
  assert len(result["checks"]) == 2
  assert all(c["impl"] == "ring_jax ring=1 [splash]" and c["against"] == "splash"
             and c["max_abs_diff"] < 5e-2 for c in result["checks"])
  # fwd and fwd+bwd, against splash and the XLA ring, causal and not: each the TF/s quotient.
  assert {(r["causal"], r["mode"], r["vs"]) for r in result["ratios"]} == {
      (c, m, vs) for c in (True, False) for m in ("fwd", "fb") for vs in impls[:2]}
  for r in result["ratios"]:
    key = f"{r['mode']}_tflops"
    assert r["ratio"] == pytest.approx(rows[(r["causal"], r["impl"])][key]
                                       / rows[(r["causal"], r["vs"])][key])
  assert result["auto"] == AUTO_ON_CPU
