"""The batch the train and eval steps take: its fields, their dtypes and their sharding.

A batch is a dict of ``[rows, seq_len]`` arrays in the ring's layout order::

  tokens       int32    input ids
  positions    int32    position of each token inside its document (RoPE, causal mask)
  segment_ids  int32    1, 2, ... per packed document; 0 = padding
  labels       int32    next token of the same document (0 where there is none)
  loss_mask    float32  1 where ``labels`` is a real target

Every field has the logical axes ``("batch", "length")``, sharded by the rules table of
:mod:`models.sharding` as the model's activations are.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

import ring_jax
from models import sharding as shd

#: field name -> dtype, in a fixed order.
DTYPES: dict[str, np.dtype] = {
    "tokens": np.dtype(np.int32),
    "positions": np.dtype(np.int32),
    "segment_ids": np.dtype(np.int32),
    "labels": np.dtype(np.int32),
    "loss_mask": np.dtype(np.float32),
}
FIELDS: tuple[str, ...] = tuple(DTYPES)
#: Logical axis names of every field (see models.sharding.LOGICAL_RULES).
LOGICAL_AXES: tuple[str, str] = ("batch", "length")


def spec(mesh=None) -> PartitionSpec:
  """The fields' ``PartitionSpec`` on ``mesh`` (default: the context mesh) from the rules."""
  return shd.logical_to_spec(LOGICAL_AXES, mesh=mesh)


def sharding(mesh) -> NamedSharding:
  """``NamedSharding`` of every field on ``mesh``."""
  return NamedSharding(mesh, spec(mesh))


def shardings(mesh) -> dict[str, NamedSharding]:
  """Field name -> ``NamedSharding`` (jit ``in_shardings`` of the batch argument)."""
  one = sharding(mesh)
  return {name: one for name in FIELDS}


def abstract(shape: tuple[int, int], mesh) -> dict[str, jax.ShapeDtypeStruct]:
  """Field name -> ``ShapeDtypeStruct`` of a ``[rows, seq_len]`` batch sharded on ``mesh``."""
  one = sharding(mesh)
  return {name: jax.ShapeDtypeStruct(shape, dtype, sharding=one)
          for name, dtype in DTYPES.items()}


def random_documents(seed: int, rows: int, length: int, vocab_size: int, layout: str,
                     ring_size: int) -> dict[str, np.ndarray]:
  """A host batch of uniformly random tokens, one document per row, in layout order (for
  benchmarks and smoke tests); ``length`` must split over the ring."""
  ring_jax.layouts.check_length(layout, ring_size, length)
  rng = np.random.default_rng(seed)
  stream = rng.integers(0, vocab_size, (rows, length + 1)).astype(np.int32)
  loss_mask = np.ones((rows, length), np.float32)
  loss_mask[:, -1] = 0.0  # the last token's next one belongs to no document
  natural = dict(tokens=stream[:, :-1],
                 positions=np.broadcast_to(np.arange(length, dtype=np.int32), (rows, length)),
                 segment_ids=np.ones((rows, length), np.int32),
                 labels=np.where(loss_mask > 0, stream[:, 1:], 0).astype(np.int32),
                 loss_mask=loss_mask)
  # One document per row: the document layout deals it as zigzag does.
  perm = ring_jax.layout_positions(ring_jax.layouts.mask_layout(layout), ring_size, length)
  return {name: np.ascontiguousarray(natural[name][:, perm]) for name in FIELDS}
