"""Blockwise attention of local queries against a whole (gathered) K/V, as one ``custom_vjp``.

All-gather and Ulysses attend their queries to the whole sequence's K/V in
one call of the ring's per-hop kernel (:class:`ring_jax.HopKernel`, the XLA
one by default): it skips the block pairs the causal mask, window or
documents hide from the tokens' global positions, exactly as in a ring hop,
so masks, layouts and GQA behave the same in every strategy.
:func:`_kernel_forward` and :func:`_kernel_backward` are the strategies' only
calls into the kernel.
"""

from __future__ import annotations

import dataclasses
import functools

import jax

from ring_jax import hop as hop_lib
from ring_jax import validation
from ring_jax.hop import HopKernel, HopMasks, HopSpec


@dataclasses.dataclass(frozen=True)
class LocalConfig:
  spec: HopSpec
  kernel: HopKernel
  gather_axis: object = None  # all_gather: K/V (and kv ids) are gathered over this axis
  return_lse: bool = False  # local_attention returns (out, lse), both differentiable


# --- the hop-kernel call sites -------------------------------------------------------------


def _kernel_forward(cfg: LocalConfig, q, k, v, q_pos, kv_pos, q_seg, kv_seg):
  """``(out_h, lse_h)`` of the queries at ``q_pos`` against the keys at ``kv_pos``."""
  masks = HopMasks.build(cfg.spec, q_pos, kv_pos, q_seg, kv_seg)
  cfg.kernel.check(q.shape, k.shape, q.dtype, cfg.spec)
  return cfg.kernel.forward(q, k, v, masks, cfg.spec)  # empty rows: (0, -inf)


def _kernel_backward(cfg: LocalConfig, q, k, v, q_pos, kv_pos, q_seg, kv_seg, out, lse, do,
                     dlse=None):
  """float32 ``(dq, dk, dv)`` of one whole-K/V call, from zero accumulators (``dlse``: the
  lse's cotangent, or None)."""
  masks = HopMasks.build(cfg.spec, q_pos, kv_pos, q_seg, kv_seg)
  res = hop_lib.HopResiduals(out, hop_lib.lse_for_backward(lse), do, dlse)
  dq, dk, dv = cfg.kernel.backward(q, k, v, masks, cfg.spec, res, hop_lib.zero_grads(q, k, v))
  return dq, dk, dv


# -------------------------------------------------------------------------------------------


def _gather(cfg: LocalConfig, k, v, kv_seg):
  if cfg.gather_axis is None:
    return k, v, kv_seg
  with jax.named_scope("gather_kv"):
    g = functools.partial(jax.lax.all_gather, axis_name=cfg.gather_axis, axis=1, tiled=True)
    return g(k), g(v), None if kv_seg is None else g(kv_seg)


def _forward(cfg: LocalConfig, q, k, v, q_pos, kv_pos, q_seg, kv_seg):
  """``(out [B,T,K,G,H], lse [B,T,K,G])``; K/V gathered first when ``cfg.gather_axis``."""
  k, v, kv_seg = _gather(cfg, k, v, kv_seg)
  out, lse = _kernel_forward(cfg, q, k, v, q_pos, kv_pos, q_seg, kv_seg)
  return out.astype(q.dtype), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def local_attention(cfg: LocalConfig, q, k, v, q_pos, kv_pos, q_seg, kv_seg):
  """Attention of ``q [B,T,K,G,H]`` at ``q_pos`` to ``k``/``v [B,S,K,H]`` at ``kv_pos``
  (gathered over ``cfg.gather_axis`` first when set); ``[B,T,K,G,H]`` in ``q.dtype``, or
  with ``cfg.return_lse`` ``(out, lse)``, ``lse [B,T,K,G]`` float32 (``-inf`` in rows that
  see no key), both differentiable."""
  out, lse = _forward(cfg, q, k, v, q_pos, kv_pos, q_seg, kv_seg)
  return (out, lse) if cfg.return_lse else out


def _fwd(cfg, q, k, v, q_pos, kv_pos, q_seg, kv_seg):
  out, lse = _forward(cfg, q, k, v, q_pos, kv_pos, q_seg, kv_seg)
  # Residuals hold the *local* K/V: the all-gather variant gathers again in the backward
  # rather than keeping the whole sequence's K/V alive between the passes.
  result = (out, lse) if cfg.return_lse else out
  return result, (q, k, v, q_pos, kv_pos, q_seg, kv_seg, out, lse)


def _bwd(cfg, res, cotangent):
  q, k_local, v_local, q_pos, kv_pos, q_seg, kv_seg_local, out, lse = res
  do, dlse = cotangent if cfg.return_lse else (cotangent, None)
  k, v, kv_seg = _gather(cfg, k_local, v_local, kv_seg_local)
  dq, dk, dv = _kernel_backward(cfg, q, k, v, q_pos, kv_pos, q_seg, kv_seg, out, lse, do,
                                dlse)
  if cfg.gather_axis is not None:
    with jax.named_scope("scatter_dkv"):  # transpose of the all_gather: sum, keep own shard
      dk, dv = (jax.lax.psum_scatter(x, cfg.gather_axis, scatter_dimension=1, tiled=True)
                for x in (dk, dv))
  extra = tuple(sorted(hop_lib.varying_axes(dk) - hop_lib.varying_axes(k_local), key=str))
  if extra:  # K/V replicated over axes the queries are split over (MQA on a tensor axis)
    dk, dv = jax.lax.psum((dk, dv), extra)
  return (dq.astype(q.dtype), dk.astype(k_local.dtype), dv.astype(v_local.dtype), None, None,
          None, None)


local_attention.defvjp(_fwd, _bwd)


def heads_last(result, heads: int):
  """:func:`local_attention`'s ``out [B,T,K,G,H]`` (and ``lse [B,T,K,G]``) with the query
  heads as one axis: ``[B,T,N,H]`` (``[B,T,N]``), ``N = heads``."""
  if isinstance(result, tuple):
    out, lse = result
    return heads_last(out, heads), lse.reshape(*lse.shape[:2], heads)
  return result.reshape(*result.shape[:2], heads, result.shape[-1])


def check_self_attention(query, key, value, segment_ids, axis_name, options, who: str) -> int:
  """The checks of a whole-sequence strategy's local shards; returns the axis size."""
  validation.check_qkv(query, key, value, is_causal=options.masked, segment_ids=segment_ids)
  size = validation.axis_size(axis_name, who)
  if key.shape[1] != query.shape[1]:
    raise ValueError(f"{who} needs equal local query and key lengths, got {query.shape[1]}, "
                     f"{key.shape[1]}; use strategy='ring' for cross-attention over a sequence "
                     "axis.")
  return size
