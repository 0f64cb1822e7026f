"""The two-level ring: an inner ring over a fast mesh axis, an outer ring over a slow one.

The double ring of LoongTrain (Gu et al., "LoongTrain: Efficient Training of
Long-Sequence LLMs with Head-Context Parallelism", 2024, arXiv 2406.18485,
Sec. 3.3). On a mesh whose sequence devices sit on two kinds of links (chips in
a slice over ICI and slices over DCN; GPUs in a node over NVLink and nodes over
InfiniBand), ``axis_name=(outer, inner)`` splits the sequence over both axes,
outer-major (as ``P(None, (outer, inner))`` does): device ``(g, r)`` of
``n_o`` groups of ``n_i`` devices holds the shard of the combined ring index
``c = g * n_i + r``, in the layout of that ring of ``n = n_o * n_i`` devices.

At outer step ``s = 0..n_o-1`` a device's *outer buffer* holds the K/V shard of
device ``(g - s, r)``. The step first issues the outer transfer of that buffer
to the next group (``(g + 1, r)``, over the slow axis; it is read at step
``s + 1``), then runs an ``n_i``-hop inner ring over the fast axis starting from
it: at inner hop ``h`` the device holds the shard of ``(g - s, r - h)`` and
folds it into the float32 online-softmax carry (:func:`ring_jax.hop.merge`).
Every device sees every shard exactly once; a flat ring over both axes pays
the slow link at every one of its ``n - 1`` hops, the two-level ring only
``n_o - 1`` times, each behind ``n_i`` hops of compute.

With causal routing (``causal_routing``, the flat ring's rule) the outer transfers follow
:func:`ring_jax.routing.group_routes`, the flat ring's routes
(:func:`ring_jax.routing.routes`) with groups as members: each part of a group's
buffer goes only to the groups that see it. Contiguous causal: group ``j``'s buffer goes
``j -> j+1 -> ... -> n_o-1`` and no further (groups before ``j`` see none of it, and the
wrap would carry it to them): at step ``s`` only the groups ``s..n_o-2`` send, half the
outer K/V bytes. Zigzag (and document): device ``c`` holds the early chunk ``c`` and the
late chunk ``2n-1-c``; every group sees every early chunk, but the late chunks of group
``j`` only groups ``0..j``, so both chunks travel backward (group ``g`` holds group
``g + s``'s buffer at step ``s``), the early ones around the whole outer ring, the late ones
only until they wrap: 0.75x. A group that receives nothing at a step (``ppermute``
gives zeros) holds a buffer none of its queries sees: its masks are built from the
positions of the shard it would hold, which the causal mask (and window) hide, so the
block table skips every pair and the zeros are never read. Each step's pairs differ,
so the steps between the first and the last run in a ``fori_loop`` whose transfers are
picked by a ``lax.switch`` on the step (:func:`ring_jax.ring.hop_send`, as the flat
routed ring's hops; unrolled steps hold more temp memory and a larger program,
docs/performance.md). The inner rings rotate the group's whole buffer: they are
:func:`ring_jax.ring.forward_loop` / :func:`ring_jax.ring.backward_loop` on the full
rotation over the inner axis, the outer transfer tied to their last hop (so their last hop
is peeled on every platform, never :func:`ring_jax.ring.one_loop`), and the outer
steps run on the same driver (:func:`ring_jax.ring.over_hops`).

The backward (a ``custom_vjp``) of the full rotation (no routing: striped and non-causal
rings, and every ring on TPU, :data:`ring_jax.ring.PLATFORM_DEFAULTS`) runs both rings the
other way round, own shard last (:func:`ring_jax.routing.backward_rotation` over each axis;
:func:`_backward_rotation`): at outer step ``s = 1..n_o`` the outer buffer is device
``(g + s, r + 1)``'s shard and the inner ring ends on ``(g + s, r)`` with that shard's
float32 dK/dV accumulator, which travels on over the outer axis (issued at the next step's
start, added after its inner ring) to the device that ends the next step on the same shard;
at the last step every device ends on its own shard, so no accumulator goes home and no
transfer follows the last hop's compute. The first step's buffer is what the forward's last
inner hop held (a residual: nothing is sent before the backward's first hop).

With routed outer transfers the backward follows the forward's routes: in each outer step
the inner ring carries K/V with fresh float32 dK/dV accumulators (as :mod:`ring_jax.ring`,
``overlap_dkv`` applies there) that return to the holder of the outer buffer
after the last inner hop; the group's contribution is added to the outer
accumulator of that buffer, which travels on with it, its transfer issued at
the start of the next outer step and read at its end, so it overlaps that
step's inner ring. An accumulator whose buffer has had its last use goes home
from that group over the outer axis in the same way (routed contiguous: from group
``n_o - 1``, one transfer per buffer instead of the rest of the way round). In the
last outer step the inner accumulators stay where the inner ring left them (one device
on), the outer one moves there instead (off the critical path), and their sum goes
home in one transfer over both axes: the last step exposes one transfer.

Masks, the block table (causal, window and document skipping of block pairs,
whole hops included) and the hop kernels are those of :mod:`ring_jax.ring`;
every hop of both levels runs (a window's hop pruning is the flat ring's; routed, a
window also drops the outer transfers it hides).
Profiles name the parts ``two_level_fwd`` / ``two_level_bwd`` with
``send_outer``, ``send_kv``, ``send_dkv``, ``dkv_home`` and ``outer_dkv``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from ring_jax import layouts
from ring_jax import routing
from ring_jax import validation
from ring_jax.hop import (HopMasks, HopResiduals, empty_result,
                          lse_for_backward, varying_like)
from ring_jax.ring import (RingConfig, attend_grouped, backward_loop, finish_grads,
                           forward_loop, hop_partly_masked, hop_send, hops_of, in_flight_during,
                           join_streams, loop_span, make_config, over_hops, platform_defaults,
                           send_distinct, shift, split_streams, v_finite_flags, with_sinks)


@dataclasses.dataclass(frozen=True)
class _TwoLevelConfig:
  ring: RingConfig    # the combined ring: axis_name (outer, inner), ring_size n_o * n_i
  outer: RingConfig   # the same computation over the outer axis (n_o groups, all hops)
  inner: RingConfig   # ... and over the inner axis (n_i devices, all hops)
  routes: routing.Routes  # the outer ring's (routing.group_routes; full or routed)

  def backward(self) -> "_TwoLevelConfig | None":
    """The backward's plan where the outer ring runs the full rotation: both rings rotated
    own shard last (:func:`ring_jax.routing.backward_rotation` over each axis), so every
    dK/dV accumulator ends its last hop on its owner; None for a routed outer ring."""
    if self.routes.routed:
      return None
    s = self.routes.local_len
    n_o, n_i = self.outer.ring_size, self.inner.ring_size
    return dataclasses.replace(
        self, routes=routing.backward_rotation(self.ring.layout, n_o, s),
        inner=dataclasses.replace(self.inner,
                                  routes=routing.backward_rotation(self.ring.layout, n_i, s)))


def split_axes(axis_name) -> tuple[str, str]:
  """``axis_name`` as ``(outer, inner)``; ValueError unless it is a pair of axis names."""
  if not (isinstance(axis_name, (tuple, list)) and len(axis_name) == 2
          and axis_name[0] != axis_name[1]):
    raise ValueError(f"the two-level ring needs axis_name=(outer_axis, inner_axis), a pair of "
                     f"different mesh axes, got {axis_name!r}.")
  return tuple(axis_name)


def two_level_ring_attention(query, key, value, *, axis_name, is_causal: bool = False,
                             segment_ids=None, scale: float | None = None,
                             local_window_size=None, layout: str = "contiguous",
                             block_q: int | None = None, block_kv: int | None = None,
                             precision=None, hop_kernel="auto", return_lse: bool = False,
                             overlap_dkv: bool | None = None,
                             causal_routing: bool | None = None, sinks=None,
                             logits_soft_cap: float | None = None):
  """Exact attention over a sequence sharded over two mesh axes ``(outer, inner)``.

  Call inside ``jax.shard_map`` on the local shards of a sequence split over
  ``P(..., (outer, inner))``: device ``(g, r)`` holds the shard of ring index
  ``g * n_inner + r`` of the ``layout`` (:func:`ring_jax.to_layout` with
  ``ring_size = n_outer * n_inner``). The inner ring runs over ``inner`` (the
  fast links), the outer transfers over ``outer`` are issued a whole inner
  ring ahead of their use (module docstring). Every other argument and the
  result as in :func:`ring_jax.ring_attention` (``sinks`` and ``logits_soft_cap``
  included); with the same inputs the two
  compute the same attention (``ring_attention(axis_name=(outer, inner))`` is
  the flat ring over both axes).

  ``causal_routing`` routes the outer transfers (the slow links) as the flat ring routes
  its hops (:func:`ring_jax.routing.group_routes`), with the same rule
  (:func:`ring_jax.routing.check_routing`: ``None`` the flat ring's default, off on TPU
  (:data:`ring_jax.ring.PLATFORM_DEFAULTS`), elsewhere on for causal rings in
  :data:`ring_jax.routing.ROUTED_BY_DEFAULT`, contiguous today; ``True`` / ``False``
  force it), so one or two sequence axes behave alike: each part
  of a group's K/V goes only to the groups that see it, and its dK/dV comes home from
  the last group that uses it. Causal contiguous: half the outer K/V bytes; zigzag and
  document: 0.75x (both chunks backward over the outer axis, the late chunk of group
  ``j`` only to groups ``0..j``); a window drops what it hides; striped and non-causal
  rings have nothing to drop and run the full rotation. The inner rings rotate every
  shard of the group's buffer in full. Exact in every case.
  """
  outer, inner = split_axes(axis_name)
  layout = layouts.check_attention_layout(layout, segment_ids, local_window_size)
  causal_routing = platform_defaults(causal_routing=causal_routing,
                                     overlap_dkv=overlap_dkv)["causal_routing"]
  n_o = validation.axis_size(outer, "two_level_ring_attention")
  n_i = validation.axis_size(inner, "two_level_ring_attention")
  sinks = validation.check_sinks(sinks, query.shape[2])
  cfg = make_config(query, key, value, axis_name=(outer, inner), is_causal=is_causal,
                    segment_ids=segment_ids, scale=scale, local_window_size=local_window_size,
                    layout=layout, block_q=block_q, block_kv=block_kv, precision=precision,
                    hop_kernel=hop_kernel, return_lse=return_lse or sinks is not None,
                    overlap_dkv=overlap_dkv, logits_soft_cap=logits_soft_cap,
                    causal_routing=False)  # the flat ring's routes do not apply (below)
  routed = (routing.check_routing(causal_routing, layout, is_causal) and n_o > 1
            and query.shape[1] == key.shape[1])
  routes = routing.group_routes(layout, n_o, n_i, key.shape[1], bool(is_causal),
                                cfg.spec.window, routed=routed)
  if routes.kv_fraction() == 1:  # nothing dropped (striped, no mask): the full rotation
    routes = routing.group_routes(layout, n_o, n_i, key.shape[1], bool(is_causal),
                                  cfg.spec.window, routed=False)
  tl = _TwoLevelConfig(
      ring=cfg,
      outer=dataclasses.replace(cfg, axis_name=outer, ring_size=n_o, hops=(0, n_o - 1)),
      inner=dataclasses.replace(cfg, axis_name=inner, ring_size=n_i, hops=(0, n_i - 1),
                                routes=routing.rotation(layout, n_i, key.shape[1]),
                                one_loop=False),
      routes=routes)
  result = attend_grouped(_two_level, tl, query, key, value, segment_ids, cfg.return_lse)
  return with_sinks(result, sinks, return_lse)


def _where(tl: _TwoLevelConfig):
  """``(g, r)``: this device's group over the outer axis and index in it over the inner."""
  return jax.lax.axis_index(tl.outer.axis_name), jax.lax.axis_index(tl.inner.axis_name)


def _source(tl: _TwoLevelConfig, stream: routing.Stream, g, r, step, hop):
  """Ring index of the device whose ``stream`` part ``(g, r)`` holds at outer ``step``,
  inner ``hop`` (int or traced): group ``stream.source(g, step)``, member
  ``inner_stream.source(r, hop)`` (``r - hop``; ``r + hop`` in the backward's rotation)."""
  n_o, n_i = tl.outer.ring_size, tl.inner.ring_size
  inner = tl.inner.routes.streams[0]
  return stream.source(g, step, n_o) * n_i + inner.source(r, hop, n_i)


def _masks(tl: _TwoLevelConfig, g, r, step, hop, q_pos, q_seg, kv_seg, steps=(), hops=(),
           v_finite=None):
  """Masks of the buffer held at outer ``step``, inner ``hop``: its streams' positions side by
  side (and, forward, the AND of their parts' non-finite-V flags ``v_finite[device,
  stream]``). A part this device did not receive (zeros: no query of its group sees that
  part, :func:`ring_jax.routing.group_routes`) has its source's positions, which the
  causal mask / window hide from every query here, so the block table skips it.
  ``steps`` / ``hops``: the Python ints ``step`` / ``hop`` may be; the block table masks
  nothing where no pair of them has a partly masked block pair on any device
  (:func:`_partly_masked`)."""
  cfg, routes = tl.ring, tl.routes
  pos, flags = [], []
  for i, stream in enumerate(routes.streams):
    src = _source(tl, stream, g, r, step, hop)
    pos.append(layouts.local_positions(cfg.layout, cfg.ring_size, routes.local_len,
                                       src)[stream.start:stream.stop])
    if v_finite is not None:
      flags.append(v_finite[src] if v_finite.ndim == 1 else v_finite[src, i])
  finite = None if v_finite is None else functools.reduce(jnp.logical_and, flags)
  kv_pos = pos[0] if len(pos) == 1 else jnp.concatenate(pos)
  may_mask = (q_seg is not None or not steps or not hops
              or _partly_masked(tl, q_pos.shape[0], steps, hops))
  return HopMasks.build(cfg.spec, q_pos, kv_pos, q_seg, kv_seg, v_finite=finite,
                        may_mask=may_mask)


def _partly_masked(tl: _TwoLevelConfig, q_len: int, steps, hops) -> bool:
  """Whether some device of the combined ring computes a partly masked block pair at some
  outer step of ``steps`` and inner hop of ``hops`` (Python ints;
  :func:`ring_jax.ring.hop_partly_masked` with the owners :func:`_source` gives device
  ``d = g * n_i + r``)."""
  n_i = tl.inner.ring_size
  cfg = dataclasses.replace(tl.ring, routes=tl.routes)
  return any(hop_partly_masked(cfg, q_len, lambda st, d: _source(tl, st, d // n_i, d % n_i, s, h))
             for s in steps for h in hops)


def _forward(tl: _TwoLevelConfig, q, k, v, seg):
  """``(out [B,T,K,G,H] input dtype, lse [B,T,K,G] f32, received)``, as
  :mod:`ring_jax.ring`'s forward: per outer step (:func:`ring_jax.ring.over_hops` over the
  outer routes) the transfer of the next step's parts (``send_outer``), then the inner ring
  (:func:`ring_jax.ring.forward_loop`, the full rotation over the inner axis) on the
  group's buffer, the outer transfer tied to its last hop. ``received``: what the backward
  reads instead of sending it again: with a routed outer ring, per stream the ``(k, v,
  seg)`` parts the first outer transfer delivered (held at step 1; None on one group); with
  the full rotation (:meth:`_TwoLevelConfig.backward`) the parts the last inner hop held
  (device ``(g + 1, r + 1)``'s shard: the backward's first).""" 
  cfg, routes = tl.ring, tl.routes
  n_o = tl.outer.ring_size
  g, r = _where(tl)
  q_pos = layouts.local_positions(cfg.layout, cfg.ring_size, q.shape[1],
                                  g * tl.inner.ring_size + r)
  # Flags per device (ring-index order: all_gather over (outer, inner) is outer-major) and
  # stream part. As in the flat ring, the gather runs before any K/V transfer on every
  # device (XLA:CPU deadlock otherwise).
  v_finite = v_finite_flags(routes, cfg.axis_name, v)
  v_finite, k, v, seg = jax.lax.optimization_barrier((v_finite, k, v, seg))
  acc = tuple(varying_like(x, q, k, v) for x in empty_result(q, v.shape[-1]))
  # rows[i]: per stream, the outer pairs that deliver step i + 1's parts
  rows = [[s.arrive[i + 1] if i + 1 < n_o else () for s in routes.streams] for i in range(n_o)]
  span = loop_span(n_o, peel_first=True)
  received = {}
  rotates = tl.backward() is not None

  def outer_step(i, state, *, name, first, last):
    del name
    held, acc = state
    nxt = None
    if not last:  # issued before the inner ring, read at i + 1
      with jax.named_scope("send_outer"):
        nxt = hop_send(i, rows, span, tl.outer.axis_name, held)
    ko, vo, sego = (join_streams(x) for x in zip(*held))
    masks_at = lambda h, kv_seg, hops: _masks(  # noqa: E731
        tl, g, r, i, h, q_pos, seg, kv_seg, hops_of(i, span), hops, v_finite)
    acc, nxt, inner_held = forward_loop(tl.inner, q, [(ko, vo, sego)], acc, masks_at,
                                        also=nxt)
    if rotates and last:
      received["parts"] = inner_held
    elif first and not last and not rotates:
      received["parts"] = nxt
    return (held if last else nxt), acc

  _, (out, lse) = over_hops(n_o, outer_step, (split_streams(routes, k, v, seg), acc),
                            peel_first=True)
  return out.astype(q.dtype), lse, received.get("parts")


def _backward_start(tl: _TwoLevelConfig, q, out, lse, do, dlse):
  """``(g, r, q_pos, res)``: this device's group and member, its queries' positions in the
  layout and the backward's :class:`ring_jax.hop.HopResiduals`."""
  g, r = _where(tl)
  q_pos = layouts.local_positions(tl.ring.layout, tl.ring.ring_size, q.shape[1],
                                  g * tl.inner.ring_size + r)
  return g, r, q_pos, HopResiduals(out=out, lse=lse_for_backward(lse), do=do, dlse=dlse)


def _backward(tl: _TwoLevelConfig, q, k, v, seg, out, lse, do, dlse, received):
  """dQ stays home; dK/dV accumulators follow their parts through both rings and go home
  from the last group that uses them (module docstring). ``received``: the forward's
  (:func:`_forward`): the parts of step 1 are not sent again."""
  cfg, routes = tl.ring, tl.routes
  outer = tl.outer.axis_name
  n_o, n_i = tl.outer.ring_size, tl.inner.ring_size
  g, r, q_pos, res = _backward_start(tl, q, out, lse, do, dlse)
  k_own, v_own = k, v
  streams = routes.streams

  def zeros(x):
    return varying_like(jnp.zeros(x.shape, jnp.float32), q, k, v)

  span = loop_span(n_o, peel_first=True)  # the steps the loop runs (0 and the last peeled)
  arrive_next = [[s.arrive[i + 1] if i + 1 < n_o else () for s in streams] for i in range(n_o)]
  arrive_now = [[s.arrive[i] for s in streams] for i in range(n_o)]
  home_prev = [[s.home[i - 1] if i else () for s in streams] for i in range(n_o)]
  # kept[j][h, d]: group d's own part of stream j has its last use on group d at step h
  kept = [np.array([[d in s.done_home[h] for d in range(n_o)] for h in range(n_o)])
          for s in streams]

  def outer_step(i, state, *, name, first, last):
    # acc: per stream, the outer dK/dV accumulators of the parts held at step i - 1 (by
    # then at this device, their holder); they travel on with the parts (outer_dkv) or go
    # home (dkv_home) while this step's inner ring runs, and are read after it.
    del name
    held, acc, home, dq = state
    nxt, sent_outer = held, None
    if first and received is not None:  # step 1's parts: kept from the forward
      nxt = [_pack(*p) for p in received]
    elif not last:
      with jax.named_scope("send_outer"):
        sent_outer = hop_send(i, arrive_next, span, outer, held, send=send_distinct)
    arrived = None
    if not first:
      with jax.named_scope("outer_dkv"):
        arrived = hop_send(i, arrive_now, span, outer, acc, send=send_distinct)
      steps = hops_of(i, span)
      if any(s.home[h - 1] or s.done_home[h - 1] for s in streams for h in steps):
        with jax.named_scope("dkv_home"):  # parts whose last use was step i - 1
          sent = hop_send(i, home_prev, span, outer, acc, send=send_distinct)
          mine = [jnp.asarray(kept_j)[i - 1, g] for kept_j in kept]
          home = [tuple(h_ + s_ + jnp.where(m, a, 0.0) for h_, s_, a in zip(hj, sj, aj))
                  for hj, sj, aj, m in zip(home, sent, acc, mine)]
    kh, vh = (join_streams([p[0][m] for p in held]) for m in (0, 1))
    segh = join_streams([p[-1] for p in held])
    # The inner ring; its accumulators go home to the holder of the outer buffer, (g, r),
    # except at the last step, where they stay one device on (the outer ones move there).
    masks_at = lambda h, kv_seg, hops: _masks(  # noqa: E731
        tl, g, r, i, h, q_pos, seg, kv_seg, hops_of(i, span), hops)
    dq, dk, dv, sent_outer = backward_loop(tl.inner, q, [(kh, vh, segh)], res, dq, masks_at,
                                           also=sent_outer, home=not last)
    if sent_outer is not None:  # the next step's parts, in flight during the inner ring
      nxt = sent_outer
    if not last:
      if arrived is not None:
        dk = dk + join_streams([a[0] for a in arrived])
        dv = dv + join_streams([a[1] for a in arrived])
    elif arrived is not None:  # the outer accumulators of shard r + 1 come here instead
      with jax.named_scope("outer_dkv"):
        ak, av = shift(tl.inner, -1, join_streams([a[0] for a in arrived]),
                       join_streams([a[1] for a in arrived]))
      dk, dv = dk + ak, dv + av
    return nxt, split_streams(routes, dk, dv), home, dq

  # Each part's K and V travel stacked, one array: a routed step that sends one pair sends
  # what the forward sent (send_distinct cannot reorder one pair), and XLA would merge equal
  # transfers of the two passes; the stacked array's shape keeps them apart.
  held = [_pack(*p) for p in split_streams(routes, k, v, seg)]
  acc = [(zeros(p[0]), zeros(p[1])) for p in split_streams(routes, k, v)]
  home = [(zeros(p[0]), zeros(p[1])) for p in split_streams(routes, k, v)]
  _, acc, home, dq = over_hops(n_o, outer_step, (held, acc, home, zeros(q)), peel_first=True)
  with jax.named_scope("dkv_home"):  # the parts last used at the last step: one transfer
    last = n_o - 1
    for j, s in enumerate(streams):
      groups = list(s.home[last]) + [(d, d) for d in s.done_home[last]]
      pairs = [(a * n_i + m, b * n_i + (m + 1) % n_i) for a, b in groups for m in range(n_i)]
      moved = [p for p in pairs if p[0] != p[1]]
      if moved:
        got = tuple(jax.lax.ppermute(x, cfg.axis_name, moved) for x in acc[j])
        home[j] = tuple(h_ + x for h_, x in zip(home[j], got))
      if len(moved) < len(pairs):  # n_i == 1: a group's own part stays
        mine = jnp.asarray(kept[j])[last, g]
        home[j] = tuple(h_ + jnp.where(mine, a, 0.0) for h_, a in zip(home[j], acc[j]))
  dk, dv = join_streams([h_[0] for h_ in home]), join_streams([h_[1] for h_ in home])
  return finish_grads(q, k_own, v_own, dq, dk, dv)


def _backward_rotation(tl: _TwoLevelConfig, q, k, v, seg, out, lse, do, dlse, held):
  """The backward of the full rotation, both rings run own shard last (``tl``:
  :meth:`_TwoLevelConfig.backward`): at outer step ``s = 1..n_o`` device ``(g, r)``'s outer
  buffer is device ``(g + s, r + 1)``'s shard, and its inner ring (:func:`ring_jax.ring.
  backward_loop` over :func:`ring_jax.routing.backward_rotation`) holds ``(g + s, r + h)``
  at inner hop ``h = 1..n_i``, ending on ``(g + s, r)`` with that shard's float32 dK/dV
  accumulator: no transfer home inside a step. The outer buffer goes on to ``(g - 1, r)``
  (``send_outer``, issued before the inner ring) and so does the step's accumulator
  (``outer_dkv``, issued at the next step's start and read only once that step's inner ring
  has made its dQ, :func:`ring_jax.ring.in_flight_during`; at the last step nothing else
  reads it before the end, and untied the compiler issued it after the last kernel): device
  ``(g - 1, r)`` ends step ``s + 1`` on the same shard. At ``s = n_o`` every device ends on
  its own shard: no transfer follows the last hop's compute. ``held``: the first step's
  buffer, the forward's last inner hop's parts (not sent again)."""
  routes, outer, n_o = tl.routes, tl.outer.axis_name, tl.outer.ring_size
  g, r, q_pos, res = _backward_start(tl, q, out, lse, do, dlse)
  (stream,) = routes.streams
  first = routes.hops[0]
  span = loop_span(n_o, peel_first=True)
  arrive_next = [[stream.arrive[i + 1]] if i + 1 < n_o else [()] for i in range(n_o)]
  arrive_now = [[stream.arrive[i]] for i in range(n_o)]

  def outer_step(i, state, *, name, first_step, last):
    del name
    held, acc, dq = state
    nxt = None
    if not last:  # read at the next step
      with jax.named_scope("send_outer"):
        (nxt,) = hop_send(i, arrive_next, span, outer, [held])
    arrived = None
    if not first_step:  # the previous step's accumulators, in flight during the inner ring
      with jax.named_scope("outer_dkv"):
        (arrived,) = hop_send(i, arrive_now, span, outer, [acc])
    masks_at = lambda h, kv_seg, hops: _masks(  # noqa: E731
        tl, g, r, first + i, h, q_pos, seg, kv_seg, [first + s for s in hops_of(i, span)], hops)
    dq, dk, dv, nxt = backward_loop(tl.inner, q, [held], res, dq, masks_at, also=nxt,
                                    arrived=True)
    if arrived is not None:
      arrived, dq = in_flight_during(arrived, dq)
      dk, dv = dk + arrived[0], dv + arrived[1]
    return (held if last else nxt), (dk, dv), dq

  dq = varying_like(jnp.zeros(q.shape, jnp.float32), q, k, v)
  step = lambda i, state, *, name, first, last: outer_step(  # noqa: E731
      i, state, name=name, first_step=first, last=last)
  _, (dk, dv), dq = over_hops(n_o, step, (held[0], None, dq), peel_first=True)
  return finish_grads(q, k, v, dq, dk, dv)


def _pack(k, v, seg):
  """A part's K and V as one stacked array (``(kv, seg)``), or as two when V's head size
  differs (``(k, v, seg)``); ``part[0][m]`` is K (m = 0) or V (m = 1) either way."""
  if k.shape == v.shape:
    return jnp.stack((k, v)), seg
  return (k, v), seg


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _two_level(tl: _TwoLevelConfig, q, k, v, seg):
  with jax.named_scope("two_level_fwd"):
    out, lse, _ = _forward(tl, q, k, v, seg)
  return (out, lse) if tl.ring.return_lse else out


def _two_level_fwd(tl: _TwoLevelConfig, q, k, v, seg):
  # The first outer transfer's parts are a residual: one K/V shard per device (what the
  # first step's transfer delivers), so the backward sends one outer step fewer over the
  # slow links (at n_o = 2 none), for no more temp memory.
  with jax.named_scope("two_level_fwd"):
    out, lse, received = _forward(tl, q, k, v, seg)
  return ((out, lse) if tl.ring.return_lse else out), (q, k, v, seg, out, lse, received)


def _two_level_bwd(tl: _TwoLevelConfig, res, cotangent):
  q, k, v, seg, out, lse, received = res
  do, dlse = cotangent if tl.ring.return_lse else (cotangent, None)
  with jax.named_scope("two_level_bwd"):
    if tl.backward() is None:
      dq, dk, dv = _backward(tl, q, k, v, seg, out, lse, do, dlse, received)
    else:
      dq, dk, dv = _backward_rotation(tl.backward(), q, k, v, seg, out, lse, do, dlse,
                                      received)
  return dq, dk, dv, None


_two_level.defvjp(_two_level_fwd, _two_level_bwd)
