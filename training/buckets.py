"""Length buckets: each batch on the ring its longest row needs (``data.length_buckets``).

Bucket ``b`` holds ``batch_size * seq_len / L_b`` rows of ``L_b`` tokens on a ring of
``sequence * L_b / seq_len`` devices of the same mesh, re-split (:func:`bucket_mesh`), so the
state keeps one sharding; :class:`BucketedBatches` packs whole documents per bucket (text
data, one process). docs/training.md, "Length buckets", has the whole story.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from models import lengths
from models import sharding as shd
from training import batch as batch_lib
from training.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Bucket:
  """One length bucket: rows of ``length`` tokens (run at ``run_length``, padded to the
  model's length rule on its ring), ``rows`` per batch, on ``mesh`` (ring ``ring``)."""
  index: int
  length: int
  ring: int
  rows: int
  run_length: int
  mesh: jax.sharding.Mesh

  @property
  def shape(self) -> tuple[int, int]:
    return (self.rows, self.run_length)

  @property
  def sharding(self) -> NamedSharding:
    """The batch fields' sharding on the bucket's mesh (rows over data, tokens over its ring)."""
    return batch_lib.sharding(self.mesh)


def lengths_of(config) -> tuple[int, ...]:
  """``data.length_buckets`` as a tuple of ints with ``data.seq_len`` last (empty: one ring)."""
  buckets = tuple(int(b) for b in config.data.get("length_buckets", None) or ())
  seq_len = int(config.data.seq_len)
  return buckets + ((seq_len,) if buckets and buckets[-1] != seq_len else ())


def check(config, sizes: dict[str, int]) -> None:
  """``data.length_buckets`` against the run: sorted positive ints up to ``data.seq_len``,
  each bucket's ring a divisor of the run's, text data, no pipeline or two-level mesh
  (ConfigError naming the fix). A bucket's rows then always split over its data devices."""
  raw = tuple(config.data.get("length_buckets", None) or ())
  if not raw:
    return
  where = f"data.length_buckets={raw}"
  if any(not isinstance(b, (int, np.integer)) or isinstance(b, bool) or b < 1 for b in raw):
    raise ConfigError(f"{where}: buckets are token counts >= 1.")
  if list(raw) != sorted(set(raw)):
    raise ConfigError(f"{where}: buckets must be sorted ascending without repeats; pass "
                      f"{tuple(sorted(set(raw)))}.")
  seq_len, n = int(config.data.seq_len), shd.ring_size(sizes)
  if raw[-1] > seq_len:
    raise ConfigError(f"{where}: bucket {raw[-1]} is longer than data.seq_len={seq_len}; "
                      f"buckets are at most data.seq_len (drop it or raise data.seq_len).")
  if config.data.kind != "text":
    raise ConfigError(f"{where}: length buckets pack documents of text data "
                      f"(data.kind='text'), got data.kind={config.data.kind!r}.")
  if sizes["pipeline"] > 1 or sizes["sequence_outer"] > 1:
    raise ConfigError(f"{where}: buckets re-split the mesh's data x sequence devices; they "
                      "run with mesh.pipeline=1 and mesh.sequence_outer=1.")
  fits = [seq_len * r // n for r in range(1, n + 1) if n % r == 0 and (seq_len * r) % n == 0]
  for length in lengths_of(config):
    ring = length * n / seq_len
    if ring != int(ring) or n % int(ring):
      raise ConfigError(
          f"{where}: bucket {length} needs a ring of {n} x {length} / {seq_len} = {ring:g} "
          f"devices, which does not divide the ring of {n}; use buckets from {fits}.")


def bucket_mesh(mesh: jax.sharding.Mesh, ring: int) -> jax.sharding.Mesh:
  """``mesh`` with its ``data x sequence`` devices re-split as ``(data * sequence / ring) x
  ring`` in the same device order: a ring of ``ring`` consecutive devices of the mesh's ring,
  the same flat device assignment (so shardings of the mesh stay valid)."""
  sizes = dict(mesh.shape)
  shape = dict(sizes, data=sizes["data"] * sizes["sequence"] // ring, sequence=ring)
  devices = mesh.devices.reshape(tuple(shape[a] for a in mesh.axis_names))
  return jax.sharding.Mesh(devices, mesh.axis_names, axis_types=mesh.axis_types)


def plan(config, model_cfg, mesh) -> tuple[Bucket, ...]:
  """The run's buckets (empty without ``data.length_buckets``), the last one the full ring."""
  seq_len, n = int(config.data.seq_len), shd.ring_size(mesh.shape)
  out = []
  for i, length in enumerate(lengths_of(config)):
    ring = length * n // seq_len
    out.append(Bucket(index=i, length=length, ring=ring,
                      rows=config.batch_size * seq_len // length,
                      run_length=lengths.padded_length(model_cfg, ring, length),
                      mesh=bucket_mesh(mesh, ring)))
  return tuple(out)


class BucketedBatches:
  """Batches of documents packed per length bucket: ``next()`` is ``(bucket index, batch)``,
  rows padded to the bucket's run length in ``layout`` for its ring. Checkpointable: the
  state is the stream's position plus every bucket's rows not yet yielded (JSON-able)."""

  def __init__(self, documents, buckets: tuple[Bucket, ...], layout: str):
    self._it, self._buckets, self._layout = iter(documents), buckets, layout
    self._pending: list[list[list[list[int]]]] = [[] for _ in buckets]  # bucket, row, doc
    self._full: list[list] = []  # [bucket, rows] of batches filled, not yet yielded

  def __iter__(self):
    return self

  def _add(self, doc: list[int]) -> None:
    """Packs one document (at most the last bucket's length) into the shortest bucket it
    fits; a batch whose rows are all taken is full when a document opens one more row."""
    bucket = next(b for b in self._buckets if len(doc) <= b.length)
    rows = self._pending[bucket.index]
    if not rows or sum(map(len, rows[-1])) + len(doc) > bucket.length:
      if len(rows) == bucket.rows:
        self._full.append([bucket.index, rows])
        rows = self._pending[bucket.index] = []
      rows.append([])
    rows[-1].append(doc)

  def __next__(self) -> tuple[int, dict[str, np.ndarray]]:
    from training import data as data_lib  # the one-ring run's padding and layout
    top = self._buckets[-1].length
    while not self._full:
      tokens = np.asarray(next(self._it)["tokens"]).tolist()
      for start in range(0, len(tokens), top):  # longer than seq_len: cut, as the packer does
        self._add(tokens[start:start + top])
    index, rows = self._full.pop(0)
    bucket = self._buckets[index]
    batch = data_lib.pad_rows(pack_rows(rows, bucket.length), bucket.run_length)
    return index, data_lib.to_layout_np(batch, self._layout, bucket.ring)

  def get_state(self) -> dict[str, Any]:
    return copy.deepcopy(dict(source=self._it.get_state(), pending=self._pending,
                              full=self._full))

  def set_state(self, state: dict[str, Any]) -> None:
    state = copy.deepcopy(state)
    self._it.set_state(state["source"])  # the document stream's state: JSON as it is
    self._pending, self._full = state["pending"], state["full"]


def pack_rows(rows: list[list[list[int]]], length: int) -> dict[str, np.ndarray]:
  """Rows of whole documents -> ``[len(rows), length]`` natural-order batch fields: segment
  ids 1, 2, ... per document, positions restarting at 0, labels inside each document, the
  rest of each row padding (segment 0, no target)."""
  tokens, segments = np.zeros((2, len(rows), length), np.int32)
  for r, docs in enumerate(rows):
    sizes = [len(doc) for doc in docs]
    tokens[r, :sum(sizes)] = [t for doc in docs for t in doc]
    segments[r, :sum(sizes)] = np.repeat(np.arange(1, len(docs) + 1), sizes)
  return batch_lib.from_segments(tokens, segments)


def compile_steps(train_step, buckets: tuple[Bucket, ...], microbatches: int, params=None,
                  opt_state=None) -> list:
  """Every bucket's step (:meth:`training.step.TrainStep.jit` on its mesh) compiled ahead of
  time (state defaults to the abstract one)."""
  params = train_step.abstract_params if params is None else params
  opt_state = train_step.abstract_opt_state if opt_state is None else opt_state
  out = []
  for bucket in buckets:
    with jax.set_mesh(bucket.mesh):
      out.append(train_step.jit(bucket.mesh, microbatches).lower(
          params, opt_state, batch_lib.abstract(bucket.shape, bucket.mesh)).compile())
  return out


def describe(buckets: tuple[Bucket, ...]) -> str:
  """The startup line: which ring each bucket uses."""
  return "length buckets: " + "; ".join(
      f"{b.length} tokens x {b.rows} rows on a ring of {b.ring} "
      f"(data {b.mesh.shape['data']} x sequence {b.mesh.shape['sequence']})" for b in buckets)


def compiled_count_line(count: int) -> str:
  return (f"compiled {count} train-step program{'s' if count != 1 else ''} (one per length "
          "bucket, cached for the run)")
