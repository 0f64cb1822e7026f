"""The XLA hop kernel: blockwise attention in plain XLA, the CPU path and the default.

See :mod:`ring_jax.hop` for the protocol, shapes and non-finite rules.

Loop structure (FlashAttention-2, Dao 2023, Alg. 1-2):

* forward: an outer loop over query blocks (``lax.map``) whose body keeps the
  block's own ``(o, m, l)`` online-softmax state, and an inner loop over the
  key blocks ``[lo, hi)`` that query block can see;
* backward: an outer loop over key/value blocks (``lax.scan``) keeping that
  block's ``dK``/``dV`` locally, and an inner loop over the query blocks
  ``[lo, hi)`` that see it, adding to ``dQ`` block by block.

Positions increase within a shard in every layout, so the causal/window
visible key blocks of a query block form one range. Pairs inside the range
are computed with the elementwise mask only when some score in them can be
masked (diagonal / window-edge / segment-boundary pairs), and with segment
ids a pair whose blocks share no document is skipped. Correctness does not
rest on monotone positions: a range is first to last visible block, and any
pair inside it that is not fully visible is masked.

Blocks are sliced from the operands in place and rearranged per block to
``[B, K, G, bq, H]`` / ``[B, K, bk, H]``, so every block matmul is a plain
batched matmul over ``(B, K)``; outputs are written back block by block
(no full-size rearranged copies, which would cost memory).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from ring_jax import scheduling
from ring_jax.hop import HopMasks, HopSpec, backward_delta, varying_like


class BlockPlan(NamedTuple):
  """Which block pairs the kernel computes at one hop, and how.

  lo, hi: int32 ``[nq]``: query block ``a`` meets key blocks ``lo[a] <= b < hi[a]``
    (``lo == hi``: none).
  kv_lo, kv_hi: int32 ``[nk]``: the same ranges seen from the key blocks (backward).
  visible: bool ``[nq, nk]``: some score of the pair is visible.
  masked: bool ``[nq, nk]``: some score of the pair may be masked (elementwise mask needed).
  skip_invisible: static bool: pairs inside a range that are not ``visible`` are skipped
    (with segment ids; without them every pair in a range is visible when positions
    increase within the shard).
  """
  lo: jax.Array
  hi: jax.Array
  kv_lo: jax.Array
  kv_hi: jax.Array
  visible: jax.Array
  masked: jax.Array
  skip_invisible: bool

  def computed(self):
    """bool ``[nq, nk]``: the pairs the kernel's loops compute."""
    nq, nk = self.visible.shape
    b = jnp.arange(nk)[None, :]
    in_range = (self.lo[:, None] <= b) & (b < self.hi[:, None])
    return in_range & self.visible if self.skip_invisible else in_range


def _ranges(visible):
  """First and one-past-last True along the last axis (``0, 0`` for an all-False row)."""
  n = visible.shape[-1]
  idx = jnp.arange(n, dtype=jnp.int32)
  any_ = visible.any(-1)
  lo = jnp.where(any_, jnp.min(jnp.where(visible, idx, n), axis=-1), 0).astype(jnp.int32)
  hi = jnp.where(any_, jnp.max(jnp.where(visible, idx, -1), axis=-1) + 1, 0).astype(jnp.int32)
  return lo, hi


def _uniform_segments(seg, block):
  """bool ``[B, n]`` per block: all ids equal and nonzero; and the id ``[B, n]``."""
  seg = seg.reshape(seg.shape[0], -1, block)
  first = seg[..., 0]
  return (seg == first[..., None]).all(-1) & (first != 0), first


def block_plan(masks: HopMasks, spec: HopSpec) -> BlockPlan:
  """The :class:`BlockPlan` of a hop, from positions and segment ids (per block pair)."""
  bq, bk = spec.block_q, spec.block_kv
  visible, full = scheduling.block_visibility(masks.q_positions, masks.kv_positions, bq, bk,
                                              spec.is_causal, spec.window)
  skip = masks.q_segment_ids is not None
  if skip:
    visible = visible & scheduling.blocks_share_a_segment(
        masks.q_segment_ids, masks.kv_segment_ids, bq, bk)
    q_uni, q_id = _uniform_segments(masks.q_segment_ids, bq)
    k_uni, k_id = _uniform_segments(masks.kv_segment_ids, bk)
    same_doc = q_uni[:, :, None] & k_uni[:, None, :] & (q_id[:, :, None] == k_id[:, None, :])
    full = full & same_doc.all(0)  # one document on both sides in every batch row
  lo, hi = _ranges(visible)
  kv_lo, kv_hi = _ranges(visible.T)
  return BlockPlan(lo=lo, hi=hi, kv_lo=kv_lo, kv_hi=kv_hi, visible=visible, masked=~full,
                   skip_invisible=skip)


def _may_mask(masks: HopMasks, spec: HopSpec) -> bool:
  """Whether some computed score can be masked (statically); if not, every pair is visible."""
  return spec.is_causal or spec.window is not None or masks.q_segment_ids is not None


def _pair_mask(masks: HopMasks, spec: HopSpec, a, b):
  """bool ``[B or 1, 1, 1, bq, bk]`` visibility of block pair (a, b), to broadcast over (K, G)."""
  bq, bk = spec.block_q, spec.block_kv
  qp = jax.lax.dynamic_slice_in_dim(masks.q_positions, a * bq, bq)
  kp = jax.lax.dynamic_slice_in_dim(masks.kv_positions, b * bk, bk)
  mask = scheduling.position_mask(qp, kp, spec.is_causal, spec.window)[None]  # [1, bq, bk]
  if masks.q_segment_ids is not None:
    qs = jax.lax.dynamic_slice_in_dim(masks.q_segment_ids, a * bq, bq, axis=1)
    ks = jax.lax.dynamic_slice_in_dim(masks.kv_segment_ids, b * bk, bk, axis=1)
    mask = mask & scheduling.segment_mask(qs, ks)
  return mask[:, None, None]


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
  """float32 scaled scores ``[B, K, G, bq, bk]``.

  For 32/64-bit inputs the scale goes into the query block before the matmul: with
  ``dot * scale`` the compiler may contract ``dot * scale - max`` (in ``exp(s - max)``)
  into a fused multiply-add, computing the difference from the unrounded product while
  ``max`` came from the rounded one; with a huge scale (``1e30``) that ulp is
  ``exp(1e23) = inf``. Scaling a 16-bit query would add a rounding in its own dtype, so
  those multiply after the float32 matmul.
  """
  if jnp.dtype(q_blk.dtype).itemsize >= 4:
    return jnp.einsum("bkgqh,bksh->bkgqs", q_blk * jnp.asarray(scale, q_blk.dtype), k_blk,
                      precision=precision, preferred_element_type=jnp.float32)
  return jnp.einsum("bkgqh,bksh->bkgqs", q_blk, k_blk, precision=precision,
                    preferred_element_type=jnp.float32) * scale


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


def _pair_step(plan: BlockPlan, qa, kb, masked_fn, full_fn, carry, may_mask: bool):
  """One block pair: ``masked_fn`` when it may hold a masked score, else ``full_fn`` (no
  elementwise mask); with ``plan.skip_invisible``, a pair sharing no document returns
  ``carry`` unchanged."""
  if not may_mask:
    return full_fn(qa, kb, carry)
  branches = [lambda c: masked_fn(qa, kb, c), lambda c: full_fn(qa, kb, c)]
  index = jnp.where(plan.masked[qa, kb], 0, 1)
  if plan.skip_invisible:
    branches.append(lambda c: c)
    index = jnp.where(plan.visible[qa, kb], index, 2)
  return jax.lax.switch(index, branches, carry)


def _pair_loop(plan: BlockPlan, a, lo, hi, masked_fn, full_fn, carry, may_mask: bool):
  """``carry`` (block-sized) folded over the key blocks ``[lo, hi)`` of query block ``a``."""
  return jax.lax.fori_loop(
      lo, hi, lambda j, c: _pair_step(plan, a, j, masked_fn, full_fn, c, may_mask), carry)


@dataclasses.dataclass(frozen=True)
class XlaHopKernel:
  """Blockwise hop kernel in plain XLA (see the module docstring for the loop structure).

  Each step materialises one ``[B, K, G, bq, bk]`` float32 score block and
  nothing larger, so memory is linear in the local sequence length. Matmuls
  run in the input dtype with float32 accumulation. Runs on every platform,
  any block sizes dividing the local lengths. Profiles name the loops
  ``xla_hop_fwd_blocks`` / ``xla_hop_bwd_blocks``.
  """

  name: str = dataclasses.field(default="xla", init=False)

  def check(self, q_shape, kv_shape, dtype, spec: HopSpec) -> None:
    del dtype
    for what, block, length in (("block_q", spec.block_q, q_shape[1]),
                                ("block_kv", spec.block_kv, kv_shape[1])):
      if length % block:
        raise ValueError(
            f"{what}={block} does not divide the local length {length}; pick a divisor.")

  block_plan = staticmethod(block_plan)

  def forward(self, q, k, v, masks: HopMasks, spec: HopSpec):
    bq, bk, prec, scale = spec.block_q, spec.block_kv, spec.precision, spec.scale
    plan = block_plan(masks, spec)
    may_mask = _may_mask(masks, spec)
    b, t, kh, g, h = q.shape
    nq = t // bq

    def fold(guard_v: bool):
      def update(q_blk, a, bb, c, masked: bool):
        o, m, l = c
        k_blk = _kv_block(k, bb, bk)                           # [B, K, bk, H]
        v_blk = _kv_block(v, bb, bk)
        s = _scores(q_blk, k_blk, scale, prec)
        mask = _pair_mask(masks, spec, a, bb) if masked else None
        if mask is not None:
          s = jnp.where(mask, s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(-1))
        # A row that has seen no visible key yet has m = -inf: subtract 0 instead, so
        # exp(-inf - 0) = 0 rather than exp(-inf + inf) = NaN. Per row, not per score.
        m_ref = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.exp(s - m_ref[..., None])                      # masked -> 0
        alpha = jnp.exp(m - m_ref)
        l_new = alpha * l + p.sum(-1)
        if guard_v:
          pv = _masked_pv(p, v_blk, mask, prec)
        else:
          pv = jnp.einsum("bkgqs,bksh->bkgqh", p.astype(v.dtype), v_blk, precision=prec,
                          preferred_element_type=jnp.float32)
        return alpha[..., None] * o + pv, m_new, l_new

      def q_block(a, acc):
        out_full, lse_full = acc
        q_blk = _q_block(q, a, bq)                             # [B, K, G, bq, H]
        init = tuple(varying_like(x, q, k, v) for x in (
            jnp.zeros((b, kh, g, bq, h), jnp.float32),
            jnp.full((b, kh, g, bq), -jnp.inf, jnp.float32),
            jnp.zeros((b, kh, g, bq), jnp.float32)))
        masked_fn = lambda a, bb, c: update(q_blk, a, bb, c, masked=True)
        # The guarded product needs the mask on every pair (it decides what V is read).
        full_fn = masked_fn if guard_v else (
            lambda a, bb, c: update(q_blk, a, bb, c, masked=False))
        o, m, l = _pair_loop(plan, a, plan.lo[a], plan.hi[a], masked_fn, full_fn, init,
                             may_mask)
        empty = l == 0  # only an exact 0 means "no visible key"; NaN passes through
        l_safe = jnp.where(empty, 1.0, l)
        out = jnp.where(empty[..., None], 0.0, o / l_safe[..., None])
        lse = jnp.where(empty, -jnp.inf, m + jnp.log(l_safe))
        return (_put_q_block(out_full, out, a, bq), _put_q_block(lse_full, lse, a, bq))

      init = tuple(varying_like(x, q, k, v) for x in (
          jnp.zeros(q.shape, jnp.float32), jnp.full(q.shape[:4], -jnp.inf, jnp.float32)))
      with jax.named_scope("xla_hop_fwd_blocks"):
        return jax.lax.fori_loop(0, nq, q_block, init)

    if not may_mask:
      return fold(guard_v=False)  # every pair is visible: p @ v may read all of V
    # Only a hop whose V shard holds a non-finite value pays for the guarded matmul.
    return jax.lax.cond(jnp.isfinite(v).all(), lambda: fold(guard_v=False),
                        lambda: fold(guard_v=True))

  def backward(self, q, k, v, out, lse, do, dlse, masks: HopMasks, spec: HopSpec, dq, dk, dv):
    bq, bk, prec, scale = spec.block_q, spec.block_kv, spec.precision, spec.scale
    plan = block_plan(masks, spec)
    may_mask = _may_mask(masks, spec)
    # The gradient matmuls (dP = dO V^T, dQ = dS K, dK = dS^T Q) read their right-hand
    # operand at masked pairs too, where 0 * NaN would spread a non-finite value into
    # rows that do not see it; they read the finite part instead (per block: no copies).
    # Rows and keys that do see a non-finite value still get non-finite gradients: it
    # reaches them through the scores (computed from the raw q, k) or through
    # delta = rowsum(dO * O), which is non-finite where the output is. Without masks
    # every pair is visible and the raw operands are right.
    finite = (lambda x: jnp.where(jnp.isfinite(x), x, 0)) if may_mask else (lambda x: x)
    delta = backward_delta(out, do, dlse)
    lseB, deltaB = _q_blocks(lse, bq), _q_blocks(delta, bq)    # [nq, B, K, G, bq] (small)
    nk = k.shape[1] // bk
    b, t, kh, g, h = q.shape

    def update(kv_blks, a, bb, c, masked: bool):
      """``(dq_blk, dk_blk, dv_blk)``: this pair's dQ block and the updated dK/dV blocks."""
      k_blk, kf_blk, vf_blk = kv_blks                          # [B, K, bk, H]
      _, dk_blk, dv_blk = c
      row = lambda x: jax.lax.dynamic_index_in_dim(x, a, keepdims=False)
      q_blk, do_blk = _q_block(q, a, bq), _q_block(do, a, bq)  # [B, K, G, bq, H]
      s = _scores(q_blk, k_blk, scale, prec)
      p = jnp.exp(s - row(lseB)[..., None])                    # softmax probabilities
      if masked:
        p = jnp.where(_pair_mask(masks, spec, a, bb), p, 0.0)
      dv_blk = dv_blk + jnp.einsum("bkgqs,bkgqh->bksh", p.astype(do.dtype), do_blk,
                                   precision=prec, preferred_element_type=jnp.float32)
      dp = jnp.einsum("bkgqh,bksh->bkgqs", do_blk, vf_blk, precision=prec,
                      preferred_element_type=jnp.float32)
      ds = (p * (dp - row(deltaB)[..., None]) * scale).astype(q.dtype)
      dk_blk = dk_blk + jnp.einsum("bkgqs,bkgqh->bksh", ds, finite(q_blk), precision=prec,
                                   preferred_element_type=jnp.float32)
      dq_blk = jnp.einsum("bkgqs,bksh->bkgqh", ds, kf_blk, precision=prec,
                          preferred_element_type=jnp.float32)
      return dq_blk, dk_blk, dv_blk

    def kv_block(bb, acc):
      dq, dk, dv = acc
      k_blk, v_blk = _kv_block(k, bb, bk), _kv_block(v, bb, bk)
      kv_blks = (k_blk, finite(k_blk), finite(v_blk))
      dq_zeros = varying_like(jnp.zeros((b, kh, g, bq, h), jnp.float32), q, k, v)

      def pair(a, c):
        # Only block-sized values pass through the per-pair branches (a branch operand
        # is copied; the full dQ is updated outside them, in place).
        dq, dk_blk, dv_blk = c
        dq_blk, dk_blk, dv_blk = _pair_step(
            plan, a, bb, lambda a, bb, c: update(kv_blks, a, bb, c, masked=True),
            lambda a, bb, c: update(kv_blks, a, bb, c, masked=False),
            (dq_zeros, dk_blk, dv_blk), may_mask)
        return _put_q_block(dq, _q_block(dq, a, bq) + dq_blk, a, bq), dk_blk, dv_blk

      dq, dk_blk, dv_blk = jax.lax.fori_loop(plan.kv_lo[bb], plan.kv_hi[bb], pair,
                                             (dq, _kv_block(dk, bb, bk), _kv_block(dv, bb, bk)))
      return dq, _put_kv_block(dk, dk_blk, bb, bk), _put_kv_block(dv, dv_blk, bb, bk)

    init = tuple(varying_like(x.astype(jnp.float32), q, k, v) for x in (dq, dk, dv))
    with jax.named_scope("xla_hop_bwd_blocks"):
      return jax.lax.fori_loop(0, nk, kv_block, init)
