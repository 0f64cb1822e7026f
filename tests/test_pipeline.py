"""The pipeline axis: GPipe over `pipeline` == the one-device step (loss and every gradient)."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import model_utils
import ring_jax
from model_utils import tiny_config
from models import llama
from models import pipeline as pipeline_lib
from models import sharding as shd
from training import batch as batch_lib
from training import data as data_lib
from training import errors
from training import mesh as mesh_lib
from training import step as step_lib
from training import validation as val_lib
import train_procs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The train.py runs: --stop_at_step=N of a schedule longer than any run (so no run ends a
# stage: no eval to compile), and no checkpoint but the one each stop writes.
RUN = {"total_steps": 8, "log_every": 1, "eval_every": 1000, "checkpoint_every": 1000,
       "async_checkpointing": False}


# tiny.py with 4 layers (so 4 stages divide them), small enough to compile in seconds, on
# one device unless a test sets mesh sizes.
SMALL = {
    "model.dim": 32, "model.mlp_dim": 64, "model.num_heads": 4, "model.num_kv_heads": 2,
    "model.num_layers": 4, "data.seq_len": 64, "batch_size": 8, "eval_batch_size": 8,
    "eval_batches": 1, "data.kv.num_pairs": 4, "data.kv.num_queries": 4,
    "optim.warmup_steps": 0, "optim.lr": 1e-3, "optim.eps": 1e-6,
    "mesh.data": 1, "mesh.sequence": 1,
}


def small_config(**overrides):
  return tiny_config(**{**SMALL, **overrides})


def capture_grads() -> optax.GradientTransformation:
  """An optimizer whose update is zero and whose state is the gradient it was given: after
  one train step the optimizer state holds the step's own gradients (one compiled program
  gives the metrics and the gradients)."""
  return optax.GradientTransformation(
      init=lambda params: jax.tree.map(jnp.zeros_like, params),
      update=lambda grads, state, params=None: (jax.tree.map(jnp.zeros_like, grads), grads))


def loss_and_grads(config):
  """``(metrics of one train step, its gradients)`` on ``config.mesh``, same data."""
  sizes = val_lib.validate_config(config, int(np.prod([v for v in config.mesh.values()])))
  devices = jax.devices()[:int(np.prod(list(sizes.values())))]
  mesh = mesh_lib.make_mesh(config.mesh, devices=devices)
  model_cfg = val_lib.llama_config(config)
  built = step_lib.build_train_step(model_cfg, mesh, capture_grads(),
                                    microbatches=config.microbatches, seed=config.seed)
  params, opt_state = built.init_state()
  with jax.set_mesh(mesh):
    sharding = batch_lib.sharding(mesh)
    local = data_lib.make_dataset(config, sharding, sizes["sequence"], split="train")[0]
    batch = data_lib.to_global(local, sharding, (config.batch_size, config.data.seq_len))
    _, grads, metrics = built.step(params, opt_state, batch)
  return jax.device_get(metrics), jax.device_get(nnx.to_pure_dict(grads))


@pytest.fixture(scope="module")
def one_device():
  return loss_and_grads(small_config())


# FSDP, full remat, the blockwise FFN and the chunked loss inside the stages (same math).
COMPOSED = {"model.fsdp": True, "model.remat_policy": "full", "model.ffn_chunk_size": 8,
            "model.loss_chunk_size": 8}


@pytest.mark.parametrize("mesh,model", [
    (dict(pipeline=2), {}),
    (dict(pipeline=2, sequence=2, tensor=2), {}),
    (dict(pipeline=2, data=2, sequence=2), {}),
    (dict(pipeline=4, sequence=2), {}),
    (dict(pipeline=2, data=2, sequence=2), COMPOSED),
], ids=["p2", "p2xs2xt2", "p2xd2xs2", "p4xs2", "p2xd2xs2-fsdp-remat-chunks"])
def test_pipeline_step_equals_one_device_step(mesh, model, one_device):
  """The train step's loss, every gradient it takes (float32, rtol 1e-5) and its metrics on
  a pipeline mesh (against the one-device step without FSDP, remat or chunking)."""
  config = small_config(**{f"mesh.{k}": v for k, v in mesh.items()}, **model)
  metrics, grads = loss_and_grads(config)
  want_metrics, want_grads = one_device
  np.testing.assert_allclose(metrics["loss"], want_metrics["loss"], rtol=1e-5)
  np.testing.assert_allclose(metrics["grad_norm"], want_metrics["grad_norm"], rtol=1e-5)
  assert metrics["target_tokens"] == want_metrics["target_tokens"]
  scale = max(float(np.abs(g).max()) for g in jax.tree.leaves(want_grads))
  # rtol 1e-5 on every entry; atol at 1e-6 of the largest gradient covers entries that are
  # float32 rounding noise of a sum (near-zero gradients), whose relative error is unbounded.
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * scale),
               grads, want_grads)


@pytest.mark.parametrize("auto", [False, True], ids=["explicit", "auto"])
def test_pipelined_model_equals_one_device_on_both_axis_types(auto):
  """The model alone (no trainer) on pipeline=2 x sequence=2 x tensor=2, Explicit and Auto
  axes: logits and the gradient of a weighted sum of them equal the one-device model's."""
  cfg = llama.LlamaConfig(vocab_size=64, dim=32, num_layers=4, num_heads=4, num_kv_heads=2,
                          mlp_dim=64, layout="zigzag", pipeline_microbatches=2)
  params = model_utils.random_params(cfg)
  tokens, pos, segs = model_utils.packed_batch(
      cfg.vocab_size, ((5, 7), (9, 3, 4), (16,), (8, 8)), 16)
  perm = ring_jax.layout_positions("zigzag", 2, 16)
  tokens, pos, segs = tokens[:, perm], pos[:, perm], segs[:, perm]
  weights = np.random.default_rng(0).normal(size=(4, 16, cfg.vocab_size)).astype(np.float32)
  weights *= (segs > 0)[..., None]
  graphdef = model_utils.graphdef(cfg)

  def loss(p, t, q, s, w):
    logits = nnx.merge(graphdef, p)(t, q, s)
    return jnp.sum(logits * w), logits

  fn = jax.jit(jax.value_and_grad(loss, has_aux=True))
  (_, want), want_grads = fn(params, tokens, pos, segs, weights)
  mesh = model_utils.make_mesh(auto=auto, pipeline=2, sequence=2, tensor=2)
  with jax.set_mesh(mesh):
    (_, got), grads = fn(shd.shard_params(params, mesh), tokens, pos, segs, weights)
  real = segs > 0
  np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], rtol=1e-5,
                             atol=1e-6)
  want_grads = jax.device_get(nnx.to_pure_dict(want_grads))
  # atol: float32 summation-order noise of the O(B L vocab)-term sums with N(0, 1) weights,
  # relative to the largest gradient (the weights do not average the terms down).
  scale = max(float(np.abs(g).max()) for g in jax.tree.leaves(want_grads))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * scale),
               jax.device_get(nnx.to_pure_dict(grads)), want_grads)


def test_bubble_fraction_and_default_microbatches():
  assert pipeline_lib.bubble_fraction(1, 8) == 0.0
  assert pipeline_lib.bubble_fraction(2, 4) == pytest.approx(1 / 5)
  assert pipeline_lib.bubble_fraction(4, 8) == pytest.approx(3 / 11)
  assert pipeline_lib.default_microbatches(8, 2) == 4  # 2 x stages
  assert pipeline_lib.default_microbatches(8, 2, data=4) == 2  # rows must split over data
  assert pipeline_lib.default_microbatches(6, 2) == 3
  assert pipeline_lib.default_microbatches(1, 4) == 1


@pytest.mark.parametrize("overrides,match", [
    ({"mesh.pipeline": 4, "mesh.sequence": 2, "model.num_layers": 6},
     r"mesh.pipeline=4 stages do not divide model.num_layers=6; choose mesh.pipeline from "
     r"\[1, 2, 3, 6\]"),
    ({"mesh.pipeline": 2, "mesh.sequence": 4, "model.pipeline_microbatches": 3},
     "batch_size=8 on mesh.pipeline=2: pipeline_microbatches=3 must be >= 1 and divide the "
     "batch of 8 rows"),
    ({"mesh.pipeline": 2, "mesh.data": 4, "model.pipeline_microbatches": 4},
     "2 rows per pipeline microbatch do not divide over the mesh 'data' axis \\(4\\)"),
    ({"mesh.pipeline": 2, "mesh.sequence": 4, "eval_batch_size": 6,
      "model.pipeline_microbatches": 4}, "eval_batch_size=6 on mesh.pipeline=2"),
    ({"model.pipeline_microbatches": 0}, "model.pipeline_microbatches=0 must be >= 1"),
])
def test_config_validation_names_the_pipeline_problem(overrides, match):
  config = small_config(**overrides)
  with pytest.raises(errors.ConfigError, match=match):
    val_lib.validate_config(config, num_devices=int(np.prod(list(config.mesh.values()))))


def test_pipeline_alone_runs_with_default_microbatches():
  """--config.mesh.pipeline=2 alone: validates, with 2 x 2 microbatches of the 8 rows."""
  config = small_config(**{"mesh.pipeline": 2})
  sizes = val_lib.validate_config(config, num_devices=2)
  assert sizes == dict(data=1, pipeline=2, sequence_outer=1, sequence=1, tensor=1)
  assert pipeline_lib.resolve_microbatches(None, config.batch_size, 2) == 4


def train_py(workdir, stop_at_step, **overrides):
  """``python train.py --config configs/tiny.py --stop_at_step=N`` with SMALL's fields (and
  RUN's) as ``--config.*`` flags, in a process that sizes its own devices (a mesh of one
  device here); returns (stdout, losses by step from metrics.jsonl)."""
  flat = {**SMALL, **RUN, **overrides}
  cmd = [os.path.join(ROOT, "configs", "tiny.py"), f"--stop_at_step={stop_at_step}",
         *(f"--config.{k}={v}" for k, v in flat.items())]
  workdir.parent.mkdir(parents=True, exist_ok=True)
  proc = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--config", *cmd,
                         "--workdir", str(workdir)], cwd=workdir.parent, env=train_procs.env(),
                        capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return proc.stdout, _losses(workdir)


def _losses(workdir) -> dict[int, float]:
  rows = [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines()]
  return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}


def train_run(workdir, stop_at_step, capsys, **overrides):
  """``train.train`` (what ``python train.py`` runs) in this process, on its 8 devices, with
  SMALL's fields and RUN's; returns (what it printed, losses by step from metrics.jsonl)."""
  import train as train_script

  capsys.readouterr()
  train_script.train(small_config(**{**RUN, **overrides}), str(workdir),
                     stop_at_step=stop_at_step)
  return capsys.readouterr().out, _losses(workdir)


# The three pipeline meshes of 8 devices, in the order the runs use them (each resuming the
# previous one's checkpoint): sizes as train.py prints them, and its pipeline line.
TRAIN_PY_MESHES = [
    (dict(data=1, pipeline=2, sequence_outer=1, sequence=2, tensor=2),
     "pipeline: 2 stages x 2 layers, GPipe over 4 microbatches, bubble fraction 0.200"),
    (dict(data=2, pipeline=2, sequence_outer=1, sequence=2, tensor=1),
     "pipeline: 2 stages x 2 layers, GPipe over 4 microbatches, bubble fraction 0.200"),
    (dict(data=1, pipeline=4, sequence_outer=1, sequence=2, tensor=1),
     "pipeline: 4 stages x 1 layers, GPipe over 8 microbatches, bubble fraction 0.273"),
]


def test_train_py_on_each_pipeline_mesh_follows_one_device(tmp_path, capsys):
  """The trainer for 2 steps on each pipeline mesh of the issue -- pipeline=2 x
  sequence=2 x tensor=2, pipeline=2 x data=2 x sequence=2, pipeline=4 x sequence=2 -- each
  run resuming the one before (so checkpoints restore across pipeline and tensor sizes):
  steps 1-6 have the losses of 6 steps of `python train.py` on one device, float32 rtol
  1e-5. The pipelined runs are train.train in this process (8 devices, no process start
  each); the reference is its own process, which sizes one device."""
  out, want = train_py(tmp_path / "one" / "run", stop_at_step=6)
  assert ("mesh {'data': 1, 'pipeline': 1, 'sequence_outer': 1, 'sequence': 1, "
          "'tensor': 1}") in out
  assert sorted(want) == list(range(1, 7)) and want[6] != want[1]
  workdir, got = tmp_path / "run", {}
  for i, (sizes, pipeline_line) in enumerate(TRAIN_PY_MESHES):
    out, losses = train_run(workdir, 2 * i + 2, capsys,
                            **{f"mesh.{k}": v for k, v in sizes.items()})
    assert f"mesh {sizes}" in out and pipeline_line in out
    assert i == 0 or f"resumed from step {2 * i} " in out, out
    got.update(losses)
  assert sorted(got) == list(range(1, 7))
  np.testing.assert_allclose([got[s] for s in range(1, 7)], [want[s] for s in range(1, 7)],
                             rtol=1e-5)
  # The steps above were compiled for these shardings and the restored arrays were passed
  # to them, so the [layers, ...] arrays restored into stage blocks (1 layer per device).
  config = small_config(**{f"mesh.{k}": v for k, v in TRAIN_PY_MESHES[-1][0].items()})
  mesh = mesh_lib.make_mesh(config.mesh)
  built = step_lib.build_train_step(val_lib.llama_config(config), mesh,
                                    step_lib.make_optimizer(config.optim, 8))
  for leaf in jax.tree.leaves(built.abstract_params.layers):
    assert leaf.sharding.spec[0] == "pipeline" and leaf.sharding.mesh.shape["pipeline"] == 4


def test_llama_7b_on_all_four_axes_validates():
  from configs import llama_7b

  config = llama_7b.get_config("4d")
  assert val_lib.validate_config(config, 256) == dict(data=2, pipeline=4, sequence_outer=1,
                                                      sequence=8, tensor=4)
  assert config.model.num_layers // 4 == 8 and config.model.pipeline_microbatches == 8
