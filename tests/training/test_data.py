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
from training import sources


def _tiny_config(**data_overrides):
  return tiny_config(**{"data.seq_len": 64, "data.kv.num_pairs": 4, "data.kv.num_queries": 4,
                        "batch_size": 4, **{f"data.{k}": v for k, v in data_overrides.items()}})


@pytest.fixture(scope="module")
def mesh():
  devices = np.asarray(jax.devices()[:8]).reshape(2, 1, 1, 4, 1)
  return jax.sharding.Mesh(devices, shd.MESH_AXES)


@pytest.fixture(scope="module")
def sharding(mesh):
  return batch_lib.sharding(mesh)


# --- the batch definition --------------------------------------------------------------------


def test_batch_spec_comes_from_the_rules(mesh):
  """Rows over 'data', the sequence over 'sequence': the rules table's ("batch", "length")."""
  assert batch_lib.sharding(mesh).spec == shd.logical_to_spec(("batch", "length"), mesh=mesh)
  assert batch_lib.sharding(mesh).spec == P("data", "sequence")
  # A mesh without a 'sequence' axis (no ring) keeps the sequence whole.
  data_only = jax.make_mesh((8,), ("data",))
  assert batch_lib.sharding(data_only).spec == P("data", None)
  abstract = batch_lib.abstract((4, 64), mesh)
  assert tuple(abstract) == batch_lib.FIELDS
  assert {k: v.dtype for k, v in abstract.items()} == batch_lib.DTYPES
  assert all(v.sharding == batch_lib.sharding(mesh) for v in abstract.values())


@pytest.mark.parametrize("kind", ["kv_retrieval", "text"])
def test_pipelines_produce_the_defined_batch(tmp_path, mesh, kind):
  (tmp_path / "a.txt").write_text("some text for the byte tokenizer " * 8)
  config = _tiny_config(**({"kind": "text", "path": str(tmp_path)} if kind == "text" else {}))
  batch = next(data_lib.make_iterator(
      data_lib.make_dataset(config, batch_lib.sharding(mesh), 4, split="train"), prefetch=0))
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


def _pack_documents(docs_tokens, seq_len):
  """data.pack_stream + data.finish_rows over a list of documents: ``[rows, seq_len]``."""
  import grain
  docs = grain.MapDataset.source([{"tokens": np.asarray(t, np.int32)} for t in docs_tokens])
  rows = list(data_lib.pack_stream(docs.to_iter_dataset(), seq_len))
  return data_lib.finish_rows({k: np.stack([r[k] for r in rows]) for k in rows[0]})


def test_packing_segments_never_cross_documents():
  docs = ["hello", "a", "the quick brown fox jumps", "", "xyz" * 7, "end"]
  tokens = [data_lib.load_tokenizer("byte").encode_document(d) for d in docs if d]
  packed = _pack_documents(tokens, seq_len=16)
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
  ids = data_lib.load_tokenizer("byte").encode_document(text)
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


def test_document_layout_is_built_per_distinct_row():
  """to_layout_np("document") builds each distinct row's permutation once (the kv task's rows
  share theirs) and gives every row what ring_jax.document_layout gives it alone."""
  rng = np.random.default_rng(0)
  seg = np.zeros((3, 64), np.int32)
  for r, cuts in enumerate(([5, 40], [17, 23, 50], [5, 40])):  # rows 0 and 2 are alike
    for i, (a, b) in enumerate(zip([0] + cuts, cuts + [64])):
      seg[r, a:b] = i + 1
  batch = dict(tokens=rng.integers(0, 99, size=(3, 64)).astype(np.int32), segment_ids=seg,
               positions=data_lib.segment_positions(seg))
  out = data_lib.to_layout_np(batch, "document", 4)
  for r in range(3):
    alone = ring_jax.document_layout(seg[r:r + 1], 4)
    np.testing.assert_array_equal(out["tokens"][r], batch["tokens"][r, alone.permutation[0]])
    np.testing.assert_array_equal(out["positions"][r], batch["positions"][r, alone.permutation[0]])
    np.testing.assert_array_equal(out["segment_ids"][r], alone.segment_ids[0])


def test_make_dataset_needs_a_resolved_layout(sharding):
  """model.layout="auto" is decided at startup (training.validation.resolve_layout); the
  pipeline refuses it unresolved, naming that, rather than failing inside a permutation."""
  from training import validation as val_lib

  config = _tiny_config()
  config.model.layout = "auto"
  with pytest.raises(ValueError, match="resolve_layout"):
    data_lib.make_dataset(config, sharding, 4, split="train")
  resolved, _ = val_lib.resolve_layout(config, 4)
  batch = data_lib.make_dataset(resolved, sharding, 4, split="train")[0]
  assert batch["tokens"].shape == (config.batch_size, config.data.seq_len)


def test_kv_task_errors_are_value_errors():
  """The data module raises plain ValueError (training.validation wraps it into ConfigError)."""
  from training.errors import ConfigError

  for task, match in ((dict(seq_len=64, num_pairs=2, num_queries=3), "num_queries"),
                      (dict(seq_len=64, num_pairs=8, num_queries=8), "too short"),
                      (dict(seq_len=128, docs_per_row=0), "docs_per_row=0")):
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
               if s.device == mesh.devices[0, 0, 0, 3, 0])
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
  assert data_lib.list_data_files(str(tmp_path)) == [str(path), str(tmp_path / "notes.txt")]
  # Two files: the last one is held out; an epoch of each split reads each document once.
  split = {s: [data_lib.byte_detokenize(d["tokens"]) for d in _epoch(
      data_lib.text_documents(config, s))] for s in ("train", "eval")}
  assert sorted(split["train"]) == sorted(docs)
  assert split["eval"] == ["a plain text file is one document"]
  it = data_lib.make_iterator(data_lib.make_dataset(config, sharding, 4, split="train"))
  batch = [next(it) for _ in range(6)][5]
  assert batch["tokens"].shape == (4, 64)
  # Layout (contiguous here) keeps each row's tokens, segments and labels consistent.
  mask = batch["loss_mask"].astype(bool)
  assert mask.any() and (batch["segment_ids"][mask] > 0).all()


def test_process_slices_single_process_covers_everything(sharding):
  rows, cols = data_lib.process_slices(sharding, (8, 64))
  assert (rows.start, rows.stop, cols.start, cols.stop) == (0, 8, 0, 64)


# --- streamed text sources --------------------------------------------------------------------


def _epoch(documents):
  """One epoch of a document stream (no repeat), as a list."""
  documents.repeat = False
  return list(documents)


def _texts(documents) -> list[str]:
  return [data_lib.byte_detokenize(d["tokens"]) for d in _epoch(documents)]


def _stream(spans, shard_index=0, shard_count=1, **kw):
  return sources.DocumentDataset(spans, data_lib.load_tokenizer("byte"), shard_index=shard_index,
                                 shard_count=shard_count, **kw)


def _whole(path):
  return [sources.Span(str(path), 0, sources.num_units(str(path)))]


def _write_jsonl(path, texts):
  path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))


def _write_parquet(path, texts, row_group_size=7):
  import pyarrow as pa
  import pyarrow.parquet as pq
  pq.write_table(pa.table({"text": texts}), str(path), row_group_size=row_group_size)


def _write_array_record(path, texts):
  from array_record.python import array_record_module
  writer = array_record_module.ArrayRecordWriter(str(path), "group_size:4")
  for t in texts:
    writer.write(json.dumps({"text": t}).encode())
  writer.close()


DOCS = [f"doc {i:03d} " + "x" * (i % 13) for i in range(101)]


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "arrayrecord"])
def test_two_processes_partition_the_records_of_one_file(tmp_path, fmt):
  """One file, two shards: each reads its own record range; none twice, none missed."""
  path = tmp_path / f"c.{fmt}"
  {"jsonl": _write_jsonl, "parquet": _write_parquet, "arrayrecord": _write_array_record}[fmt](
      path, DOCS)
  shards = [_texts(_stream(_whole(path), i, 2, shuffle=True)) for i in range(2)]
  assert not set(shards[0]) & set(shards[1])
  assert sorted(shards[0] + shards[1]) == DOCS
  assert abs(len(shards[0]) - len(shards[1])) <= 15  # Halves (of bytes / rows), not all-or-none.
  # The train and eval splits of a single file partition it too (its tail is held out).
  split = {s: _texts(_stream(sources.split_spans([str(path)], 0.1, s))) for s in ("train",
                                                                                   "eval")}
  assert sorted(split["train"] + split["eval"]) == DOCS and 5 <= len(split["eval"]) <= 15


def test_two_processes_partition_the_files(tmp_path):
  """More files than shards: whole files round robin (reshuffled per epoch, the same on all)."""
  files = []
  for f in range(5):
    files.append(tmp_path / f"part{f}.jsonl")
    _write_jsonl(files[-1], DOCS[f::5])
  spans = [s for f in files for s in _whole(f)]
  for epoch in range(2):
    per_shard = []
    for i in range(2):
      ds = _stream(spans, i, 2, shuffle=True, seed=3)
      assert len(ds.epoch_spans(epoch)) in (2, 3)  # whole files
      it = iter(ds)
      it.set_state(dict(epoch=epoch, span=0, offset=None, line=0, docs=0, epoch_docs=0))
      ds.repeat = False
      per_shard.append([data_lib.byte_detokenize(d["tokens"]) for d in it])
    assert not set(per_shard[0]) & set(per_shard[1])
    assert sorted(per_shard[0] + per_shard[1]) == DOCS
  assert [s.path for s in ds.epoch_spans(0)] != [s.path for s in ds.epoch_spans(1)] or (
      [s.path for s in _stream(spans, 0, 2, shuffle=True, seed=3).epoch_spans(0)]
      != [s.path for s in _stream(spans, 0, 2, shuffle=True, seed=3).epoch_spans(2)])


def test_byte_ranges_cut_mid_line_give_each_line_to_one_reader(tmp_path):
  path = tmp_path / "c.jsonl"
  _write_jsonl(path, DOCS)
  size = sources.num_units(str(path))
  for cut in (1, 17, 18, 19, size // 2, size - 1):  # anywhere, including right after a newline
    head = _texts(_stream([sources.Span(str(path), 0, cut)]))
    tail = _texts(_stream([sources.Span(str(path), cut, size)]))
    assert head + tail == DOCS, cut


def test_the_reader_streams_instead_of_reading_the_file(tmp_path, monkeypatch):
  """A file 200x the read buffer: the first documents come with memory of a few buffers."""
  import tracemalloc

  monkeypatch.setattr(sources, "READ_BUFFER_BYTES", 1 << 16)
  monkeypatch.setattr(sources, "TXT_PIECE_BYTES", 1 << 16)
  monkeypatch.setattr(sources, "ENCODE_BATCH_BYTES", 1 << 16)
  line = json.dumps({"text": "y" * 1000}) + "\n"
  path = tmp_path / "big.jsonl"
  path.write_text(line * 13_000)  # ~13 MB
  text_path = tmp_path / "big.txt"
  text_path.write_text(("z" * 99 + "\n") * 130_000)  # ~13 MB, one document
  for p, want in ((path, "y" * 1000), (text_path, None)):
    it = iter(_stream(_whole(p)))
    tracemalloc.start()
    try:
      for _ in range(20):  # (not kept: a .txt piece is 64K int32 ids)
        got = data_lib.byte_detokenize(next(it)["tokens"])
        assert got == want if want else set(got) == {"z", "\n"}
      _, peak = tracemalloc.get_traced_memory()
    finally:
      tracemalloc.stop()
    assert peak < 2 << 20, (p, peak)  # < 2 MiB of a 13 MB file
  # The .txt document came in pieces: BOS on the first only, EOS on the last only.
  pieces = [d["tokens"] for d in _epoch(_stream(_whole(text_path)))]
  assert len(pieces) > 190
  assert pieces[0][0] == data_lib.BOS_ID and pieces[0][-1] != data_lib.EOS_ID
  assert pieces[-1][-1] == data_lib.EOS_ID and pieces[-1][0] != data_lib.BOS_ID
  assert "".join(data_lib.byte_detokenize(p) for p in pieces) == text_path.read_text()


def _bad_corpus(tmp_path):
  lines = [json.dumps({"text": "good one"}), json.dumps({"text": "good two"}), "{not json",
           json.dumps({"text": "good three"}), json.dumps({"body": "no text field"}),
           json.dumps({"text": "good four"}), None, json.dumps({"text": ""}),
           json.dumps({"text": 7})]
  path = tmp_path / "c.jsonl"
  with open(path, "wb") as f:
    for l in lines:
      f.write(b'{"text": "\xff\xfe bad bytes"}\n' if l is None else l.encode() + b"\n")
  return path


def test_bad_records_are_counted_with_file_and_line(tmp_path, caplog):
  path = _bad_corpus(tmp_path)
  it = iter(_stream(_whole(path)))
  with caplog.at_level("WARNING"):
    texts = [data_lib.byte_detokenize(next(it)["tokens"]) for _ in range(4)]
    assert texts == ["good one", "good two", "good three", "good four"]
    next(it)  # the next epoch's first document: every bad line has been seen
  counts = it.get_state()["bad_records"]
  assert counts["counts"] == {"invalid_json": 1, "missing_field": 2, "undecodable": 1,
                              "empty": 1}
  assert counts["first"] == {"invalid_json": [f"{path}:3"],
                             "missing_field": [f"{path}:5", f"{path}:9"],
                             "undecodable": [f"{path}:7"], "empty": [f"{path}:8"]}
  warned = "\n".join(r.getMessage() for r in caplog.records)
  for what in ("1 record(s) with invalid JSON so far (first at", "no string text field",
               "not UTF-8", "empty document"):
    assert what in warned
  assert f"{path}:3" in warned
  assert data_lib.bad_record_counts(it.get_state()) == {
      "data/bad_records": 5, "data/bad_empty": 1, "data/bad_invalid_json": 1,
      "data/bad_missing_field": 2, "data/bad_undecodable": 1}
  # A reader of a range starting anywhere (mid-line or not) still names the absolute line.
  size = sources.num_units(str(path))
  everywhere = {loc for locs in counts["first"].values() for loc in locs}
  for start in range(1, size, 7):
    second = iter(_stream([sources.Span(str(path), start, size)]))
    try:
      next(second)
    except data_lib.DataError:  # (a range holding no good document)
      continue
    seen = {loc for locs in second.get_state()["bad_records"]["first"].values() for loc in locs}
    assert seen <= everywhere, (start, seen)


def test_strict_stops_at_the_first_bad_record(tmp_path):
  path = _bad_corpus(tmp_path)
  it = iter(_stream(_whole(path), strict=True))
  next(it), next(it)
  with pytest.raises(data_lib.DataError, match=rf"{path}:3: invalid JSON .*data.strict=True"):
    next(it)


def test_a_shard_without_documents_is_an_error(tmp_path):
  path = tmp_path / "c.jsonl"
  path.write_text('{"text": ""}\n{"x": 1}\n')
  with pytest.raises(data_lib.DataError,
                     match=r"holds no usable document.*1 with an empty document.*c.jsonl:1"):
    next(iter(_stream(_whole(path))))


def test_packed_stream_never_attends_or_predicts_across_documents(tmp_path):
  """Rows of the stream: segment = document within a row, labels stop at document ends."""
  _write_jsonl(tmp_path / "c.jsonl", DOCS)
  docs = _epoch(_stream(_whole(tmp_path / "c.jsonl")))
  rows = list(data_lib.pack_stream(_stream(_whole(tmp_path / "c.jsonl"), repeat=False), 32))
  batch = data_lib.finish_rows({k: np.stack([r[k] for r in rows]) for k in rows[0]})
  doc_of = np.concatenate([np.full(len(d["tokens"]), i) for i, d in enumerate(docs)])
  stream = np.concatenate([d["tokens"] for d in docs])
  n = len(stream)
  np.testing.assert_array_equal(batch["tokens"].reshape(-1)[:n], stream)
  seg = batch["segment_ids"]
  flat_doc = np.full(seg.size, -1)
  flat_doc[:n] = doc_of
  row_doc = flat_doc.reshape(seg.shape)
  for r in range(len(seg)):
    real = row_doc[r] >= 0
    # The attention mask (same nonzero segment) is exactly "same document".
    np.testing.assert_array_equal((seg[r][:, None] == seg[r][None, :])[real][:, real],
                                  (row_doc[r][:, None] == row_doc[r][None, :])[real][:, real])
    ends = np.flatnonzero(real[:-1] & (row_doc[r][1:] != row_doc[r][:-1]))
    assert not batch["loss_mask"][r, ends].any()  # a document's last token predicts nothing
    assert (batch["labels"][r, ends] == 0).all()


@pytest.mark.parametrize("prefetch", [0, 2])
def test_text_resume_continues_exactly(tmp_path, sharding, prefetch):
  """N batches, save the state (JSON), restore into a fresh pipeline: the same next batches.

  The corpus is small, so the batches after the restore cross an epoch boundary.
  """
  _write_jsonl(tmp_path / "a.jsonl", DOCS[:60])
  _write_parquet(tmp_path / "b.parquet", DOCS[60:])
  config = _tiny_config(kind="text", path=str(tmp_path))
  config.model.layout = "zigzag"
  dataset = data_lib.make_dataset(config, sharding, 4, split="train")
  for n in (3, 11):
    it = data_lib.make_iterator(dataset, prefetch=prefetch)
    for _ in range(n):
      next(it)
    state = json.loads(json.dumps(it.get_state()))
    expected = [next(it) for _ in range(12)]
    resumed = data_lib.make_iterator(data_lib.make_dataset(config, sharding, 4, split="train"),
                                     prefetch=prefetch)
    resumed.set_state(state)
    for want in expected:
      got = next(resumed)
      for k in batch_lib.FIELDS:
        np.testing.assert_array_equal(got[k], want[k])
  assert _find(it.get_state(), "epoch") >= 2  # (the restored stream crossed epochs)


def _find(state, key):
  if isinstance(state, dict):
    if key in state:
      return state[key]
    return next((v for v in map(lambda s: _find(s, key), state.values()) if v is not None), None)
  return None


def test_processes_sharing_rows_share_a_data_shard(monkeypatch):
  """Processes holding different columns of the same rows must read the same documents."""

  class Device:
    def __init__(self, process_index):
      self.process_index = process_index

  class Sharding:  # 4 processes: (0, 1) hold rows 0-1, (2, 3) rows 2-3; columns split
    def devices_indices_map(self, shape):
      return {Device(p): (slice(2 * (p // 2), 2 * (p // 2) + 2), slice(32 * (p % 2), None))
              for p in range(4)}

  got = []
  for p in range(4):
    monkeypatch.setattr(jax, "process_index", lambda p=p: p)
    got.append(data_lib.data_shard(Sharding(), (4, 64)))
  assert got == [(0, 2), (0, 2), (1, 2), (1, 2)]


def test_data_pipeline_benchmark_runs_small(tmp_path):
  """benchmarks/data_pipeline.py end to end at 1 and 2 MiB (the recorded run: 100 MB, 1 GB)."""
  from benchmarks import data_pipeline

  out = tmp_path / "result.json"
  results = data_pipeline.main(["--sizes-mb", "1,2", "--file-mb", "1", "--seq-len", "256",
                                "--batches", "2", "--bpe-vocab", "300", "--dir",
                                str(tmp_path / "corpus"), "--out", str(out)])
  assert json.loads(out.read_text()) == results
  runs = {(r["corpus_mb"], r["tokenizer"]): r for r in results["runs"]}
  assert set(runs) == {(1, "byte"), (2, "byte"), (1, "bpe"), (2, "bpe")}
  assert runs[(2, "bpe")]["files"] == 2 and runs[(1, "bpe")]["vocab_size"] == 300
  for r in runs.values():
    assert r["batch_shape"] == [8, 256] and r["tokens_per_s"] > 0 and r["first_batch_s"] > 0
    assert r["peak_rss_mib"] >= r["rss_before_mib"] > 0
  assert not (tmp_path / "corpus" / "corpus_2mb").exists()  # the corpus is deleted after


@pytest.mark.parametrize("overrides, match", [
    ({"data.eval_fraction": 0.0}, r"data.eval_fraction=0.0 must be in \(0, 1\)"),
    ({"data.tokenizer": "/nonexistent/tokenizer.json"}, "neither 'byte' nor an existing"),
    ({"data.path": "/nonexistent/*.parquet"}, "matches no .jsonl/.json/.txt/.parquet"),
])
def test_text_data_config_errors(tmp_path, overrides, match):
  from training.errors import ConfigError
  from training.validation import validate_config

  _write_jsonl(tmp_path / "c.jsonl", DOCS)
  config = _tiny_config(kind="text", path=str(tmp_path / "c.jsonl"))
  config.model.vocab_size = 264
  validate_config(config, num_devices=8)
  for k, v in overrides.items():
    section, name = k.split(".")
    config[section][name] = v
  with pytest.raises(ConfigError, match=match):
    validate_config(config, num_devices=8)
