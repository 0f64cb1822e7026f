"""The batch the train and eval steps take: its fields, their dtypes, their sharding, and
the fields made of a row's tokens and segment ids (:func:`from_segments`)."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding

import ring_jax
from models import sharding as shd

#: Field name -> dtype, in a fixed order. A batch is a dict of ``[rows, seq_len]`` arrays in
#: the ring's layout order.
DTYPES: dict[str, np.dtype] = {
    "tokens": np.dtype(np.int32),  # input ids
    "positions": np.dtype(np.int32),  # each token's place in its document (RoPE, causal mask)
    "segment_ids": np.dtype(np.int32),  # 1, 2, ... per packed document; 0 = padding
    "labels": np.dtype(np.int32),  # next token of the same document (0 where there is none)
    "loss_mask": np.dtype(np.float32),  # 1 where ``labels`` is a real target
}
FIELDS: tuple[str, ...] = tuple(DTYPES)
#: Logical axis names of every field: sharded by the rules table (models.sharding.LOGICAL_RULES)
#: as the model's activations are.
LOGICAL_AXES: tuple[str, str] = ("batch", "length")


def sharding(mesh) -> NamedSharding:
  """``NamedSharding`` of every field on ``mesh``, its spec from the rules table."""
  return NamedSharding(mesh, shd.logical_to_spec(LOGICAL_AXES, mesh=mesh))


def shardings(mesh) -> dict[str, NamedSharding]:
  """Field name -> ``NamedSharding`` (jit ``in_shardings`` of the batch argument)."""
  return dict.fromkeys(FIELDS, sharding(mesh))


def abstract(shape: tuple[int, int], mesh) -> dict[str, jax.ShapeDtypeStruct]:
  """Field name -> ``ShapeDtypeStruct`` of a ``[rows, seq_len]`` batch sharded on ``mesh``."""
  one = sharding(mesh)
  return {name: jax.ShapeDtypeStruct(shape, dtype, sharding=one) for name, dtype in DTYPES.items()}


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


def from_segments(tokens: np.ndarray, segment_ids: np.ndarray, positions=None,
                  loss_mask=None) -> dict[str, np.ndarray]:
  """Every field of a natural-order ``[rows, L]`` batch from its tokens and segment ids:
  positions restarting at 0 per segment (or ``positions``), 0 on padding (segment 0); the
  labels and loss mask of :func:`next_token_targets` (or that ``loss_mask``)."""
  labels, targets = next_token_targets(tokens, segment_ids)
  positions = segment_positions(segment_ids) if positions is None else positions
  out = dict(tokens=tokens, positions=np.where(segment_ids > 0, positions, 0),
             segment_ids=segment_ids, labels=labels,
             loss_mask=targets if loss_mask is None else loss_mask)
  return {k: np.asarray(out[k], DTYPES[k]) for k in FIELDS}


def random_documents(seed: int, rows: int, length: int, vocab_size: int, layout: str,
                     ring_size: int) -> dict[str, np.ndarray]:
  """A host batch of uniformly random tokens, one document per row, in layout order (for
  benchmarks and smoke tests); ``length`` must split over the ring."""
  ring_jax.layouts.check_length(layout, ring_size, length)
  rng = np.random.default_rng(seed)
  stream = rng.integers(0, vocab_size, (rows, length + 1)).astype(np.int32)
  natural = from_segments(stream[:, :-1], np.ones((rows, length), np.int32))
  # One document per row: the document layout deals it as zigzag does.
  perm = ring_jax.layout_positions(ring_jax.layouts.mask_layout(layout), ring_size, length)
  return {name: np.ascontiguousarray(natural[name][:, perm]) for name in FIELDS}
