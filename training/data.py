"""Input pipeline: a synthetic long-range retrieval task and packed local text, via Grain.

Everything here is host-side numpy. A batch is a dict of ``[rows, seq_len]``
arrays with the fields, dtypes and sharding :mod:`training.batch` defines
(tokens, positions, segment_ids, labels, loss_mask).

Examples are built in natural order (labels, per-document positions) and the
whole batch is then reordered ONCE into the ring's sequence layout
(contiguous / zigzag / striped, see :mod:`ring_jax.layouts`), so that sharding
the sequence axis evenly over the mesh's ``sequence`` axis hands every device
exactly the tokens the ring kernel expects. The loss is a masked sum, so it is
computed in layout order without undoing the permutation.

The pipeline is a ``grain.MapDataset`` indexed by *batch number*: batch ``k``
is a pure function of ``(seed, k)``, so the iterator state is a single
integer (``get_state()/set_state()``), a resumed run sees exactly the batches
an uninterrupted one would, and every process can build just the rows its
devices hold (multi-host) from the same index.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
from typing import Callable

import grain
import jax
import numpy as np

from ring_jax import layouts
from training.batch import DTYPES, FIELDS

# Byte-level tokenizer: ids 0..2 are special, byte b is id b + 3.
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
BYTE_OFFSET = 3
BYTE_VOCAB_SIZE = 256 + BYTE_OFFSET

# Effectively infinite: batch indices are drawn lazily, never materialised.
_NUM_BATCHES = 2**50

# ----------------------------------------------------------------------------
# Layout
# ----------------------------------------------------------------------------


def to_layout_np(batch: dict[str, np.ndarray], layout: str, ring_size: int) -> dict:
  """Reorders every ``[rows, L]`` field from natural order into ``layout`` order.

  Same permutation as :func:`ring_jax.to_layout` (``layout_positions`` is
  exactly "natural index of the token at each layout slot"), applied with numpy
  on the host so no device work or transfer is spent on it.
  """
  length = batch["tokens"].shape[1]
  perm = layouts.layout_positions(layout, ring_size, length)
  return {k: np.ascontiguousarray(v[:, perm]) for k, v in batch.items()}


def segment_positions(segment_ids: np.ndarray) -> np.ndarray:
  """Position of each token inside its segment (restarts at 0 per document), natural order."""
  rows, length = segment_ids.shape
  idx = np.broadcast_to(np.arange(length, dtype=np.int32), (rows, length))
  starts = np.ones_like(segment_ids, dtype=bool)
  starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
  # Index of the most recent segment start at or before each token.
  last_start = np.maximum.accumulate(np.where(starts, idx, 0), axis=1)
  return (idx - last_start).astype(np.int32)


def next_token_targets(tokens: np.ndarray, segment_ids: np.ndarray):
  """Labels and loss mask that never cross a document (or row) boundary."""
  labels = np.zeros_like(tokens)
  labels[:, :-1] = tokens[:, 1:]
  same_doc = np.zeros(tokens.shape, dtype=bool)
  same_doc[:, :-1] = (segment_ids[:, 1:] == segment_ids[:, :-1]) & (segment_ids[:, :-1] != 0)
  labels = np.where(same_doc, labels, 0).astype(np.int32)
  return labels, same_doc.astype(np.float32)


# ----------------------------------------------------------------------------
# (a) Synthetic key -> value retrieval at a distance
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class KVRetrievalTask:
  """Key/value pairs at the start of a document, queries for them at its end.

  A row of ``seq_len`` tokens packs ``docs_per_row`` independent documents
  (segment ids 1, 2, ...; positions restart per document), each::

    BOS k1 v1 k2 v2 ... kP vP  f f f ... f  QUERY kq1 vq1 kq2 vq2 ... kqQ vqQ

  ``P = num_pairs`` distinct keys with random values, random filler ``f``, then
  ``Q = num_queries`` of the keys again, each followed by its value. The loss
  (and the accuracy) is only on predicting each ``vq`` at its ``kq``.

  Why two documents per row: with ring size ``n`` the zigzag layout puts
  sequence chunks ``d`` and ``2n-1-d`` on device ``d``, so the very start and
  the very end of a row share device 0. Splitting the row in two puts each
  document's pairs and its queries on different devices in the zigzag
  (first doc: devices 0 -> n-1; second: n-1 -> 0) and contiguous (0 -> n/2-1,
  n/2 -> n-1) layouts, and striped spreads every document over all devices.
  Filler and values are random, so beating chance (``1/num_values``) needs
  attention across the ring. Guessing among the values present in the
  document scores ~``1/num_distinct_values`` (~0.17 with the tiny defaults);
  beyond that the model must match keys (an induction-head lookup).
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

  @classmethod
  def from_config(cls, data_config) -> "KVRetrievalTask":
    kv = data_config.kv
    return cls(seq_len=data_config.seq_len, num_pairs=kv.num_pairs,
               num_queries=kv.num_queries, num_keys=kv.num_keys, num_values=kv.num_values,
               num_filler=kv.num_filler, docs_per_row=kv.docs_per_row)

  @property
  def filler_start(self) -> int:
    return 3

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

  def check(self) -> None:
    """Raises ValueError (named by config field) if the task cannot be laid out."""
    if self.num_pairs > self.num_keys:
      raise ValueError(f"data.kv.num_pairs={self.num_pairs} exceeds num_keys={self.num_keys} "
                        "(keys in one document are distinct).")
    if self.num_queries > self.num_pairs:
      raise ValueError(f"data.kv.num_queries={self.num_queries} exceeds "
                        f"num_pairs={self.num_pairs}.")
    if self.docs_per_row < 1 or self.seq_len % self.docs_per_row:
      raise ValueError(f"data.kv.docs_per_row={self.docs_per_row} must be >= 1 and divide "
                        f"data.seq_len={self.seq_len}.")
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
    tokens = np.concatenate([t for t, _ in docs]).astype(np.int32)
    is_query = np.concatenate([m for _, m in docs])
    segment_ids = np.repeat(np.arange(1, self.docs_per_row + 1, dtype=np.int32), self.doc_len)
    labels, _ = next_token_targets(tokens[None], segment_ids[None])
    return dict(tokens=tokens, positions=segment_positions(segment_ids[None])[0],
                segment_ids=segment_ids, labels=labels[0],
                loss_mask=is_query.astype(np.float32))

  def rows(self, seed: int, first: int, count: int) -> dict[str, np.ndarray]:
    examples = [self.example(seed, first + i) for i in range(count)]
    return {k: np.stack([e[k] for e in examples]).astype(DTYPES[k]) for k in FIELDS}


# ----------------------------------------------------------------------------
# (b) Local text files, byte tokenizer, packed rows with segment ids
# ----------------------------------------------------------------------------


def list_text_files(path: str) -> list[str]:
  """``path`` may be a file, a directory (searched recursively) or a glob."""
  exts = (".txt", ".jsonl", ".json")
  if os.path.isfile(path):
    return [path]
  if os.path.isdir(path):
    found = glob.glob(os.path.join(path, "**", "*"), recursive=True)
  else:
    found = glob.glob(path, recursive=True)
  return sorted(f for f in found if os.path.isfile(f) and f.endswith(exts))


def read_documents(path: str, text_field: str = "text") -> list[str]:
  """A ``.txt`` file is one document; each line of a ``.jsonl`` file is one (``text_field``)."""
  docs = []
  for name in list_text_files(path):
    with open(name, encoding="utf-8") as f:
      if name.endswith(".txt"):
        docs.append(f.read())
        continue
      for lineno, line in enumerate(f, 1):
        if not line.strip():
          continue
        record = json.loads(line)
        if text_field not in record:
          raise KeyError(f"{name}:{lineno} has no field {text_field!r} (data.text_field).")
        docs.append(record[text_field])
  return [d for d in docs if d]


def byte_tokenize(text: str) -> np.ndarray:
  """UTF-8 bytes shifted past the special ids, wrapped in BOS ... EOS."""
  ids = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32) + BYTE_OFFSET
  return np.concatenate([[BOS_ID], ids, [EOS_ID]]).astype(np.int32)


def byte_detokenize(ids) -> str:
  ids = np.asarray(ids)
  ids = ids[ids >= BYTE_OFFSET] - BYTE_OFFSET
  return bytes(ids.astype(np.uint8).tolist()).decode("utf-8", errors="replace")


def pack_documents(docs_tokens: list[np.ndarray], seq_len: int) -> dict[str, np.ndarray]:
  """Greedy stream packing into ``[rows, seq_len]`` with segment ids, natural order.

  Documents are laid end to end; one that does not fit the rest of a row
  continues in the next row as a new segment (attention never crosses a row
  anyway). Segment ids restart at 1 in every row; the tail of the last row is
  padding (segment 0, masked). Positions restart at 0 at every segment start,
  and labels/loss mask stop at every segment end.
  """
  stream = np.concatenate(docs_tokens) if docs_tokens else np.zeros(0, np.int32)
  doc_of_token = np.concatenate(
      [np.full(len(t), i, np.int64) for i, t in enumerate(docs_tokens)]) if docs_tokens else (
          np.zeros(0, np.int64))
  rows = max(1, -(-len(stream) // seq_len))
  tokens = np.full(rows * seq_len, PAD_ID, np.int32)
  doc = np.full(rows * seq_len, -1, np.int64)
  tokens[:len(stream)], doc[:len(stream)] = stream, doc_of_token
  tokens, doc = tokens.reshape(rows, seq_len), doc.reshape(rows, seq_len)
  # Segment ids: count document changes along each row, 1-based; padding -> 0.
  change = np.ones_like(doc, dtype=bool)
  change[:, 1:] = doc[:, 1:] != doc[:, :-1]
  segment_ids = np.where(doc >= 0, np.cumsum(change, axis=1), 0).astype(np.int32)
  labels, loss_mask = next_token_targets(tokens, segment_ids)
  positions = np.where(segment_ids > 0, segment_positions(segment_ids), 0).astype(np.int32)
  return dict(tokens=tokens, positions=positions, segment_ids=segment_ids, labels=labels,
              loss_mask=loss_mask)


@dataclasses.dataclass
class PackedText:
  """Packed train and held-out rows from local files (all in host memory)."""
  train: dict[str, np.ndarray]
  eval: dict[str, np.ndarray]

  @classmethod
  def from_config(cls, data_config) -> "PackedText":
    docs = read_documents(data_config.path, data_config.text_field)
    if not docs:
      raise ValueError(f"data.path={data_config.path!r} holds no non-empty documents.")
    if len(docs) == 1:  # One document: hold out its tail rather than nothing.
      cut = int(len(docs[0]) * (1 - data_config.eval_fraction))
      train_docs, eval_docs = [docs[0][:cut]], [docs[0][cut:]]
    else:
      num_eval = max(1, int(round(len(docs) * data_config.eval_fraction)))
      train_docs, eval_docs = docs[:-num_eval], docs[-num_eval:]
    pack = lambda ds: pack_documents([byte_tokenize(d) for d in ds], data_config.seq_len)
    return cls(train=pack(train_docs), eval=pack(eval_docs))


# ----------------------------------------------------------------------------
# Grain pipeline: batch k -> this process's rows, in layout order
# ----------------------------------------------------------------------------


def process_slices(sharding: jax.sharding.Sharding, global_shape: tuple[int, int]):
  """(row slice, column slice) of the global batch held by this process's devices.

  With several processes each one builds and transfers only that block
  (:func:`jax.make_array_from_process_local_data` assembles the global array).
  Assumes the block is a rectangle, which holds for the batch sharding
  (:func:`training.batch.sharding`) on meshes built by ``jax.make_mesh``.
  """
  index_map = sharding.addressable_devices_indices_map(global_shape)
  bounds = []
  for axis, size in enumerate(global_shape):
    starts = [idx[axis].indices(size)[0] for idx in index_map.values()]
    stops = [idx[axis].indices(size)[1] for idx in index_map.values()]
    bounds.append(slice(min(starts), max(stops)))
  return tuple(bounds)


class BatchSource:
  """Random-access batches: ``source[k]`` is batch ``k`` (this process's block of it)."""

  def __init__(self, make_rows: Callable[[int, int], dict], global_batch: int, layout: str,
               ring_size: int, rows: slice, cols: slice):
    self._make_rows = make_rows
    self._global_batch = global_batch
    self._layout, self._ring_size = layout, ring_size
    self._rows, self._cols = rows, cols

  def __len__(self) -> int:
    return _NUM_BATCHES

  def __getitem__(self, k: int) -> dict[str, np.ndarray]:
    first = k * self._global_batch + self._rows.start
    batch = self._make_rows(first, self._rows.stop - self._rows.start)
    batch = to_layout_np(batch, self._layout, self._ring_size)
    return {name: v[:, self._cols] for name, v in batch.items()}


def make_dataset(config, sharding: jax.sharding.Sharding, ring_size: int, *,
                 split: str) -> grain.MapDataset:
  """The ``grain.MapDataset`` of batches for ``split`` in {'train', 'eval'}.

  Eval streams use a different seed (synthetic) or the held-out documents
  (text), and always restart at batch 0 so every eval sees the same data.
  """
  d = config.data
  batch = config.batch_size if split == "train" else config.eval_batch_size
  rows, cols = process_slices(sharding, (batch, d.seq_len))
  seed = config.seed + (0 if split == "train" else 1_000_003)
  if d.kind == "kv_retrieval":
    task = KVRetrievalTask.from_config(d)
    make_rows = lambda first, count: task.rows(seed, first, count)
  elif d.kind == "text":
    packed = getattr(PackedText.from_config(d), split)
    # Shuffled, reshuffled every epoch, endless; examples are rows of `packed`.
    order = grain.MapDataset.range(len(packed["tokens"])).shuffle(seed=seed).repeat()

    def make_rows(first, count):
      idx = np.asarray([order[first + i] for i in range(count)])
      return {k: v[idx] for k, v in packed.items()}
  else:
    raise ValueError(f"unknown data.kind {d.kind!r}")
  source = BatchSource(make_rows, batch, config.model.layout, ring_size, rows, cols)
  return grain.MapDataset.source(source)


def make_iterator(dataset: grain.MapDataset, prefetch: int = 2):
  """Checkpointable iterator (``get_state()`` / ``set_state()``) with background prefetch."""
  options = grain.ReadOptions(num_threads=1 if prefetch else 0, prefetch_buffer_size=prefetch)
  return iter(dataset.to_iter_dataset(options))


def to_global(batch: dict[str, np.ndarray], sharding: jax.sharding.Sharding,
              global_shape: tuple[int, int]) -> dict[str, jax.Array]:
  """This process's block -> global ``jax.Array``s with ``sharding`` (the batch's)."""
  return {k: jax.make_array_from_process_local_data(sharding, v, global_shape)
          for k, v in batch.items()}
