"""The pipeline axis: GPipe over `pipeline` == the one-device step (loss and every gradient)."""

import jax
import numpy as np
import pytest
from flax import nnx

from model_utils import tiny_config
from models import pipeline as pipeline_lib
from training import batch as batch_lib
from training import config as cfg_lib
from training import data as data_lib
from training import step as step_lib


def small_config(**overrides):
  """tiny.py with 4 layers (so 4 stages divide them), small enough to compile in seconds."""
  settings = {
      "model.dim": 32, "model.mlp_dim": 64, "model.num_heads": 4, "model.num_kv_heads": 2,
      "model.num_layers": 4, "data.seq_len": 64, "batch_size": 8, "eval_batch_size": 8,
      "eval_batches": 1, "data.kv.num_pairs": 4, "data.kv.num_queries": 4,
      "optim.warmup_steps": 0, "optim.lr": 1e-3, "optim.eps": 1e-6,
      "mesh.data": 1, "mesh.sequence": 1,
  }
  settings.update(overrides)
  return tiny_config(**settings)


def loss_and_grads(config):
  """``(metrics of one train step, loss sum, gradients)`` on ``config.mesh``, same data."""
  sizes = cfg_lib.validate_config(config, int(np.prod([v for v in config.mesh.values()])))
  devices = jax.devices()[:int(np.prod(list(sizes.values())))]
  mesh = cfg_lib.make_mesh(config.mesh, devices=devices)
  model_cfg = cfg_lib.llama_config(config)
  tx = step_lib.make_optimizer(config.optim, config.total_steps)
  built = step_lib.build_train_step(model_cfg, mesh, tx, microbatches=config.microbatches,
                                    seed=config.seed)
  params, opt_state = built.init_state()
  with jax.set_mesh(mesh):
    sharding = batch_lib.sharding(mesh)
    local = data_lib.make_dataset(config, sharding, sizes["sequence"], split="train")[0]
    batch = data_lib.to_global(local, sharding, (config.batch_size, config.data.seq_len))
    grad_fn = jax.jit(jax.value_and_grad(
        lambda p, b: step_lib.loss_sums(built.graphdef, p, built.rest, b)[0]))
    loss_sum, grads = grad_fn(params, batch)
    grads = jax.device_get(nnx.to_pure_dict(grads))
    _, _, metrics = built.step(params, opt_state, batch)
  return jax.device_get(metrics), float(loss_sum), grads


@pytest.fixture(scope="module")
def one_device():
  return loss_and_grads(small_config())


@pytest.mark.parametrize("mesh", [
    dict(pipeline=2),
    dict(pipeline=2, sequence=2, tensor=2),
    dict(pipeline=2, data=2, sequence=2),
    dict(pipeline=4, sequence=2),
], ids=lambda m: "x".join(f"{k}{v}" for k, v in m.items()))
def test_pipeline_step_equals_one_device_step(mesh, one_device):
  """Loss, every gradient (float32, rtol 1e-5) and the step's metrics on a pipeline mesh."""
  config = small_config(**{f"mesh.{k}": v for k, v in mesh.items()})
  metrics, loss_sum, grads = loss_and_grads(config)
  want_metrics, want_loss_sum, want_grads = one_device
  np.testing.assert_allclose(loss_sum, want_loss_sum, rtol=1e-5)
  np.testing.assert_allclose(metrics["loss"], want_metrics["loss"], rtol=1e-5)
  np.testing.assert_allclose(metrics["grad_norm"], want_metrics["grad_norm"], rtol=1e-5)
  assert metrics["target_tokens"] == want_metrics["target_tokens"]
  scale = max(float(np.abs(g).max()) for g in jax.tree.leaves(want_grads))
  # rtol 1e-5 on every entry; atol at 1e-6 of the largest gradient covers entries that are
  # float32 rounding noise of a sum (near-zero gradients), whose relative error is unbounded.
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * scale),
               grads, want_grads)


def test_bubble_fraction_and_default_microbatches():
  assert pipeline_lib.bubble_fraction(1, 8) == 0.0
  assert pipeline_lib.bubble_fraction(2, 4) == pytest.approx(1 / 5)
  assert pipeline_lib.bubble_fraction(4, 8) == pytest.approx(3 / 11)
  assert pipeline_lib.default_microbatches(8, 2) == 4  # 2 x stages
  assert pipeline_lib.default_microbatches(8, 2, data=4) == 2  # rows must split over data
  assert pipeline_lib.default_microbatches(6, 2) == 3
  assert pipeline_lib.default_microbatches(1, 4) == 1
