"""Where K/V travel: the hops a ring runs and, with causal routing, which part of which shard
moves where at each hop.

:func:`hop_range` gives the hops ``first..last`` a ring runs (a local window on the
contiguous layout needs only a few neighbouring shards). :func:`routes` (the flat ring) and
:func:`group_routes` (the two-level ring's outer axis) give the :class:`Routes` of a ring
pass: every shard cut into :class:`Stream` s, each part forwarded only while a device further
along its path still holds a query that can see it (:func:`ring_jax.masking.block_visibility`
over the layout's positions), its dK/dV accumulator sent home from the last device that uses
it. :func:`check_routing` resolves ``causal_routing`` (default: :data:`ROUTED_BY_DEFAULT`).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from ring_jax import layouts
from ring_jax.masking import block_visibility, normalize_window


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
  mask and the window: :func:`ring_jax.masking.block_visibility` at the granularity of layout
  chunks), and its dK/dV accumulator goes straight home from the last device that uses it.
  ``routed``: some transfer of the full rotation is dropped or a stream travels backward.
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
#: routing drops half the K/V bytes at no measured cost in time; zigzag's (and the document
#: layout's, which runs as zigzag) drops a quarter but measured slower than the full rotation
#: on CPU (docs/performance.md, "Routing: moving only what a causal mask uses"): opt-in until
#: a measurement shows it no slower.
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
def rotation(layout: str, ring_size: int, local_len: int,
             hops: tuple[int, int] | None = None, step: int = 1) -> Routes:
  """The full rotation as :class:`Routes`: one stream, the whole shard, forward (``d ->
  d+1``; ``step=-1``: ``d -> d-1``) at every hop of ``hops`` (default: the whole ring ``(0, n -
  1)``; the first hop's transfer, when it is not 0, moves every shard ``first`` devices on),
  every accumulator home after the last hop. The plan of a ring that does not route."""
  n = ring_size
  hops = (0, n - 1) if hops is None else tuple(hops)
  return Routes(layout=layout, ring_size=n, local_len=local_len, hops=hops,
                streams=(_stream(0, local_len, step, np.ones((n, n), bool), hops),))


def backward_rotation(layout: str, ring_size: int, local_len: int) -> Routes:
  """The full rotation for the backward pass, its own shard last: every shard travels
  ``d -> d-1`` (device ``d`` holds shard ``d + h`` at hop ``h``) over the hops ``1..n``,
  so each shard's dK/dV accumulator ends its last hop on its owner and no transfer home
  follows the last hop's compute (the rotation of :func:`rotation` sends every
  accumulator home after it, with no compute left to hide it). In its place one K/V
  transfer precedes the first hop, which depends on nothing the backward computes (a
  compiler can start it during the forward); K/V are half the bytes of the float32
  accumulators in bf16. ``n = 1``: the plain rotation (nothing travels)."""
  if ring_size == 1:
    return rotation(layout, 1, local_len)
  return rotation(layout, ring_size, local_len, (1, ring_size), step=-1)


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
  mask and the window over the layout's positions, :func:`ring_jax.masking.block_visibility`
  per layout chunk, exact for causal masks). Members and hops are groups and outer steps
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
    return rotation(layout, n_o, s, hops)
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
