"""Which scores of a hop are visible: the masks, and the block table every hop kernel loops over.

Positions come from :mod:`ring_jax.layouts`; from them and the segment ids this module
decides the causal / local-window mask (:func:`position_mask`), the segment-id mask
(:func:`segment_mask`), and, per hop, which (query block, key block) pairs hold any
visible score and which of them need the elementwise mask (:class:`BlockTable`, built by
:func:`block_table`; the ring hands it to every hop kernel in :class:`ring_jax.hop.HopMasks`).
Every function here takes numpy or traced jax arrays alike, so the host-side schedule
(:mod:`ring_jax.scheduling`) and the kernels agree by construction.

Segment ids: ``0`` is padding (a padding query attends nothing and outputs 0; a padding
key is never attended); every other value, negative ones included, is a document id, and
a query attends a key only when their ids are equal. Ids are compared in the dtype they
come in (no cast), so unsigned or 64-bit ids keep their values.
"""

from __future__ import annotations

import dataclasses
import functools

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


# Token positions are int32 (layouts.local_positions), so a window side beyond this is meaningless
# and cannot be compared against int32 position differences.
_MAX_WINDOW = int(np.iinfo(np.int32).max)


def _window_side(value, whole) -> int:
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
    raise ValueError(
        f"local_window_size entries must be integers (token counts), got {value!r} in "
        f"{whole!r}; pass an int or a (left, right) pair of ints.")
  value = int(value)
  if value < 0:
    raise ValueError(f"local_window_size entries must be >= 0, got {whole!r}.")
  if value > _MAX_WINDOW:
    raise ValueError(
        f"local_window_size entries must be <= 2**31 - 1 (token positions are int32), got "
        f"{whole!r}; a side of 2**31 - 1 (or anything >= the sequence length) already means "
        "'no limit' on that side, and local_window_size=None means no window at all.")
  return value


def normalize_window(local_window_size) -> tuple[int, int] | None:
  """``int w`` -> ``(w, w)``; ``(left, right)`` kept; ``None`` kept.

  Same meaning as ``jax.nn.dot_product_attention``: query at position ``p``
  may attend keys in ``[p - left, p + right]``. Raises ``ValueError`` for
  non-integer, negative or larger-than-int32 sides (nothing is truncated), and
  ``TypeError`` for something that is neither an int nor a pair.
  """
  if local_window_size is None:
    return None
  if isinstance(local_window_size, (int, np.integer, float, np.floating)):
    side = _window_side(local_window_size, local_window_size)
    return side, side
  try:
    left, right = local_window_size
  except (TypeError, ValueError):
    raise TypeError(
        "local_window_size must be an int or a (left, right) pair of ints, got "
        f"{local_window_size!r}.") from None
  return (_window_side(left, local_window_size), _window_side(right, local_window_size))


def position_mask(q_pos, k_pos, is_causal: bool, window):
  """Boolean ``[..., Tq, Tk]`` mask allowed by causality and the local window."""
  xp = np if isinstance(q_pos, np.ndarray) else jnp
  diff = q_pos[..., :, None] - k_pos[..., None, :]  # >0: key is in the past
  mask = xp.ones(diff.shape, dtype=bool)
  if is_causal:
    mask &= diff >= 0
  if window is not None:
    left, right = window
    mask &= (diff <= left) & (diff >= -right)
  return mask


def segment_mask(q_seg, kv_seg):
  """Boolean ``[..., Tq, Tk]``: query and key are in the same document (see module docstring).

  ``q_seg`` ``[..., Tq]`` and ``kv_seg`` ``[..., Tk]`` integer ids; ``0`` is
  padding, any other value (negative included) a document, compared by equality.
  """
  q = q_seg[..., :, None]
  return (q == kv_seg[..., None, :]) & (q != 0)


class BlockSegments(NamedTuple):
  """Per-block summary of segment ids ``[B, n]`` (numpy or jax), from :func:`block_segments`.

  lo / hi: smallest / largest non-padding id of the block (a padding-only block has
    ``lo > hi``); uniform: the block's id when every token holds that one non-padding id,
    else 0. Two blocks share no document when their ``[lo, hi]`` ranges are disjoint, and
    every (query, key) pair of them is in one document when both are uniform with equal ids.
  """
  lo: object
  hi: object
  uniform: object


def block_segments(seg, block: int) -> BlockSegments:
  """The :class:`BlockSegments` of integer ids ``seg`` ``[B, L]`` in blocks of ``block``.

  Ids keep their dtype (0 = padding; see the module docstring).
  """
  xp = np if isinstance(seg, np.ndarray) else jnp
  info = np.iinfo(seg.dtype)
  biggest, smallest = (xp.asarray(x, seg.dtype) for x in (info.max, info.min))
  seg = seg.reshape(seg.shape[0], -1, block)
  real = seg != 0
  first = seg[..., 0]
  same = (seg == first[..., None]).all(-1) & (first != 0)
  return BlockSegments(lo=xp.min(xp.where(real, seg, biggest), axis=-1),
                       hi=xp.max(xp.where(real, seg, smallest), axis=-1),
                       uniform=xp.where(same, first, xp.zeros_like(first)))


def _share_a_segment(q: BlockSegments, k: BlockSegments):
  """bool ``[B, nq, nk]``: the blocks' ranges of non-padding ids overlap (see
  :func:`blocks_share_a_segment`)."""
  return (q.lo[:, :, None] <= k.hi[:, None, :]) & (k.lo[:, None, :] <= q.hi[:, :, None])


def blocks_share_a_segment(q_seg, kv_seg, block_q: int, block_kv: int):
  """bool ``[nq, nk]``: in some batch row, the two blocks' document-id ranges overlap.

  ``q_seg`` ``[B, T]``, ``kv_seg`` ``[B, S]`` integer ids (any integer dtype;
  0 = padding, ignored). A pair of blocks whose ranges of non-padding ids are
  disjoint in every row (different packed documents, or padding) has an empty
  :func:`segment_mask` and can be skipped. Ranges make this exact for
  documents stored as consecutive runs of ids and conservative (extra work,
  never a miss) otherwise.
  """
  return _share_a_segment(block_segments(q_seg, block_q),
                          block_segments(kv_seg, block_kv)).any(axis=0)


def block_visibility(q_pos, k_pos, block_q: int, block_kv: int, is_causal: bool, window):
  """``(any, all)``: bool ``[nq, nk]`` per (query block, key block) pair.

  ``any``: some (query, key) pair in the block pair is allowed by the causal
  mask / window; ``all``: every pair is. Decided from each block's smallest and
  largest position: exact for causal masks in every layout and for windows on
  blocks of consecutive positions (contiguous, zigzag); for striped blocks
  under a window ``any`` may be True for a pair whose mask is empty, which
  costs work, never correctness. Works on numpy and on traced jax arrays, so
  the kernels and :func:`ring_jax.schedule` agree by construction.
  """
  xp = np if isinstance(q_pos, np.ndarray) else jnp
  q = q_pos.reshape(-1, block_q)
  k = k_pos.reshape(-1, block_kv)
  d_min = q.min(-1)[:, None] - k.max(-1)[None, :]  # smallest query - key distance
  d_max = q.max(-1)[:, None] - k.min(-1)[None, :]
  any_ = xp.ones(d_min.shape, dtype=bool)
  all_ = xp.ones(d_min.shape, dtype=bool)
  if is_causal:
    any_ &= d_max >= 0
    all_ &= d_min >= 0
  if window is not None:
    left, right = window
    any_ &= (d_min <= left) & (d_max >= -right)
    all_ &= (d_max <= left) & (d_min >= -right)
  return any_, all_


@functools.partial(jax.tree_util.register_dataclass, data_fields=["q_ranges", "kv_ranges"],
                   meta_fields=["may_mask"])
@dataclasses.dataclass(frozen=True)
class BlockTable:
  """Which block pairs one hop computes, and which of them need the elementwise mask.

  The one description of a hop's block sparsity: :func:`block_table` builds it
  from positions and segment ids, every hop kernel loops over it, and
  :func:`ring_jax.schedule` lists its pairs. Rows ``(lo, full_lo, full_hi, hi)`` with
  ``lo <= full_lo <= full_hi <= hi``:

  q_ranges: int32 ``[R, nq, 4]``: query block ``a`` (batch row ``r``) meets the
    key blocks ``lo <= b < hi`` (empty: ``[0, 0)``); those in ``[full_lo, full_hi)``
    are visible everywhere (no elementwise mask), the others may be partly masked.
  kv_ranges: int32 ``[R, nk, 4]``: the same for key block ``b`` over query blocks
    (the backward's dK/dV loop).
  may_mask: static bool: some score of the hop can be masked at all (causal, window
    or segment ids); False: every pair is computed unmasked.

  ``R`` is the batch size with segment ids (documents differ per row) and 1
  without (broadcast over rows). ``[lo, hi)`` spans every pair that may hold a
  visible score; a pair inside it that holds none is computed and masked, never
  missed. ``[full_lo, full_hi)`` is the first run of pairs visible everywhere
  (for positions increasing within a shard, as in every layout, the only run).
  """
  q_ranges: object
  kv_ranges: object
  may_mask: bool


def _spans(vis, full):
  """``[R, rows, n]`` bool (possibly visible, visible everywhere) -> int32 ``[R, rows, 4]``."""
  xp = np if isinstance(vis, np.ndarray) else jnp
  n = vis.shape[-1]
  idx = xp.arange(n, dtype=np.int32)
  hi = xp.max(xp.where(vis, idx + 1, 0), axis=-1)
  lo = xp.minimum(xp.min(xp.where(vis, idx, n), axis=-1), hi)  # empty row: [0, 0)
  full_lo = xp.min(xp.where(full, idx, n), axis=-1)
  # end of the first run of full pairs: the first non-full index after full_lo
  full_hi = xp.min(xp.where(~full & (idx >= full_lo[..., None]), idx, n), axis=-1)
  no_run = full_lo >= n
  full_lo = xp.where(no_run, hi, full_lo)
  full_hi = xp.where(no_run, hi, xp.minimum(full_hi, hi))
  return xp.stack([lo, full_lo, full_hi, hi], axis=-1).astype(np.int32)


def block_table(q_pos, kv_pos, q_seg, kv_seg, block_q: int, block_kv: int, is_causal: bool,
                window, may_mask: bool = True) -> BlockTable:
  """The :class:`BlockTable` of one hop (numpy, or traced jax arrays inside a kernel's caller).

  ``q_pos`` ``[T]`` / ``kv_pos`` ``[S]`` positions; ``q_seg`` ``[B, T]`` /
  ``kv_seg`` ``[B, S]`` ids or None. A pair may hold a visible score when the
  positions allow one (:func:`block_visibility`) and, with ids, the blocks'
  document ranges overlap in that row (:class:`BlockSegments`); it is visible
  everywhere when the positions make it so and both blocks are one and the
  same document (no padding). ``may_mask=False``: the caller knows that every pair in the
  ranges is visible everywhere (:func:`partly_masked` is False for every device's positions),
  so the table's pairs are computed without the elementwise mask.
  """
  any_, all_ = block_visibility(q_pos, kv_pos, block_q, block_kv, is_causal, window)
  any_, all_ = any_[None], all_[None]
  if q_seg is not None:
    qs, ks = block_segments(q_seg, block_q), block_segments(kv_seg, block_kv)
    any_ = any_ & _share_a_segment(qs, ks)
    uq, uk = qs.uniform[:, :, None], ks.uniform[:, None, :]
    all_ = all_ & (uq != 0) & (uq == uk)
  all_ = all_ & any_
  return BlockTable(q_ranges=_spans(any_, all_),
                    kv_ranges=_spans(any_.swapaxes(1, 2), all_.swapaxes(1, 2)),
                    may_mask=bool(may_mask and (is_causal or window is not None
                                                or q_seg is not None)))


def partly_masked(positions, block_q: int, block_kv: int, is_causal: bool, window) -> bool:
  """Whether some block pair computed for some ``(q_pos, kv_pos)`` of ``positions`` (numpy
  ``[T]`` / ``[S]``, e.g. one per device of a ring's hop) needs the elementwise mask: a pair
  in a row's range ``[lo, hi)`` of :func:`block_table` outside its full run (no segment ids).
  False lets a hop known at trace time compile only the unmasked block loop (a causal hop
  between whole zigzag or contiguous chunks)."""
  for q_pos, kv_pos in positions:
    table = block_table(q_pos, kv_pos, None, None, block_q, block_kv, is_causal, window)
    for r in (table.q_ranges, table.kv_ranges):
      if (r[..., 0] != r[..., 1]).any() or (r[..., 2] != r[..., 3]).any():
        return True
  return False


def merge_rows(ranges):
  """``[R, n, 4]`` -> ``[n, 4]``: one range row per block for kernels that compute every
  batch row of a block together.

  ``[lo, hi)`` spans the rows' non-empty ranges; ``[full_lo, full_hi)`` is the
  part visible everywhere in every row (empty, at ``hi``, when there is none).
  Pairs inside the span that no row's range holds can be skipped
  (:func:`rows_cover`).
  """
  xp = np if isinstance(ranges, np.ndarray) else jnp
  lo, full_lo, full_hi, hi = (ranges[..., i] for i in range(4))
  some = lo < hi
  hi_m = xp.max(xp.where(some, hi, 0), axis=0)
  lo_m = xp.minimum(xp.min(xp.where(some, lo, _MAX_WINDOW), axis=0), hi_m)
  flo, fhi = xp.max(full_lo, axis=0), xp.min(full_hi, axis=0)
  run = (flo < fhi) & some.all(axis=0)
  flo, fhi = xp.where(run, flo, hi_m), xp.where(run, fhi, hi_m)
  return xp.stack([lo_m, flo, fhi, hi_m], axis=-1).astype(np.int32)


def rows_cover(ranges, i, j):
  """bool: block ``j`` lies in the range of block ``i`` in some batch row (``ranges``
  ``[R, n, 4]``)."""
  return ((ranges[:, i, 0] <= j) & (j < ranges[:, i, 3])).any()


def segment_ids_int32(q_seg, kv_seg):
  """Segment ids as int32 (for kernels that take int32 ids), keeping equality and the 0 =
  padding rule.

  Ids that already fit int32 are cast. Wider ids (int64 / uint32 / uint64 values
  outside int32) are remapped to dense int32 codes by rank over the union of both
  arrays (0 stays 0), which preserves exactly which pairs are equal.
  """
  q_seg, kv_seg = jnp.asarray(q_seg), jnp.asarray(kv_seg)
  dt = jnp.promote_types(q_seg.dtype, kv_seg.dtype)
  if jnp.iinfo(dt).bits <= 32 and jnp.iinfo(dt).max <= _MAX_WINDOW:
    return q_seg.astype(jnp.int32), kv_seg.astype(jnp.int32)
  both = jnp.concatenate([q_seg.reshape(-1), kv_seg.reshape(-1)]).astype(dt)
  # Padded with the largest id so that `uniq` stays sorted for searchsorted.
  uniq = jnp.unique(both, size=both.size, fill_value=both.max())
  # 0 maps to 0; any other id to 1 + its rank among the distinct ids (ids can be negative).
  def code(x):
    rank = jnp.searchsorted(uniq, x.astype(dt)).astype(jnp.int32)
    return jnp.where(x == 0, 0, rank + 1)
  return code(q_seg), code(kv_seg)
