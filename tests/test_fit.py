"""benchmarks/fit.py: the context-length planner, on the tiny config (one layer, a ring of 2).

Each case runs the script as a user would (a subprocess: it creates its own fake CPU
devices) and reads the JSON object on its last line.
"""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIB = 2 ** 30
SMALL = ["--config", os.path.join(ROOT, "configs", "tiny.py"), "--devices", "2",
         "--mesh", "data=1,sequence=2", "--config.batch_size=2", "--config.model.num_layers=1"]


def fit(*args):
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["PYTHONPATH"] = ROOT
  proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "fit.py"), *args],
                        env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
  return proc, proc.stdout.strip().splitlines()


def check_row(row):
  assert row["per_device_bytes"] == (row["argument_bytes"] + row["output_bytes"]
                                     + row["temp_bytes"] - row["alias_bytes"])
  assert row["argument_bytes"] > 0 and row["temp_bytes"] > 0


def test_one_length_then_search_finds_it():
  """--seq_len reports one length; a search with exactly that memory per device answers it
  (memory grows with length, so the next power of two does not fit)."""
  proc, lines = fit(*SMALL, "--seq_len", "256", "--memory_gib", "1")
  assert proc.returncode == 0, proc.stderr[-3000:]
  one = json.loads(lines[-1])
  assert one["seq_len"] == 256 and one["fits"] is True
  assert one["mesh"] == {"data": 1, "sequence": 2, "tensor": 1} and one["batch_rows"] == 2
  (row,) = one["checked"]
  check_row(row)
  assert one["per_device_bytes"] == row["per_device_bytes"]
  assert any(line.split()[:1] == ["256"] for line in lines[:-1])  # the table row

  limit_gib = one["per_device_bytes"] / GIB
  proc, lines = fit(*SMALL, "--memory_gib", repr(limit_gib), "--start", "256",
                    "--resolution", "1")
  assert proc.returncode == 0, proc.stderr[-3000:]
  found = json.loads(lines[-1])
  assert found["seq_len"] == 256 and found["fits"] is True and found["upper_bounded"] is True
  assert found["per_device_bytes"] == one["per_device_bytes"]
  by_length = {r["seq_len"]: r for r in found["checked"]}
  assert set(by_length) == {256, 512}
  assert not by_length[512]["fits"]
  assert by_length[512]["per_device_bytes"] > by_length[256]["per_device_bytes"]
  for r in found["checked"]:
    check_row(r)


@pytest.mark.parametrize("args,message", [
    (["--devices", "3"], "--mesh data=1,sequence=3"),
    (["--devices", "2", "--mesh", "data=1,sequence=2", "--seq_len", "102"],
     "multiples of"),
])
def test_bad_mesh_or_length_names_the_fix(args, message):
  proc, _ = fit("--config", os.path.join(ROOT, "configs", "tiny.py"), "--memory_gib", "1",
                *args)
  assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
  assert message in proc.stderr


def test_seq_len_multiple_matches_the_config_check():
  """Every multiple of seq_len_multiple passes check_seq_len; smaller steps do not."""
  from configs import llama_1b
  from training import config as cfg_lib

  model = llama_1b.get_config("long").model
  for ring in (1, 8):
    g = cfg_lib.seq_len_multiple(model, ring)
    for k in (1, 3, 128):
      assert cfg_lib.check_seq_len(model, ring, k * g) == k * g // ring
    for bad in (g // 2, g + ring * 2):
      with pytest.raises(cfg_lib.ConfigError):
        cfg_lib.check_seq_len(model, ring, bad)
