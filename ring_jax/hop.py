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
  m, l   ``[B, T, K, G]``      float32 running row max (``-inf`` until the row meets a
                               visible key) / row sum of exp (exactly 0 until then)
  lse    ``[B, T, K, G]``      float32 log-sum-exp of the finished forward
  delta  ``[B, T, K, G]``      float32 ``rowsum(dO * O)`` (FlashAttention-2, Alg. 2)

Kernels keep non-finite inputs visible and read nothing masked: masked scores
are ``-inf`` (never a finite floor, which huge scales would cross), a row whose
max is still ``-inf`` subtracts 0 instead of it, no ``l > 0`` style guard turns
a NaN into 0 (:func:`finalize` treats only ``l == 0`` as an empty row), and
values at masked pairs never reach an output (``0 * NaN`` is NaN).

References: Dao et al., FlashAttention (2022) Alg. 1 and FlashAttention-2
(2023) Alg. 1-2 for the per-block update; Liu et al., Ring Attention (2023)
Alg. 1 for merging the per-hop results.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Protocol

import jax
import jax.numpy as jnp

from ring_jax import scheduling


class Carry(NamedTuple):
  """Online-softmax state, all float32: ``o`` ``[B,T,K,G,H]``, ``m``/``l`` ``[B,T,K,G]``."""
  o: jax.Array
  m: jax.Array
  l: jax.Array


class HopMasks(NamedTuple):
  """What decides which scores of this hop are visible.

  q_positions / kv_positions: int32 ``[T]`` / ``[S]`` global token positions.
  q_segment_ids / kv_segment_ids: integer ``[B, T]`` / ``[B, S]`` or None (0 =
    padding, any other value a document; see :func:`ring_jax.scheduling.segment_mask`).
  pairs: int32 ``[P, 2]`` (q block, kv block) pairs to compute, as
    :func:`ring_jax.schedule` lists them; only the first ``num_pairs`` are real.
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
  """Empty state: ``o = l = 0`` and running max ``m = -inf`` (no key seen yet).

  ``m`` starts at a true ``-inf``, not a finite floor, so that scores of any
  finite size (e.g. with a huge ``scale``) are never mistaken for masked ones.
  """
  b, t, k, g, h = q.shape
  return Carry(o=jnp.zeros((b, t, k, g, h), jnp.float32),
               m=jnp.full((b, t, k, g), -jnp.inf, jnp.float32),
               l=jnp.zeros((b, t, k, g), jnp.float32))


def finalize(carry: Carry, dtype):
  """Returns ``(out [B,T,K,G,H] dtype, lse [B,T,K,G] f32)``; rows that saw no key give 0.

  A row saw no key exactly when ``l == 0`` (``l`` is a sum of ``exp`` of
  visible scores). A NaN ``l`` or ``o`` (from a non-finite input) is passed
  through, not mistaken for an empty row.
  """
  empty = carry.l == 0
  l_safe = jnp.where(empty, 1.0, carry.l)
  out = jnp.where(empty[..., None], 0.0, carry.o / l_safe[..., None]).astype(dtype)
  lse = jnp.where(empty, jnp.inf, carry.m + jnp.log(l_safe))  # inf: backward's p = 0
  return out, lse


def _block_mask(masks: HopMasks, spec: HopSpec, a, b):
  """bool ``[B or 1, 1, 1, bq, bk]`` visibility of block pair (a, b); None if all visible."""
  if not spec.is_causal and spec.window is None and masks.q_segment_ids is None:
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


def _slice(x, start, size, axis=1):
  return jax.lax.dynamic_slice_in_dim(x, start, size, axis=axis)


def _update(x, upd, start, axis=1):
  return jax.lax.dynamic_update_slice_in_dim(x, upd, start, axis=axis)


def _may_mask(masks: HopMasks, spec: HopSpec) -> bool:
  """Whether some computed score can be masked (statically); if not, every pair is visible."""
  return spec.is_causal or spec.window is not None or masks.q_segment_ids is not None


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


@dataclasses.dataclass(frozen=True)
class XlaHopKernel:
  """Blockwise hop kernel in plain XLA: a loop over the scheduled block pairs.

  Each iteration materialises one ``[B, K, G, bq, bk]`` float32 score block
  and nothing larger, so memory is linear in the local sequence length.
  Matmuls run in the input dtype with float32 accumulation. Masked scores are
  ``-inf``, the running max starts at ``-inf``, and no guard turns a NaN into
  a finite number, so non-finite inputs stay visible in exactly the outputs
  that read them (see :func:`_masked_pv` for V). Profiles name the loops
  ``xla_hop_fwd_blocks`` / ``xla_hop_bwd_blocks``.
  """

  def forward(self, q, k, v, carry: Carry, masks: HopMasks, spec: HopSpec) -> Carry:
    bq, bk = spec.block_q, spec.block_kv

    def fold(guard_v: bool) -> Carry:
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
        # A row that has seen no visible key yet has m = -inf: subtract 0 instead, so
        # exp(-inf - 0) = 0 rather than exp(-inf + inf) = NaN. Per row, not per score.
        m_ref = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p_blk = jnp.exp(s - jnp.einsum("bqkg->bkgq", m_ref)[..., None])  # masked -> 0
        alpha = jnp.exp(m_old - m_ref)
        l_new = alpha * _slice(c.l, a * bq, bq) + jnp.einsum("bkgqs->bqkg", p_blk)
        if guard_v:
          pv = _masked_pv(p_blk, v_blk, mask, spec.precision)
        else:
          pv = jnp.einsum("bkgqs,bskh->bqkgh", p_blk.astype(v.dtype), v_blk,
                          precision=spec.precision, preferred_element_type=jnp.float32)
        o_new = alpha[..., None] * _slice(c.o, a * bq, bq) + pv
        return Carry(o=_update(c.o, o_new, a * bq), m=_update(c.m, m_new, a * bq),
                     l=_update(c.l, l_new, a * bq))

      with jax.named_scope("xla_hop_fwd_blocks"):
        return jax.lax.fori_loop(0, masks.num_pairs, body, carry)

    if not _may_mask(masks, spec):
      return fold(guard_v=False)  # every computed pair is visible: p @ v may read all of V
    # Only a hop whose V shard holds a non-finite value pays for the guarded matmul.
    return jax.lax.cond(jnp.isfinite(v).all(), lambda: fold(guard_v=False),
                        lambda: fold(guard_v=True))

  def backward(self, q, k, v, do, lse, delta, masks: HopMasks, spec: HopSpec, dq, dk, dv):
    bq, bk = spec.block_q, spec.block_kv
    # The gradient matmuls (dP = dO V^T, dQ = dS K, dK = dS^T Q) read their right-hand
    # operand at masked pairs too, where 0 * NaN would spread a non-finite value into
    # rows that do not see it; they read the finite part instead. Rows and keys that do
    # see a non-finite value still get non-finite gradients: it reaches them through
    # the scores (computed from the raw q, k) or through delta = rowsum(dO * O), which
    # is non-finite where the output is. Per block operand, not per score; without masks
    # every computed pair is visible and the raw operands are right.
    finite = (lambda x: jnp.where(jnp.isfinite(x), x, 0)) if _may_mask(masks, spec) else (
        lambda x: x)

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

    with jax.named_scope("xla_hop_bwd_blocks"):
      return jax.lax.fori_loop(0, masks.num_pairs, body, (dq, dk, dv))
