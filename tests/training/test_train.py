"""The trainer: sharded step == unsharded step, resume == uninterrupted, end-to-end smoke."""

import functools
import json
import os
import subprocess
import sys

import jax
import ml_collections
import numpy as np
import pytest
from flax import nnx

import model_utils
import train as train_script
from model_utils import tiny_config
from models import llama
from models import sharding as shd
from training import batch as batch_lib
from training import data as data_lib
from training import errors
from training import flags as flags_lib
from training import mesh as mesh_lib
from training import stages as stages_lib
from training import step as step_lib
from training import supervisor as supervisor_lib
from training import validation as val_lib
import train_procs

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def small_config(**overrides):
  """tiny.py trimmed further so each compile takes seconds."""
  settings = {
      "model.dim": 32, "model.mlp_dim": 64, "model.num_heads": 4, "model.num_kv_heads": 2,
      "data.seq_len": 64, "batch_size": 8, "eval_batch_size": 8, "eval_batches": 1,
      "data.kv.num_pairs": 4, "data.kv.num_queries": 4,
      "optim.warmup_steps": 0, "optim.lr": 1e-3,
      "log_every": 1, "eval_every": 1000, "checkpoint_every": 1000,
      "async_checkpointing": False,
  }
  settings.update(overrides)
  return tiny_config(**settings)


def one_step(config, mesh):
  """Initial params and params after one train step on ``mesh``, plus the step's metrics."""
  model_cfg = val_lib.llama_config(config)
  ring = shd.ring_size(mesh.shape)
  tx = step_lib.make_optimizer(config.optim, config.total_steps)
  train_step = step_lib.build_train_step(model_cfg, mesh, tx, microbatches=config.microbatches,
                                         seed=config.seed)
  params, opt_state = train_step.init_state()
  initial = jax.device_get(nnx.to_pure_dict(params))
  with jax.set_mesh(mesh):
    sharding = batch_lib.sharding(mesh)
    local = data_lib.make_dataset(config, sharding, ring, split="train")[0]
    batch = data_lib.to_global(local, sharding, (config.batch_size, config.data.seq_len))
    params, opt_state, metrics = train_step.step(params, opt_state, batch)
  # The params stay sharded as the rules say (e.g. nothing silently replicated).
  for leaf, want in zip(jax.tree.leaves(params), jax.tree.leaves(train_step.param_shardings)):
    assert leaf.sharding.is_equivalent_to(want, leaf.ndim)
  return initial, jax.device_get(nnx.to_pure_dict(params)), jax.device_get(metrics)


@functools.cache
def dense_step():
  """:func:`one_step` on one device, dense attention, one batch (what sharded steps equal)."""
  dense_cfg = small_config(**{"model.attention": "dense", "mesh.data": 1, "mesh.sequence": 1,
                              "optim.eps": 1e-6})
  return one_step(dense_cfg, mesh_lib.make_mesh(dense_cfg.mesh, devices=jax.devices()[:1]))


@pytest.mark.parametrize("overrides", [
    {"model.fsdp": True, "microbatches": 2},
    # The two-level ring: 2 groups of 4 on the sequence axes, zigzag over the ring of 8.
    {"mesh.data": 1, "mesh.sequence_outer": 2, "mesh.sequence": 4},
], ids=["data2_seq4_fsdp_micro2", "two_level_2x4"])
def test_sharded_ring_step_equals_unsharded_dense_step(overrides):
  """data=2 x sequence=4, ring, zigzag, FSDP, 2 microbatches (and data=1 x sequence_outer=2 x
  sequence=4, the two-level ring) == 1 device, dense, 1 batch."""
  sharded_cfg = small_config(**{"model.attention": "ring", "model.layout": "zigzag",
                                "optim.eps": 1e-6, **overrides})
  init_a, params_a, metrics_a = one_step(sharded_cfg, mesh_lib.make_mesh(sharded_cfg.mesh))
  init_b, params_b, metrics_b = dense_step()

  jax.tree.map(np.testing.assert_array_equal, init_a, init_b)  # same start on any mesh
  np.testing.assert_allclose(metrics_a["loss"], metrics_b["loss"], rtol=1e-5)
  np.testing.assert_allclose(metrics_a["grad_norm"], metrics_b["grad_norm"], rtol=1e-4)
  assert metrics_a["target_tokens"] == metrics_b["target_tokens"] == 8 * 2 * 4  # rows*docs*q
  moved = jax.tree.map(lambda a, b: float(np.abs(a - b).max()), params_b, init_b)
  assert max(jax.tree.leaves(moved)) > 1e-4  # the step did update the params
  # Adam's first update is ~lr * g / (|g| + eps): entries whose gradient is near zero move by
  # an amount that depends on summation order (seen: 3.8e-6 on jax 0.12), so atol is set a
  # decade below the smallest movement the check above requires, not at float32 rounding.
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5),
               params_a, params_b)


def test_explicit_mesh_step_with_tensor_equals_one_device_step():
  """The train step on an Explicit mesh (jax.make_mesh's default) with data=2 x sequence=2 x
  tensor=2: the loss reads each label's log-probability from vocab-sharded logits (a
  gather there fails on Explicit axes) and equals the one-device step."""
  sizes = {"mesh.data": 2, "mesh.sequence": 2, "mesh.tensor": 2}
  config = small_config(**sizes, **{"optim.eps": 1e-6})
  mesh = model_utils.make_mesh(data=2, sequence=2, tensor=2)
  assert set(mesh.axis_types) == {jax.sharding.AxisType.Explicit}
  single_cfg = small_config(**{"mesh.data": 1, "mesh.sequence": 1, "optim.eps": 1e-6})
  single_mesh = mesh_lib.make_mesh(single_cfg.mesh, devices=jax.devices()[:1])
  init_a, params_a, metrics_a = one_step(config, mesh)
  init_b, params_b, metrics_b = one_step(single_cfg, single_mesh)
  # The same start up to float32 rounding: the initialisers, traced on Explicit axes, round
  # some entries 1 ulp differently (seen: 7.5e-9 at most; bit-equal on Auto axes).
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-8),
               init_a, init_b)
  for key in ("loss", "grad_norm", "accuracy"):
    np.testing.assert_allclose(metrics_a[key], metrics_b[key], rtol=1e-5)
  # atol as in the test above: Adam's first update of near-zero gradients.
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5),
               params_a, params_b)


def test_document_layout_step_equals_zigzag_step():
  """model.layout="document": the same packed batch, reordered per row by its documents,
  gives the zigzag run's loss and gradient norm (float32 summation order aside)."""
  runs = {}
  for layout in ("zigzag", "document"):
    config = small_config(**{"model.attention": "ring", "model.layout": layout,
                             "model.num_layers": 1, "batch_size": 4, "data.seq_len": 128,
                             "data.kv.docs_per_row": 4})
    runs[layout] = one_step(config, mesh_lib.make_mesh(config.mesh))
  (init_z, params_z, metrics_z), (init_d, params_d, metrics_d) = runs.values()
  # The two runs saw the same rows in different orders (each row by its own documents; two
  # documents of equal length would be dealt exactly as zigzag deals them, four are not).
  rows = data_lib.KVRetrievalTask.from_config(config.data).rows(config.seed, 0, 2)
  zigzag, document = (data_lib.to_layout_np(rows, lay, 4) for lay in ("zigzag", "document"))
  assert not np.array_equal(zigzag["tokens"], document["tokens"])
  np.testing.assert_array_equal(np.sort(zigzag["tokens"]), np.sort(document["tokens"]))
  jax.tree.map(np.testing.assert_array_equal, init_z, init_d)
  np.testing.assert_allclose(metrics_d["loss"], metrics_z["loss"], rtol=1e-5)
  np.testing.assert_allclose(metrics_d["grad_norm"], metrics_z["grad_norm"], rtol=1e-4)
  assert metrics_d["target_tokens"] == metrics_z["target_tokens"]
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5),
               params_d, params_z)


def test_auto_layout_resolves_to_document_on_packed_rows_and_trains_as_zigzag(tmp_path, capsys):
  """model.layout="auto" on rows of four packed documents: train() decides "document" once at
  startup and says so in one line; the loss curve is the zigzag run's (the two layouts
  permute the same tokens of every row; float32 summation order aside), and so is the routed
  zigzag ring's (model.causal_routing=True: the same attention, fewer K/V bytes)."""
  settings = {"model.num_layers": 1, "batch_size": 4, "eval_batch_size": 4,
              "data.seq_len": 128, "data.kv.docs_per_row": 4, "total_steps": 3}
  variants = {"auto": {"model.layout": "auto"}, "zigzag": {"model.layout": "zigzag"},
              "routed": {"model.layout": "zigzag", "model.causal_routing": True}}
  runs = {name: train_script.train(small_config(**over, **settings), str(tmp_path / name))
          for name, over in variants.items()}
  out = capsys.readouterr().out
  assert out.count("layout: auto -> document (packed rows: several documents per row; "
                   "data.kind='kv_retrieval' with data.kv.docs_per_row=4; ring of 4)") == 1
  assert out.count("layout=document ring=4") == 1 and out.count("layout=zigzag ring=4") == 2
  assert out.count("ring K/V routing: routed under the causal mask") == 1
  losses = {k: [row["loss"] for row in run.history] for k, run in runs.items()}
  assert len(losses["auto"]) == 3
  np.testing.assert_allclose(losses["auto"], losses["zigzag"], rtol=1e-5)
  np.testing.assert_allclose(losses["routed"], losses["zigzag"], rtol=1e-5)


def test_resume_matches_uninterrupted_run_even_on_another_mesh(tmp_path):
  """Stop at step 3 of 6 on data=2 x sequence=4, resume to 6 on data=1 x sequence=8.

  The resumed run must continue the same loss curve (same batches from the
  restored data iterator, same params/optimizer state) as one uninterrupted
  6-step run; only float reduction order differs across the two meshes.
  """
  config = small_config(**{"total_steps": 6, "checkpoint_every": 2})
  full = train_script.train(config, str(tmp_path / "full"))
  first = train_script.train(config, str(tmp_path / "split"), stop_at_step=3)
  moved = small_config(**{"total_steps": 6, "checkpoint_every": 2, "mesh.data": 1,
                          "mesh.sequence": 8})
  second = train_script.train(moved, str(tmp_path / "split"))

  assert dict(second.mesh.shape) == dict(data=1, pipeline=1, sequence_outer=1, sequence=8,
                                         tensor=1)
  assert [r["step"] for r in full.history] == list(range(1, 7))
  assert [r["step"] for r in first.history] == [1, 2, 3]
  assert [r["step"] for r in second.history] == [4, 5, 6]
  np.testing.assert_array_equal([r["loss"] for r in first.history],
                                [r["loss"] for r in full.history[:3]])
  np.testing.assert_allclose([r["loss"] for r in second.history],
                             [r["loss"] for r in full.history[3:]], rtol=1e-5)
  assert full.history[5]["loss"] != full.history[2]["loss"]  # the curve does move
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
               jax.device_get(nnx.to_pure_dict(second.params)),
               jax.device_get(nnx.to_pure_dict(full.params)))
  for leaf in jax.tree.leaves(second.params):  # restored straight onto the new mesh
    assert leaf.sharding.mesh.shape["sequence"] == 8
  assert full.evals and full.evals[-1]["step"] == 6  # eval at the end of the schedule
  # Periodic saves (2, 4) and the final one (6), keeping the last 2; the split run also
  # saved where it stopped (3).
  steps = lambda run: sorted(int(p.name) for p in (tmp_path / run / "checkpoints").iterdir()
                             if p.name.isdigit())
  assert steps("full") == [4, 6] and steps("split") == [4, 6]
  rows = [json.loads(l) for l in (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows if "train/loss" in r] == list(range(1, 7))  # appended
  assert {"train/tokens_per_s", "train/mfu", "train/learning_rate",
          "train/grad_norm", "train/step_time_s"} <= set(rows[0])


def test_distributed_launch_detection():
  detect = supervisor_lib.multiprocess_launch_detected
  assert detect({}) is None
  assert detect({"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234"}) == "JAX_COORDINATOR_ADDRESS"
  assert detect({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1"}) is None  # single task: no init
  assert detect({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4"}) == "SLURM"
  assert detect({"OMPI_MCA_orte_hnp_uri": "x", "OMPI_COMM_WORLD_SIZE": "2"}) == "Open MPI"
  assert detect({"TPU_WORKER_HOSTNAMES": "a,b"}).startswith("multi-host TPU")
  assert detect({"TPU_WORKER_HOSTNAMES": "a"}) is None


@pytest.mark.newest_jax  # one end-to-end train.py on leg 2 of .ci/run (tests/conftest.py)
def test_train_py_end_to_end(tmp_path):
  """`python train.py` with config-file, --config.* and gin overrides, on simulated devices:
  the two-level ring (mesh.sequence_outer=2 groups of sequence=4), striped over the ring of 8."""
  gin_file = tmp_path / "short.gin"
  gin_file.write_text("config.total_steps = 4\nmodel.dim = 32\n")
  env = train_procs.env()  # train.py sizes its own devices
  workdir = tmp_path / "run"
  cmd = [sys.executable, os.path.join(ROOT, "train.py"),
         "--config", os.path.join(ROOT, "configs", "tiny.py") + ":striped",
         "--workdir", str(workdir), "--config.data.seq_len=64", "--config.model.mlp_dim=64",
         "--config.data.kv.num_pairs=4", "--config.data.kv.num_queries=4",
         "--config.log_every=2", "--config.eval_every=4", "--config.eval_batches=1",
         "--config.profile_steps=2:4", "--config.mesh.data=1", "--config.mesh.sequence_outer=2",
         f"--gin_file={gin_file}", "--gin_param=model.num_layers = 1",
         "--gin_param=optim.warmup_steps = 1"]
  proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  out = proc.stdout
  assert "mesh {'data': 1, 'pipeline': 1, 'sequence_outer': 2, 'sequence': 4, 'tensor': 1}" in out
  assert "layout=striped ring=8 (two-level: 2 groups of 4)" in out
  assert "ring K/V routing: full rotation;" in out  # striped: nothing to drop
  assert "step      4/4" in out and "ETA" in out and "MFU" in out
  assert "nominal CPU peak" in out  # honest about the MFU denominator on CPU
  assert "done: step 4" in out
  saved = json.loads((workdir / "config.json").read_text())
  assert saved["model"]["num_layers"] == 1 and saved["model"]["dim"] == 32
  assert saved["total_steps"] == 4
  assert (workdir / "checkpoints" / "4").is_dir()
  assert any(f.startswith("events.out.tfevents") for f in os.listdir(workdir / "tensorboard"))
  rows = [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows if "train/loss" in r] == [2, 4]
  assert any("eval/retrieval_accuracy" in r and "eval/chance_accuracy" in r for r in rows)
  # --config.profile_steps=2:4: a jax.profiler trace of steps 2 and 3, for TensorBoard/XProf.
  assert f"profiling steps 2 to 3 into {workdir / 'profile'}" in out
  traces = list((workdir / "profile").glob("plugins/profile/*/*.xplane.pb"))
  assert len(traces) == 1 and traces[0].stat().st_size > 0, traces

  # A bad config is reported cleanly, before compiling.
  bad = subprocess.run(cmd[:2] + ["--config", cmd[3], "--workdir", str(tmp_path / "bad"),
                                  "--config.data.kind=webdataset"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
  assert bad.returncode == 2
  assert "config error: data.kind='webdataset' is unknown" in bad.stderr


def test_weight_decay_skips_stacked_norm_scales():
  """AdamW decays weight matrices and embeddings, never RMSNorm scales (even stacked 2-D ones)."""
  import jax.numpy as jnp
  from training import step as step_lib

  cfg = llama.LlamaConfig(vocab_size=16, dim=8, num_layers=2, num_heads=2, num_kv_heads=1,
                          mlp_dim=16, attention="dense")
  abstract = nnx.eval_shape(lambda: llama.Llama(cfg, rngs=nnx.Rngs(0)))
  _, params, _ = nnx.split(abstract, nnx.Param, ...)
  params = jax.tree.map(lambda x: jnp.ones(x.shape, x.dtype), params)  # no slow eager init
  optim = type("Optim", (), dict(lr=1.0, warmup_steps=1, min_lr_ratio=1.0, b1=0.9, b2=0.95,
                                 eps=1e-8, weight_decay=0.5, grad_clip=1.0))()
  tx = step_lib.make_optimizer(optim, total_steps=10)
  zero_grads = jax.tree.map(jnp.zeros_like, params)
  state = jax.jit(tx.init)(params)
  update = jax.jit(tx.update)
  _, state = update(zero_grads, state, params)        # step 0: warmup lr is 0
  updates, _ = update(zero_grads, state, params)      # step 1: lr 1, only decay moves
  for path, u in jax.tree.leaves_with_path(updates):
    name = jax.tree_util.keystr(path)
    assert bool(jnp.all(u == 0)) == ("norm" in name), name


def _losses(config, steps: int = 3):
  """Losses of ``steps`` train steps of ``config`` on its mesh (same seed and batches)."""
  mesh = mesh_lib.make_mesh(config.mesh)
  model_cfg, _ = val_lib.resolve_attention(config, mesh)
  tx = step_lib.make_optimizer(config.optim, config.total_steps)
  train_step = step_lib.build_train_step(model_cfg, mesh, tx, seed=config.seed)
  params, opt_state = train_step.init_state()
  sharding = batch_lib.sharding(mesh)
  shape = (config.batch_size, config.data.seq_len)
  dataset = data_lib.make_dataset(config, sharding, mesh.shape["sequence"], split="train")
  losses = []
  with jax.set_mesh(mesh):
    for i in range(steps):
      batch = data_lib.to_global(dataset[i], sharding, shape)
      params, opt_state, metrics = train_step.step(params, opt_state, batch)
      losses.append(float(metrics["loss"]))
  return np.asarray(losses)


@pytest.fixture(scope="module")
def ring_losses():
  return _losses(small_config(**STRATEGY_MESH, **{"model.attention": "ring"}))


# 8 devices with every axis > 1: Ulysses over sequence (2 of the 2 query heads per tensor
# shard), the hybrid's ring over sequence and Ulysses over tensor (its default hybrid_axes).
STRATEGY_MESH = {"mesh.data": 2, "mesh.sequence": 2, "mesh.tensor": 2}


@pytest.mark.parametrize("attention", ["all_gather", "ulysses", "hybrid", "auto", "dense"])
def test_every_strategy_follows_the_ring_loss_curve(ring_losses, attention):
  """model.attention=<strategy>: the same 3-step loss curve as the ring (float32)."""
  losses = _losses(small_config(**STRATEGY_MESH, **{"model.attention": attention}))
  assert ring_losses[0] != ring_losses[-1]  # the curve moves
  np.testing.assert_allclose(losses, ring_losses, rtol=1e-5)


def test_tensor_sequence_parallel_keeps_the_loss_curve():
  """model.tensor_sequence_parallel off == on (the default with tensor > 1): the train step's
  3-step losses on data=1 x sequence=2 x tensor=4, with the blockwise FFN and chunked loss."""
  overrides = {"mesh.data": 1, "mesh.sequence": 2, "mesh.tensor": 4, "model.num_kv_heads": 4,
               "model.ffn_chunk_size": 4, "model.loss_chunk_size": 8}
  on = _losses(small_config(**overrides))
  off = _losses(small_config(**overrides, **{"model.tensor_sequence_parallel": False}))
  assert on[0] != on[-1]
  np.testing.assert_allclose(on, off, rtol=1e-5)


def test_auto_attention_is_decided_once_and_says_why(tmp_path, capsys):
  """model.attention="auto": ring_jax.plan's pick for the run's shapes, with its reasons, in
  the line train.py prints at startup (and runs); any other strategy is left as it is."""
  config = small_config(**{"model.attention": "auto", "total_steps": 1})
  mesh = mesh_lib.make_mesh(config.mesh)
  resolved, line = val_lib.resolve_attention(config, mesh)
  assert resolved.attention in ("ring", "all_gather", "ulysses")
  assert line.startswith(f"attention=auto -> {resolved.attention} (ring_jax.plan): ")
  assert len(line) > len("attention=auto -> ring (ring_jax.plan): ") + 10  # the reasons
  capsys.readouterr()
  train_script.train(config, str(tmp_path))
  startup = capsys.readouterr().out.splitlines()
  assert f"attention={resolved.attention} " in startup[0] and startup[1] == line
  ring = small_config()
  assert val_lib.resolve_attention(ring, mesh) == (val_lib.llama_config(ring), None)


@pytest.mark.parametrize("overrides,match", [
    ({"model.attention": "ulysses", "model.num_heads": 4, "model.num_kv_heads": 2,
      "mesh.sequence": 8, "mesh.data": 1},
     r"attention='ulysses': ulysses needs the query heads on each device \(4\) divisible by "
     r"the size of axis 'sequence' \(8\)"),
    ({"model.attention": "hybrid", "model.hybrid_axes": ("data", "tensor")},
     r"hybrid_axes=\('data', 'tensor'\): the ring axis must be the axis the sequence is "
     r"sharded over \('sequence'\)"),
    ({"model.attention": "hybrid", "model.hybrid_axes": ("sequence", "data"),
      "model.num_heads": 6, "model.num_kv_heads": 6, "model.head_dim": 8, "mesh.data": 4,
      "mesh.sequence": 2},
     r"attention='hybrid': ulysses needs the query heads on each device \(6\) divisible by "
     r"the size of axis 'data' \(4\)"),
    ({"mesh.data": 1, "mesh.sequence": 2, "mesh.tensor": 4, "model.num_kv_heads": 4,
      "model.ffn_chunk_size": 16}, "ffn_chunk_size=16 must divide the residual"),
])
def test_mesh_dependent_model_fields_fail_before_compiling(overrides, match):
  with pytest.raises(errors.ConfigError, match=match):
    val_lib.validate_config(small_config(**overrides), num_devices=8)


def test_a_second_train_of_the_same_setup_reuses_the_jitted_step():
  """training.stages.cached_train_step: the same model, mesh, optimizer settings and
  schedule length give the same TrainStep (so JAX reuses its compiled programs, eval step
  included); any change in them builds a new one."""
  config = small_config()
  mesh = mesh_lib.make_mesh(config.mesh)
  model_cfg = val_lib.llama_config(config)
  optim = ml_collections.FrozenConfigDict(config.optim)
  args = (model_cfg, mesh, optim, 6, config.microbatches, config.seed)
  first = stages_lib.cached_train_step(*args)
  assert stages_lib.cached_train_step(*args) is first
  assert first.eval_step is first.eval_step
  assert stages_lib.cached_train_step(model_cfg, mesh, optim, 7, config.microbatches,
                                  config.seed) is not first  # another schedule length
  other_optim = ml_collections.FrozenConfigDict(
      flags_lib.apply_overrides(small_config(), [("optim.lr", 5e-4)]).optim)
  assert stages_lib.cached_train_step(model_cfg, mesh, other_optim, 6, config.microbatches,
                                  config.seed) is not first
