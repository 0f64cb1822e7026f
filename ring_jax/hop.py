"""One hop of ring attention: blockwise attention of the local queries against
the key/value shard currently held, as an online-softmax update of a float32
carry (forward) and its FlashAttention-2 style gradient (backward).

This is the seam for fused kernels. The ring loop in :mod:`ring_jax.ring` only
calls :meth:`HopKernel.forward` / :meth:`HopKernel.backward` with the
arguments documented here; a Pallas or cuDNN kernel implementing the same two
methods plugs in through ``ring_attention(..., hop_kernel=...)`` without
touching the ring.

Shapes (local to one device; ``N = K * G`` query heads in ``K`` groups of ``G``):

  q      ``[B, T, K, G, H]``   local queries, input dtype
  k, v   ``[B, S, K, H]``      the K/V shard held at this hop, input dtype
  o      ``[B, T, K, G, H]``   float32 un-normalised output accumulator
  m, l   ``[B, T, K, G]``      float32 running row max / row sum of exp
  lse    ``[B, T, K, G]``      float32 log-sum-exp of the finished forward
  delta  ``[B, T, K, G]``      float32 ``rowsum(dO * O)`` (FlashAttention-2, Alg. 2)

References: Dao et al., FlashAttention (2022) Alg. 1 and FlashAttention-2
(2023) Alg. 1-2 for the per-block update; Liu et al., Ring Attention (2023)
Alg. 1 for merging the per-hop results.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Protocol

import jax
import jax.numpy as jnp

from ring_jax import layouts

# A finite "minus infinity" for the running max: exp(m_old - m_new) stays
# finite (0 or 1) even for rows that have seen no unmasked key yet, so fully
# masked rows (padding) never produce NaN.
_MASK_VALUE = -1e30


class Carry(NamedTuple):
  """Online-softmax state, all float32: ``o`` ``[B,T,K,G,H]``, ``m``/``l`` ``[B,T,K,G]``."""
  o: jax.Array
  m: jax.Array
  l: jax.Array


class HopMasks(NamedTuple):
  """What decides which scores of this hop are visible.

  q_positions / kv_positions: int32 ``[T]`` / ``[S]`` global token positions.
  q_segment_ids / kv_segment_ids: int32 ``[B, T]`` / ``[B, S]`` or None (0 = pad).
  pairs: int32 ``[P, 2]`` (q block, kv block) pairs to compute, from
    :func:`ring_jax.layouts.schedule`; only the first ``num_pairs`` are real.
    Pairs absent from the list are fully masked and are not computed.
  num_pairs: int32 scalar.
  """
  q_positions: jax.Array
  kv_positions: jax.Array
  q_segment_ids: jax.Array | None
  kv_segment_ids: jax.Array | None
  pairs: jax.Array
  num_pairs: jax.Array


@dataclasses.dataclass(frozen=True)
class HopSpec:
  """Static parameters of the hop computation."""
  scale: float
  is_causal: bool
  window: tuple[int, int] | None
  block_q: int
  block_kv: int
  precision: jax.lax.Precision | None = None


class HopKernel(Protocol):
  """Interface of a per-hop attention kernel (see module docstring for shapes)."""

  def forward(self, q, k, v, carry: Carry, masks: HopMasks, spec: HopSpec) -> Carry:
    """Folds the visible scores of ``q @ k^T`` into ``carry``."""

  def backward(self, q, k, v, do, lse, delta, masks: HopMasks, spec: HopSpec,
               dq, dk, dv) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Adds this hop's gradient to the float32 accumulators ``dq`` ``[B,T,K,G,H]``
    and ``dk``/``dv`` ``[B,S,K,H]`` and returns them."""


def init_carry(q) -> Carry:
  b, t, k, g, h = q.shape
  return Carry(o=jnp.zeros((b, t, k, g, h), jnp.float32),
               m=jnp.full((b, t, k, g), _MASK_VALUE, jnp.float32),
               l=jnp.zeros((b, t, k, g), jnp.float32))


def finalize(carry: Carry, dtype):
  """Returns ``(out [B,T,K,G,H] dtype, lse [B,T,K,G] f32)``; rows that saw no key give 0."""
  seen = carry.l > 0
  l_safe = jnp.where(seen, carry.l, 1.0)
  out = jnp.where(seen[..., None], carry.o / l_safe[..., None], 0.0).astype(dtype)
  lse = jnp.where(seen, carry.m + jnp.log(l_safe), jnp.inf)
  return out, lse


def _block_mask(masks: HopMasks, spec: HopSpec, a, b):
  """bool ``[B or 1, 1, 1, bq, bk]`` visibility of block pair (a, b); None if all visible."""
  if not spec.is_causal and spec.window is None and masks.q_segment_ids is None:
    return None  # nothing to mask: skip the elementwise work
  bq, bk = spec.block_q, spec.block_kv
  qp = jax.lax.dynamic_slice_in_dim(masks.q_positions, a * bq, bq)
  kp = jax.lax.dynamic_slice_in_dim(masks.kv_positions, b * bk, bk)
  mask = layouts.position_mask(qp, kp, spec.is_causal, spec.window)[None]  # [1, bq, bk]
  if masks.q_segment_ids is not None:
    qs = jax.lax.dynamic_slice_in_dim(masks.q_segment_ids, a * bq, bq, axis=1)
    ks = jax.lax.dynamic_slice_in_dim(masks.kv_segment_ids, b * bk, bk, axis=1)
    mask = mask & (qs[:, :, None] == ks[:, None, :]) & (qs[:, :, None] != 0)
  return mask[:, None, None]  # [B, 1, 1, bq, bk] to broadcast over (K, G)


def _slice(x, start, size, axis=1):
  return jax.lax.dynamic_slice_in_dim(x, start, size, axis=axis)


def _update(x, upd, start, axis=1):
  return jax.lax.dynamic_update_slice_in_dim(x, upd, start, axis=axis)


@dataclasses.dataclass(frozen=True)
class XlaHopKernel:
  """Blockwise hop kernel in plain XLA: a loop over the scheduled block pairs.

  Each iteration materialises one ``[B, K, G, bq, bk]`` float32 score block
  and nothing larger, so memory is linear in the local sequence length.
  Matmuls run in the input dtype with float32 accumulation.
  """

  def forward(self, q, k, v, carry: Carry, masks: HopMasks, spec: HopSpec) -> Carry:
    bq, bk = spec.block_q, spec.block_kv

    def body(p, c: Carry) -> Carry:
      a, b = masks.pairs[p, 0], masks.pairs[p, 1]
      q_blk = _slice(q, a * bq, bq)
      k_blk, v_blk = _slice(k, b * bk, bk), _slice(v, b * bk, bk)
      mask = _block_mask(masks, spec, a, b)
      s = jnp.einsum("bqkgh,bskh->bkgqs", q_blk, k_blk, precision=spec.precision,
                     preferred_element_type=jnp.float32) * spec.scale
      if mask is not None:
        s = jnp.where(mask, s, -jnp.inf)
      m_old = _slice(c.m, a * bq, bq)                        # [B, bq, K, G]
      m_new = jnp.maximum(m_old, jnp.einsum("bkgq->bqkg", s.max(-1)))
      p_blk = jnp.exp(s - jnp.einsum("bqkg->bkgq", m_new)[..., None])  # masked -> 0
      alpha = jnp.exp(m_old - m_new)
      l_new = alpha * _slice(c.l, a * bq, bq) + jnp.einsum("bkgqs->bqkg", p_blk)
      pv = jnp.einsum("bkgqs,bskh->bqkgh", p_blk.astype(v.dtype), v_blk,
                      precision=spec.precision, preferred_element_type=jnp.float32)
      o_new = alpha[..., None] * _slice(c.o, a * bq, bq) + pv
      return Carry(o=_update(c.o, o_new, a * bq), m=_update(c.m, m_new, a * bq),
                   l=_update(c.l, l_new, a * bq))

    return jax.lax.fori_loop(0, masks.num_pairs, body, carry)

  def backward(self, q, k, v, do, lse, delta, masks: HopMasks, spec: HopSpec, dq, dk, dv):
    bq, bk = spec.block_q, spec.block_kv

    def body(p, acc):
      dq, dk, dv = acc
      a, b = masks.pairs[p, 0], masks.pairs[p, 1]
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
      dp = jnp.einsum("bqkgh,bskh->bkgqs", do_blk, v_blk, precision=spec.precision,
                      preferred_element_type=jnp.float32)
      ds = (p_blk * (dp - delta_blk) * spec.scale).astype(q.dtype)
      dq_blk = jnp.einsum("bkgqs,bskh->bqkgh", ds, k_blk, precision=spec.precision,
                          preferred_element_type=jnp.float32)
      dk_blk = jnp.einsum("bkgqs,bqkgh->bskh", ds, q_blk, precision=spec.precision,
                          preferred_element_type=jnp.float32)
      dq = _update(dq, _slice(dq, a * bq, bq) + dq_blk, a * bq)
      dk = _update(dk, _slice(dk, b * bk, bk) + dk_blk, b * bk)
      dv = _update(dv, _slice(dv, b * bk, bk) + dv_blk, b * bk)
      return dq, dk, dv

    return jax.lax.fori_loop(0, masks.num_pairs, body, (dq, dk, dv))
