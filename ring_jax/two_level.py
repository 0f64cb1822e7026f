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

The backward (a ``custom_vjp``) mirrors it: in each outer step the inner ring
carries K/V with fresh float32 dK/dV accumulators (as :mod:`ring_jax.ring`,
``overlap_dkv`` applies there) that return to the holder of the outer buffer
after the last inner hop; the group's contribution is added to the outer
accumulator of that buffer, which travels one group on, its transfer issued at
the start of the next outer step and read at its end, so it overlaps that
step's inner ring. In the last outer step the inner accumulators stay where
the inner ring left them (one device on), the outer one moves there instead
(off the critical path), and their sum goes home in one transfer over both
axes: the last step exposes one transfer, as the flat ring's last hop does.

Masks, the block table (causal, window and document skipping of block pairs,
whole hops included) and the hop kernels are those of :mod:`ring_jax.ring`;
every hop of both levels runs (a window's hop pruning is the flat ring's).
Profiles name the parts ``two_level_fwd`` / ``two_level_bwd`` with
``send_outer``, ``send_kv``, ``send_dkv``, ``dkv_home`` and ``outer_dkv``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from ring_jax import layouts
from ring_jax import scheduling
from ring_jax import validation
from ring_jax.hop import (HopGrads, HopMasks, HopResiduals, empty_result,
                          lse_for_backward, merge, varying_like)
from ring_jax.ring import (_finish_grads, _grouped, _make_config, _over_hops, _RingConfig,
                           _shift)


@dataclasses.dataclass(frozen=True)
class _TwoLevelConfig:
  ring: _RingConfig    # the combined ring: axis_name (outer, inner), ring_size n_o * n_i
  outer: _RingConfig   # the same computation over the outer axis (n_o groups, all hops)
  inner: _RingConfig   # ... and over the inner axis (n_i devices, all hops)


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
                             overlap_dkv: bool = False, causal_routing: bool | None = None):
  """Exact attention over a sequence sharded over two mesh axes ``(outer, inner)``.

  Call inside ``jax.shard_map`` on the local shards of a sequence split over
  ``P(..., (outer, inner))``: device ``(g, r)`` holds the shard of ring index
  ``g * n_inner + r`` of the ``layout`` (:func:`ring_jax.to_layout` with
  ``ring_size = n_outer * n_inner``). The inner ring runs over ``inner`` (the
  fast links), the outer transfers over ``outer`` are issued a whole inner
  ring ahead of their use (module docstring). Every other argument and the
  result as in :func:`ring_jax.ring_attention`; with the same inputs the two
  compute the same attention (``ring_attention(axis_name=(outer, inner))`` is
  the flat ring over both axes). Both levels rotate every shard the whole
  way: the default ``causal_routing=None`` runs unrouted here, and ``True`` is
  refused (the flat ring's routing does not apply to the two rings yet).
  """
  if scheduling.check_routing(causal_routing):
    raise NotImplementedError(
        "causal_routing=True is not implemented for the two-level ring (seq_axis=(outer, "
        "inner)); pass causal_routing=False, or a single sequence axis for the routed ring.")
  outer, inner = split_axes(axis_name)
  layout = layouts.check_attention_layout(layout, segment_ids, local_window_size)
  n_o = validation.axis_size(outer, "two_level_ring_attention")
  n_i = validation.axis_size(inner, "two_level_ring_attention")
  cfg = _make_config(query, key, value, axis_name=(outer, inner), is_causal=is_causal,
                     segment_ids=segment_ids, scale=scale, local_window_size=local_window_size,
                     layout=layout, block_q=block_q, block_kv=block_kv, precision=precision,
                     hop_kernel=hop_kernel, return_lse=return_lse, overlap_dkv=overlap_dkv,
                     causal_routing=False)  # both levels rotate in full (docstring)
  tl = _TwoLevelConfig(
      ring=cfg,
      outer=dataclasses.replace(cfg, axis_name=outer, ring_size=n_o, hops=(0, n_o - 1)),
      inner=dataclasses.replace(cfg, axis_name=inner, ring_size=n_i, hops=(0, n_i - 1)))
  return _grouped(_two_level, tl, query, key, value, segment_ids, return_lse)


def _where(tl: _TwoLevelConfig):
  """``(g, r)``: this device's group over the outer axis and index in it over the inner."""
  return jax.lax.axis_index(tl.outer.axis_name), jax.lax.axis_index(tl.inner.axis_name)


def _source(tl: _TwoLevelConfig, g, r, step, hop):
  """Ring index of the device whose shard ``(g, r)`` holds at outer ``step``, inner ``hop``."""
  n_o, n_i = tl.outer.ring_size, tl.inner.ring_size
  return ((g - step) % n_o) * n_i + (r - hop) % n_i


def _masks(tl, src, q_pos, s, q_seg, kv_seg, v_finite=None) -> HopMasks:
  cfg = tl.ring
  kv_pos = layouts.local_positions(cfg.layout, cfg.ring_size, s, src)
  return HopMasks.build(cfg.spec, q_pos, kv_pos, q_seg, kv_seg,
                        v_finite=None if v_finite is None else v_finite[src])


def _forward(tl: _TwoLevelConfig, q, k, v, seg):
  """``(out [B,T,K,G,H] input dtype, lse [B,T,K,G] f32)``, as :func:`ring_jax.ring._forward`."""
  cfg = tl.ring
  g, r = _where(tl)
  s_len = k.shape[1]
  q_pos = layouts.local_positions(cfg.layout, cfg.ring_size, q.shape[1],
                                  g * tl.inner.ring_size + r)
  # Flags in ring-index order (all_gather over (outer, inner) is outer-major). As in the flat
  # ring, the gather runs before any K/V transfer on every device (XLA:CPU deadlock otherwise).
  v_finite = jax.lax.all_gather(jnp.isfinite(v).all(), cfg.axis_name)
  v_finite, k, v, seg = jax.lax.optimization_barrier((v_finite, k, v, seg))
  acc = tuple(varying_like(x, q, k, v) for x in empty_result(q))

  def outer_step(step, state, *, name, first, last):
    del name, first
    ko, vo, sego, acc = state
    nxt = (ko, vo, sego)
    if not last:  # issued before the inner ring, read at the next outer step
      with jax.named_scope("send_outer"):
        nxt = _shift(tl.outer, 1, ko, vo, sego)

    def hop(h, state, *, name, first, last):
      del first
      k, v, kv_seg, acc = state
      nxt = (k, v, kv_seg)
      if not last:
        with jax.named_scope("send_kv"):
          nxt = _shift(tl.inner, 1, k, v, kv_seg)
      with jax.named_scope(name):
        masks = _masks(tl, _source(tl, g, r, step, h), q_pos, s_len, seg, kv_seg, v_finite)
        acc = merge(*acc, *cfg.kernel.forward(q, k, v, masks, cfg.spec))
      return (*nxt, acc)

    *_, acc = _over_hops(tl.inner, hop, (ko, vo, sego, acc), peel_first=False)
    return (*nxt, acc)

  *_, (out, lse) = _over_hops(tl.outer, outer_step, (k, v, seg, acc), peel_first=False)
  return out.astype(q.dtype), lse


def _backward(tl: _TwoLevelConfig, q, k, v, seg, out, lse, do, dlse):
  """dQ stays home; dK/dV accumulators follow their shards through both rings (module doc)."""
  cfg = tl.ring
  g, r = _where(tl)
  s_len = k.shape[1]
  n_i = tl.inner.ring_size
  q_pos = layouts.local_positions(cfg.layout, cfg.ring_size, q.shape[1], g * n_i + r)
  res = HopResiduals(out=out, lse=lse_for_backward(lse), do=do, dlse=dlse)
  k_own, v_own = k, v

  def zeros(x):
    return varying_like(jnp.zeros(x.shape, jnp.float32), q, k, v)

  def outer_step(step, state, *, name, first, last):
    del name
    # dko/dvo: the outer accumulators of the shard this device held at the previous outer step
    # (unused at the first); they travel on with it and are read after this step's inner ring.
    ko, vo, sego, dq, dko, dvo = state
    nxt = (ko, vo, sego)
    if not last:
      with jax.named_scope("send_outer"):
        nxt = _shift(tl.outer, 1, ko, vo, sego)
    if not first:
      with jax.named_scope("outer_dkv"):
        dko, dvo = _shift(tl.outer, 1, dko, dvo)

    def hop(h, state, *, name, first, last):
      k, v, kv_seg, dq, dk, dv = state
      nxt = (k, v, kv_seg)
      if not last:
        with jax.named_scope("send_kv"):
          nxt = _shift(tl.inner, 1, k, v, kv_seg)
      if not first:
        with jax.named_scope("send_dkv"):
          dk, dv = _shift(tl.inner, 1, dk, dv)
      with jax.named_scope(name):
        masks = _masks(tl, _source(tl, g, r, step, h), q_pos, s_len, seg, kv_seg)
        if cfg.overlap_dkv and not first:
          gr = cfg.kernel.backward(q, k, v, masks, cfg.spec, res,
                                   HopGrads(dq, zeros(k), zeros(v)))
          dq, dk, dv = gr.dq, dk + gr.dk, dv + gr.dv
        else:
          dq, dk, dv = cfg.kernel.backward(q, k, v, masks, cfg.spec, res, HopGrads(dq, dk, dv))
      return (*nxt, dq, dk, dv)

    *_, dq, dk, dv = _over_hops(tl.inner, hop, (ko, vo, sego, dq, zeros(k), zeros(v)),
                                peel_first=True)
    # (g, r) now holds this group's part of the dK/dV of shard (g - step, r + 1).
    if not last:
      with jax.named_scope("dkv_home"):  # to the holder of the outer buffer, (g, r)
        dk, dv = _shift(tl.inner, -(n_i - 1), dk, dv)
    elif not first:  # the outer accumulator of shard (g + 1, r + 1) comes here instead
      with jax.named_scope("outer_dkv"):
        dko, dvo = _shift(tl.inner, -1, dko, dvo)
    if not first:
      dk, dv = dko + dk, dvo + dv
    return (*nxt, dq, dk, dv)

  *_, dq, dk, dv = _over_hops(tl.outer, outer_step, (k, v, seg, zeros(q), zeros(k), zeros(v)),
                              peel_first=True)
  with jax.named_scope("dkv_home"):  # shard (g + 1, r + 1) goes home in one transfer
    n_o = tl.outer.ring_size
    home = [(g_ * n_i + r_, ((g_ + 1) % n_o) * n_i + (r_ + 1) % n_i)
            for g_ in range(n_o) for r_ in range(n_i)]
    if any(a != b for a, b in home):
      dk, dv = (jax.lax.ppermute(x, cfg.axis_name, home) for x in (dk, dv))
  return _finish_grads(q, k_own, v_own, dq, dk, dv)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _two_level(tl: _TwoLevelConfig, q, k, v, seg):
  with jax.named_scope("two_level_fwd"):
    out, lse = _forward(tl, q, k, v, seg)
  return (out, lse) if tl.ring.return_lse else out


def _two_level_fwd(tl: _TwoLevelConfig, q, k, v, seg):
  with jax.named_scope("two_level_fwd"):
    out, lse = _forward(tl, q, k, v, seg)
  return ((out, lse) if tl.ring.return_lse else out), (q, k, v, seg, out, lse)


def _two_level_bwd(tl: _TwoLevelConfig, res, cotangent):
  q, k, v, seg, out, lse = res
  do, dlse = cotangent if tl.ring.return_lse else (cotangent, None)
  with jax.named_scope("two_level_bwd"):
    dq, dk, dv = _backward(tl, q, k, v, seg, out, lse, do, dlse)
  return dq, dk, dv, None


_two_level.defvjp(_two_level_fwd, _two_level_bwd)
