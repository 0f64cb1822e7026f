"""Any length in the trainer, evaluation and generation (issue 46, section 1).

A ``data.seq_len`` (an eval length, a prompt, a cache) the ring does not divide runs
padded at each row's end to the model's length rule, the padding masked (segment 0, no
loss target): the loss, its gradients and the predictions equal those of the same rows on
one device, where nothing is padded.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

import train as train_script
from model_utils import tiny_config
import model_utils
from models import inference
from models import lengths
from models import sharding as shd
from models.llama import LlamaConfig
from training import data as data_lib
from training import mesh as mesh_lib
from training import stages as stages_lib
from training import step as step_lib
from training import validation as val_lib


def _config(**overrides):
  """tiny.py trimmed so each compile takes seconds, at 100 tokens per row."""
  settings = {
      "model.dim": 32, "model.mlp_dim": 64, "model.num_heads": 4, "model.num_kv_heads": 2,
      "data.seq_len": 100, "batch_size": 4, "eval_batch_size": 4, "eval_batches": 1,
      "data.kv.num_pairs": 4, "data.kv.num_queries": 4, "mesh.data": 2, "mesh.sequence": 4,
      "optim.warmup_steps": 0, "optim.lr": 1e-3, "optim.eps": 1e-6, "log_every": 1,
      "eval_every": 1000, "checkpoint_every": 1000, "async_checkpointing": False,
  }
  settings.update(overrides)
  return tiny_config(**settings)


def test_padded_length_is_the_next_length_the_rule_accepts():
  cfg = LlamaConfig(vocab_size=64, dim=32, num_layers=1, num_heads=4, num_kv_heads=2,
                    mlp_dim=64, layout="zigzag")
  assert [lengths.padded_length(cfg, 4, n) for n in (1, 7, 8, 9, 100, 104)] == [
      8, 8, 8, 16, 104, 104]
  for n in (1, 3, 37, 100, 101):  # the result passes the rule and is the smallest that does
    padded = lengths.padded_length(cfg, 4, n)
    lengths.check_length(cfg, 4, padded)
    assert not any(_passes(cfg, 4, m) for m in range(n, padded))
  blocks = dataclasses.replace(cfg, block_q=16, loss_chunk_size=8)  # 4 x 16 per ring of 4
  assert lengths.padded_length(blocks, 4, 100) == 128
  with pytest.raises(ValueError, match=">= 1"):
    lengths.padded_length(cfg, 4, 0)


def _passes(cfg, ring, length) -> bool:
  try:
    lengths.check_length(cfg, ring, length)
  except ValueError:
    return False
  return True


def _step_and_grads(config):
  """The trainer's own stage (:func:`training.stages.build_stage`) and data pipeline on ``config``'s
  mesh: ``(batch shape, step metrics, params after the step, gradient of the summed loss)``."""
  devices = jax.devices()[:config.mesh.data * config.mesh.sequence]
  config = val_lib.resolve_run(config, len(devices))
  val_lib.validate_config(config, len(devices))
  mesh = mesh_lib.make_mesh(config.mesh, devices)
  with jax.set_mesh(mesh):
    setup = stages_lib.build_stage(stages_lib.plan(config)[0], mesh)
    step = setup.train_step
    params, opt_state = step.init_state()
    sharding = shd_batch_sharding(mesh)
    local = data_lib.make_dataset(config, sharding, shd.ring_size(mesh.shape), split="train")[0]
    batch = data_lib.to_global(local, sharding, setup.train_shape)
    grads = jax.jit(jax.grad(lambda p: step_lib.loss_sums(step.graphdef, p, step.rest,
                                                          batch)[0]))(params)
    params, _, metrics = step.step(params, opt_state, batch)
  return (setup.train_shape, jax.device_get(metrics), jax.device_get(nnx.to_pure_dict(params)),
          jax.device_get(nnx.to_pure_dict(grads)))


def shd_batch_sharding(mesh):
  from training import batch as batch_lib
  return batch_lib.sharding(mesh)


@pytest.fixture(scope="module")
def one_device():
  """100 tokens per row on one device, dense attention: nothing padded (the oracle)."""
  return _step_and_grads(_config(**{"model.attention": "dense", "mesh.data": 1,
                                    "mesh.sequence": 1}))


@pytest.mark.parametrize("overrides,run_len", [
    ({"model.attention": "ring", "model.layout": "zigzag"}, 104),
    # document layout: each row's documents dealt over the ring, the padding as a segment 0
    ({"model.attention": "ring", "model.layout": "document", "model.block_q": 13,
      "model.block_kv": 13}, 104),
    ({"model.attention": "all_gather", "model.layout": "zigzag"}, 104),
], ids=["ring_zigzag", "ring_document_blocks", "all_gather"])
def test_train_step_at_a_length_the_ring_does_not_divide_equals_one_device(
    one_device, overrides, run_len):
  """seq_len=100 on data=2 x sequence=4 (zigzag's multiple is 8: rows run at 104 tokens, the
  last 4 padding) == the same rows on one device: summed loss, its gradients, the step."""
  shape, metrics, params, grads = _step_and_grads(_config(**overrides))
  shape_1, metrics_1, params_1, grads_1 = one_device
  assert shape == (4, run_len) and shape_1 == (4, 100)
  assert metrics["target_tokens"] == metrics_1["target_tokens"] == 4 * 2 * 4  # rows x docs x q
  np.testing.assert_allclose(metrics["loss"], metrics_1["loss"], rtol=1e-5)
  np.testing.assert_allclose(metrics["grad_norm"], metrics_1["grad_norm"], rtol=1e-4)
  # float32 sums in another order: entries near zero get an atol of 1e-5 of the leaf's largest
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4,
                                                       atol=1e-5 * np.abs(b).max()),
               grads, grads_1)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), params,
               params_1)


def test_validation_accepts_any_seq_len_and_says_what_it_pads():
  config = _config(**{"model.layout": "zigzag", "data.seq_len": 101, "data.kv.docs_per_row": 2})
  model_cfg = val_lib.llama_config(config)
  val_lib.validate_config(config, 8)
  assert val_lib.run_length(model_cfg, 4, 101) == 104
  assert val_lib.padding_line(model_cfg, 4, 104) is None
  line = val_lib.padding_line(model_cfg, 4, 101)
  assert line.startswith("data.seq_len=101 runs as rows of 104 tokens on the ring of 4 ")
  assert "3 padding tokens per row (2.9% of each row)" in line


def test_text_rows_are_packed_at_seq_len_and_padded_to_the_run_length(tmp_path):
  """The text pipeline packs documents into rows of data.seq_len tokens (as on one device),
  then pads each row's end: the real tokens are those of the unpadded rows."""
  corpus = tmp_path / "corpus.txt"
  corpus.write_text("\n".join(f"document {i} " + "abc" * (i % 7 + 1) for i in range(200)))
  base = {"data.kind": "text", "data.path": str(corpus), "model.vocab_size": 264,
          "data.seq_len": 37, "model.layout": "zigzag"}
  rows = {}
  for sequence in (1, 4):
    config = _config(**base, **{"mesh.data": 8 // sequence, "mesh.sequence": sequence,
                                "batch_size": 8})
    mesh = mesh_lib.make_mesh(config.mesh)
    batch = data_lib.make_dataset(config, shd_batch_sharding(mesh), sequence, split="train")
    rows[sequence] = next(iter(batch))
  one, ring = rows[1], rows[4]
  assert one["tokens"].shape == (8, 38) and ring["tokens"].shape == (8, 40)  # 2 and 8 per ring
  perm = np.argsort(data_lib.layouts.layout_positions("zigzag", 4, 40))
  perm1 = np.argsort(data_lib.layouts.layout_positions("zigzag", 1, 38))
  for name in data_lib.FIELDS:
    natural, natural1 = ring[name][:, perm], one[name][:, perm1]
    np.testing.assert_array_equal(natural[:, :37], natural1[:, :37])
    assert not natural[:, 37:].any() and not natural1[:, 37:].any()  # padding: all zero


# ---------------------------------------------------------------------------------------------
# evaluate.py and generation
# ---------------------------------------------------------------------------------------------


def test_evaluate_at_lengths_the_ring_does_not_divide(tmp_path):
  """evaluate.py at 37 and 101 tokens on the ring of 4 (zigzag: padded to 40 and 104) finds
  the answers dense attention finds on a mesh without a ring, where nothing is padded."""
  import evaluate

  config = _config(**{"model.layout": "zigzag", "data.seq_len": 64, "total_steps": 2,
                      "batch_size": 8, "eval_batch_size": 8})
  workdir = str(tmp_path / "run")
  train_script.train(config, workdir)
  results = evaluate.evaluate(config, workdir, [37, 101], ["kv", "passkey"], batch_size=8,
                              batches=1, log=lambda m: None)
  dense = _config(**{"model.layout": "contiguous", "data.seq_len": 64,
                     "model.attention": "dense", "mesh.data": 8, "mesh.sequence": 1})
  again = evaluate.evaluate(dense, workdir, [37, 101], ["kv", "passkey"], batch_size=8,
                            batches=1, log=lambda m: None)
  answers = {(r["task"], r["length"]): r["answers"] for r in results}
  # kv: 2 documents of 18 (37 tokens: 1 left as padding) or 50 (101: 1), 4 queries each
  assert answers == {("kv", 37): 8 * 2 * 4, ("passkey", 37): 8, ("kv", 101): 8 * 2 * 4,
                     ("passkey", 101): 8}
  assert again == results


@pytest.mark.parametrize("prompt_lengths,cache_len", [((3,), 13), ((5, 11), 29)],
                         ids=["prompt_shorter_than_the_ring", "cache_of_29"])
def test_generate_at_lengths_the_ring_does_not_divide_equals_dense(prompt_lengths, cache_len):
  """Prompts of 3 (fewer tokens than the ring of 4), 5 and 11 tokens, caches of 13 and 29
  slots (rounded up to the ring): greedy decoding to the cache's end == dense recompute."""
  cfg = LlamaConfig(vocab_size=64, dim=64, num_layers=2, num_heads=4, num_kv_heads=2,
                    mlp_dim=128, init_std=0.3, layout="zigzag")
  params = model_utils.random_params(cfg, seed=3)
  rng = np.random.default_rng(11)
  prompts = [rng.integers(3, 64, n).tolist() for n in prompt_lengths]
  mesh = model_utils.make_mesh(sequence=4)
  gen = inference.Generator(cfg, shd.shard_params(params, mesh), mesh, cache_len)
  padded = gen.check(prompts, 1)
  assert padded == 8 if max(prompt_lengths) <= 8 else padded == 16  # zigzag on 4: 8 per step
  steps = gen.cache_len - padded
  tokens = np.stack(list(gen.generate(prompts, steps)), axis=1)
  np.testing.assert_array_equal(tokens, model_utils.dense_greedy(cfg, params, prompts, steps))
