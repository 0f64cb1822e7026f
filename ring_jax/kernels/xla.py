"""The XLA hop kernel: blockwise attention in plain XLA, the CPU path and the default.

See :mod:`ring_jax.hop` for the protocol, shapes and non-finite rules.

Loop structure (FlashAttention-2, Dao 2023, Alg. 1-2), over the hop's
:class:`ring_jax.masking.BlockTable` (``masks.blocks``):

* forward: an outer ``fori_loop`` over query blocks whose body keeps the
  block's own ``(o, m, l)`` online-softmax state, and inner ``fori_loop`` loops
  over the key blocks ``[lo, hi)`` that query block meets
  (:func:`ring_jax.hop.fold_blocks`);
* backward: an outer ``fori_loop`` over key/value blocks keeping that block's
  ``dK``/``dV`` locally, and inner loops over the query blocks ``[lo, hi)``
  that meet it, adding to ``dQ`` block by block.

Pairs in the table's fully visible run are computed without the elementwise
mask; the others with it. The batch rows of a block are computed together, so
with segment ids (one range per row) the rows' ranges are merged
(:func:`ring_jax.masking.merge_rows`) and a masked pair that no row's range
holds (blocks sharing no document in any row) is skipped.

Blocks are sliced from the operands in place and rearranged per block to
``[B*K, G*bq, H]`` / ``[B*K, bk, H]`` (:func:`_q_rows`), so every block matmul
is a plain batched matmul over ``B*K`` and every elementwise step works on
``[B*K, G*bq, bk]`` score blocks in the matmul's own layout; outputs are
written back block by block
(no full-size rearranged copies, which would cost memory).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from ring_jax import masking
from ring_jax.hop import (HopGrads, HopMasks, HopResiduals, HopSpec, backward_delta,
                          fold_blocks, v_is_finite, varying_like)


def _pair_mask(masks: HopMasks, spec: HopSpec, a, b):
  """bool ``[B or 1, 1, 1, bq, bk]`` visibility of block pair (a, b), to broadcast over (K, G)."""
  bq, bk = spec.block_q, spec.block_kv
  qp = jax.lax.dynamic_slice_in_dim(masks.q_positions, a * bq, bq)
  kp = jax.lax.dynamic_slice_in_dim(masks.kv_positions, b * bk, bk)
  mask = masking.position_mask(qp, kp, spec.is_causal, spec.window)[None]  # [1, bq, bk]
  if masks.q_segment_ids is not None:
    qs = jax.lax.dynamic_slice_in_dim(masks.q_segment_ids, a * bq, bq, axis=1)
    ks = jax.lax.dynamic_slice_in_dim(masks.kv_segment_ids, b * bk, bk, axis=1)
    mask = mask & masking.segment_mask(qs, ks)
  return mask[:, None, None]


def _unless_uncovered(skip: bool, ranges, i, j, compute, carry):
  """``compute(carry)``; with ``skip`` (batch rows with their own ranges, merged), ``carry``
  unchanged when no row's range of block ``i`` holds block ``j`` (``ranges`` ``[R, n, 4]``)."""
  if not skip:
    return compute(carry)
  return jax.lax.cond(masking.rows_cover(ranges, i, j), compute, lambda c: c, carry)


def _masked_pv(p_blk, v_blk, mask, precision):
  """``p @ v`` (``[B,K,G,bq,bk] x [B,K,bk,H]``) that reads ``v_blk`` only through visible pairs.

  A masked pair has ``p = 0``, but ``0 * NaN`` (or ``0 * inf``) is NaN, so a
  plain matmul would spread a non-finite value from a key a row does not see
  into that row. Here the matmul reads the finite part of ``v_blk`` and an
  output element is set to NaN where it sees (through a visible pair) a
  non-finite value. Costs one more matmul: only used on hops whose V holds one.
  """
  bad = ~jnp.isfinite(v_blk)                                   # [B, K, bk, H]
  pv = jnp.einsum("bkgqs,bksh->bkgqh", p_blk.astype(v_blk.dtype), jnp.where(bad, 0, v_blk),
                  precision=precision, preferred_element_type=jnp.float32)
  b, bq, bk = bad.shape[0], mask.shape[-2], mask.shape[-1]
  seen = jnp.broadcast_to(mask[:, 0, 0], (b, bq, bk)).astype(jnp.float32)
  reads_bad = jnp.einsum("bqs,bksh->bkqh", seen, bad.astype(jnp.float32),
                         preferred_element_type=jnp.float32) > 0
  return jnp.where(reads_bad[:, :, None], jnp.nan, pv)


def _scores(q_blk, k_blk, scale, precision):
  """float32 scaled scores ``[B*K, G*bq, bk]`` of ``[B*K, G*bq, H]`` / ``[B*K, bk, H]`` blocks.

  For 32/64-bit inputs the scale goes into the query block before the matmul: with
  ``dot * scale`` the compiler may contract ``dot * scale - max`` (in ``exp(s - max)``)
  into a fused multiply-add, computing the difference from the unrounded product while
  ``max`` came from the rounded one; with a huge scale (``1e30``) that ulp is
  ``exp(1e23) = inf``. Scaling a 16-bit query would add a rounding in its own dtype, so
  those multiply after the float32 matmul.
  """
  if jnp.dtype(q_blk.dtype).itemsize >= 4:
    return jnp.einsum("nqh,nsh->nqs", q_blk * jnp.asarray(scale, q_blk.dtype), k_blk,
                      precision=precision, preferred_element_type=jnp.float32)
  return jnp.einsum("nqh,nsh->nqs", q_blk, k_blk, precision=precision,
                    preferred_element_type=jnp.float32) * scale


def _q_rows(x):
  """``[B, K, G, bq, ...]`` -> ``[B*K, G*bq, ...]``: a query block (or its row statistics) as
  rows of one batched matmul over ``B*K``. Score blocks in this shape keep the matmul's own
  layout through every elementwise step (the mask, the soft-cap, the softmax and its
  gradient): no per-element relayout between the matmul's ``[B*K, ...]`` and a
  ``[B, K, G, ...]`` view."""
  return x.reshape(x.shape[0] * x.shape[1], x.shape[2] * x.shape[3], *x.shape[4:])


def _kv_rows(x):
  """``[B, K, bk, H]`` -> ``[B*K, bk, H]`` (the matmul batch of :func:`_q_rows`)."""
  return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _kv_unrows(x, b, kh):
  """``[B*K, bk, H]`` -> ``[B, K, bk, H]``."""
  return x.reshape(b, kh, *x.shape[1:])


def _soft_cap(s, cap):
  """``(cap * tanh(s / cap), tanh(s / cap))`` of float32 scores (``cap`` None: ``(s, None)``)."""
  if cap is None:
    return s, None
  t = jnp.tanh(s / cap)
  return cap * t, t


def _q_blocks(x, block):
  """``[B, T, K, G]`` -> block-major ``[nq, B, K, G, bq]`` (row statistics; small)."""
  b, t, k, g = x.shape
  return x.reshape(b, t // block, block, k, g).transpose(1, 0, 3, 4, 2)


def _q_block(x, a, block):
  """Query block ``a`` of ``[B, T, K, G, ...]`` as ``[B, K, G, bq, ...]`` (matmul layout)."""
  blk = jax.lax.dynamic_slice_in_dim(x, a * block, block, axis=1)
  return jnp.moveaxis(blk, 1, 3)


def _put_q_block(x, blk, a, block):
  """Writes ``[B, K, G, bq, ...]`` back as query block ``a`` of ``[B, T, K, G, ...]``."""
  return jax.lax.dynamic_update_slice_in_dim(x, jnp.moveaxis(blk, 3, 1), a * block, axis=1)


def _kv_block(x, b, block):
  """Key block ``b`` of ``[B, S, K, H]`` as ``[B, K, bk, H]``."""
  return jax.lax.dynamic_slice_in_dim(x, b * block, block, axis=1).swapaxes(1, 2)


def _put_kv_block(x, blk, b, block):
  return jax.lax.dynamic_update_slice_in_dim(x, blk.swapaxes(1, 2), b * block, axis=1)


@dataclasses.dataclass(frozen=True)
class XlaHopKernel:
  """The hop kernel in plain XLA (``hop_kernel="xla"``): blockwise attention that runs on
  every platform, and what ``"auto"`` falls back to (loop structure in the
  :mod:`ring_jax.kernels.xla` docstring).

  Each step materialises one ``[B*K, G*bq, bk]`` float32 score block and
  nothing larger, so memory is linear in the local sequence length. Matmuls
  run in the input dtype with float32 accumulation. Runs on every platform,
  any block sizes dividing the local lengths. Profiles name the loops
  ``xla_hop_fwd_blocks`` / ``xla_hop_bwd_blocks``.
  """

  name: ClassVar[str] = "xla"

  def check(self, q_shape, kv_shape, dtype, spec: HopSpec) -> None:
    del dtype
    for what, block, length in (("block_q", spec.block_q, q_shape[1]),
                                ("block_kv", spec.block_kv, kv_shape[1])):
      if length % block:
        raise ValueError(
            f"{what}={block} does not divide the local length {length}; pick a divisor.")

  def forward(self, q, k, v, masks: HopMasks, spec: HopSpec):
    bq, bk, prec, scale = spec.block_q, spec.block_kv, spec.precision, spec.scale
    table = masks.table()  # rows with their own ranges (skip): merged, skip what none holds
    q_ranges, skip = masking.merge_rows(table.q_ranges), table.q_ranges.shape[0] > 1
    b, t, kh, g, _ = q.shape
    nq, hv = t // bq, v.shape[-1]

    def fold(guard_v: bool):
      def update(q_blk, a, bb, c, masked: bool):
        o, m, l = c
        k_blk = _kv_rows(_kv_block(k, bb, bk))                 # [B*K, bk, H]
        v_blk = _kv_block(v, bb, bk)                           # [B, K, bk, Hv]
        s, _ = _soft_cap(_scores(q_blk, k_blk, scale, prec), spec.logits_soft_cap)
        mask = _pair_mask(masks, spec, a, bb) if masked else None
        if mask is not None:
          s = jnp.where(_q_rows(jnp.broadcast_to(mask, (b, kh, g, bq, bk))), s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(-1))
        # A row that has seen no visible key yet has m = -inf: subtract 0 instead, so
        # exp(-inf - 0) = 0 rather than exp(-inf + inf) = NaN. Per row, not per score.
        m_ref = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.exp(s - m_ref[..., None])                      # masked -> 0
        alpha = jnp.exp(m - m_ref)
        l_new = alpha * l + p.sum(-1)
        if guard_v:
          pv = _q_rows(_masked_pv(p.reshape(b, kh, g, bq, bk), v_blk, mask, prec))
        else:
          pv = jnp.einsum("nqs,nsh->nqh", p.astype(v.dtype), _kv_rows(v_blk), precision=prec,
                          preferred_element_type=jnp.float32)
        return alpha[..., None] * o + pv, m_new, l_new

      def q_block(a, acc):
        out_full, lse_full = acc
        q_blk = _q_rows(_q_block(q, a, bq))                    # [B*K, G*bq, H]
        init = tuple(varying_like(x, q, k, v) for x in (
            jnp.zeros((b * kh, g * bq, hv), jnp.float32),
            jnp.full((b * kh, g * bq), -jnp.inf, jnp.float32),
            jnp.zeros((b * kh, g * bq), jnp.float32)))

        def step(j, c, masked):
          return _unless_uncovered(skip and masked, table.q_ranges, a, j,
                                   lambda c: update(q_blk, a, j, c, masked), c)

        # The guarded product needs the mask on every pair (it decides what V is read).
        o, m, l = fold_blocks(q_ranges[a], step, init, table.may_mask, k.shape[1] // bk,
                              mask_all=guard_v)
        empty = l == 0  # only an exact 0 means "no visible key"; NaN passes through
        l_safe = jnp.where(empty, 1.0, l)
        out = jnp.where(empty[..., None], 0.0, o / l_safe[..., None])
        lse = jnp.where(empty, -jnp.inf, m + jnp.log(l_safe))
        return (_put_q_block(out_full, out.reshape(b, kh, g, bq, hv), a, bq),
                _put_q_block(lse_full, lse.reshape(b, kh, g, bq), a, bq))

      init = tuple(varying_like(x, q, k, v) for x in (
          jnp.zeros((*q.shape[:4], hv), jnp.float32),
          jnp.full(q.shape[:4], -jnp.inf, jnp.float32)))
      with jax.named_scope("xla_hop_fwd_blocks"):
        return jax.lax.fori_loop(0, nq, q_block, init)

    if not table.may_mask:
      return fold(guard_v=False)  # every pair is visible: p @ v may read all of V
    # Only a hop whose V shard holds a non-finite value pays for the guarded matmul.
    return jax.lax.cond(v_is_finite(masks, v), lambda: fold(guard_v=False),
                        lambda: fold(guard_v=True))

  def backward(self, q, k, v, masks: HopMasks, spec: HopSpec, res: HopResiduals,
               acc: HopGrads) -> HopGrads:
    bq, bk, prec, scale = spec.block_q, spec.block_kv, spec.precision, spec.scale
    table = masks.table()
    kv_ranges, skip = masking.merge_rows(table.kv_ranges), table.kv_ranges.shape[0] > 1
    # The gradient matmuls (dP = dO V^T, dQ = dS K, dK = dS^T Q) read their right operand
    # at masked pairs too (0 * NaN = NaN), so they read its finite part, per block. Who
    # sees a non-finite value still gets non-finite gradients: through the scores (raw
    # q, k) or delta = rowsum(dO * O). Without masks the raw operands are right.
    finite = ((lambda x: jnp.where(jnp.isfinite(x), x, 0)) if table.may_mask
              else (lambda x: x))
    do = res.do
    delta = backward_delta(res.out, do, res.dlse)
    lseB, deltaB = _q_blocks(res.lse, bq), _q_blocks(delta, bq)  # [nq, B, K, G, bq] (small)
    nk, nq = k.shape[1] // bk, q.shape[1] // bq
    b, t, kh, g, h = q.shape

    def update(kv_blks, a, bb, c, masked: bool):
      """``(dq_blk, dk_blk, dv_blk)``: this pair's dQ block and the updated dK/dV blocks.

      Computed on ``[B*K, G*bq, bk]`` score blocks (:func:`_q_rows`)."""
      k_blk, kf_blk, vf_blk = (_kv_rows(x) for x in kv_blks)   # [B*K, bk, H]
      _, dk_blk, dv_blk = c
      row = lambda x: _q_rows(jax.lax.dynamic_index_in_dim(x, a, keepdims=False))[..., None]
      q_blk, do_blk = _q_rows(_q_block(q, a, bq)), _q_rows(_q_block(do, a, bq))
      s, tanh = _soft_cap(_scores(q_blk, k_blk, scale, prec), spec.logits_soft_cap)
      p = jnp.exp(s - row(lseB))                               # softmax probabilities
      if masked:
        mask = jnp.broadcast_to(_pair_mask(masks, spec, a, bb), (b, kh, g, bq, bk))
        p = jnp.where(_q_rows(mask), p, 0.0)
      dv_blk = dv_blk + _kv_unrows(jnp.einsum("nqs,nqh->nsh", p.astype(do.dtype), do_blk,
                                              precision=prec,
                                              preferred_element_type=jnp.float32), b, kh)
      dp = jnp.einsum("nqh,nsh->nqs", do_blk, vf_blk, precision=prec,
                      preferred_element_type=jnp.float32)
      ds = p * (dp - row(deltaB))
      if tanh is not None:  # through the cap: d(c tanh(r / c)) / dr
        ds = ds * (1.0 - tanh * tanh)
      ds = (ds * scale).astype(q.dtype)
      dk_blk = dk_blk + _kv_unrows(jnp.einsum("nqs,nqh->nsh", ds, finite(q_blk),
                                              precision=prec,
                                              preferred_element_type=jnp.float32), b, kh)
      dq_blk = jnp.einsum("nqs,nsh->nqh", ds, kf_blk, precision=prec,
                          preferred_element_type=jnp.float32)
      return dq_blk.reshape(b, kh, g, bq, h), dk_blk, dv_blk

    def kv_block(bb, acc):
      dq, dk, dv = acc
      k_blk, v_blk = _kv_block(k, bb, bk), _kv_block(v, bb, bk)
      kv_blks = (k_blk, finite(k_blk), finite(v_blk))
      dq_zeros = varying_like(jnp.zeros((b, kh, g, bq, h), jnp.float32), q, k, v)

      def pair(a, c, masked):
        # Only block-sized values pass through the skip's branches (a branch operand is
        # copied; the full dQ is updated outside them, in place).
        dq, dk_blk, dv_blk = c
        dq_blk, dk_blk, dv_blk = _unless_uncovered(
            skip and masked, table.kv_ranges, bb, a,
            lambda c: update(kv_blks, a, bb, c, masked), (dq_zeros, dk_blk, dv_blk))
        return _put_q_block(dq, _q_block(dq, a, bq) + dq_blk, a, bq), dk_blk, dv_blk

      dq, dk_blk, dv_blk = fold_blocks(kv_ranges[bb], pair,
                                       (dq, _kv_block(dk, bb, bk), _kv_block(dv, bb, bk)),
                                       table.may_mask, nq)
      return dq, _put_kv_block(dk, dk_blk, bb, bk), _put_kv_block(dv, dv_blk, bb, bk)

    init = tuple(varying_like(x.astype(jnp.float32), q, k, v) for x in acc)
    with jax.named_scope("xla_hop_bwd_blocks"):
      return HopGrads(*jax.lax.fori_loop(0, nk, kv_block, init))
