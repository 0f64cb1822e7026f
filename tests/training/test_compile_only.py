"""train.py --compile_only and training/compile_only.py: the bad-input lines (before any
compile), the mesh over several slices, and (``tpu_compiler``, tests/conftest.py) the tiny
train step compiled for v5e:2x2 by train.py and by benchmarks/fit.py alike."""

import os
import subprocess
import sys

import jax
import pytest

from benchmarks import fit as fit_lib
from configs import tiny
from ring_jax import hardware
from ring_jax import topology
from training import compile_only as compile_lib
from training import mesh as mesh_lib
from training import stages as stages_lib
from training.errors import ConfigError
from message_utils import assert_states

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def tiny_config(**fields):
  config = tiny.get_config()
  config.mesh.update(dict(data=1, sequence=4))
  config.model.num_layers = 1
  for key, value in fields.items():
    parent, name = (config, key) if "." not in key else (
        config[key.split(".")[0]], key.split(".")[1])
    parent[name] = value
  return config


@pytest.fixture
def no_compile(monkeypatch):
  """Makes any train-step build fail loudly: the errors under test come before it."""
  def fail(*args, **kwargs):
    raise AssertionError("a train step was built before the bad input was reported")
  monkeypatch.setattr(stages_lib, "build_stage", fail)


# Each bad input's line: the setting at fault as given, the numbers and names that make it
# wrong, and what works instead.
@pytest.mark.parametrize("topology_name, slices, fields, facts", [
    ("v7:2x2", 1, {}, ("--topology", "'v7:2x2'", str(topology.FORMS))),
    ("v5e:2x2", 0, {}, ("--topology_slices", ">= 1", "0")),
    ("v5e:2x2", 1, {"mesh.data": 2},
     ("config.mesh={'data': 2, 'pipeline': 1, 'sequence_outer': 1, 'sequence': 4, 'tensor': 1}",
      "8 devices", "4", "v5e:2x2", "4 chips", "-1")),
    ("v5e:2x2", 1, {"model.hop_kernel": "tokamax"},
     ("model.hop_kernel='tokamax'", "GPU", "--topology", "TPU",
      "--config.model.hop_kernel=auto", "splash", "xla")),
    ("v5e:2x2", 2, {"mesh.data": 1, "mesh.sequence": 8},
     ("config.mesh={'data': 1, 'pipeline': 1, 'sequence_outer': 1, 'sequence': 8, 'tensor': 1}",
      "2 slices", "('sequence_outer', 'data', 'pipeline')", "2 equal parts",
      "--config.mesh.data=2", "--config.mesh.sequence_outer=2")),
])
def test_bad_input_is_one_line_before_any_compile(no_compile, topology_name, slices, fields,
                                                  facts):
  with pytest.raises(ConfigError) as e:
    compile_lib.compile_stages(tiny_config(**fields), topology_name, slices)
  assert_states(str(e.value), *facts)


def test_missing_libtpu_is_reported_before_any_compile(no_compile, monkeypatch):
  def missing():
    raise topology.TopologyError("libtpu is missing (stand-in)")
  monkeypatch.setattr(topology, "check_libtpu", missing)
  with pytest.raises(ConfigError, match=r"^--topology: libtpu is missing \(stand-in\)$"):
    compile_lib.compile_stages(tiny_config(), "v5e:2x2")


def test_cli_bad_topology_is_one_line_status_2():
  proc = subprocess.run(
      [sys.executable, "train.py", "--config", "configs/tiny.py", "--compile_only",
       "--topology", "v5p:4x4"], cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2
  [line] = proc.stderr.strip().splitlines()
  # The topology as given, what v5p needs (3 dimensions, the first two 1 or even), the forms.
  assert_states(line, "'v5p:4x4'", "3 dimensions", "v5p", "1 or even", str(topology.FORMS),
                starts_with="config error: --topology: ")


def test_topology_needs_compile_only():
  proc = subprocess.run(
      [sys.executable, "train.py", "--config", "configs/tiny.py", "--topology", "v5e:2x2"],
      cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2
  [line] = proc.stderr.strip().splitlines()
  assert_states(line, "--topology", "not attached", "--compile_only",
                starts_with="config error: ")


@pytest.mark.parametrize("sizes, slices, dcn", [
    (dict(data=4, sequence=4), 2, (2, 1, 1, 1, 1)),
    (dict(data=2, sequence_outer=2, sequence=4), 2, (1, 1, 2, 1, 1)),
    (dict(data=2, sequence_outer=2, sequence=4), 4, (2, 1, 2, 1, 1)),
    (dict(data=1, pipeline=2, sequence=4), 2, (1, 2, 1, 1, 1)),
])
def test_dcn_shape_spans_slices_outer_axes_first(sizes, slices, dcn):
  full = {axis: sizes.get(axis, 1) for axis in mesh_lib.MESH_AXES}
  assert mesh_lib.dcn_shape(full, slices) == dcn


def test_compile_only_on_attached_devices_has_no_hbm_figure(capsys):
  """Without --topology: the CPU devices this process simulates (no HBM figure for them)."""
  rows = compile_lib.compile_stages(tiny_config(**{"mesh.data": 2}))
  assert len(rows) == 1 and rows[0]["hbm_bytes"] is None and rows[0]["fits"] is None
  assert rows[0]["per_chip_bytes"] == (rows[0]["argument_bytes"] + rows[0]["output_bytes"]
                                       + rows[0]["temp_bytes"] - rows[0]["alias_bytes"])
  out = capsys.readouterr().out
  assert "no HBM figure for this device kind" in out and "compile only, for cpu" in out


# ---- with the TPU compiler ------------------------------------------------------------


@pytest.mark.tpu_compiler
def test_mesh_over_two_slices_keeps_each_data_row_in_one_slice():
  devices = topology.devices("v5e:2x2", slices=2)
  mesh = mesh_lib.make_mesh(dict(data=2, sequence=4), devices)
  for row in range(2):
    assert {d.slice_index for d in mesh.devices[row].flat} == {row}


@pytest.mark.tpu_compiler
def test_tiny_step_compiles_for_v5e_with_train_py_and_fit_py_alike(capsys):
  """``train.py --compile_only --topology v5e:2x2`` on the tiny config (one layer), and
  ``fit.py --topology`` at the same length: the same step, the same bytes per chip."""
  config = tiny_config()
  rows = compile_lib.compile_stages(config, "v5e:2x2")
  out = capsys.readouterr().out.splitlines()
  assert len(rows) == 1
  row = rows[0]
  hbm = hardware.lookup("TPU v5e").memory_bytes
  assert row["hbm_bytes"] == hbm and row["fits"] is True and row["seq_len"] == 128
  assert row["per_chip_bytes"] == (row["argument_bytes"] + row["output_bytes"]
                                   + row["temp_bytes"] - row["alias_bytes"])
  assert 0 < row["per_chip_bytes"] < hbm
  assert [line for line in out if line.startswith("compile only")] == [
      "compile only, for TPU slice v5e:2x2 (4 chips) (TPU v5 lite): mesh {'data': 1, "
      "'pipeline': 1, 'sequence_outer': 1, 'sequence': 4, 'tensor': 1}; libtpu "
      f"{topology.check_libtpu()}"]
  assert any(line.startswith("per chip: arguments ") and line.endswith(
      f"of {hbm / 2**30:.2f} GiB HBM (TPU v5 lite): fits "
      f"({100 * row['per_chip_bytes'] / hbm:.0f}%)") for line in out)
  assert "hop kernel: xla (auto: splash not tried on tpu: these shapes or this dtype do not " \
         "suit it, see its check())" in out  # the tiny model's blocks of 64: below splash's
  assert row["overlap"] and out[-len(row["overlap"]):] == row["overlap"]  # the summary ends it

  found = fit_lib.run(tiny_config(), topology="v5e:2x2", seq_len=128)
  assert found["platform"] == "tpu" and found["memory_bytes"] == int(hbm)
  assert found["per_device_bytes"] == row["per_chip_bytes"] and found["fits"] is True


def test_a_compiler_refusal_is_one_line():
  """What the TPU compiler said for configs/llama_7b.py at 1M tokens on v5p:4x4x4 (splash's
  forward at block 2048 over its VMEM), abridged: one line with the allocation and the op."""
  error = jax.errors.JaxRuntimeError(
      "RESOURCE_EXHAUSTED: E1001: CompileTimeScopedVmemOom:\nRan out of memory in memory "
      "space vmem while allocating on stack for %splash_mha_fwd.8 = custom-call(%a), "
      'metadata={op_name="jit(train_step)/layer/attention/hop/splash_mha_fwd/pallas_call" '
      "stack_frame_id=668}. Scoped allocation with size 27.81M and limit 16.00M exceeded "
      "scoped vmem limit by 11.81M and 0.5K.\nSee https://openxla.org/xla/errors/error_1001")
  where = compile_lib.Target(name="v5p:4x4x4", slices=1, chips=64)
  with pytest.raises(compile_lib.CompileFailed) as e:
    with compile_lib.compiling(where):
      raise error
  # The slice, the compiler's status and error, the allocation, its limit and the excess,
  # and the op; not the compiler's prose, its metadata or its link.
  line = str(e.value)
  assert_states(line, "v5p:4x4x4", "64 chips",
                "RESOURCE_EXHAUSTED: E1001: CompileTimeScopedVmemOom", "27.81M", "16.00M",
                "11.81M", ends_with="splash_mha_fwd/pallas_call")
  assert not any(noise in line for noise in ("Ran out of memory", "stack_frame_id", "0.5K",
                                              "openxla.org", "jit(train_step)")), line
