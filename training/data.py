"""Input pipeline: a synthetic long-range retrieval task and streamed local text, via Grain.

Host-side numpy rows of the :mod:`training.batch` fields, built in natural order, padded
(:func:`pad_rows`) and reordered once into the ring's layout (:func:`to_layout_np`); both
pipelines are checkpointable with JSON-able states (:func:`make_dataset`, :func:`make_iterator`).
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import grain
import jax
import numpy as np

from models import lengths
from ring_jax import documents, layouts
from training import sources
from training.batch import (DTYPES, FIELDS, from_segments,  # noqa: F401 (the pipeline's API)
                            next_token_targets, segment_positions)
from training.sources import DataError, list_data_files  # noqa: F401 (the pipeline's API)
from training.tokenizer import (BOS_ID, BYTE_VOCAB_SIZE, EOS_ID, PAD_ID,  # noqa: F401
                                byte_detokenize, load_tokenizer)


def to_layout_np(batch: dict[str, np.ndarray], layout: str, ring_size: int) -> dict:
  """Every ``[rows, L]`` field from natural order into ``layout`` order, on the host (the
  permutation of :func:`ring_jax.to_layout`). ``"document"``: each row by the permutation
  of its segment ids (:func:`ring_jax.document_layout`, built once per distinct row), and
  ``segment_ids`` become that layout's renumbered ids."""
  if layout == layouts.DOCUMENT:
    seg = batch["segment_ids"]
    distinct, inverse = np.unique(seg, axis=0, return_inverse=True)
    inverse = inverse.reshape(-1)  # (numpy 2.0.0 gives it the shape of the rows)
    doc = documents.document_layout(distinct, ring_size)
    permutation = doc.permutation[inverse]
    out = {k: np.ascontiguousarray(np.take_along_axis(v, permutation, axis=1))
           for k, v in batch.items()}
    out["segment_ids"] = doc.segment_ids[inverse].astype(seg.dtype)
    return out
  length = batch["tokens"].shape[1]
  perm = layouts.layout_positions(layout, ring_size, length)
  return {k: np.ascontiguousarray(v[:, perm]) for k, v in batch.items()}


def pad_rows(batch: dict[str, np.ndarray], length: int) -> dict[str, np.ndarray]:
  """``[rows, L]`` natural-order fields -> ``[rows, length]`` (``length >= L``), the new
  tokens at each row's end all zero: token ``PAD_ID``, position 0, segment 0 (padding:
  masked in attention), label 0, loss mask 0 (no target)."""
  have = batch["tokens"].shape[1]
  if length < have:
    raise ValueError(f"cannot pad rows of {have} tokens to {length}.")
  if length == have:
    return batch
  return {k: np.pad(v, [(0, 0), (0, length - have)]) for k, v in batch.items()}


# --- (a) Synthetic key -> value retrieval at a distance ---------------------------------------


@dataclasses.dataclass(frozen=True)
class KVRetrievalTask:
  """Key/value pairs at the start of a document, queries for them at its end.

  A row of ``seq_len`` tokens packs ``docs_per_row`` documents of ``seq_len // docs_per_row``
  tokens (the rest: padding), each::

    BOS k1 v1 k2 v2 ... kP vP  f f f ... f  QUERY kq1 vq1 kq2 vq2 ... kqQ vqQ

  ``P = num_pairs`` distinct keys with random values, random filler ``f``, then ``Q =
  num_queries`` of the keys again, each followed by its value; the loss is only on each
  ``vq``. With two documents per row, each document's pairs and queries sit on different
  devices in the zigzag and contiguous layouts, so beating chance (``1/num_values``) needs
  attention across the ring.
  """
  seq_len: int
  num_pairs: int = 8
  num_queries: int = 8
  num_keys: int = 32
  num_values: int = 16
  num_filler: int = 16
  docs_per_row: int = 2

  # Token id layout: [PAD, BOS, QUERY, filler..., keys..., values...].
  QUERY_ID = 2
  filler_start = 3

  @classmethod
  def from_config(cls, data_config) -> "KVRetrievalTask":
    return cls(seq_len=data_config.seq_len, **data_config.kv)

  @property
  def key_start(self) -> int:
    return self.filler_start + self.num_filler

  @property
  def value_start(self) -> int:
    return self.key_start + self.num_keys

  @property
  def vocab_size(self) -> int:
    return self.value_start + self.num_values

  @property
  def doc_len(self) -> int:
    return self.seq_len // self.docs_per_row

  @property
  def chance_accuracy(self) -> float:
    return 1.0 / self.num_values

  def check(self, vocab_size: int | None = None) -> None:
    """Raises ValueError (named by config field) if the task cannot be laid out (or its ids
    need more than a model's ``vocab_size``)."""
    if vocab_size is not None and vocab_size < self.vocab_size:
      raise ValueError(f"the kv_retrieval task needs model.vocab_size >= {self.vocab_size}, "
                       f"got {vocab_size}.")
    if self.num_pairs > self.num_keys:
      raise ValueError(f"data.kv.num_pairs={self.num_pairs} exceeds num_keys={self.num_keys} "
                        "(keys in one document are distinct).")
    if self.num_queries > self.num_pairs:
      raise ValueError(f"data.kv.num_queries={self.num_queries} exceeds "
                        f"num_pairs={self.num_pairs}.")
    if self.docs_per_row < 1:
      raise ValueError(f"data.kv.docs_per_row={self.docs_per_row} must be >= 1.")
    used = 1 + 2 * self.num_pairs + 1 + 2 * self.num_queries
    if used > self.doc_len:
      raise ValueError(
          f"documents of data.seq_len / docs_per_row = {self.doc_len} tokens are too short "
          f"for the kv task, which needs {used} tokens before any filler.")

  def _document(self, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, query mask) of one document, natural order."""
    p, q, length = self.num_pairs, self.num_queries, self.doc_len
    keys = rng.choice(self.num_keys, size=p, replace=False) + self.key_start
    values = rng.integers(0, self.num_values, size=p) + self.value_start
    asked = rng.choice(p, size=q, replace=False)
    tokens = rng.integers(self.filler_start, self.key_start, size=length)
    tokens[0] = BOS_ID
    tokens[1:1 + 2 * p:2], tokens[2:2 + 2 * p:2] = keys, values
    tail = length - 2 * q
    tokens[tail - 1] = self.QUERY_ID
    tokens[tail::2], tokens[tail + 1::2] = keys[asked], values[asked]
    is_query = np.zeros(length, bool)
    is_query[tail::2] = True  # Positions holding a query key predict its value.
    return tokens, is_query

  def example(self, seed: int, index: int) -> dict[str, np.ndarray]:
    """Row ``index`` of the stream ``seed`` (natural order, ``[seq_len]`` fields)."""
    rng = np.random.default_rng([seed, index])
    docs = [self._document(rng) for _ in range(self.docs_per_row)]
    rest = self.seq_len - self.docs_per_row * self.doc_len  # then padding: PAD_ID, segment 0
    pad = lambda parts: np.pad(np.concatenate(parts), (0, rest))[None]  # one row, zeros after
    row = from_segments(pad([t for t, _ in docs]),
                        pad([np.full(self.doc_len, d + 1) for d in range(len(docs))]),
                        loss_mask=pad([m for _, m in docs]))
    return {k: v[0] for k, v in row.items()}

  def rows(self, seed: int, first: int, count: int) -> dict[str, np.ndarray]:
    examples = [self.example(seed, first + i) for i in range(count)]
    return {k: np.stack([e[k] for e in examples]) for k in FIELDS}


# --- (b) Local text files, streamed, tokenised and packed with segment ids --------------------


def _fix_json_state(state):
  """Undoes a JSON round trip of Grain's concat-then-split state: its remainder slices are
  tuples (the sentinel ``(-1, -1)`` is compared with ``!=``), which JSON made lists."""
  if isinstance(state, dict):
    return {k: ({f: tuple(v) for f, v in sl.items()} if k == "remainder_slices" else
                _fix_json_state(sl)) for k, sl in state.items()}
  if isinstance(state, list):
    return [_fix_json_state(v) for v in state]
  return state


def finish_rows(packed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """Concat-then-split output ``[rows, L]`` -> the batch fields, natural order; no label
  crosses a segment end (:func:`next_token_targets`)."""
  return from_segments(packed["tokens"], packed["tokens_segment_ids"],
                       positions=packed["tokens_positions"])


def pack_stream(documents: grain.IterDataset, seq_len: int) -> grain.IterDataset:
  """Documents (``{"tokens": int32[n]}``) -> rows of ``seq_len`` by concat-and-split: laid
  end to end, one that does not fit the rest of a row continuing in the next as a new
  segment; segment ids restart at 1 per row, positions at 0 per segment."""
  return grain.experimental.ConcatThenSplitIterDataset(documents, length_struct={"tokens": seq_len})


def data_shard(sharding: jax.sharding.Sharding, global_shape: tuple[int, int]) -> tuple[int, int]:
  """(index, count) of this process's data shard: one per distinct block of rows, so
  processes holding columns of the same rows (sequence over hosts) build the same rows."""
  blocks: dict[int, tuple[int, int]] = {}
  for device, idx in sharding.devices_indices_map(global_shape).items():
    start, stop, _ = idx[0].indices(global_shape[0])
    lo, hi = blocks.get(device.process_index, (start, stop))
    blocks[device.process_index] = (min(lo, start), max(hi, stop))
  distinct = sorted(set(blocks.values()))
  return distinct.index(blocks[jax.process_index()]), len(distinct)


def text_documents(config, split: str, shard_index: int = 0,
                   shard_count: int = 1) -> sources.DocumentDataset:
  """The tokenised document stream of ``split`` for one data shard (train: reshuffled by epoch)."""
  d = config.data
  return sources.DocumentDataset(
      sources.split_spans(list_data_files(d.path), d.eval_fraction, split),
      load_tokenizer(d.tokenizer), text_field=d.text_field, shard_index=shard_index,
      shard_count=shard_count, shuffle=split == "train", seed=config.seed, strict=d.strict)


def bad_record_counts(state: dict[str, Any]) -> dict[str, int]:
  """``{"data/bad_records": total, "data/bad_<kind>": count, ...}`` of the bad records
  skipped so far, read from a text iterator's ``get_state()``; empty for the kv task."""
  nodes = [state]  # the document reader's state, wherever the pipeline nests it
  while nodes:
    node = nodes.pop()
    if isinstance(node, dict):
      if isinstance(node.get("bad_records"), dict):
        counts = node["bad_records"].get("counts", {})
        return {"data/bad_records": sum(counts.values()),
                **{f"data/bad_{k}": n for k, n in sorted(counts.items())}}
      nodes.extend(node.values())
  return {}


# --- Grain pipeline: batch k -> this process's rows, in layout order --------------------------


def process_slices(sharding: jax.sharding.Sharding, global_shape: tuple[int, int]):
  """(row slice, column slice) of the global batch this process's devices hold (a rectangle
  for the batch sharding on ``jax.make_mesh`` meshes): the block it builds and transfers."""
  index_map = sharding.addressable_devices_indices_map(global_shape)
  bounds = []
  for axis, size in enumerate(global_shape):
    starts = [idx[axis].indices(size)[0] for idx in index_map.values()]
    stops = [idx[axis].indices(size)[1] for idx in index_map.values()]
    bounds.append(slice(min(starts), max(stops)))
  return tuple(bounds)


def make_dataset(config, sharding: jax.sharding.Sharding, ring_size: int, *,
                 split: str) -> grain.MapDataset | grain.IterDataset:
  """The Grain dataset of this process's batches for ``split`` in {'train', 'eval'}, rows
  padded to :func:`models.lengths.padded_length`: kv task, a ``MapDataset`` by batch number
  (eval: another seed); text, an ``IterDataset`` of this data shard (eval: the held-out
  files). ``model.layout`` must be resolved (:func:`training.validation.resolve_layout`)."""
  d = config.data
  if config.model.layout not in layouts.ALL_LAYOUTS:
    raise ValueError(f"model.layout={config.model.layout!r}: the data pipeline needs one of "
                     f"{layouts.ALL_LAYOUTS} ('auto' is resolved first: "
                     "training.validation.resolve_layout).")
  batch = config.batch_size if split == "train" else config.eval_batch_size
  run_len = lengths.padded_length(config.model, ring_size, d.seq_len)
  rows, cols = process_slices(sharding, (batch, run_len))
  seed = config.seed + (0 if split == "train" else 1_000_003)
  layout = config.model.layout

  def local_block(natural):  # natural-order rows -> padded, in layout order, our columns
    padded = pad_rows(natural, run_len)
    return {k: v[:, cols] for k, v in to_layout_np(padded, layout, ring_size).items()}

  if d.kind == "kv_retrieval":
    task = KVRetrievalTask.from_config(d)
    return grain.MapDataset.range(2**50).map(  # endless: indices are drawn lazily
        lambda k: local_block(task.rows(seed, k * batch + rows.start, rows.stop - rows.start)))
  if d.kind != "text":
    raise ValueError(f"unknown data.kind {d.kind!r}")
  documents = text_documents(config, split, *data_shard(sharding, (batch, run_len)))
  return (pack_stream(documents, d.seq_len).batch(rows.stop - rows.start, drop_remainder=True)
          .map(lambda packed: local_block(finish_rows(packed))))


class StreamIterator:
  """A Grain iterator whose ``set_state`` also takes the state back from a JSON checkpoint."""

  def __init__(self, iterator):
    self._it = iterator
    if hasattr(iterator, "close"):  # Stop a prefetch thread before interpreter teardown.
      weakref.finalize(self, iterator.close)

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    return next(self._it)

  def get_state(self) -> dict[str, Any]:
    return self._it.get_state()

  def set_state(self, state: dict[str, Any]) -> None:
    self._it.set_state(_fix_json_state(state))


def make_iterator(dataset: grain.MapDataset | grain.IterDataset, prefetch: int = 2):
  """Checkpointable iterator (``get_state()`` / ``set_state()``) prefetching ``prefetch``
  batches in a background thread."""
  if isinstance(dataset, grain.MapDataset):
    options = grain.ReadOptions(num_threads=1 if prefetch else 0, prefetch_buffer_size=prefetch)
    return iter(dataset.to_iter_dataset(options))
  if prefetch:
    dataset = grain.experimental.ThreadPrefetchIterDataset(dataset, prefetch_buffer_size=prefetch)
  return StreamIterator(iter(dataset))


def to_global(batch: dict[str, np.ndarray], sharding: jax.sharding.Sharding,
              global_shape: tuple[int, int]) -> dict[str, jax.Array]:
  """This process's block -> global ``jax.Array``s with ``sharding`` (the batch's)."""
  return {k: jax.make_array_from_process_local_data(sharding, v, global_shape)
          for k, v in batch.items()}
