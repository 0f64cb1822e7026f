"""A cost model for sequence-parallel attention: which strategy, and why.

:func:`plan` predicts, per device, the FLOPs, the bytes each strategy moves,
the time those take on the device's compute and links, whether the ring's
transfers hide behind its compute, and the memory an attention call needs;
it then picks the fastest strategy that fits in memory. It is a first-order
(roofline) model with nominal hardware figures from :mod:`ring_jax.hardware`:
good for choosing between strategies and for seeing where the crossover
lies, not for predicting milliseconds. ``docs/performance.md`` derives it.

Per device (after ``data``/``tensor`` sharding), with ``n`` sequence devices,
local length ``ℓ = L/n``, ``N``/``K`` query/key-value heads, head dim ``d``,
``e`` bytes per element, ``c`` the fraction of (query, key) pairs computed on
the busiest device (1 without a mask; ½ causal with a balanced layout, ``1 -
1/(2n)`` causal contiguous; window width / L with a window). With V's own head size
``d_v`` (``value_head_dim``, MLA) every ``2·d`` below reads ``d + d_v`` (one score and one
value matmul; K and V, or Q and the output, side by side):

* compute: forward ``4·B·ℓ·L·N·d·c`` FLOPs, backward 2.5x that (FlashAttention-2).
* ring: ``n-1`` hops, each moving ``2·B·ℓ·K·d·e`` bytes over one link while a
  hop's compute runs; hidden iff ``ℓ >= ℓ* = e/(2c)·(K/N)·F/W``. The backward
  moves K/V again and the float32 dK/dV (``(e+4)/e`` times the bytes).
* all_gather: gathers ``(n-1)·2·B·ℓ·K·d·e`` bytes before computing (exposed);
  the backward gathers again and reduce-scatters float32 dK/dV. Holds the
  whole K/V (and its float32 gradients in the backward).
* ulysses: two ``all_to_all`` of ``(u-1)/u`` of the local q, k, v and out
  (K/V heads repeated up to ``u`` when fewer), exposed; attention over the
  whole sequence for ``N/u`` heads.
* hybrid ``(r, u)``: Ulysses over ``u`` then a ring of ``r`` on shards of
  ``L/r`` tokens with ``N/u`` heads.
* two-level ring ``(o, i)`` (a pair of axes, :mod:`ring_jax.two_level`): ``o``
  outer steps of ``max(inner ring, outer transfer)``, each inner ring ``i``
  hops over the inner axis's links while the next outer buffer (``2·B·ℓ·K·d·e``
  bytes) crosses the outer links. Hidden iff ``ℓ >= ℓ*`` of the inner links and
  ``ℓ >= ℓ*/i`` of the outer ones: the slow link gets ``i`` hops of compute
  to hide behind, where a flat ring over both axes waits for it at every hop.

Links: on a TPU torus a mesh axis is a ring of neighbours: ``ppermute`` uses
one link in one direction, ``all_gather``/``psum_scatter`` a bidirectional
ring (2 links), ``all_to_all`` is bisection-bound (2 links, and ``n/4`` hops
on average beyond 4 devices). Through an NVSwitch every transfer gets the
GPU's whole NVLink bandwidth. An axis whose devices (times the devices of the
axes inside it: ``tensor``, and for the hybrid's ring its Ulysses axis) span
more than one fast domain (TPU pod, 8-GPU node) uses the network bandwidth.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np

from ring_jax import hardware
from ring_jax import layouts
from ring_jax import routing
from ring_jax import scheduling
from ring_jax import validation
from ring_jax.ring import default_block

#: The sequence-parallel strategies (ring_jax.strategies implements them; "auto" asks plan()).
STRATEGIES: tuple[str, ...] = ("ring", "all_gather", "ulysses", "hybrid")


@dataclasses.dataclass(frozen=True)
class Estimate:
  """The prediction for one strategy (per device, fwd+bwd unless ``backward=False``).

  Attributes:
    strategy: ``"ring"``, ``"all_gather"``, ``"ulysses"`` or ``"hybrid"``.
    split: for the hybrid, ``(ring_size, ulysses_size)``; for the two-level ring
      ``(outer, inner)``; else ``(n,)``.
    feasible: whether it can run on these shapes (heads divisible, lengths...).
    why_not: the reason when it cannot (or does not fit in memory).
    flops: FLOPs on the busiest device.
    bytes_moved: bytes sent by one device over the call.
    compute_s, comm_s: time of the compute and of the transfers alone.
    exposed_comm_s: transfer time not hidden behind compute.
    time_s: predicted time (compute + exposed transfers).
    hidden: ring/hybrid: whether the ring's transfers hide behind each hop's compute
      (forward, and backward when included).
    min_local_len: ring/hybrid: the local length from which they would (``ℓ*``, or
      with the backward the larger ``ℓ*_bwd``; without a window).
    memory_bytes: predicted peak bytes per device of the call (inputs, outputs,
      residuals, temporaries).
    padding: tokens of padding per row: a length the strategy does not split runs padded at
      its end to the next one it does (``attention_sharded`` pads natural-order inputs so,
      :func:`ring_jax.strategies.global_arrays.padded_length`), and every figure above is
      for ``seq_len + padding`` tokens.
  """
  strategy: str
  split: tuple[int, ...]
  feasible: bool
  why_not: str | None
  flops: float
  bytes_moved: float
  compute_s: float
  comm_s: float
  exposed_comm_s: float
  time_s: float
  hidden: bool | None
  min_local_len: float | None
  memory_bytes: float
  padding: int = 0

  @property
  def name(self) -> str:
    return _name(self.strategy, self.split)


def _name(strategy: str, split) -> str:
  """``"hybrid<r>x<u>"``, the two-level ring as ``"ring<outer>x<inner>"``, else the strategy."""
  if len(split) == 2:
    return f"{strategy}{split[0]}x{split[1]}"
  return strategy


@dataclasses.dataclass(frozen=True)
class Plan:
  """What :func:`plan` returns: the choice, the reasons, every strategy's estimate."""
  strategy: str
  split: tuple[int, ...]
  reasons: tuple[str, ...]
  estimates: tuple[Estimate, ...]
  device: str
  setting: str

  def estimate(self, name: str) -> Estimate:
    """The estimate of strategy ``name`` (the hybrid's as ``"hybrid<r>x<u>"`` or the best one)."""
    for e in self.estimates:
      if e.name == name:
        return e
    found = [e for e in self.estimates if e.strategy == name]
    if not found:
      raise KeyError(f"no estimate for {name!r}; have {[e.name for e in self.estimates]}")
    return min(found, key=lambda e: e.time_s)

  def table(self) -> str:
    """A fixed-width table of the estimates, then the choice and its reasons."""
    head = (f"{'strategy':12s} {'TFLOP':>8s} {'GB moved':>9s} {'compute':>9s} {'comm':>9s} "
            f"{'exposed':>9s} {'time':>9s} {'hidden':>6s} {'l*':>7s} {'mem GiB':>8s}  note")
    rows = [self.setting, head]
    for e in self.estimates:
      hidden = "-" if e.hidden is None else ("yes" if e.hidden else "no")
      lstar = "-" if e.min_local_len is None else f"{e.min_local_len:,.0f}"
      note = "" if e.feasible and e.why_not is None else f"[{e.why_not}]"
      if e.padding:
        note = f"pads +{e.padding} tokens/row " + note
      if e.flops == 0 and not e.feasible:
        rows.append(f"{e.name:12s} {'-':>8s} {'-':>9s} {'-':>9s} {'-':>9s} {'-':>9s} "
                    f"{'-':>9s} {'-':>6s} {'-':>7s} {'-':>8s}  {note}")
        continue
      rows.append(
          f"{e.name:12s} {e.flops / 1e12:8.1f} {e.bytes_moved / 1e9:9.2f} "
          f"{_ms(e.compute_s):>9s} {_ms(e.comm_s):>9s} {_ms(e.exposed_comm_s):>9s} "
          f"{_ms(e.time_s):>9s} {hidden:>6s} {lstar:>7s} {e.memory_bytes / 2**30:8.2f}  {note}")
    chosen = self.estimate(_name(self.strategy, self.split))
    rows.append(f"-> {chosen.name}: " + "; ".join(self.reasons))
    return "\n".join(rows)

  def __repr__(self) -> str:
    return self.table()

  __str__ = __repr__


def _ms(seconds: float) -> str:
  return f"{seconds * 1e3:.2f}ms"


def _dtype_bytes(dtype) -> int:
  if isinstance(dtype, (int, np.integer)):
    return int(dtype)
  if "bfloat16" in str(dtype):
    return 2
  return int(np.dtype(dtype).itemsize)


def _window_pair(local_window_size):
  if local_window_size is None:
    return None
  if isinstance(local_window_size, (int, np.integer)):
    return int(local_window_size), int(local_window_size)
  left, right = local_window_size
  return int(left), int(right)


def _coverage(seq_len, n, is_causal, window, layout) -> float:
  """Fraction of the busiest device's (query, key) pairs that are computed."""
  if window is not None:
    left, right = window
    width = min(left, seq_len) + (0 if is_causal else min(right, seq_len)) + 1
    return min(1.0, width / seq_len)
  if not is_causal:
    return 1.0
  if layout == "contiguous" and n > 1:
    return 1.0 - 1.0 / (2 * n)  # the last device: all keys but half its own shard
  return 0.5


@dataclasses.dataclass(frozen=True)
class _Links:
  p2p: float       # one ppermute to a neighbour
  gather: float    # all_gather / psum_scatter, per device
  a2a: float       # all_to_all, per device, before the n/4 factor on a torus
  torus: bool


def _links(spec: hardware.DeviceSpec, span: int, link_bandwidth, network_bandwidth,
           fast_domain=None) -> _Links:
  """Bandwidths a collective over an axis of devices gets, from the device's figures."""
  fast = fast_domain or spec.fast_domain or 1
  if span > fast:
    w = network_bandwidth or spec.network_bandwidth
    if w is None:
      raise ValueError(
          f"{span} devices exceed one fast domain of {spec.label} ({fast} devices) and the "
          "table has no network bandwidth for it: pass network_bandwidth= (bytes/s per device, "
          "one direction).")
    return _Links(p2p=w, gather=w, a2a=w, torus=False)
  w = link_bandwidth or spec.link_bandwidth
  if w is None or spec.topology is None:
    raise ValueError(f"no link bandwidth known for {spec.label}: pass link_bandwidth= "
                     "(bytes/s, one link, one direction).")
  if spec.topology == "torus":
    return _Links(p2p=w, gather=2 * w, a2a=2 * w, torus=True)
  total = w * (spec.links or 1)
  return _Links(p2p=total, gather=total, a2a=total, torus=False)


def _a2a_time(nbytes_local, u, links: _Links) -> float:
  """Time of an all_to_all of a device's ``nbytes_local`` over ``u`` devices."""
  if u <= 1:
    return 0.0
  sent = nbytes_local * (u - 1) / u
  hops = max(1.0, u / 4) if links.torus else 1.0  # torus: bisection-bound beyond 4
  return sent * hops / links.a2a


def _ring_time(hop_compute, hops_active, hop_transfer, n):
  """Synchronous hops: hop 0 computes only; hops 1..n-1 take max(compute, transfer)."""
  total = 0.0
  for h in range(n):
    comp = hop_compute if h < hops_active else 0.0
    total += comp if h == 0 else max(comp, hop_transfer)
  return total


@dataclasses.dataclass(frozen=True)
class _Setting:
  """One :func:`plan` call, per device after ``data``/``tensor`` sharding: what every
  strategy's cost function reads."""
  spec: hardware.DeviceSpec
  flops_s: float            # peak FLOP/s
  link_bandwidth: float | None
  network_bandwidth: float | None
  tensor: int
  b: int                    # batch per device
  nh: int                   # query heads per device
  kh: int                   # key/value heads per device (MQA: the one, replicated)
  d: int
  e: int                    # bytes per element
  seq_len: int
  is_causal: bool
  window: tuple[int, int] | None
  layout: str
  backward: bool
  block: int | None         # None: the ring's default for each strategy's local length
  fast_domain: int | None = None  # devices on the fast links (None: the device table's)
  causal_routing: bool = False  # the ring's K/V routing (routing.routes)
  dv: int | None = None     # V's (and the output's) head size where it differs from d

  @property
  def hv(self) -> int:
    """V's and the output's head size (``d`` unless ``value_head_dim``)."""
    return self.d if self.dv is None else self.dv

  @property
  def dd(self) -> int:
    """``d + hv``: the head sizes of one score matmul and one value matmul together."""
    return self.d + self.hv

  @property
  def platform(self) -> str:
    """The device's platform (this process's backend for figures given by hand)."""
    return self.spec.platform or jax.default_backend()

  @property
  def bwd(self) -> float:
    return 2.5 if self.backward else 0.0  # backward FLOPs / forward (FlashAttention-2)

  def kv_bytes(self, tokens, k_heads) -> float:
    """K and V (two buffers: head sizes ``d`` and ``hv``)."""
    return self.b * tokens * k_heads * self.dd * self.e

  def act_bytes(self, tokens, q_heads, k_heads) -> float:
    """q, k, v, out (and with backward: dout, dq, dk, dv) in the input dtype."""
    per = self.b * tokens * self.e * (q_heads + k_heads) * self.dd
    return per * (2 if self.backward else 1)

  def tile_bytes(self, q_heads, local_len) -> float:
    """The hop kernel's float32 score tiles, for blocks of the ring's default size."""
    block = self.block or default_block(self.layout, max(1, int(local_len)),
                                        platform=self.platform)
    return 3 * self.b * q_heads * block * block * 4

  def links(self, span: int) -> _Links:
    return _links(self.spec, span, self.link_bandwidth, self.network_bandwidth,
                  self.fast_domain)


def _ring_like(s: _Setting, r, tokens, q_heads, k_heads, links_ring) -> dict:
  """A ring of ``r`` over shards of ``tokens`` with ``q_heads``/``k_heads`` per device."""
  c = _coverage(s.seq_len, r, s.is_causal, s.window, s.layout)
  fwd = 2 * s.b * tokens * s.seq_len * q_heads * s.dd * c
  hop_fwd = fwd / r
  active = r
  if s.window is not None:
    left, right = s.window
    reach = min(left, s.seq_len) + (0 if s.is_causal else min(right, s.seq_len))
    active = min(r, 1 + math.ceil(reach / tokens))
    hop_fwd = fwd / active
  # With a window the contiguous ring runs only the hops that hold visible keys.
  first, last = routing.hop_range(s.layout, r, max(1, int(tokens)), s.is_causal, s.window)
  runs = last - first + 1
  sends = runs - 1 + (first < 0)  # one more transfer to start from a later shard
  active = min(active, runs)
  kv = s.kv_bytes(tokens, k_heads)
  t_fwd = kv / links_ring.p2p
  t_bwd = kv * (s.e + 4) / s.e / links_ring.p2p
  time = _ring_time(hop_fwd / s.flops_s, active, t_fwd, runs) + (first < 0) * t_fwd
  comm = sends * t_fwd
  moved = sends * kv
  if s.backward:
    home = kv * 4 / s.e / links_ring.p2p  # dK/dV home
    time += _ring_time(hop_fwd * s.bwd / s.flops_s, active, t_bwd, runs) + home
    comm += sends * t_bwd + home
    moved += sends * kv + runs * kv * 4 / s.e
  link = 1.0  # a hop's transfer time, relative to one shard over one link
  route = _routes(s, r, tokens)
  if route is not None:
    # docs/performance.md "Routing": fewer bytes; a hop's transfer takes the busiest link's
    # share (torus: each direction is its own link; switch: a device's egress), and the
    # busiest device's work per hop grows by the schedule's critical-path ratio.
    link = route.max_chunks_per_link() if links_ring.torus else route.max_egress()
    slow = _critical_path_ratio(s, r, tokens)
    time = _ring_time(hop_fwd * slow / s.flops_s, active, t_fwd * link, runs)
    comm = sends * t_fwd * route.kv_fraction()
    moved = sends * kv * route.kv_fraction()
    if s.backward:
      dkv = runs * kv * 4 / s.e * route.dkv_fraction()
      time += (_ring_time(hop_fwd * slow * s.bwd / s.flops_s, active, t_bwd * link, runs)
               + kv * 4 / s.e / links_ring.p2p * link)
      comm += sends * kv * route.kv_fraction() / links_ring.p2p + dkv / links_ring.p2p
      moved += sends * kv * route.kv_fraction() + dkv
  # docs/performance.md: l* = e/(2c) (K/N) F/W; with the backward (K/V and float32
  # dK/dV travel, 2.5x the compute) (e+4)/(5c) (K/N) F/W, the larger of the two; routed,
  # times the busiest link's share of a shard per hop.
  lstar = link * s.e / (2 * c) * (k_heads / q_heads) * s.flops_s / links_ring.p2p
  if s.backward:
    lstar = max(lstar, link * (s.e + 4) / (5 * c) * (k_heads / q_heads) * s.flops_s
                / links_ring.p2p)
  # Every hop must compute at least as long as its transfer; with a window and a layout
  # whose hops are not pruned (zigzag, striped) most hops only pass K/V on.
  hidden = runs == 1 or (active == runs and hop_fwd >= t_fwd * link * s.flops_s and (
      not s.backward or hop_fwd * s.bwd >= t_bwd * link * s.flops_s))
  mem = (s.act_bytes(tokens, q_heads, k_heads) + 2 * kv + s.b * tokens * q_heads * s.hv * 4
         + s.tile_bytes(q_heads, tokens))
  if s.backward:
    mem += s.b * tokens * q_heads * s.d * 4 + 4 * kv * 4 / s.e
  return dict(flops=fwd * (1 + s.bwd), bytes_moved=moved, compute_s=fwd * (1 + s.bwd) / s.flops_s,
              comm_s=comm, time_s=time, hidden=hidden, min_local_len=lstar, memory_bytes=mem)


def _routes(s: _Setting, r, tokens):
  """The ring's :class:`ring_jax.routing.Routes` with ``causal_routing``, or None (off,
  nothing dropped, or a local length the layout cannot split)."""
  if not s.causal_routing or r < 2 or tokens != int(tokens):
    return None
  try:
    route = routing.routes(s.layout, r, int(tokens), s.is_causal, s.window)
  except ValueError:
    return None
  return route if route.routed else None


def _critical_path_ratio(s: _Setting, r, tokens) -> float:
  """Routed over full ring: the sum over hops of the busiest device's block pairs, with one
  block per layout chunk (1 for the routes :func:`ring_jax.routing.routes` builds today;
  kept so a route that shifts work between hops is costed)."""
  chunk = int(tokens) // 2 if s.layout == "zigzag" else int(tokens)
  window = s.window
  full = scheduling.schedule(s.layout, r, int(tokens), chunk, chunk, s.is_causal, window)
  routed = scheduling.schedule(s.layout, r, int(tokens), chunk, chunk, s.is_causal, window,
                               causal_routing=True)
  return routed.critical_path() / max(1, full.critical_path())


def _ring_cost(s: _Setting, n: int) -> dict:
  """The ring over ``n`` devices: ``n`` synchronous hops of ``max(compute, transfer)``."""
  return _ring_like(s, n, s.seq_len / n, s.nh, s.kh, s.links(n * s.tensor))


def _group_routes(s: _Setting, n_o: int, n_i: int, tokens):
  """The two-level ring's outer :class:`ring_jax.routing.Routes` with ``causal_routing``
  (:func:`ring_jax.routing.group_routes`), or None (off, nothing dropped, or a local
  length the layout cannot split)."""
  if not s.causal_routing or n_o < 2 or tokens != int(tokens):
    return None
  try:
    route = routing.group_routes(layouts.mask_layout(s.layout), n_o, n_i, int(tokens),
                                 s.is_causal, s.window)
  except ValueError:
    return None
  return route if route.routed else None


def _two_level_cost(s: _Setting, n_o: int, n_i: int) -> dict:
  """The two-level ring (:mod:`ring_jax.two_level`): ``n_o`` outer steps, each an ``n_i``-hop
  inner ring over the inner axis's links while the outer buffer's transfer (to the next
  group, over the links the whole ring spans) runs: a step takes ``max(inner ring, outer
  transfer)``, the last one the inner ring alone. The backward's outer transfers carry K/V
  and the float32 dK/dV; its last dK/dV goes home in one transfer over the outer links.
  Every hop runs (a window's hop pruning is the flat ring's). With ``causal_routing`` the
  outer bytes are the routed ones (:func:`_group_routes`)."""
  n = n_o * n_i
  tokens = s.seq_len / n
  inner = s.links(n_i * s.tensor)
  outer = s.links(n * s.tensor)
  c = _coverage(s.seq_len, n, s.is_causal, s.window, s.layout)
  fwd = 2 * s.b * tokens * s.seq_len * s.nh * s.dd * c
  hop = fwd / n / s.flops_s
  kv = s.kv_bytes(tokens, s.kh)
  grad = 4 / s.e  # float32 dK/dV per byte of K/V

  def level_time(hop_s, inner_xfer, outer_xfer):
    ring = _ring_time(hop_s, n_i, inner_xfer, n_i)
    return (n_o - 1) * max(ring, outer_xfer) + ring

  # Routed (causal_routing): the outer K/V and dK/dV bytes of routing.group_routes; a
  # step still sends a whole buffer over its busiest outer link (contiguous: every step
  # but the last; zigzag: both chunks share the link early on), so the times stay.
  kv_frac = dkv_frac = 1.0
  route = _group_routes(s, n_o, n_i, tokens)
  if route is not None:
    kv_frac, dkv_frac = route.kv_fraction(), route.dkv_fraction()
  time = level_time(hop, kv / inner.p2p, kv / outer.p2p)
  comm = (n_o * (n_i - 1) * kv / inner.p2p + (n_o - 1) * kv * kv_frac / outer.p2p)
  moved = n_o * (n_i - 1) * kv + (n_o - 1) * kv * kv_frac
  if s.backward:
    home = kv * grad / outer.p2p
    time += level_time(hop * s.bwd, kv * (1 + grad) / inner.p2p,
                       kv * (1 + grad) / outer.p2p) + home
    # Inner: K/V and dK/dV between hops, each step's dK/dV back to the outer buffer's
    # holder (the last step: the outer dK/dV one device on instead). Outer: K/V, and the
    # dK/dV one group on per step after the first, then home (routed: on only as far as
    # used, home from the last group that uses it).
    inner_bwd = n_o * (n_i - 1) * kv * (1 + grad) + (n_o if n_i > 1 else 0) * kv * grad
    outer_bwd = (n_o - 1) * kv * kv_frac + n_o * kv * grad * dkv_frac
    comm += inner_bwd / inner.p2p + outer_bwd / outer.p2p
    moved += inner_bwd + outer_bwd
  # Hidden: each inner hop covers its inner transfer (l* of the inner links) and each inner
  # ring its outer transfer (n_i hops: l* of the outer links divided by n_i).
  ratio = s.kh / s.nh * s.flops_s
  lstar = max(s.e / (2 * c) * ratio / inner.p2p, s.e / (2 * c) * ratio / outer.p2p / n_i)
  hidden = hop >= kv / inner.p2p and n_i * hop >= kv / outer.p2p
  if s.backward:
    lstar = max(lstar, (s.e + 4) / (5 * c) * ratio / inner.p2p,
                (s.e + 4) / (5 * c) * ratio / outer.p2p / n_i)
    hidden = hidden and (hop * s.bwd >= kv * (1 + grad) / inner.p2p
                         and n_i * hop * s.bwd >= kv * (1 + grad) / outer.p2p)
  # The flat ring's buffers plus the outer buffer in flight (and its dK/dV accumulators).
  mem = (s.act_bytes(tokens, s.nh, s.kh) + 4 * kv + s.b * tokens * s.nh * s.hv * 4
         + s.tile_bytes(s.nh, tokens))
  if s.backward:
    mem += s.b * tokens * s.nh * s.d * 4 + 6 * kv * grad
  return dict(flops=fwd * (1 + s.bwd), bytes_moved=moved, compute_s=fwd * (1 + s.bwd) / s.flops_s,
              comm_s=comm, time_s=time, hidden=hidden or n == 1, min_local_len=lstar,
              memory_bytes=mem)


def _all_gather_cost(s: _Setting, n: int) -> dict:
  """Gather the whole K/V (exposed), attend; the backward gathers again and reduce-scatters
  the float32 dK/dV. Holds the whole K/V (and its float32 gradients)."""
  local = s.seq_len / n
  links = s.links(n * s.tensor)
  c = _coverage(s.seq_len, n, s.is_causal, s.window, s.layout)
  fwd = 2 * s.b * local * s.seq_len * s.nh * s.dd * c
  gather = (n - 1) * s.kv_bytes(local, s.kh)
  comm, moved = gather / links.gather, gather
  if s.backward:
    comm += (gather + gather * 4 / s.e) / links.gather
    moved += gather + gather * 4 / s.e
  comp = fwd * (1 + s.bwd) / s.flops_s
  mem = (s.act_bytes(local, s.nh, s.kh) + s.kv_bytes(s.seq_len, s.kh)
         + s.b * local * s.nh * s.hv * 4 + s.tile_bytes(s.nh, local))
  if s.backward:
    mem += s.kv_bytes(s.seq_len, s.kh) * 4 / s.e + s.b * local * s.nh * s.d * 4
  return dict(flops=fwd * (1 + s.bwd), bytes_moved=moved, compute_s=comp, comm_s=comm,
              time_s=comp + comm, hidden=None, min_local_len=None, memory_bytes=mem)


def _ulysses_cost(s: _Setting, u: int) -> dict:
  """Two all_to_alls (exposed) around attention over the whole sequence for ``N/u`` heads."""
  local = s.seq_len / u
  links = s.links(u * s.tensor)
  kr = max(s.kh, u)
  c = _coverage(s.seq_len, 1, s.is_causal, s.window, "zigzag")  # whole sequence: balanced
  fwd = 2 * s.b * s.seq_len * s.seq_len * (s.nh / u) * s.dd * c
  exchange = s.b * local * s.e * (s.nh + kr) * s.dd  # q, k, v in; out back
  ways = 2 if s.backward else 1
  comm = ways * _a2a_time(exchange, u, links)
  comp = fwd * (1 + s.bwd) / s.flops_s
  mem = (s.act_bytes(local, s.nh, kr) + s.act_bytes(s.seq_len, s.nh / u, kr / u)
         + s.b * s.seq_len * (s.nh / u) * s.hv * 4 + s.tile_bytes(s.nh / u, local))
  if s.backward:
    mem += s.b * s.seq_len * 4 * (s.nh * s.d + kr * s.dd) / u
  return dict(flops=fwd * (1 + s.bwd), bytes_moved=exchange * (u - 1) / u * ways,
              compute_s=comp, comm_s=comm, time_s=comp + comm, hidden=None,
              min_local_len=None, memory_bytes=mem)


def _hybrid_cost(s: _Setting, r: int, u: int) -> dict:
  """Ulysses over ``u`` (inside), then a ring of ``r`` on shards of ``L/r`` tokens and
  ``N/u`` heads (its axis spans the Ulysses axis's devices too)."""
  kr = max(s.kh, u)
  res = _ring_like(s, r, s.seq_len / r, s.nh / u, kr / u, s.links(r * u * s.tensor))
  local = s.seq_len / (r * u)
  exchange = s.b * local * s.e * (s.nh + kr) * s.dd
  ways = 2 if s.backward else 1
  a2a = _a2a_time(exchange, u, s.links(u * s.tensor)) * ways
  res["comm_s"] += a2a
  res["time_s"] += a2a
  res["bytes_moved"] += exchange * (u - 1) / u * ways
  res["memory_bytes"] += s.act_bytes(local, s.nh, kr)
  return res


#: strategy -> (its cost function, the step between the lengths it splits, why it cannot run
#: or None); each takes (setting, *split). A length it does not split is costed padded.
_COSTS = {
    "ring": (_ring_cost, lambda s, n: validation.split_multiple(s.layout, n), lambda s, n: None),
    "all_gather": (_all_gather_cost, lambda s, n: validation.split_multiple(s.layout, n),
                   lambda s, n: None),
    # Natural-order inputs run Ulysses in natural order (attention_sharded): no layout rule.
    "ulysses": (_ulysses_cost, lambda s, u: validation.split_multiple("contiguous", u),
                lambda s, u: _heads_problem(s.nh, s.kh, u)),
    "hybrid": (_hybrid_cost, lambda s, r, u: validation.split_multiple(s.layout, r, ulysses=u),
               lambda s, r, u: _heads_problem(s.nh, s.kh, u)),
}
assert tuple(_COSTS) == STRATEGIES


def plan(*, batch: int, seq_len: int, heads: int, head_dim: int, kv_heads: int | None = None,
         value_head_dim: int | None = None, dtype="bfloat16", is_causal: bool = True,
         local_window_size=None, layout: str = "zigzag", sequence=8, tensor: int = 1, data: int = 1,
         device: str | None = None, peak_flops: float | None = None,
         link_bandwidth: float | None = None, network_bandwidth: float | None = None,
         memory_bytes: float | None = None, backward: bool = True, block: int | None = None,
         strategies=None, fast_domain: int | None = None,
         causal_routing: bool | None = None) -> Plan:
  """Predicts each sequence-parallel strategy's cost per device and picks one.

  Args:
    batch, seq_len, heads, head_dim, kv_heads: global shapes (``kv_heads``
      defaults to ``heads``).
    value_head_dim: V's (and the output's) head size where it differs from ``head_dim``
      (MLA: 192 and 128); the FLOPs, bytes moved and memory follow it (K and V as two
      buffers). None: ``head_dim``.
    dtype: of q/k/v (a numpy/JAX dtype, its name, or bytes per element).
    is_causal, local_window_size, layout: the mask and the sequence layout.
    sequence: devices the sequence is split over: an int ``n`` (ring,
      all_gather, ulysses over one axis of ``n``, and the hybrid for every
      split ``r x u = n`` with ``u > 1``), or a pair ``(outer, inner)``: two
      mesh axes, the inner one on the faster links, as
      ``attention_sharded(seq_axis=(outer, inner))`` takes them: the
      two-level ring (``strategy="ring"``, estimate ``"ring<o>x<i>"``), the
      flat ring over both (estimate ``"ring"``: compared, not run by
      ``attention_sharded``; never faster in this model), all_gather over both,
      and the hybrid (ring over ``outer``, Ulysses over ``inner``).
    tensor, data: sizes of the head and batch axes (they divide heads / batch).
    device: a device kind (``jax.Device.device_kind`` or a name of
      :mod:`ring_jax.hardware`, e.g. ``"TPU v5p"``, ``"H200"``, ``"cpu"``).
    peak_flops, link_bandwidth, network_bandwidth, memory_bytes: override (or
      supply, without ``device``) the device's figures: FLOP/s, one link one
      direction (bytes/s), network per device one direction, memory per device.
    backward: include the backward pass (training) or not (inference).
    block: the hop kernel's block size (the score tiles' memory); default the
      one the strategies run with, :func:`ring_jax.ring.default_block` of each
      one's local length on the device's platform (at most
      ``ring_jax.ring.BLOCK_TARGETS[platform]``); the table's first line names it.
    strategies: restrict the candidates (default all of ``ring``,
      ``all_gather``, ``ulysses``, ``hybrid``).
    fast_domain: devices that share the fast links (a TPU slice of a multislice
      job, an NVLink node); default the device table's. Beyond it transfers use
      ``network_bandwidth`` (DCN, InfiniBand).
    causal_routing: the ring's (and the hybrid's ring's) K/V routing, as in
      :func:`ring_jax.ring_attention`: the bytes of
      :func:`ring_jax.routing.routes`, the busiest link's share per hop
      (``min_local_len`` scales by it), the busiest device's work per hop.

  Returns:
    a :class:`Plan`: ``strategy`` (and ``split`` for the hybrid), the reasons,
    and every candidate's :class:`Estimate`; ``print(plan)`` shows a table. Any
    ``seq_len >= 1``: a strategy that does not split it is costed at the next length it
    splits, the padding its :attr:`Estimate.padding` (the table's note, and a reason when
    the chosen one pads).
  """
  wanted = tuple(STRATEGIES if strategies is None else strategies)
  for name in wanted:
    if name not in STRATEGIES:
      raise ValueError(f"strategies must be among {STRATEGIES}, got {name!r}.")
  if isinstance(sequence, (tuple, list)):
    if len(sequence) != 2:
      raise ValueError(f"sequence must be an int or a pair (outer, inner), got {sequence!r}.")
    pair = tuple(int(x) for x in sequence)
    n = math.prod(pair)
    # Two mesh axes: the two-level ring, the flat ring and all-gather over both, the hybrid.
    candidates = [("ring", pair), ("ring", (n,)), ("all_gather", (n,)), ("hybrid", pair)]
  else:
    n = int(sequence)
    candidates = [(name, (n,)) for name in ("ring", "all_gather", "ulysses")]
    candidates += [("hybrid", (n // u, u)) for u in range(2, n) if n % u == 0]
  if seq_len < 1:
    raise ValueError(f"seq_len must be >= 1, got {seq_len}.")
  if batch % data:
    raise ValueError(f"batch {batch} is not divisible by data={data}.")
  if heads % tensor:
    raise ValueError(f"heads {heads} are not divisible by tensor={tensor}.")
  kv_heads = heads if kv_heads is None else kv_heads
  spec = _device(device, peak_flops, link_bandwidth)
  window = _window_pair(local_window_size)
  s = _Setting(spec=spec, flops_s=float(peak_flops or spec.peak_bf16_flops),
               link_bandwidth=link_bandwidth, network_bandwidth=network_bandwidth,
               tensor=tensor, b=batch // data, nh=heads // tensor,
               kh=kv_heads // tensor if kv_heads % tensor == 0 else 1,  # MQA: replicated
               d=head_dim, e=_dtype_bytes(dtype), seq_len=seq_len, is_causal=is_causal,
               window=window, layout=layout, backward=backward, block=block,
               fast_domain=fast_domain,
               dv=None if value_head_dim in (None, head_dim) else int(value_head_dim),
               causal_routing=routing.check_routing(causal_routing, layout, is_causal))
  budget = float(memory_bytes or spec.memory_bytes or math.inf)
  estimates = []
  for name, split in candidates:
    if name not in wanted:
      continue
    cost, multiple, problem = _COSTS[name]
    if name == "ring" and len(split) == 2:
      cost, multiple = _two_level_cost, lambda s, o, i: _COSTS["ring"][1](s, o * i)
      problem = lambda s, o, i: None  # noqa: E731
    why = problem(s, *split)
    step = multiple(s, *split)
    padded = dataclasses.replace(s, seq_len=-(-seq_len // step) * step)
    estimates.append(_infeasible(name, split, why) if why else
                     _fit(_estimate(name, split, cost(padded, *split),
                                    padding=padded.seq_len - seq_len), budget))
  setting = (f"{spec.label}: B={batch} L={seq_len:,} N={heads} K={kv_heads} d={head_dim} "
             f"{'' if s.dv is None else f'dv={s.dv} '}"
             f"{_dtype_name(dtype)}, {_mask_name(is_causal, window)}, layout={layout}, "
             f"sequence={sequence} tensor={tensor} data={data}, "
             f"{_block_note(s, seq_len // max(1, math.prod(np.atleast_1d(sequence))))}, "
             f"{'fwd+bwd' if backward else 'fwd'}; per device:")
  return _choose(estimates, spec, setting)


def _block_note(s: _Setting, local_len: int) -> str:
  """``"block 128 (cpu default)"``: the hop kernel's block at the ring's local length."""
  if s.block:
    return f"block {s.block}"
  block = default_block(s.layout, max(1, int(local_len)), platform=s.platform)
  return f"block {block} ({s.platform} default)"


def choose_layout(ring_size: int, *, packed: bool, is_causal: bool = True,
                  local_window_size=None, local_len: int | None = None) -> tuple[str, str]:
  """``(layout, why)``: the sequence layout that balances a ring's work for this input.

  The rule (the first that applies):

  * a ring of 1: ``"contiguous"``; one device holds the row in natural order in every
    layout, and contiguous splits any length (zigzag needs an even one).
  * not causal: ``"contiguous"``; every query sees every key (of its document), so no
    layout moves work between devices.
  * a local window: ``"contiguous"`` when it lets the ring skip hops
    (:func:`ring_jax.routing.hop_range`: a window of at most one shard of
    ``local_len`` tokens reaches only the device before, 2 hops of ``ring_size``),
    where zigzag and striped, whose shards hold far-apart positions, run every hop;
    else ``"zigzag"`` (the document layout does not keep distances, so it takes no
    window).
  * packed rows (several documents per row, told apart by segment ids):
    ``"document"``, each row balanced by its own documents
    (:func:`ring_jax.document_layout`: the busiest device's causal work 1.01-1.09x the
    mean where zigzag's is 1.5-1.9x on 128K-token rows of realistic documents,
    ``benchmarks/balance.py packed``).
  * one sequence per row: ``"zigzag"``, the same causal work on every device at every hop.

  Args:
    ring_size: devices the sequence is split over.
    packed: whether rows pack several documents.
    is_causal, local_window_size: the mask, as :func:`ring_jax.ring_attention` takes it.
    local_len: tokens per device; needed with a window.
  """
  if ring_size == 1:
    return "contiguous", "a ring of 1 device: every layout is the natural order"
  if not is_causal:
    return "contiguous", "not causal: every layout gives each device the same work"
  window = _window_pair(local_window_size)
  if window is not None:
    if local_len is None:
      raise ValueError("choose_layout with a local_window_size needs local_len.")
    first, last = routing.hop_range("contiguous", ring_size, local_len, True, window)
    hops = last - first + 1
    if hops < ring_size:
      return "contiguous", (f"a local window of {window[0]} tokens: contiguous runs {hops} "
                            f"of the {ring_size} hops")
    return "zigzag", (f"a local window of {window[0]} tokens reaches every device (the "
                      "document layout takes no window)")
  if packed:
    return "document", "packed rows: several documents per row"
  return "zigzag", "one sequence per row"


def _device(device, peak_flops, link_bandwidth) -> hardware.DeviceSpec:
  if device is None:
    if peak_flops is None or link_bandwidth is None:
      raise ValueError("pass device= (a device kind, e.g. 'TPU v5p' or 'H200') or both "
                       "peak_flops= and link_bandwidth=.")
    return hardware.DeviceSpec("custom", float(peak_flops), "given", name="custom",
                               link_bandwidth=link_bandwidth, links=1, topology="switch",
                               fast_domain=1 << 30)
  spec = hardware.lookup(device)
  if spec is None:
    names = sorted({s.label for s in hardware.DEVICES} | {hardware.CPU.label})
    raise ValueError(f"unknown device {device!r}; known: {names}; or pass peak_flops= and "
                     "link_bandwidth= with device=None.")
  return spec


def _heads_problem(nh, kh, u) -> str | None:
  """Why Ulysses over ``u`` devices cannot split these heads (:func:`validation.ulysses_repeat`)."""
  try:
    validation.ulysses_repeat(nh, kh, u)
  except ValueError as e:
    return str(e)
  return None


def _infeasible(strategy, split, why) -> Estimate:
  return Estimate(strategy=strategy, split=split, feasible=False, why_not=why, flops=0.0,
                  bytes_moved=0.0, compute_s=0.0, comm_s=0.0, exposed_comm_s=0.0,
                  time_s=math.inf, hidden=None, min_local_len=None, memory_bytes=0.0)


def _estimate(strategy, split, r, padding: int = 0) -> Estimate:
  return Estimate(strategy=strategy, split=split, feasible=True, why_not=None, padding=padding,
                  flops=r["flops"], bytes_moved=r["bytes_moved"], compute_s=r["compute_s"],
                  comm_s=r["comm_s"], exposed_comm_s=max(0.0, r["time_s"] - r["compute_s"]),
                  time_s=r["time_s"], hidden=r["hidden"], min_local_len=r["min_local_len"],
                  memory_bytes=r["memory_bytes"])


def _fit(est: Estimate, budget: float) -> Estimate:
  if est.feasible and est.memory_bytes > budget:
    return dataclasses.replace(
        est, feasible=False,
        why_not=f"needs {est.memory_bytes / 2**30:.1f} GiB > {budget / 2**30:.1f} GiB")
  return est


def _choose(estimates, spec, setting) -> Plan:
  ok = [e for e in estimates if e.feasible]
  if not ok:
    raise ValueError("no strategy can run this: " + "; ".join(
        f"{e.name}: {e.why_not}" for e in estimates))
  order = {s: i for i, s in enumerate(STRATEGIES)}
  # Ties: the strategy order, then the two-level ring before the flat one (never slower).
  best = min(ok, key=lambda e: (round(e.time_s, 12), order[e.strategy], -len(e.split)))
  reasons = [f"fastest predicted ({best.time_s * 1e3:.2f} ms per device, "
             f"{best.exposed_comm_s * 1e3:.2f} ms of it exposed transfer)"]
  if best.padding:
    reasons.append(f"pads each row by {best.padding} tokens to the next length it splits "
                   "(costed in)")
  if best.hidden is not None:
    reasons.append("the ring's transfer hides behind compute" if best.hidden else
                   f"the ring's transfer is exposed (local length below l* = "
                   f"{best.min_local_len:,.0f})")
  flat = [e for e in ok if e.strategy == "ring" and len(e.split) == 1]
  if best.strategy == "ring" and len(best.split) == 2 and flat:
    outer, inner = best.split
    reasons.append(f"two levels: {outer - 1} transfers over the outer links, each behind a "
                   f"{inner}-hop inner ring, against {outer * inner - 1} outer-paced hops of "
                   f"the flat ring ({flat[0].time_s * 1e3:.2f} ms)")
  others = sorted((e for e in ok if e is not best), key=lambda e: e.time_s)
  if others:
    nxt = others[0]
    reasons.append(f"next: {nxt.name} at {nxt.time_s * 1e3:.2f} ms")
  dropped = [e for e in estimates if not e.feasible]
  if dropped:
    reasons.append("ruled out: " + ", ".join(f"{e.name} ({e.why_not})" for e in dropped))
  return Plan(strategy=best.strategy, split=best.split, reasons=tuple(reasons),
              estimates=tuple(estimates), device=spec.label, setting=setting)


def _dtype_name(dtype) -> str:
  if isinstance(dtype, (int, np.integer)):
    return f"{int(dtype)}-byte"
  if "bfloat16" in str(dtype):
    return "bfloat16"
  return np.dtype(dtype).name


def _mask_name(is_causal, window) -> str:
  parts = (["causal"] if is_causal else []) + ([f"window {window}"] if window else [])
  return " + ".join(parts) or "no mask"
