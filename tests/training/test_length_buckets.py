"""Length buckets (issue 46, section 2; training/buckets.py): each batch on the ring it needs.

For one fixed set of documents, a step's summed loss and its gradients are the same whether
they are packed for the full ring or for a bucket's shorter ring on the same devices
re-split (data x sequence); the trainer compiles one program per bucket and says which ring
each uses; bad buckets are one line before compiling.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

import train as train_script
from model_utils import tiny_config
from training import buckets as buckets_lib
from training import data as data_lib
from training import mesh as mesh_lib
from training import stages as stages_lib
from training import step as step_lib
from training import validation as val_lib
from training.errors import ConfigError

DOC_LENGTHS = (3, 16, 9, 12, 5, 16, 7, 11, 14, 2, 8, 13, 6, 10, 15, 4)  # each fits 16 tokens


def _corpus(tmp_path, docs: int = 300):
  path = tmp_path / "corpus.jsonl"
  rng = np.random.default_rng(0)
  lines = ['{"text": "%s"}' % ("ab" * int(rng.integers(1, 40))) for _ in range(docs)]
  path.write_text("\n".join(lines) + "\n")
  return str(path)


def _config(tmp_path, **overrides):
  settings = {
      "data.kind": "text", "data.path": _corpus(tmp_path), "model.vocab_size": 264,
      "model.dim": 32, "model.mlp_dim": 64, "model.num_heads": 4, "model.num_kv_heads": 2,
      "model.num_layers": 1, "data.seq_len": 64, "batch_size": 4, "eval_batch_size": 4,
      "eval_batches": 1, "mesh.data": 2, "mesh.sequence": 4, "model.layout": "zigzag",
      "data.length_buckets": (16,), "optim.warmup_steps": 0, "optim.lr": 1e-3,
      "optim.eps": 1e-6, "log_every": 1, "eval_every": 1000, "checkpoint_every": 1000,
      "async_checkpointing": False, "total_steps": 3,
  }
  settings.update(overrides)
  return tiny_config(**settings)


def test_bucket_mesh_resplits_the_same_devices():
  mesh = mesh_lib.make_mesh(tiny_config(**{"mesh.data": 2, "mesh.sequence": 4}).mesh)
  for ring in (1, 2, 4):
    bucket = buckets_lib.bucket_mesh(mesh, ring)
    assert dict(bucket.shape) == dict(mesh.shape, data=8 // ring, sequence=ring)
    assert list(bucket.devices.flat) == list(mesh.devices.flat)  # one device assignment
    ring_devices = bucket.devices.reshape(-1, ring)  # a bucket ring: consecutive devices
    for row in ring_devices:
      ids = [d.id for d in row]
      assert ids == list(range(ids[0], ids[0] + ring))


@pytest.mark.parametrize("buckets,match", [
    ((32, 16), r"sorted ascending without repeats; pass \(16, 32\)"),
    ((16, 128), "bucket 128 is longer than data.seq_len=64"),
    ((24,), r"bucket 24 needs a ring of 4 x 24 / 64 = 1.5 devices.*use buckets from "
            r"\[16, 32, 64\]"),
    ((0,), "token counts >= 1"),
])
def test_bad_buckets_are_one_line_before_compiling(tmp_path, buckets, match):
  with pytest.raises(ConfigError, match=match):
    val_lib.validate_config(_config(tmp_path, **{"data.length_buckets": buckets}), 8)


def test_buckets_need_text_data_and_one_ring_axis(tmp_path):
  with pytest.raises(ConfigError, match="data.kind='text'"):
    val_lib.validate_config(tiny_config(**{"data.length_buckets": (64,)}), 8)
  with pytest.raises(ConfigError, match="mesh.pipeline=1 and mesh.sequence_outer=1"):
    val_lib.validate_config(_config(tmp_path, **{"mesh.data": 1, "mesh.sequence_outer": 2}), 8)


def _docs(vocab: int = 264):
  rng = np.random.default_rng(5)
  return [rng.integers(3, vocab, n).tolist() for n in DOC_LENGTHS]


def _batches(docs, buckets, layout="zigzag"):
  """Every batch the bucketed packer yields for ``docs`` (then padding rows, if any)."""
  source = iter([{"tokens": np.asarray(d, np.int32)} for d in docs])

  class Source:
    def __iter__(self):
      return self

    def __next__(self):
      return next(source)

  out = []
  it = buckets_lib.BucketedBatches(Source(), buckets, layout)
  try:
    while True:
      out.append(next(it))
  except StopIteration:
    pass
  pending = [(b, rows) for b, rows in enumerate(it._pending) if rows]  # the last, unfilled
  for b, rows in pending:
    bucket = buckets[b]
    rows = rows + [[] for _ in range(bucket.rows - len(rows))]
    batch = data_lib.pad_rows(buckets_lib.pack_rows(rows, bucket.length), bucket.run_length)
    out.append((b, data_lib.to_layout_np(batch, layout, bucket.ring)))
  return out


def test_each_document_goes_to_the_shortest_bucket_and_is_never_cut(tmp_path):
  config = _config(tmp_path, **{"data.length_buckets": (8, 16, 32), "mesh.data": 1,
                                "mesh.sequence": 8})
  val_lib.validate_config(config, 8)
  mesh = mesh_lib.make_mesh(config.mesh)
  buckets = buckets_lib.plan(config, val_lib.llama_config(config), mesh)
  # zigzag: rows of 8 on a ring of 1 run at 8, of 16 on 2 at 16, of 32 on 4 at 32, 64 on 8
  assert [(b.length, b.ring, b.rows, b.run_length) for b in buckets] == [
      (8, 1, 32, 8), (16, 2, 16, 16), (32, 4, 8, 32), (64, 8, 4, 64)]
  assert buckets_lib.describe(buckets) == (
      "length buckets: 8 tokens x 32 rows on a ring of 1 (data 8 x sequence 1); 16 tokens x "
      "16 rows on a ring of 2 (data 4 x sequence 2); 32 tokens x 8 rows on a ring of 4 "
      "(data 2 x sequence 4); 64 tokens x 4 rows on a ring of 8 (data 1 x sequence 8)")
  docs = _docs() + [list(range(3, 103))]  # and one of 100 tokens: cut into 64 + 36
  seen = []
  for index, batch in _batches(docs, buckets):
    bucket = buckets[index]
    assert batch["tokens"].shape == bucket.shape
    perm = np.argsort(data_lib.layouts.layout_positions("zigzag", bucket.ring,
                                                        bucket.run_length))
    natural = {k: v[:, perm] for k, v in batch.items()}
    for row_tokens, row_segments in zip(natural["tokens"], natural["segment_ids"]):
      for s in range(1, row_segments.max() + 1):
        doc = row_tokens[row_segments == s].tolist()
        shorter = [b.length for b in buckets if b.length < bucket.length]
        assert len(doc) <= bucket.length and all(len(doc) > b for b in shorter)
        seen.append(doc)
  assert sorted(map(tuple, seen)) == sorted(map(tuple, _docs() + [list(range(3, 67)),
                                                                   list(range(67, 103))]))


def _sums_and_step(train_step, bucket, batch, params, opt_state, microbatches=1):
  """Summed loss and its gradients on ``bucket``'s mesh, then the bucket's real step."""
  with jax.set_mesh(bucket.mesh):
    batch = data_lib.to_global(batch, bucket.sharding, bucket.shape)
    loss_and_grads = jax.jit(jax.value_and_grad(
        lambda p: step_lib.loss_sums(train_step.graphdef, p, train_step.rest, batch)[0]))
    loss_sum, grads = loss_and_grads(params)
    step = train_step.jit(bucket.mesh, microbatches)
    new_params, _, metrics = step(params, jax.tree.map(lambda x: x.copy(), opt_state), batch)
  for leaf, want in zip(jax.tree.leaves(new_params), jax.tree.leaves(train_step.param_shardings)):
    assert leaf.sharding.is_equivalent_to(want, leaf.ndim)  # one sharding across buckets
  return (float(loss_sum), jax.device_get(nnx.to_pure_dict(grads)), jax.device_get(metrics),
          jax.device_get(nnx.to_pure_dict(new_params)))


def test_summed_loss_and_grads_equal_on_the_full_ring_and_a_buckets_ring(tmp_path):
  """16 documents of <= 16 tokens: packed into 4 rows of 64 on the ring of 4, or into 16 rows
  of 16 on rings of 1 (the same 8 devices as data 8 x sequence 1): equal summed loss and
  gradients (rtol 1e-5), and the same update."""
  config = val_lib.resolve_run(_config(tmp_path), 8)
  val_lib.validate_config(config, 8)
  mesh = mesh_lib.make_mesh(config.mesh)
  with jax.set_mesh(mesh):
    setup = stages_lib.build_stage(stages_lib.plan(config)[0], mesh)
  buckets = buckets_lib.plan(config, setup.model_cfg, mesh)
  short, full = buckets
  (b_full, batch_full), = _batches(_docs(), (dataclasses_replace(full, index=0),))
  (b_short, batch_short), = _batches(_docs(), (dataclasses_replace(short, index=0),))
  assert batch_full["tokens"].shape == (4, 64) and batch_short["tokens"].shape == (16, 16)
  params, opt_state = setup.train_step.init_state()
  params_copy = jax.tree.map(lambda x: x.copy(), params)
  loss_f, grads_f, metrics_f, new_f = _sums_and_step(setup.train_step, full, batch_full,
                                                     params_copy, opt_state)
  loss_s, grads_s, metrics_s, new_s = _sums_and_step(setup.train_step, short, batch_short,
                                                     params, opt_state)
  assert metrics_f["target_tokens"] == metrics_s["target_tokens"] == sum(DOC_LENGTHS) - 16
  np.testing.assert_allclose(loss_s, loss_f, rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5,
                                                       atol=1e-5 * np.abs(b).max()),
               grads_s, grads_f)
  np.testing.assert_allclose(metrics_s["loss"], metrics_f["loss"], rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), new_s,
               new_f)


def dataclasses_replace(bucket, **kw):
  import dataclasses
  return dataclasses.replace(bucket, **kw)


def test_train_py_with_length_buckets_resumes_exactly(tmp_path, capsys):
  """train() with data.length_buckets=(16,): the rings said at startup, one program per
  bucket; stopped after step 2 and resumed (the document position and every bucket's rows
  not yet trained on come back from the checkpoint), its losses are the uninterrupted run's."""
  config = _config(tmp_path, total_steps=4)
  whole = train_script.train(config, str(tmp_path / "whole"))
  out = capsys.readouterr().out
  assert ("length buckets: 16 tokens x 16 rows on a ring of 1 (data 8 x sequence 1); 64 tokens "
          "x 4 rows on a ring of 4 (data 2 x sequence 4)") in out
  assert "compiled 2 train-step programs (one per length bucket, cached for the run)" in out
  losses = [h["loss"] for h in whole.history]
  assert whole.step == 4 and len(losses) == 4 and np.all(np.isfinite(losses))
  first = train_script.train(config, str(tmp_path / "split"), stop_at_step=2)
  rest = train_script.train(config, str(tmp_path / "split"))
  assert first.step == 2 and rest.step == 4
  np.testing.assert_allclose([h["loss"] for h in first.history + rest.history], losses,
                             rtol=1e-6)


def _as_full_ring_rows(batch, bucket, full, layout="zigzag"):
  """A bucket's batch (its layout order) -> the same documents as ``full``'s batch: each
  ``full.length / bucket.length`` consecutive rows laid end to end as one row (segment ids
  renumbered, so every document stays its own), padded and reordered for the full ring."""
  perm = np.argsort(data_lib.layouts.layout_positions(layout, bucket.ring, bucket.run_length))
  natural = {k: v[:, perm][:, :bucket.length] for k, v in batch.items()}
  k = full.length // bucket.length
  rows, length = natural["tokens"].shape
  segments = natural["segment_ids"].reshape(rows // k, k, length).copy()
  offsets = np.cumsum(segments.max(axis=2), axis=1) - segments.max(axis=2)
  segments = np.where(segments > 0, segments + offsets[:, :, None], 0)
  out = {f: v.reshape(rows // k, k * length) for f, v in natural.items()}
  out["segment_ids"] = segments.reshape(rows // k, k * length).astype(np.int32)
  return data_lib.to_layout_np(data_lib.pad_rows(out, full.run_length), layout, full.ring)


def test_a_bucketed_run_is_the_one_ring_run_on_the_same_documents(tmp_path, monkeypatch):
  """train() with data.length_buckets=(16,) for 4 steps, every batch it trained on recorded;
  the same documents, each batch's rows laid end to end as full-ring rows, stepped by the
  one-ring program from the same initial state: the same loss at every step (rtol 1e-5) and
  the same final parameters. So buckets change which ring a document runs on, not what the
  model learns from it."""
  seen = []

  class Recorded(buckets_lib.BucketedBatches):
    def __next__(self):
      index, batch = super().__next__()
      seen.append((index, {k: v.copy() for k, v in batch.items()}))
      return index, batch

  monkeypatch.setattr(buckets_lib, "BucketedBatches", Recorded)
  corpus, rng = tmp_path / "mixed.jsonl", np.random.default_rng(1)  # 80% fit the bucket of 16
  corpus.write_text("".join('{"text": "%s"}\n' % ("ab" * int(rng.integers(1, 8) if
                                                            rng.random() < 0.8 else
                                                            rng.integers(8, 40)))
                            for _ in range(300)))
  config = _config(tmp_path, total_steps=4, **{"data.path": str(corpus)})
  run = train_script.train(config, str(tmp_path / "run"))
  assert len(seen) == 4 and {index for index, _ in seen} == {0, 1}  # both rings ran

  config = val_lib.resolve_run(config, 8)
  mesh = mesh_lib.make_mesh(config.mesh)
  with jax.set_mesh(mesh):
    setup = stages_lib.build_stage(stages_lib.plan(config)[0], mesh)
    buckets = buckets_lib.plan(config, setup.model_cfg, mesh)
    full = buckets[-1]
    params, opt_state = setup.train_step.init_state()
    losses = []
    for index, batch in seen:
      rows = batch if index == len(buckets) - 1 else _as_full_ring_rows(batch, buckets[index],
                                                                        full)
      np.testing.assert_array_equal(  # the same real tokens, now on the full ring
          np.sort(rows["tokens"][rows["segment_ids"] > 0]),
          np.sort(batch["tokens"][batch["segment_ids"] > 0]))
      params, opt_state, metrics = setup.train_step.step(
          params, opt_state, data_lib.to_global(rows, full.sharding, full.shape))
      losses.append(float(metrics["loss"]))
  np.testing.assert_allclose([h["loss"] for h in run.history], losses, rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5),
               jax.device_get(nnx.to_pure_dict(run.params)),
               jax.device_get(nnx.to_pure_dict(params)))
