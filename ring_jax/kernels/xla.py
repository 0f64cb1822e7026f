"""The XLA hop kernel: blockwise attention in plain XLA, the CPU path and the default.

See :mod:`ring_jax.hop` for the protocol, shapes and non-finite rules.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ring_jax import scheduling
from ring_jax.hop import HopMasks, HopSpec, backward_delta, varying_like


def _slice(x, start, size, axis=1):
  return jax.lax.dynamic_slice_in_dim(x, start, size, axis=axis)


def _update(x, upd, start, axis=1):
  return jax.lax.dynamic_update_slice_in_dim(x, upd, start, axis=axis)


def _may_mask(masks: HopMasks, spec: HopSpec) -> bool:
  """Whether some computed score can be masked (statically); if not, every pair is visible."""
  return spec.is_causal or spec.window is not None or masks.q_segment_ids is not None


def _block_mask(masks: HopMasks, spec: HopSpec, a, b):
  """bool ``[B or 1, 1, 1, bq, bk]`` visibility of block pair (a, b); None if all visible."""
  if not _may_mask(masks, spec):
    return None  # nothing to mask: skip the elementwise work
  bq, bk = spec.block_q, spec.block_kv
  qp = jax.lax.dynamic_slice_in_dim(masks.q_positions, a * bq, bq)
  kp = jax.lax.dynamic_slice_in_dim(masks.kv_positions, b * bk, bk)
  mask = scheduling.position_mask(qp, kp, spec.is_causal, spec.window)[None]  # [1, bq, bk]
  if masks.q_segment_ids is not None:
    qs = jax.lax.dynamic_slice_in_dim(masks.q_segment_ids, a * bq, bq, axis=1)
    ks = jax.lax.dynamic_slice_in_dim(masks.kv_segment_ids, b * bk, bk, axis=1)
    mask = mask & scheduling.segment_mask(qs, ks)
  return mask[:, None, None]  # [B, 1, 1, bq, bk] to broadcast over (K, G)


def _masked_pv(p_blk, v_blk, mask, precision):
  """``p_blk @ v_blk`` that reads ``v_blk`` only through visible pairs.

  A masked pair has ``p = 0``, but ``0 * NaN`` (or ``0 * inf``) is NaN, so a
  plain matmul would spread a non-finite value from a key a row does not see
  into that row. Here the matmul reads the finite part of ``v_blk`` and an
  output element is set to NaN where it sees (through a visible pair) a
  non-finite value. Costs one more matmul: only used on hops whose V holds one.
  """
  bad = ~jnp.isfinite(v_blk)                                   # [B, bk, K, H]
  pv = jnp.einsum("bkgqs,bskh->bqkgh", p_blk.astype(v_blk.dtype), jnp.where(bad, 0, v_blk),
                  precision=precision, preferred_element_type=jnp.float32)
  b, bq, bk = bad.shape[0], mask.shape[-2], mask.shape[-1]
  seen = jnp.broadcast_to(mask[:, 0, 0], (b, bq, bk)).astype(jnp.float32)
  reads_bad = jnp.einsum("bqs,bskh->bqkh", seen, bad.astype(jnp.float32),
                         preferred_element_type=jnp.float32) > 0
  return jnp.where(reads_bad[:, :, :, None, :], jnp.nan, pv)


def _pairs(masks: HopMasks, spec: HopSpec):
  """The block pairs with any visible score, as :func:`ring_jax.schedule` lists them."""
  shared_docs = None
  if masks.q_segment_ids is not None:
    shared_docs = scheduling.blocks_share_a_segment(masks.q_segment_ids, masks.kv_segment_ids,
                                                    spec.block_q, spec.block_kv)
  pairs, num_pairs, _ = scheduling.block_pairs(masks.q_positions, masks.kv_positions,
                                               spec.block_q, spec.block_kv, spec.is_causal,
                                               spec.window, shared_docs)
  return pairs, num_pairs


@dataclasses.dataclass(frozen=True)
class XlaHopKernel:
  """Blockwise hop kernel in plain XLA: a loop over the visible block pairs.

  Each iteration materialises one ``[B, K, G, bq, bk]`` float32 score block
  and nothing larger, so memory is linear in the local sequence length.
  Matmuls run in the input dtype with float32 accumulation. Runs on every
  platform, any block size dividing the local lengths. Profiles name the
  loops ``xla_hop_fwd_blocks`` / ``xla_hop_bwd_blocks``.
  """

  name: str = dataclasses.field(default="xla", init=False)

  def check(self, q_shape, kv_shape, dtype, spec: HopSpec) -> None:
    del dtype
    for what, block, length in (("block_q", spec.block_q, q_shape[1]),
                                ("block_kv", spec.block_kv, kv_shape[1])):
      if length % block:
        raise ValueError(f"{what}={block} does not divide the local length {length}.")

  def forward(self, q, k, v, masks: HopMasks, spec: HopSpec):
    bq, bk = spec.block_q, spec.block_kv
    pairs, num_pairs = _pairs(masks, spec)
    b, t, kh, g, h = q.shape
    init = tuple(varying_like(x, q, k, v) for x in (
        jnp.zeros((b, t, kh, g, h), jnp.float32), jnp.full((b, t, kh, g), -jnp.inf, jnp.float32),
        jnp.zeros((b, t, kh, g), jnp.float32)))

    def fold(guard_v: bool):
      def body(p, c):
        o, m, l = c
        a, bb = pairs[p, 0], pairs[p, 1]
        q_blk = _slice(q, a * bq, bq)
        k_blk, v_blk = _slice(k, bb * bk, bk), _slice(v, bb * bk, bk)
        mask = _block_mask(masks, spec, a, bb)
        s = jnp.einsum("bqkgh,bskh->bkgqs", q_blk, k_blk, precision=spec.precision,
                       preferred_element_type=jnp.float32) * spec.scale
        if mask is not None:
          s = jnp.where(mask, s, -jnp.inf)
        m_old = _slice(m, a * bq, bq)                          # [B, bq, K, G]
        m_new = jnp.maximum(m_old, jnp.einsum("bkgq->bqkg", s.max(-1)))
        m_ref = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p_blk = jnp.exp(s - jnp.einsum("bqkg->bkgq", m_ref)[..., None])  # masked -> 0
        alpha = jnp.exp(m_old - m_ref)
        l_new = alpha * _slice(l, a * bq, bq) + jnp.einsum("bkgqs->bqkg", p_blk)
        if guard_v:
          pv = _masked_pv(p_blk, v_blk, mask, spec.precision)
        else:
          pv = jnp.einsum("bkgqs,bskh->bqkgh", p_blk.astype(v.dtype), v_blk,
                          precision=spec.precision, preferred_element_type=jnp.float32)
        o_new = alpha[..., None] * _slice(o, a * bq, bq) + pv
        return (_update(o, o_new, a * bq), _update(m, m_new, a * bq),
                _update(l, l_new, a * bq))

      with jax.named_scope("xla_hop_fwd_blocks"):
        return jax.lax.fori_loop(0, num_pairs, body, init)

    if not _may_mask(masks, spec):
      o, m, l = fold(guard_v=False)
    else:
      o, m, l = jax.lax.cond(jnp.isfinite(v).all(), lambda: fold(guard_v=False),
                             lambda: fold(guard_v=True))
    empty = l == 0  # only an exact 0 means "no visible key"; NaN passes through
    l_safe = jnp.where(empty, 1.0, l)
    out = jnp.where(empty[..., None], 0.0, o / l_safe[..., None])
    lse = jnp.where(empty, -jnp.inf, m + jnp.log(l_safe))
    return out, lse

  def backward(self, q, k, v, out, lse, do, dlse, masks: HopMasks, spec: HopSpec):
    bq, bk = spec.block_q, spec.block_kv
    pairs, num_pairs = _pairs(masks, spec)
    delta = backward_delta(out, do, dlse)
    finite = (lambda x: jnp.where(jnp.isfinite(x), x, 0)) if _may_mask(masks, spec) else (
        lambda x: x)

    def body(p, acc):
      dq, dk, dv = acc
      a, b = pairs[p, 0], pairs[p, 1]
      q_blk, do_blk = _slice(q, a * bq, bq), _slice(do, a * bq, bq)
      k_blk, v_blk = _slice(k, b * bk, bk), _slice(v, b * bk, bk)
      lse_blk = jnp.einsum("bqkg->bkgq", _slice(lse, a * bq, bq))[..., None]
      delta_blk = jnp.einsum("bqkg->bkgq", _slice(delta, a * bq, bq))[..., None]
      mask = _block_mask(masks, spec, a, b)
      s = jnp.einsum("bqkgh,bskh->bkgqs", q_blk, k_blk, precision=spec.precision,
                     preferred_element_type=jnp.float32) * spec.scale
      p_blk = jnp.exp(s - lse_blk)                             # softmax probabilities
      if mask is not None:
        p_blk = jnp.where(mask, p_blk, 0.0)
      dv_blk = jnp.einsum("bkgqs,bqkgh->bskh", p_blk.astype(do.dtype), do_blk,
                          precision=spec.precision, preferred_element_type=jnp.float32)
      dp = jnp.einsum("bqkgh,bskh->bkgqs", do_blk, finite(v_blk),
                      precision=spec.precision, preferred_element_type=jnp.float32)
      ds = (p_blk * (dp - delta_blk) * spec.scale).astype(q.dtype)
      dq_blk = jnp.einsum("bkgqs,bskh->bqkgh", ds, finite(k_blk),
                          precision=spec.precision, preferred_element_type=jnp.float32)
      dk_blk = jnp.einsum("bkgqs,bqkgh->bskh", ds, finite(q_blk),
                          precision=spec.precision, preferred_element_type=jnp.float32)
      dq = _update(dq, _slice(dq, a * bq, bq) + dq_blk, a * bq)
      dk = _update(dk, _slice(dk, b * bk, bk) + dk_blk, b * bk)
      dv = _update(dv, _slice(dv, b * bk, bk) + dv_blk, b * bk)
      return dq, dk, dv

    init = tuple(varying_like(jnp.zeros(x.shape, jnp.float32), q, k, v) for x in (q, k, v))
    with jax.named_scope("xla_hop_bwd_blocks"):
      return jax.lax.fori_loop(0, num_pairs, body, init)
