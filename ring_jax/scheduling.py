"""The block schedule of a ring pass: which (query block, key/value block) pairs each device
computes at each hop, as host-side numpy (:func:`schedule`).

The work model the planner (:mod:`ring_jax.planning`), the benchmarks and the tests read:
the same pairs the ring computes, from the same :func:`ring_jax.masking.block_table` the
ring builds on device at every hop, listed for every (device, hop) of a layout, with the
routes of :mod:`ring_jax.routing` when the ring routes its K/V. The ring itself never reads
it. (The module is ``scheduling`` rather than ``schedule`` so that it does not shadow the
function :func:`ring_jax.schedule` exported at the package's top level.)
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from ring_jax import layouts
from ring_jax.masking import BlockTable, block_table, normalize_window
from ring_jax.routing import Routes, check_routing, hop_range, routes


@dataclasses.dataclass(frozen=True)
class Schedule:
  """Which (query block, key/value block) pairs each device computes at each hop.

  At hop ``h`` device ``d`` holds the key/value shard that started on device
  ``(d - h) mod n`` (K/V travel ``d -> d+1``).

  With :attr:`routes` (:func:`ring_jax.routing.routes`), device ``d`` holds at hop ``h`` each
  stream's part of the shard of device ``stream.source(d, h, n)`` instead (zigzag: the early
  chunk of ``d - h``, the late chunk of ``d + h``), side by side in stream order.

  Attributes:
    pairs: int32 ``[n, n, Q*K, 2]``: ``pairs[d, h, p] = (q_block, kv_block)`` for
      ``p < num_pairs[d, h]``; the rest is padding (zeros).
    num_pairs: int32 ``[n, n]``: number of block pairs device ``d`` computes at hop ``h``.
    partial: bool ``[n, n, Q*K]``: True where a computed pair is only partly
      unmasked (the rest are fully visible).
    block_q, block_kv: block sizes in tokens.
    layout, ring_size, local_len: what the schedule was built for.
    hops: ``(first, last)`` of :func:`ring_jax.routing.hop_range`: the hops the ring runs (with a
      window and the contiguous layout, fewer than ``n``; hop ``h < 0`` is the
      shard of device ``d - h``, i.e. ``pairs[d, h % n]``). Hops outside have no pairs.
    routes: the ring's :class:`ring_jax.routing.Routes` when it routes K/V
      (``causal_routing``), else None.
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


def table_pairs(table: BlockTable):
  """numpy ``(pairs [P, 2], partial [P])``: the (query block, key block) pairs of a one-row
  table in row-major order, and whether each may be partly masked (outside the full run)."""
  pairs, partial = [], []
  for a, (lo, full_lo, full_hi, hi) in enumerate(np.asarray(table.q_ranges[0])):
    for b in range(lo, hi):
      pairs.append((a, b))
      partial.append(table.may_mask and not full_lo <= b < full_hi)
  return np.asarray(pairs, np.int32).reshape(-1, 2), np.asarray(partial, bool)


@functools.lru_cache(maxsize=256)
def schedule(layout: str, ring_size: int, local_len: int, block_q: int, block_kv: int,
             is_causal: bool = False, local_window_size=None,
             causal_routing: bool | None = None) -> Schedule:
  """Builds the block schedule of a ring pass: which (query block, key/value block) pairs
  each device computes at each hop, as a :class:`Schedule` (host-side numpy, cached).

  A block pair is skipped when no (query, key) pair in it is allowed by the
  causal mask / local window given the layout's global positions (see
  :func:`ring_jax.masking.block_visibility`): these are the pairs of each hop's
  :func:`ring_jax.masking.block_table`,
  which the ring builds on device from the same positions, hop by hop, rather
  than carrying an ``[n, n, P]`` table. Segment ids are data, not layout: with
  them a hop's table skips further pairs (blocks sharing no document).
  ``causal_routing`` as in :func:`ring_jax.ring_attention` (default: routed for causal
  contiguous, :func:`ring_jax.routing.check_routing`): routed, the schedule is the routed ring's
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
