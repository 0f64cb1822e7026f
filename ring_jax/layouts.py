"""Sequence layouts for ring attention and the block schedule they induce.

A *layout* says which global token positions each device of the ring holds.
With ``n`` devices and global length ``L`` (local length ``L/n``):

* ``"contiguous"``: device ``i`` holds positions ``[i*L/n, (i+1)*L/n)``.
  Under a causal mask device ``n-1`` does ``n`` times the work of device 0.
* ``"zigzag"``: the sequence is cut into ``2n`` chunks; device ``i`` holds
  chunks ``i`` and ``2n-1-i``. Every device then does the same causal work at
  every hop (half of a full hop after hop 0), as in Megatron/TE context
  parallelism and Brandon et al., "Striped Attention" (2023) Sec. 3.
* ``"striped"``: token ``t`` lives on device ``t mod n`` (Striped Attention).

Arrays are laid out "in layout order": the global array is the concatenation
of the devices' local shards, so sharding the sequence axis evenly over the
ring gives each device exactly its tokens. :func:`to_layout` /
:func:`from_layout` convert between natural order and layout order, and
:func:`layout_positions` gives each token's global position (for RoPE and
masks) in layout order.

:func:`schedule` returns, as plain numpy data, which query block meets which
key/value block on which device at which hop. The ring kernel iterates over
exactly these block pairs, so tests and benchmarks that inspect the schedule
inspect what is computed.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

Layout = Literal["contiguous", "zigzag", "striped"]
LAYOUTS: tuple[str, ...] = ("contiguous", "zigzag", "striped")


def check_layout(layout: str) -> None:
  if layout not in LAYOUTS:
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}.")


def check_local_length(layout: str, local_len: int, what: str = "local sequence length") -> None:
  """Raises ValueError if ``layout`` cannot split a shard of ``local_len`` tokens."""
  check_layout(layout)
  if local_len < 1:
    raise ValueError(f"{what} must be positive, got {local_len}.")
  if layout == "zigzag" and local_len % 2:
    raise ValueError(
        f"layout='zigzag' holds two chunks per device, so the {what} must be even; got "
        f"{local_len}. Pad the sequence to a multiple of 2 * ring_size, or use "
        "layout='striped' or 'contiguous'.")


def _check_global(layout: str, ring_size: int, length: int) -> int:
  check_layout(layout)
  if ring_size < 1:
    raise ValueError(f"ring_size must be >= 1, got {ring_size}.")
  if length % ring_size:
    raise ValueError(
        f"sequence length {length} is not divisible by the ring size {ring_size}; pad it "
        f"to a multiple of {ring_size * (2 if layout == 'zigzag' else 1)}.")
  local_len = length // ring_size
  check_local_length(layout, local_len)
  return local_len


def local_positions(layout: str, ring_size: int, local_len: int, device):
  """Global positions ``[local_len]`` (int32) of the tokens held by ``device``.

  ``device`` may be a Python int or a traced int32 scalar (e.g.
  ``jax.lax.axis_index``), so the same formula serves the kernel and the
  schedule. Works with numpy when ``device`` is an int.
  """
  xp = np if isinstance(device, (int, np.integer)) else jnp
  j = xp.arange(local_len, dtype=np.int32)
  if layout == "contiguous":
    return device * local_len + j
  if layout == "striped":
    return j * ring_size + device
  if layout == "zigzag":
    half = local_len // 2
    first = device * half + j
    second = (2 * ring_size - 1 - device) * half + (j - half)
    return xp.where(j < half, first, second).astype(np.int32)
  raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}.")


@functools.lru_cache(maxsize=256)
def _permutation(layout: str, ring_size: int, length: int) -> np.ndarray:
  """perm[k] = natural position of the token at layout-order index k."""
  local_len = _check_global(layout, ring_size, length)
  perm = np.concatenate(
      [local_positions(layout, ring_size, local_len, d) for d in range(ring_size)])
  perm.setflags(write=False)
  return perm


def layout_positions(layout: str, ring_size: int, length: int) -> np.ndarray:
  """Global position ``[length]`` of each token of a layout-ordered sequence."""
  return _permutation(layout, ring_size, length).copy()


def to_layout(x, layout: str, ring_size: int, axis: int = 1):
  """Reorders a natural-order array along ``axis`` into ``layout`` order."""
  perm = _permutation(layout, ring_size, x.shape[axis])
  if layout == "contiguous":
    return x
  return _gather(x, perm, axis)


def from_layout(x, layout: str, ring_size: int, axis: int = 1):
  """Inverse of :func:`to_layout`: layout order back to natural order."""
  perm = _permutation(layout, ring_size, x.shape[axis])
  if layout == "contiguous":
    return x
  return _gather(x, np.argsort(perm).astype(np.int32), axis)


def _gather(x, index: np.ndarray, axis: int):
  """``x`` reordered along ``axis``, keeping its sharding on meshes with Explicit axes."""
  axis = axis % x.ndim
  sharding = getattr(jax.typeof(x), "sharding", None) if isinstance(x, jax.Array) else None
  mesh = getattr(sharding, "mesh", None)
  types = getattr(mesh, "axis_types", ()) or ()
  if any(t == jax.sharding.AxisType.Explicit for t in types):
    # Sharding-in-types refuses to guess the output sharding of a gather.
    idx = (slice(None),) * axis + (jnp.asarray(index),)
    return x.at[idx].get(out_sharding=sharding)
  return jnp.take(x, jnp.asarray(index), axis=axis)


def normalize_window(local_window_size) -> tuple[int, int] | None:
  """``int w`` -> ``(w, w)``; ``(left, right)`` kept; ``None`` kept.

  Same meaning as ``jax.nn.dot_product_attention``: query at position ``p``
  may attend keys in ``[p - left, p + right]``.
  """
  if local_window_size is None:
    return None
  if isinstance(local_window_size, (int, np.integer)):
    w = (int(local_window_size), int(local_window_size))
  else:
    try:
      left, right = local_window_size
    except (TypeError, ValueError):
      raise TypeError(
          "local_window_size must be an int or a (left, right) pair of ints, got "
          f"{local_window_size!r}.") from None
    w = (int(left), int(right))
  if w[0] < 0 or w[1] < 0:
    raise ValueError(f"local_window_size entries must be >= 0, got {local_window_size!r}.")
  return w


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
  """
  pairs: np.ndarray
  num_pairs: np.ndarray
  partial: np.ndarray
  block_q: int
  block_kv: int
  layout: str
  ring_size: int
  local_len: int

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
  check_local_length(layout, local_len)
  if local_len % block_q or local_len % block_kv:
    raise ValueError(
        f"block_q={block_q} and block_kv={block_kv} must divide the local sequence length "
        f"{local_len}.")
  window = normalize_window(local_window_size)
  n = ring_size
  nq, nk = local_len // block_q, local_len // block_kv
  pos = [local_positions(layout, n, local_len, d) for d in range(n)]
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
  return Schedule(pairs=pairs, num_pairs=num_pairs, partial=partial, block_q=block_q,
                  block_kv=block_kv, layout=layout, ring_size=n, local_len=local_len)


def _zigzag_home(chunk: int, ring_size: int) -> int:
  """Device that holds natural chunk ``chunk`` (of ``2n``) under the zigzag layout."""
  return chunk if chunk < ring_size else 2 * ring_size - 1 - chunk


def can_reorder_shards(layout: str, ring_size: int, local_len: int) -> bool:
  """Whether :func:`shard_to_layout` handles this case (striped needs ``n | local_len``)."""
  if layout == "striped":
    return local_len % ring_size == 0
  return layout in LAYOUTS and (layout != "zigzag" or local_len % 2 == 0)


def shard_to_layout(x, layout: str, axis_name, axis: int = 1):
  """Inside ``shard_map``: a contiguous (natural-order) shard -> this device's ``layout`` shard.

  The collective counterpart of :func:`to_layout` for a sequence already
  sharded over ``axis_name``: zigzag moves the two half-shards with two
  ``ppermute``s, striped with one ``all_to_all``; memory stays O(local
  length), whereas reordering the global array gathers it. Striped needs the
  local length divisible by the ring size (:func:`can_reorder_shards`).
  """
  return _reorder_shard(x, layout, axis_name, axis, inverse=False)


def shard_from_layout(x, layout: str, axis_name, axis: int = 1):
  """Inverse of :func:`shard_to_layout`: this device's layout shard -> its contiguous shard."""
  return _reorder_shard(x, layout, axis_name, axis, inverse=True)


def _reorder_shard(x, layout, axis_name, axis, inverse):
  check_layout(layout)
  n = jax.lax.axis_size(axis_name)
  axis = axis % x.ndim
  local_len = x.shape[axis]
  if layout == "contiguous" or n == 1:
    return x
  if not can_reorder_shards(layout, n, local_len):
    raise ValueError(
        f"cannot reorder a local shard of {local_len} tokens into layout={layout!r} over "
        f"{n} devices: {'striped needs a multiple of the ring size' if layout == 'striped' else 'zigzag needs an even length'}.")
  if layout == "zigzag":
    half = local_len // 2
    even_device = jax.lax.axis_index(axis_name) % 2 == 0
    first, second = (jax.lax.slice_in_dim(x, 0, half, axis=axis),
                     jax.lax.slice_in_dim(x, half, local_len, axis=axis))
    # Natural chunk 2i (first half of shard i) and 2i+1 go to their zigzag homes;
    # an even device receives its first chunk from the "even" transfer.
    to_even = [(i, _zigzag_home(2 * i, n)) for i in range(n)]
    to_odd = [(i, _zigzag_home(2 * i + 1, n)) for i in range(n)]
    if not inverse:
      got_even = jax.lax.ppermute(first, axis_name, to_even)
      got_odd = jax.lax.ppermute(second, axis_name, to_odd)
      return jnp.concatenate([jnp.where(even_device, got_even, got_odd),
                              jnp.where(even_device, got_odd, got_even)], axis=axis)
    even_chunk = jnp.where(even_device, first, second)
    odd_chunk = jnp.where(even_device, second, first)
    back_even = jax.lax.ppermute(even_chunk, axis_name, [(d, s) for s, d in to_even])
    back_odd = jax.lax.ppermute(odd_chunk, axis_name, [(d, s) for s, d in to_odd])
    return jnp.concatenate([back_even, back_odd], axis=axis)
  # striped: token j of a contiguous shard goes to device j mod n (shards start at
  # multiples of n). Tiled all_to_all over a size-n axis of [.., n, L/n^.., ..] blocks.
  shape = x.shape
  lead, rest = shape[:axis], shape[axis + 1:]
  if not inverse:
    y = x.reshape(lead + (local_len // n, n) + rest)
    y = jnp.swapaxes(y, axis, axis + 1)                       # [.., residue, j, ..]
    y = jax.lax.all_to_all(y, axis_name, axis, axis, tiled=True)  # -> [.., source, j, ..]
    return y.reshape(shape)
  y = x.reshape(lead + (n, local_len // n) + rest)             # [.., source, j, ..]
  y = jax.lax.all_to_all(y, axis_name, axis, axis, tiled=True)   # -> [.., residue, j, ..]
  return jnp.swapaxes(y, axis, axis + 1).reshape(shape)


def length_multiple(layout: str, ring_size: int) -> int:
  """What every global sequence length must be a multiple of: the ring size, twice it for zigzag.

  Zigzag cuts the sequence into ``2 * ring_size`` chunks (two per device);
  contiguous and striped need only an equal share per device.
  """
  check_layout(layout)
  if ring_size < 1:
    raise ValueError(f"ring_size must be >= 1, got {ring_size}.")
  return ring_size * (2 if layout == "zigzag" else 1)


def check_length(layout: str, ring_size: int, length: int, what: str = "sequence length") -> int:
  """Raises ValueError naming the fix unless ``layout`` can split ``length`` over the ring.

  Returns the local (per-device) length ``length // ring_size``.
  """
  multiple = length_multiple(layout, ring_size)
  if length < 1 or length % multiple:
    why = " (zigzag holds two chunks per device)" if layout == "zigzag" else ""
    raise ValueError(
        f"{what} {length} does not split over a ring of {ring_size} devices with "
        f"layout={layout!r}{why}: pad it to a multiple of {multiple}.")
  return length // ring_size
