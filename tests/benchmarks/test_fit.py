"""benchmarks/fit.py: the context-length planner, on the tiny config (one layer, a ring of 2).

One case runs the script as a user would (a subprocess: it creates its own fake CPU
devices; the JSON object on its last line, the table, exit status 2 for a bad setting).
The others call ``fit.run`` in this process, which has 8 fake CPU devices
(tests/conftest.py): the same planner on the same devices, without a process start per case.
"""
import json
import os
import subprocess
import sys

import pytest

import train_procs
from benchmarks import fit as fit_lib

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
GIB = 2 ** 30
TINY = os.path.join(ROOT, "configs", "tiny.py")
SMALL = ["--config", TINY, "--devices", "2",
         "--mesh", "data=1,sequence=2", "--config.batch_size=2", "--config.model.num_layers=1"]


def fit_cli(*args):
  proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "fit.py"), *args],
                        env=train_procs.env(), capture_output=True, text=True, timeout=600,
                        cwd=ROOT)
  return proc, proc.stdout.strip().splitlines()


def tiny(**fields):
  """configs/tiny.py with ``--config.<field>=<value>`` overrides, as the script parses them."""
  from configs import tiny as tiny_lib
  from training import flags as flags_lib

  return flags_lib.apply_overrides(tiny_lib.get_config(), list(fields.items()))


def fit(config, **kw):
  """``fit.run`` in this process; the JSON object the script prints last, as a dict."""
  return json.loads(json.dumps(fit_lib.run(config, **kw)))


def test_mesh_with_a_pipeline_axis():
  """mesh pipeline=2,sequence=2: the pipelined step compiles; bad stage counts are named."""
  one = fit(tiny(**{"batch_size": 2, "model.num_layers": 2}), devices=4, memory_gib=128,
            mesh="pipeline=2,sequence=2", seq_len=256)
  assert one["mesh"] == {"data": 1, "pipeline": 2, "sequence_outer": 1, "sequence": 2,
                         "tensor": 1}
  check_row(one["checked"][0])
  from training.errors import ConfigError
  with pytest.raises((fit_lib.FitError, ConfigError), match="mesh.pipeline=2 stages do not divide"):
    fit_lib.run(tiny(**{"batch_size": 2, "model.num_layers": 3}), devices=4, memory_gib=128,
                mesh="pipeline=2,sequence=2", seq_len=256)


def check_row(row):
  assert row["per_device_bytes"] == (row["argument_bytes"] + row["output_bytes"]
                                     + row["temp_bytes"] - row["alias_bytes"])
  assert row["argument_bytes"] > 0 and row["temp_bytes"] > 0


def test_cli_one_length_then_search_finds_it(tmp_path):
  """As a script: --seq_len reports one length (a table row, then the JSON line); a search
  with exactly that memory per device answers it (memory grows with length, so the next
  power of two does not fit); a bad mesh exits 2 with one line naming the fix."""
  proc, lines = fit_cli(*SMALL, "--seq_len", "256", "--memory_gib", "1")
  assert proc.returncode == 0, proc.stderr[-3000:]
  one = json.loads(lines[-1])
  assert one["seq_len"] == 256 and one["fits"] is True
  assert one["mesh"] == {"data": 1, "pipeline": 1, "sequence_outer": 1, "sequence": 2,
                         "tensor": 1}
  assert one["batch_rows"] == 2
  (row,) = one["checked"]
  check_row(row)
  assert one["per_device_bytes"] == row["per_device_bytes"]
  assert any(line.split()[:1] == ["256"] for line in lines[:-1])  # the table row

  # The search, in this process on the same 2 devices of the same mesh.
  limit_gib = one["per_device_bytes"] / GIB
  found = fit(tiny(**{"batch_size": 2, "model.num_layers": 1}), devices=2,
              mesh="data=1,sequence=2", memory_gib=limit_gib, start=256, resolution=1)
  assert found["seq_len"] == 256 and found["fits"] is True and found["upper_bounded"] is True
  assert found["per_device_bytes"] == one["per_device_bytes"]
  by_length = {r["seq_len"]: r for r in found["checked"]}
  assert set(by_length) == {256, 512}
  assert not by_length[512]["fits"]
  assert by_length[512]["per_device_bytes"] > by_length[256]["per_device_bytes"]
  for r in found["checked"]:
    check_row(r)

  bad, _ = fit_cli("--config", TINY, "--memory_gib", "1", "--devices", "3")
  assert bad.returncode == 2, bad.stdout[-2000:] + bad.stderr[-2000:]
  assert bad.stderr.strip().splitlines() == [l for l in bad.stderr.strip().splitlines()
                                             if l.startswith("error:")]
  assert "--mesh data=1,sequence=3" in bad.stderr


@pytest.mark.parametrize("kw,message", [
    (dict(devices=3), "--mesh data=1,sequence=3"),
    (dict(devices=2, mesh="data=1,sequence=2", seq_len=0), "data.seq_len"),
])
def test_bad_mesh_or_length_names_the_fix(kw, message):
  with pytest.raises(fit_lib.FitError, match=message):
    fit_lib.run(tiny(), memory_gib=1, **kw)


def test_length_multiple_matches_the_config_check():
  """Every multiple of length_multiple runs as it is; any other length runs padded to the
  next multiple."""
  from configs import llama_1b
  from models import lengths
  from training import errors
  from training import validation as val_lib

  for ring in (1, 8):  # layout="auto": contiguous on 1 device, document on 8
    model = val_lib.resolve_layout(llama_1b.get_config("long"), ring)[0].model
    g = lengths.length_multiple(model, ring)
    for k in (1, 3, 128):
      assert val_lib.run_length(model, ring, k * g) == k * g
    for odd, padded in ((g // 2, g), (g + ring * 2, 2 * g)):
      assert val_lib.run_length(model, ring, odd) == padded
    with pytest.raises(errors.ConfigError, match="data.seq_len"):
      val_lib.run_length(model, ring, 0)


def _tiny_step(policy):
  import jax

  from configs import tiny
  from training import mesh as mesh_lib
  from training import step as step_lib
  from training import validation as val_lib

  config, _ = val_lib.resolve_layout(tiny.get_config(), ring_size=1)
  config.model.update(dict(remat_policy=policy, dtype="bfloat16", num_layers=2))
  mesh = mesh_lib.make_mesh(dict(data=1, sequence=1, tensor=1), jax.devices()[:1])
  return step_lib.build_train_step(val_lib.llama_config(config), mesh,
                                   step_lib.make_optimizer(config.optim, 10))


def test_offload_policy_lowers_to_pinned_host_but_cpu_counts_it_on_device():
  """Lowered for GPU, the layer input of "offload_layer_in" is placed in pinned_host;
  compiled for CPU, the plan is the same as "full" (the offload is dropped), so the
  planner subtracts the placed bytes (``TrainStep.offloaded_bytes``)."""
  import jax

  from benchmarks import common
  from training import batch as batch_lib

  shape = (1, 256)
  offload, full = _tiny_step("offload_layer_in"), _tiny_step("full")
  with jax.set_mesh(offload.mesh):
    traced = offload.step.trace(offload.abstract_params, offload.abstract_opt_state,
                                batch_lib.abstract(shape, offload.mesh))
    gpu_text = traced.lower(lowering_platforms=("cuda",)).as_text()
  placed = [l for l in gpu_text.splitlines() if "annotate_device_placement" in l
            and '"pinned_host"' in l]
  assert placed and all("tensor<1x256x64xbf16>" in l for l in placed), placed[:2]
  assert (common.per_device_bytes(offload.compile(shape))
          == common.per_device_bytes(full.compile(shape)))
  # What the planner subtracts for it: one bf16 [1, 256, 64] layer input per layer (2 layers).
  assert offload.offloaded_bytes(shape, layers=2) == 2 * 256 * 64 * 2
  assert full.offloaded_bytes(shape, layers=2) == 0


@pytest.mark.parametrize("devices", [1, 8])
def test_long_variant_validates(devices):
  from configs import llama_1b
  from training import validation as val_lib

  config = llama_1b.get_config("long")
  assert val_lib.validate_config(config, devices) == dict(data=1, pipeline=1, sequence_outer=1,
                                                          sequence=devices, tensor=1)
  assert config.model.remat_policy == "offload_layer_in" and config.batch_size == 1


# The attention's own transfers in test_every_strategy_compiles's step (batch 2, seq_len 128,
# one layer, float32, data=1 x sequence=2 x tensor=2): a K or V shard is [2, 64, 1, 16] (64
# tokens of the sequence split, 1 of the 2 KV heads per tensor shard, head_dim 16), its
# segment ids [2, 64] int32; bytes are per device, of each op's result.
KV, IDS = 2 * 64 * 1 * 16 * 4, 2 * 64 * 4
# The ring of 2, one hop: forward K, V, ids; the backward starts on the shard the forward
# ended on (ring_jax.routing.backward_rotation), then K, V, ids again with dK and dV along
# the ring, ending on their owner (none sent home).
RING_PERMUTES = dict(count=3 + 3 + 2, bytes=6 * KV + 2 * IDS)
# Ulysses over sequence=2: q, k, v to heads and the output back, then the gradients the other
# way; each a [2, 64, 2, 16] exchange (K/V repeated to the 2 query heads per device).
ULYSSES_ALL_TO_ALL = dict(count=4 + 4, bytes=8 * 2 * KV)
# The hybrid's Ulysses over tensor=2 (q and the output 2 KV each, k and v 1 KV each, then
# their gradients: 12 KV), and 6 reshards of q, k, v into its layout and of their gradients
# out of it (8 KV).
HYBRID_ALL_TO_ALL = dict(count=8 + 6, bytes=12 * KV + 8 * KV)
NONE = dict(count=0, bytes=0)
ATTENTION_COLLECTIVES = {  # strategy: (collective-permute, all-to-all)
    "ring": (RING_PERMUTES, NONE), "auto": (RING_PERMUTES, NONE),  # auto picks the ring here
    "all_gather": (NONE, NONE), "ulysses": (NONE, ULYSSES_ALL_TO_ALL),
    "hybrid": (RING_PERMUTES, HYBRID_ALL_TO_ALL), "dense": (NONE, NONE)}


@pytest.mark.parametrize("attention", sorted(ATTENTION_COLLECTIVES))
def test_every_strategy_compiles(attention):
  """model.attention=<strategy> compiles on data=1 x sequence=2 x tensor=2 (the hybrid: ring
  over sequence x Ulysses over tensor); collectives=True counts the step's collectives: the
  ring's K/V collective-permutes, Ulysses' all-to-alls, each exactly as the strategy sends
  them and none elsewhere, and the reduce-scatters of tensor sequence parallelism."""
  result = fit(tiny(**{"batch_size": 2, "model.num_layers": 1, "model.attention": attention}),
               devices=4, mesh="data=1,sequence=2,tensor=2", seq_len=128, memory_gib=1,
               collectives=True)
  (row,) = result["checked"]
  check_row(row)
  got = row["collectives"]
  assert (got["collective-permute"], got["all-to-all"]) == ATTENTION_COLLECTIVES[attention]
  # Tensor sequence parallelism (tensor=2): 8 reduce-scatters into the split residual stream;
  # all_gather adds its backward's 2, dK and dV scattered back to their sequence shards.
  assert got["reduce-scatter"]["count"] == 8 + 2 * (attention == "all_gather")


def test_planner_plans_the_init_hf_dir_model_with_a_layout_it_runs(tmp_path):
  """configs/finetune.py with init.hf_dir of a Mistral (a 64-token window on every layer):
  the planner resolves the config as train.py does (training.validation.resolve_config), so
  it plans that model, window included, in a layout its window allows (never "document")."""
  from configs import finetune
  from scripts import make_tiny_hf
  from training import flags as flags_lib

  make_tiny_hf.write_model(str(tmp_path), vocab_size=320, num_layers=1, family="mistral")
  config = flags_lib.apply_overrides(finetune.get_config(), [
      ("init.hf_dir", str(tmp_path)), ("batch_size", 2), ("data.seq_len", 256)])
  sizes = fit_lib.resolve_mesh(config, 2, "data=1,sequence=2")
  planner = fit_lib.Planner(config, sizes, limit_bytes=GIB)
  m = planner.model_cfg
  assert (m.family, m.sliding_window, m.num_layers, m.vocab_size) == ("mistral", 64, 1, 320)
  assert m.layout == "zigzag"  # packed text; the window reaches both devices of the ring
