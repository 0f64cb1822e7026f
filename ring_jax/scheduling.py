"""What each device computes at each hop: masks, visible block pairs, the block schedule.

Positions come from :mod:`ring_jax.layouts`; this module decides, from those
positions, the causal / local-window mask and the segment-id mask, and which
(query block, key/value block) pairs hold any visible score.

:func:`schedule` returns, as plain numpy data, which query block meets which
key/value block on which device at which hop. The ring kernel derives the same
pairs on device with the same functions (:func:`block_pairs`), so tests and
benchmarks that inspect the schedule inspect what is computed.

Segment ids: ``0`` is padding (a padding query attends nothing and outputs 0;
a padding key is never attended); every other value, negative ones included,
is a document id, and a query attends a key only when their ids are equal.
Ids are compared in the dtype they come in (no cast), so unsigned or 64-bit
ids keep their values.

(The module is ``scheduling`` rather than ``schedule`` so that it does not
shadow the function :func:`ring_jax.schedule` exported at the package's top level.)
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np

from ring_jax import layouts

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


def blocks_share_a_segment(q_seg, kv_seg, block_q: int, block_kv: int):
  """bool ``[nq, nk]``: in some batch row, the two blocks' document-id ranges overlap.

  ``q_seg`` ``[B, T]``, ``kv_seg`` ``[B, S]`` integer ids (any integer dtype;
  0 = padding, ignored). A pair of blocks whose ranges of non-padding ids are
  disjoint in every row (different packed documents, or padding) has an empty
  :func:`segment_mask` and can be skipped. Ranges make this exact for
  documents stored as consecutive runs of ids and conservative (extra work,
  never a miss) otherwise.
  """
  info = jnp.iinfo(q_seg.dtype)
  biggest, smallest = (jnp.asarray(x, q_seg.dtype) for x in (info.max, info.min))

  def ranges(seg, block):
    seg = seg.reshape(seg.shape[0], -1, block)
    real = seg != 0
    lo = jnp.min(jnp.where(real, seg, biggest), axis=-1)  # padding-only block: lo > hi
    hi = jnp.max(jnp.where(real, seg, smallest), axis=-1)
    return lo, hi

  q_lo, q_hi = ranges(q_seg, block_q)
  k_lo, k_hi = ranges(kv_seg, block_kv)
  overlap = (q_lo[:, :, None] <= k_hi[:, None, :]) & (k_lo[:, None, :] <= q_hi[:, :, None])
  return overlap.any(axis=0)


@dataclasses.dataclass(frozen=True)
class Schedule:
  """Which (query block, key/value block) pairs each device computes at each hop.

  At hop ``h`` device ``d`` holds the key/value shard that started on device
  ``(d - h) mod n`` (K/V travel ``d -> d+1``).

  Attributes:
    pairs: int32 ``[n, n, Q*K, 2]``: ``pairs[d, h, p] = (q_block, kv_block)`` for
      ``p < num_pairs[d, h]``; the rest is padding (zeros).
    num_pairs: int32 ``[n, n]``: number of block pairs device ``d`` computes at hop ``h``.
    partial: bool ``[n, n, Q*K]``: True where a computed pair is only partly
      unmasked (the rest are fully visible).
    block_q, block_kv: block sizes in tokens.
    layout, ring_size, local_len: what the schedule was built for.
    hops: ``(first, last)`` of :func:`hop_range`: the hops the ring runs (with a
      window and the contiguous layout, fewer than ``n``; hop ``h < 0`` is the
      shard of device ``d - h``, i.e. ``pairs[d, h % n]``). Hops outside have no pairs.
  """
  pairs: np.ndarray
  num_pairs: np.ndarray
  partial: np.ndarray
  block_q: int
  block_kv: int
  layout: str
  ring_size: int
  local_len: int
  hops: tuple[int, int]

  @property
  def active(self) -> np.ndarray:
    """bool ``[n, n, Q, K]``: block pair (q, kv) computed by device d at hop h."""
    n = self.ring_size
    nq, nk = self.local_len // self.block_q, self.local_len // self.block_kv
    out = np.zeros((n, n, nq, nk), dtype=bool)
    for d in range(n):
      for h in range(n):
        for a, b in self.pairs[d, h, :self.num_pairs[d, h]]:
          out[d, h, a, b] = True
    return out

  def work_per_device(self) -> np.ndarray:
    """``[n]``: block pairs each device computes over the whole ring pass."""
    return self.num_pairs.sum(axis=1)

  def critical_path(self) -> int:
    """Block pairs on the critical path: hops are synchronous, so each costs its busiest device."""
    return int(self.num_pairs.max(axis=0).sum())


def block_visibility(q_pos, k_pos, block_q: int, block_kv: int, is_causal: bool, window):
  """``(any, all)``: bool ``[nq, nk]`` per (query block, key block) pair.

  ``any``: some (query, key) pair in the block pair is allowed by the causal
  mask / window; ``all``: every pair is. Decided from each block's smallest and
  largest position: exact for causal masks in every layout and for windows on
  blocks of consecutive positions (contiguous, zigzag); for striped blocks
  under a window ``any`` may be True for a pair whose mask is empty, which
  costs work, never correctness. Works on numpy and on traced jax arrays, so
  the kernel and :func:`schedule` agree by construction.
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


def block_pairs(q_pos, k_pos, block_q: int, block_kv: int, is_causal: bool, window,
                also_required=None):
  """The visible block pairs as a list: ``(pairs [nq*nk, 2], num_pairs, partial [nq*nk])``.

  ``pairs[:num_pairs]`` are the (query block, key block) pairs to compute, in
  row-major order; the rest is zero padding. ``also_required`` (bool
  ``[nq, nk]``) removes further pairs, e.g. blocks sharing no document.
  Numpy or traced jax arrays.
  """
  any_, all_ = block_visibility(q_pos, k_pos, block_q, block_kv, is_causal, window)
  if also_required is not None:
    any_ = any_ & also_required
  nk = any_.shape[1]
  flat = any_.reshape(-1)
  if isinstance(flat, np.ndarray):
    (idx,) = np.nonzero(flat)
    num = len(idx)
    idx = np.concatenate([idx, np.zeros(flat.size - num, idx.dtype)])
  else:
    (idx,) = jnp.nonzero(flat, size=flat.size, fill_value=0)
    num = flat.sum(dtype=jnp.int32)
  xp = np if isinstance(flat, np.ndarray) else jnp
  pairs = xp.stack([idx // nk, idx % nk], axis=-1).astype(np.int32)
  partial = ~all_.reshape(-1)[idx]
  return pairs, num, partial


def hop_range(layout: str, ring_size: int, local_len: int, is_causal: bool,
              window) -> tuple[int, int]:
  """``(first, last)``: the hops ``h`` (shard of device ``d - h`` on device ``d``) the ring runs.

  ``(0, n - 1)`` (the whole ring) unless a local window confines every query's
  keys to nearby shards: with the ``contiguous`` layout a window ``(left,
  right)`` reaches ``a = ceil(left / local_len)`` shards back and ``b =
  ceil(right / local_len)`` forward (0 when causal), so only hops ``-b .. a``
  hold visible keys; when ``a + b + 1 < n`` the ring runs just those
  (``h < 0``: a shard from a later device). Zigzag and striped shards hold
  far-apart positions, so they always run the whole ring.
  """
  n = ring_size
  if window is None or layout != "contiguous" or n == 1:
    return 0, n - 1
  left, right = window
  a = -(-left // local_len)
  b = 0 if is_causal else -(-right // local_len)
  if a + b + 1 >= n:
    return 0, n - 1
  return -b, a


@functools.lru_cache(maxsize=256)
def schedule(layout: str, ring_size: int, local_len: int, block_q: int, block_kv: int,
             is_causal: bool = False, local_window_size=None) -> Schedule:
  """Builds the block schedule of a ring pass (see :class:`Schedule`).

  A block pair is skipped when no (query, key) pair in it is allowed by the
  causal mask / local window given the layout's global positions (see
  :func:`block_visibility`). The kernel derives the same pairs on device from
  the same positions, hop by hop, rather than carrying an ``[n, n, P]`` table.
  Segment ids are data, not layout: the kernel masks them inside a pair.
  """
  layouts.check_length(layout, ring_size, ring_size * local_len,
                       f"sequence length ({ring_size} x local length {local_len})")
  if local_len % block_q or local_len % block_kv:
    raise ValueError(
        f"block_q={block_q} and block_kv={block_kv} must divide the local sequence length "
        f"{local_len}.")
  window = normalize_window(local_window_size)
  n = ring_size
  nq, nk = local_len // block_q, local_len // block_kv
  pos = [layouts.local_positions(layout, n, local_len, d) for d in range(n)]
  pairs = np.zeros((n, n, nq * nk, 2), np.int32)
  partial = np.zeros((n, n, nq * nk), bool)
  num_pairs = np.zeros((n, n), np.int32)
  for d in range(n):
    for h in range(n):
      p, m, part = block_pairs(pos[d], pos[(d - h) % n], block_q, block_kv, is_causal, window)
      pairs[d, h], num_pairs[d, h] = p, m
      partial[d, h, :m] = part[:m]
  for arr in (pairs, partial, num_pairs):
    arr.setflags(write=False)
  hops = hop_range(layout, n, local_len, is_causal, window)
  return Schedule(pairs=pairs, num_pairs=num_pairs, partial=partial, block_q=block_q,
                  block_kv=block_kv, layout=layout, ring_size=n, local_len=local_len,
                  hops=hops)
