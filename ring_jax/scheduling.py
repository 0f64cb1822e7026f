"""What each device computes at each hop: masks, visible block pairs, the block schedule.

Positions come from :mod:`ring_jax.layouts`; this module decides, from those
positions, the causal / local-window mask and the segment-id mask, and which
(query block, key/value block) pairs hold any visible score.

:class:`BlockTable` (built by :func:`block_table`, once per hop, from
positions and segment ids) is the one description of which (query block,
key block) pairs a hop computes and which of them need the elementwise mask:
the ring hands it to every hop kernel in :class:`ring_jax.hop.HopMasks`, and
:func:`schedule` lists its pairs as plain numpy data (which query block meets
which key/value block on which device at which hop), so tests and benchmarks
that inspect the schedule inspect what is computed (``tests/test_ring.py``
counts the XLA kernel's loop trips against it).

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

from typing import NamedTuple

import jax
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
  """bool ``[B, nq, nk]``: the blocks' ranges of non-padding ids overlap (see :func:`blocks_share_a_segment`)."""
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


@dataclasses.dataclass(frozen=True)
class Schedule:
  """Which (query block, key/value block) pairs each device computes at each hop.

  At hop ``h`` device ``d`` holds the key/value shard that started on device
  ``(d - h) mod n`` (K/V travel ``d -> d+1``).

  With :attr:`routes` (:func:`routes`), device ``d`` holds at hop ``h`` each stream's part
  of the shard of device ``stream.source(d, h, n)`` instead (zigzag: the early chunk of
  ``d - h``, the late chunk of ``d + h``), side by side in stream order.

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
    routes: the ring's :class:`Routes` when it routes K/V (``causal_routing``), else None.
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
  routes: "Routes | None" = None

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


@functools.partial(jax.tree_util.register_dataclass, data_fields=["q_ranges", "kv_ranges"],
                   meta_fields=["may_mask"])
@dataclasses.dataclass(frozen=True)
class BlockTable:
  """Which block pairs one hop computes, and which of them need the elementwise mask.

  The one description of a hop's block sparsity: :func:`block_table` builds it
  from positions and segment ids, every hop kernel loops over it, and
  :func:`schedule` lists its pairs. Rows ``(lo, full_lo, full_hi, hi)`` with
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
                window) -> BlockTable:
  """The :class:`BlockTable` of one hop (numpy, or traced jax arrays inside a kernel's caller).

  ``q_pos`` ``[T]`` / ``kv_pos`` ``[S]`` positions; ``q_seg`` ``[B, T]`` /
  ``kv_seg`` ``[B, S]`` ids or None. A pair may hold a visible score when the
  positions allow one (:func:`block_visibility`) and, with ids, the blocks'
  document ranges overlap in that row (:class:`BlockSegments`); it is visible
  everywhere when the positions make it so and both blocks are one and the
  same document (no padding).
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
                    may_mask=bool(is_causal or window is not None or q_seg is not None))


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
  """bool: block ``j`` lies in the range of block ``i`` in some batch row (``ranges`` ``[R, n, 4]``)."""
  return ((ranges[:, i, 0] <= j) & (j < ranges[:, i, 3])).any()


def table_pairs(table: BlockTable):
  """numpy ``(pairs [P, 2], partial [P])``: the (query block, key block) pairs of a one-row
  table in row-major order, and whether each may be partly masked (outside the full run)."""
  pairs, partial = [], []
  for a, (lo, full_lo, full_hi, hi) in enumerate(np.asarray(table.q_ranges[0])):
    for b in range(lo, hi):
      pairs.append((a, b))
      partial.append(table.may_mask and not full_lo <= b < full_hi)
  return np.asarray(pairs, np.int32).reshape(-1, 2), np.asarray(partial, bool)


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
             is_causal: bool = False, local_window_size=None,
             causal_routing: bool | None = None) -> Schedule:
  """Builds the block schedule of a ring pass: which (query block, key/value block) pairs
  each device computes at each hop, as a :class:`Schedule` (host-side numpy, cached).

  A block pair is skipped when no (query, key) pair in it is allowed by the
  causal mask / local window given the layout's global positions (see
  :func:`block_visibility`): these are the pairs of each hop's :func:`block_table`,
  which the ring builds on device from the same positions, hop by hop, rather
  than carrying an ``[n, n, P]`` table. Segment ids are data, not layout: with
  them a hop's table skips further pairs (blocks sharing no document).
  ``causal_routing`` as in :func:`ring_jax.ring_attention` (default: routed for causal
  contiguous, :func:`check_routing`): routed, the schedule is the routed ring's
  (:attr:`Schedule.routes` says which part moves where at each hop).
  """
  layouts.check_length(layout, ring_size, ring_size * local_len,
                       f"sequence length ({ring_size} x local length {local_len})")
  if local_len % block_q or local_len % block_kv:
    raise ValueError(
        f"block_q={block_q} and block_kv={block_kv} must divide the local sequence length "
        f"{local_len}.")
  window = normalize_window(local_window_size)
  n = ring_size
  route = None
  if check_routing(causal_routing, layout, is_causal) and n > 1:
    route = routes(layout, n, local_len, bool(is_causal), window)
    route = route if route.routed else None
  nq, nk = local_len // block_q, local_len // block_kv
  pos = [layouts.local_positions(layout, n, local_len, d) for d in range(n)]

  def held(d, h):
    if route is None:
      return pos[(d - h) % n]
    return np.concatenate([pos[st.source(d, h, n)][st.start:st.stop] for st in route.streams])

  pairs = np.zeros((n, n, nq * nk, 2), np.int32)
  partial = np.zeros((n, n, nq * nk), bool)
  num_pairs = np.zeros((n, n), np.int32)
  for d in range(n):
    for h in range(n):
      table = block_table(pos[d], held(d, h), None, None, block_q, block_kv, is_causal,
                          window)
      p, part = table_pairs(table)
      m = num_pairs[d, h] = len(p)
      pairs[d, h, :m], partial[d, h, :m] = p, part
  for arr in (pairs, partial, num_pairs):
    arr.setflags(write=False)
  hops = hop_range(layout, n, local_len, is_causal, window)
  return Schedule(pairs=pairs, num_pairs=num_pairs, partial=partial, block_q=block_q,
                  block_kv=block_kv, layout=layout, ring_size=n, local_len=local_len,
                  hops=hops, routes=route)


@dataclasses.dataclass(frozen=True)
class Stream:
  """One part of every device's K/V shard and how it travels (see :class:`Routes`).

  start, stop: the part's token slice of a local shard (the whole shard, or one zigzag chunk).
  step: ``+1``: it travels ``d -> d+1`` (at hop ``h`` device ``d`` holds the part of device
    ``(d - h) mod n``); ``-1``: ``d -> d-1`` (the part of device ``(d + h) mod n``).
  arrive: for each hop ``first..last`` of :attr:`Routes.hops`, the ``(source, destination)``
    device pairs of the transfer that delivers that hop's parts (the first hop's from their
    owners, empty when the first hop is 0; a later hop's from the holders at the hop
    before). A device that is no destination holds no part of this stream at that hop (it
    would hold one that no query there can see).
  home: for each hop, ``(holder, owner)`` pairs: parts whose last use is this hop, whose
    float32 dK/dV accumulators the backward sends home from there.
  done_home: for each hop, the devices whose own part has its last use on itself at that hop.
  """
  start: int
  stop: int
  step: int
  arrive: tuple[tuple[tuple[int, int], ...], ...]
  home: tuple[tuple[tuple[int, int], ...], ...]
  done_home: tuple[tuple[int, ...], ...]

  def source(self, device, hop: int, ring_size: int):
    """The owner of the part ``device`` holds at ``hop`` (int or traced)."""
    return (device - self.step * hop) % ring_size


@dataclasses.dataclass(frozen=True)
class Routes:
  """Which part of which K/V shard moves where at each hop, when nothing travels unused.

  Built by :func:`routes`. Every device's shard is cut into :attr:`streams` (one, or the
  two zigzag chunks); a stream's part of shard ``j`` is forwarded only while a device further
  along its path still holds a query that can see it (from the layout's positions, the causal
  mask and the window: :func:`block_visibility` at the granularity of layout chunks), and
  its dK/dV accumulator goes straight home from the last device that uses it. ``routed``:
  some transfer of the full rotation is dropped or a stream travels backward.
  """
  layout: str
  ring_size: int
  local_len: int
  hops: tuple[int, int]
  streams: tuple[Stream, ...]

  @property
  def routed(self) -> bool:
    n = self.ring_size
    first, last = self.hops
    full = (last - first + (first != 0)) * n
    return len(self.streams) > 1 or sum(len(p) for p in self.streams[0].arrive) < full

  def kv_fraction(self) -> float:
    """K/V bytes moved over the ring pass, relative to the full rotation of whole shards."""
    n = self.ring_size
    first, last = self.hops
    full = (last - first + (first != 0)) * n * self.local_len
    moved = sum(len(p) * (s.stop - s.start) for s in self.streams for p in s.arrive)
    return moved / full if full else 1.0

  def dkv_fraction(self) -> float:
    """The backward's float32 dK/dV bytes (travelling and going home), relative to the full
    rotation (``last - first`` transfers along with K/V and one home)."""
    n = self.ring_size
    first, last = self.hops
    full = (last - first + (last != 0)) * n * self.local_len
    moved = sum(len(p) * (s.stop - s.start) for s in self.streams
                for p in s.arrive[1:] + s.home)
    return moved / full if full else 1.0

  def max_egress(self) -> float:
    """The most tokens one device sends at one hop (all streams together), over the local
    length: what bounds a hop's transfer through a switch (every GPU's links serve every
    destination), where sending two chunks two ways takes as long as one shard one way."""
    per = {}
    for s in self.streams:
      for i, pairs in enumerate(s.arrive):
        for src, _ in pairs:
          per[i, src] = per.get((i, src), 0) + s.stop - s.start
    return max(per.values(), default=0) / self.local_len

  def max_chunks_per_link(self) -> float:
    """The most tokens one link direction carries at one hop, over the local length (1: a
    whole shard per hop, as the full rotation; 0.5 where parts went opposite ways)."""
    per = {}
    for s in self.streams:
      for i, pairs in enumerate(s.arrive):
        for src, dst in pairs:
          per[i, src, dst] = per.get((i, src, dst), 0) + s.stop - s.start
    return max(per.values(), default=0) / self.local_len


#: The layouts whose causal rings route K/V by default (``causal_routing=None``): contiguous
#: routing drops half the K/V bytes and ran in the full rotation's time on CPU. Zigzag's
#: routing (and the document layout's, which runs as zigzag) drops a quarter with the same
#: work per hop, but its per-hop machinery (two parts, each its own transfer) ran 1.01-1.15x
#: the full rotation's time with 8 devices in one process, 1.02-1.21x on two processes
#: (docs/performance.md): opt-in until a measurement shows it no slower.
ROUTED_BY_DEFAULT: tuple[str, ...] = ("contiguous",)


def check_routing(causal_routing, layout: str | None = None, is_causal: bool = True) -> bool:
  """Whether a ring routes its K/V (:func:`routes`): ``causal_routing`` resolved.

  ``True`` / ``False``: as given. ``None`` (the default everywhere): on for causal
  rings in the layouts of :data:`ROUTED_BY_DEFAULT` (``layout`` and ``is_causal`` say
  which ring; without ``layout``, off). ``TypeError`` for anything else. Routing is
  exact in every layout; contiguous causal moves half the bytes, zigzag 0.75x, both with
  the same work per hop as the full rotation (docs/performance.md).
  """
  if causal_routing is None:
    return bool(is_causal) and layout in ROUTED_BY_DEFAULT
  if not isinstance(causal_routing, (bool, np.bool_)):
    raise TypeError(f"causal_routing must be None (the default: on for causal "
                    f"{'/'.join(ROUTED_BY_DEFAULT)} rings), True or False, got "
                    f"{causal_routing!r}.")
  return bool(causal_routing)


@functools.lru_cache(maxsize=256)
def routes(layout: str, ring_size: int, local_len: int, is_causal: bool,
           local_window_size=None) -> Routes:
  """The :class:`Routes` of a ring pass: per stream and hop, the transfers that are used.

  Contiguous and striped: one stream, the whole shard, forward (``d -> d+1``); with a
  causal mask on the contiguous layout shard ``j`` stops at device ``n-1`` (devices ``< j``
  see none of it): half the transfers. Zigzag: device ``i`` holds chunks ``i`` (early) and
  ``2n-1-i`` (late); every device's late queries see every early chunk, so early chunks go
  around the whole ring, but the late chunk of device ``j`` is seen only by devices
  ``0..j`` under a causal mask, so late chunks go only ``j`` hops: 0.75x the bytes. Both go
  backward (``d -> d-1``): device ``d`` then holds both chunks of ``d + h`` at hop ``h``, and
  sees the late one before the wrap and the early one after it, so every hop's work equals
  the full rotation's (early chunks forward would meet devices ``h..n-1-h`` with three
  chunk pairs of work at a hop instead of two). Striped: every device holds positions of the
  whole sequence, so under a causal mask every device sees part of every shard (nothing is
  dropped).
  """
  layouts.check_length(layout, ring_size, ring_size * local_len,
                       f"sequence length ({ring_size} x local length {local_len})")
  window = normalize_window(local_window_size)
  n, s = ring_size, local_len
  first, last = hop_range(layout, n, s, is_causal, window)
  if layout == "zigzag":
    half = s // 2
    parts, q_chunk = ((0, half, -1), (half, s, -1)), half
  else:
    parts, q_chunk = ((0, s, 1),), s
  pos = [layouts.local_positions(layout, n, s, d) for d in range(n)]
  streams = []
  for start, stop, step in parts:
    need = np.zeros((n, n), bool)  # need[j, d]: device d's queries see part of shard j
    for j in range(n):
      for d in range(n):
        vis, _ = block_visibility(pos[d], pos[j][start:stop], q_chunk, stop - start,
                                  is_causal, window)
        need[j, d] = vis.any()
    streams.append(_stream(start, stop, step, need, (first, last)))
  return Routes(layout=layout, ring_size=n, local_len=s, hops=(first, last),
                streams=tuple(streams))


def _stream(start: int, stop: int, step: int, need, hops: tuple[int, int]) -> Stream:
  """The :class:`Stream` of a part that travels ``step`` (+1/-1) over a ring of
  ``len(need)`` members, forwarded while a later holder still needs it: ``need[j, d]``
  (bool ``[n, n]``) says member ``d`` sees some of member ``j``'s part; ``hops`` the
  ``(first, last)`` hops run."""
  n = len(need)
  first, last = hops
  hops = range(first, last + 1)
  holder = lambda j, h: (j + step * h) % n  # noqa: E731
  used = {j: [h for h in hops if need[j, holder(j, h)]] for j in range(n)}
  last_use = {j: max(u) for j, u in used.items() if u}
  arrive, home, done_home = [], [], []
  for h in hops:
    if h == first:
      pairs = () if h == 0 else tuple(
          (j, holder(j, h)) for j in range(n) if last_use.get(j, first - 1) >= h)
    else:
      pairs = tuple((holder(j, h - 1), holder(j, h)) for j in range(n)
                    if last_use.get(j, first - 1) >= h)
    arrive.append(tuple(sorted(pairs)))
    done = [j for j in range(n) if last_use.get(j) == h]
    home.append(tuple(sorted((holder(j, h), j) for j in done if holder(j, h) != j)))
    done_home.append(tuple(sorted(j for j in done if holder(j, h) == j)))
  return Stream(start=start, stop=stop, step=step, arrive=tuple(arrive), home=tuple(home),
                done_home=tuple(done_home))


@functools.lru_cache(maxsize=256)
def group_routes(layout: str, n_outer: int, n_inner: int, local_len: int, is_causal: bool,
                 local_window_size=None, routed: bool = True) -> Routes:
  """The outer ring's :class:`Routes` of the two-level ring (:mod:`ring_jax.two_level`).

  The ring of ``n = n_outer * n_inner`` devices in ``layout`` (device ``g * n_inner + r``
  is member ``r`` of group ``g``), seen from the outer axis: each group's *buffer* (its
  ``n_inner`` shards) is one member's shard of a ring of ``n_outer`` groups, and group ``g``
  needs a part of group ``j``'s buffer when some device of ``g`` sees some of it (the causal
  mask and the window over the layout's positions, :func:`block_visibility` per layout
  chunk, exact for causal masks). Members and hops are groups and outer steps
  (``hops = (0, n_outer - 1)``: every step runs), pairs are group indices; ``local_len``
  is one device's. The streams follow :func:`routes`: contiguous (and striped) one
  stream, forward (``g -> g+1``): under a causal mask buffer ``j`` goes only to groups
  ``j+1..n_outer-1`` (half the outer transfers); zigzag both chunks backward (``g -> g-1``):
  early chunks around the whole outer ring, the late chunk of group ``j`` (seen by
  groups ``0..j`` only) only ``j`` steps: 0.75x. Striped: every group sees part of every
  buffer, nothing is dropped.

  ``routed=False``: the full rotation as one stream (the whole shard forward, every pair
  at every step), which the two-level ring runs without routing.
  """
  layouts.check_length(layout, n_outer * n_inner, n_outer * n_inner * local_len,
                       f"sequence length ({n_outer} x {n_inner} x local length {local_len})")
  window = normalize_window(local_window_size)
  n_o, n_i, s = n_outer, n_inner, local_len
  hops = (0, n_o - 1)
  if not routed:
    return Routes(layout=layout, ring_size=n_o, local_len=s, hops=hops,
                  streams=(_stream(0, s, 1, np.ones((n_o, n_o), bool), hops),))
  if layout == "zigzag":
    half = s // 2
    parts, q_chunk = ((0, half, -1), (half, s, -1)), half
  else:
    parts, q_chunk = ((0, s, 1),), s
  pos = [layouts.local_positions(layout, n_o * n_i, s, d) for d in range(n_o * n_i)]
  streams = []
  for start, stop, step in parts:
    need = np.zeros((n_o, n_o), bool)  # need[j, g]: group g sees part of group j's buffer
    for j in range(n_o):
      for g in range(n_o):
        need[j, g] = any(
            block_visibility(pos[g * n_i + r], pos[j * n_i + t][start:stop], q_chunk,
                             stop - start, is_causal, window)[0].any()
            for r in range(n_i) for t in range(n_i))
    streams.append(_stream(start, stop, step, need, hops))
  return Routes(layout=layout, ring_size=n_o, local_len=s, hops=hops, streams=tuple(streams))
