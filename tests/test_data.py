"""Input pipeline: packing, layouts, the synthetic task, iterator state, process slices."""

import json

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import ring_jax
from model_utils import tiny_config
from models import sharding as shd
from training import batch as batch_lib
from training import data as data_lib


def _tiny_config(**data_overrides):
  return tiny_config(**{"data.seq_len": 64, "data.kv.num_pairs": 4, "data.kv.num_queries": 4,
                        "batch_size": 4, **{f"data.{k}": v for k, v in data_overrides.items()}})


@pytest.fixture(scope="module")
def mesh():
  devices = np.asarray(jax.devices()[:8]).reshape(2, 1, 4, 1)
  return jax.sharding.Mesh(devices, shd.MESH_AXES)


@pytest.fixture(scope="module")
def sharding(mesh):
  return batch_lib.sharding(mesh)


# --- the batch definition --------------------------------------------------------------------


def test_batch_spec_comes_from_the_rules(mesh):
  """Rows over 'data', the sequence over 'sequence': the rules table's ("batch", "length")."""
  assert batch_lib.spec(mesh) == shd.logical_to_spec(("batch", "length"), mesh=mesh)
  assert batch_lib.spec(mesh) == P("data", "sequence")
  # A mesh without a 'sequence' axis (no ring) keeps the sequence whole.
  data_only = jax.make_mesh((8,), ("data",))
  assert batch_lib.spec(data_only) == P("data", None)
  abstract = batch_lib.abstract((4, 64), mesh)
  assert tuple(abstract) == batch_lib.FIELDS
  assert {k: v.dtype for k, v in abstract.items()} == batch_lib.DTYPES
  assert all(v.sharding == batch_lib.sharding(mesh) for v in abstract.values())


@pytest.mark.parametrize("kind", ["kv_retrieval", "text"])
def test_pipelines_produce_the_defined_batch(tmp_path, mesh, kind):
  (tmp_path / "a.txt").write_text("some text for the byte tokenizer " * 8)
  config = _tiny_config(**({"kind": "text", "path": str(tmp_path)} if kind == "text" else {}))
  batch = data_lib.make_dataset(config, batch_lib.sharding(mesh), 4, split="train")[0]
  assert tuple(batch) == batch_lib.FIELDS
  assert {k: v.dtype for k, v in batch.items()} == batch_lib.DTYPES


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "striped"])
def test_random_documents_batch(layout):
  batch = batch_lib.random_documents(0, rows=2, length=32, vocab_size=50, layout=layout,
                                     ring_size=4)
  assert {k: v.dtype for k, v in batch.items()} == batch_lib.DTYPES
  perm = ring_jax.layout_positions(layout, 4, 32)
  np.testing.assert_array_equal(batch["positions"][0], perm)
  natural = {k: np.asarray(ring_jax.from_layout(v, layout, 4)) for k, v in batch.items()}
  # Labels are the next token; the last position has no target.
  np.testing.assert_array_equal(natural["labels"][:, :-1], natural["tokens"][:, 1:])
  assert natural["loss_mask"][:, :-1].all() and not natural["loss_mask"][:, -1].any()
  with pytest.raises(ValueError, match="multiple of 8"):
    batch_lib.random_documents(0, 2, 36, 50, "zigzag", 4)


# --- packing ---------------------------------------------------------------------------------


def test_packing_segments_never_cross_documents():
  docs = ["hello", "a", "the quick brown fox jumps", "", "xyz" * 7, "end"]
  tokens = [data_lib.byte_tokenize(d) for d in docs if d]
  packed = data_lib.pack_documents(tokens, seq_len=16)
  stream = np.concatenate(tokens)
  doc_of = np.concatenate([np.full(len(t), i) for i, t in enumerate(tokens)])
  n = len(stream)
  flat = {k: v.reshape(-1) for k, v in packed.items()}
  np.testing.assert_array_equal(flat["tokens"][:n], stream)
  assert (flat["segment_ids"][n:] == 0).all() and (flat["loss_mask"][n:] == 0).all()

  seg = packed["segment_ids"]
  for r in range(seg.shape[0]):
    row_docs = doc_of[r * 16:(r + 1) * 16]
    real = seg[r][:len(row_docs)]
    # Same segment id <=> same document, within the row.
    same_seg = real[:, None] == real[None, :]
    same_doc = row_docs[:, None] == row_docs[None, :]
    np.testing.assert_array_equal(same_seg, same_doc)
  # A label is only ever the next token of the same document.
  for r in range(seg.shape[0]):
    for t in range(15):
      if packed["loss_mask"][r, t]:
        assert seg[r, t] == seg[r, t + 1] != 0
        assert packed["labels"][r, t] == packed["tokens"][r, t + 1]
    assert packed["loss_mask"][r, 15] == 0  # Nothing predicts across a row end.
  # Positions restart at every segment start and count up inside it.
  pos = packed["positions"]
  for r in range(seg.shape[0]):
    for t in range(16):
      if seg[r, t] == 0:
        continue
      expected = 0 if t == 0 or seg[r, t - 1] != seg[r, t] else pos[r, t - 1] + 1
      assert pos[r, t] == expected


def test_byte_tokenizer_roundtrip():
  text = "ring attention — zigzag ✓"
  ids = data_lib.byte_tokenize(text)
  assert ids[0] == data_lib.BOS_ID and ids[-1] == data_lib.EOS_ID
  assert ids.max() < data_lib.BYTE_VOCAB_SIZE
  assert data_lib.byte_detokenize(ids) == text


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "striped"])
def test_layout_reorder_matches_ring_jax(layout):
  rng = np.random.default_rng(0)
  batch = {k: rng.integers(0, 100, size=(3, 32)).astype(np.int32) for k in batch_lib.FIELDS}
  out = data_lib.to_layout_np(batch, layout, ring_size=4)
  for k in batch_lib.FIELDS:
    np.testing.assert_array_equal(out[k], np.asarray(ring_jax.to_layout(batch[k], layout, 4)))
  # Reordering natural positions gives the layout's global positions.
  natural = {k: np.broadcast_to(np.arange(32, dtype=np.int32), (3, 32)) for k in batch_lib.FIELDS}
  np.testing.assert_array_equal(data_lib.to_layout_np(natural, layout, 4)["positions"][0],
                                ring_jax.layout_positions(layout, 4, 32))


# --- synthetic task --------------------------------------------------------------------------


def test_kv_task_answers_are_the_paired_values():
  task = data_lib.KVRetrievalTask(seq_len=128, num_pairs=6, num_queries=4, num_keys=20,
                                  num_values=10, num_filler=8, docs_per_row=2)
  task.check()
  for index in range(20):
    ex = task.example(seed=3, index=index)
    tok, lab, mask, seg = ex["tokens"], ex["labels"], ex["loss_mask"], ex["segment_ids"]
    assert tok.max() < task.vocab_size
    np.testing.assert_array_equal(seg, np.repeat([1, 2], 64))
    np.testing.assert_array_equal(ex["positions"], np.tile(np.arange(64), 2))
    for doc in range(2):
      base = 64 * doc
      assert tok[base] == data_lib.BOS_ID
      pairs = {int(tok[base + 1 + 2 * i]): int(tok[base + 2 + 2 * i]) for i in range(6)}
      assert len(pairs) == 6  # distinct keys
      asked = np.flatnonzero(mask[base:base + 64]) + base
      assert len(asked) == 4
      for t in asked:
        assert task.key_start <= tok[t] < task.value_start
        assert lab[t] == tok[t + 1] == pairs[int(tok[t])]  # the value paired with this key
      # Filler never contains keys or values (no shortcut through the middle).
      filler = tok[base + 13:asked.min() - 1]
      assert ((filler >= task.filler_start) & (filler < task.key_start)).all()
    assert lab[63] == 0  # no label across the document boundary
  a, b = task.example(3, 7), task.example(3, 7)
  np.testing.assert_array_equal(a["tokens"], b["tokens"])  # pure function of (seed, index)
  assert not np.array_equal(task.example(3, 7)["tokens"], task.example(4, 7)["tokens"])


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_kv_answers_live_on_another_device_than_their_queries(layout):
  """The task cannot be solved inside one sequence shard: it needs the ring."""
  ring, length = 4, 128
  task = data_lib.KVRetrievalTask(seq_len=length)
  perm = ring_jax.layout_positions(layout, ring, length)
  device_of = np.empty(length, int)
  device_of[perm] = np.arange(length) // (length // ring)  # natural position -> device
  for index in range(10):
    ex = task.example(seed=0, index=index)
    tok = ex["tokens"]
    for t in np.flatnonzero(ex["loss_mask"]):
      doc = slice(0, 64) if t < 64 else slice(64, 128)
      context = np.flatnonzero(tok[doc][:1 + 2 * task.num_pairs] == tok[t])[0] + doc.start
      source = context + 1  # the value token the answer must be copied from
      assert tok[source] == ex["labels"][t]
      assert device_of[source] != device_of[t], (layout, t, source)


def test_kv_task_errors_are_value_errors():
  """The data module raises plain ValueError (training.config wraps it into ConfigError)."""
  from training.config import ConfigError

  for task, match in ((dict(seq_len=64, num_pairs=2, num_queries=3), "num_queries"),
                      (dict(seq_len=64, num_pairs=8, num_queries=8), "too short"),
                      (dict(seq_len=128, docs_per_row=3), "docs_per_row=3")):
    with pytest.raises(ValueError, match=match) as raised:
      data_lib.KVRetrievalTask(**task).check()
    assert not isinstance(raised.value, ConfigError)


# --- pipeline --------------------------------------------------------------------------------


def test_iterator_state_roundtrip(sharding):
  config = _tiny_config()
  dataset = data_lib.make_dataset(config, sharding, ring_size=4, split="train")
  it = data_lib.make_iterator(dataset)
  for _ in range(3):
    next(it)
  state = it.get_state()
  expected = [next(it) for _ in range(2)]
  resumed = data_lib.make_iterator(dataset)
  resumed.set_state(json.loads(json.dumps(state)))  # survives JSON (the checkpoint format)
  for want in expected:
    got = next(resumed)
    for k in batch_lib.FIELDS:
      np.testing.assert_array_equal(got[k], want[k])


def test_batches_are_layout_ordered_and_sharded(mesh, sharding):
  config = _tiny_config()
  config.model.layout = "zigzag"
  batch = next(data_lib.make_iterator(
      data_lib.make_dataset(config, sharding, ring_size=4, split="train"), prefetch=0))
  task = data_lib.KVRetrievalTask.from_config(config.data)
  natural = task.rows(config.seed, 0, config.batch_size)
  perm = ring_jax.layout_positions("zigzag", 4, 64)
  for k in batch_lib.FIELDS:
    np.testing.assert_array_equal(batch[k], natural[k][:, perm])
  # Per-document positions (2 documents of 32), reordered like everything else.
  np.testing.assert_array_equal(batch["positions"][0], perm % 32)
  np.testing.assert_array_equal(batch["segment_ids"][0], perm // 32 + 1)
  global_batch = data_lib.to_global(batch, sharding, (4, 64))
  assert global_batch["tokens"].sharding == sharding
  # Device (data=0, sequence=3) holds zigzag chunks 3 and 4 of rows 0-1.
  shard = next(s for s in global_batch["tokens"].addressable_shards
               if s.device == mesh.devices[0, 0, 3, 0])
  np.testing.assert_array_equal(np.asarray(shard.data), natural["tokens"][:2][:, perm[48:64]])


def test_eval_split_differs_from_train(sharding):
  config = _tiny_config()
  train = data_lib.make_dataset(config, sharding, 4, split="train")[0]
  held_out = data_lib.make_dataset(config, sharding, 4, split="eval")[0]
  assert not np.array_equal(train["tokens"], held_out["tokens"])


def test_text_pipeline_from_local_jsonl(tmp_path, sharding):
  docs = [f"document number {i}: " + "lorem ipsum " * (i % 5 + 1) for i in range(40)]
  path = tmp_path / "corpus.jsonl"
  path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
  (tmp_path / "notes.txt").write_text("a plain text file is one document")
  config = _tiny_config(kind="text", path=str(tmp_path))
  assert len(data_lib.read_documents(str(tmp_path))) == 41
  packed = data_lib.PackedText.from_config(config.data)
  assert packed.train["tokens"].shape[1] == 64 and len(packed.eval["tokens"]) >= 1
  batch = data_lib.make_dataset(config, sharding, 4, split="train")[5]
  assert batch["tokens"].shape == (4, 64)
  # Layout (contiguous here) keeps each row's tokens, segments and labels consistent.
  mask = batch["loss_mask"].astype(bool)
  assert mask.any() and (batch["segment_ids"][mask] > 0).all()


def test_process_slices_single_process_covers_everything(sharding):
  rows, cols = data_lib.process_slices(sharding, (8, 64))
  assert (rows.start, rows.stop, cols.start, cols.stop) == (0, 8, 0, 64)
