"""The kit's float64 oracle: dense softmax attention and its gradients in numpy.

Independent of the library it checks: no JAX, no ring_jax code (the layouts' token order is
re-derived here from their definitions in docs/design.md). Conventions (ring_jax's, and
``jax.nn.dot_product_attention``'s where it has one):

* ``q`` ``[B, T, N, H]``, ``k`` ``[B, S, K, H]``, ``v`` ``[B, S, K, Hv]``; query head ``n``
  reads key/value head ``n // (N // K)`` (GQA / MQA).
* scores ``s = scale * q.k``, then ``c * tanh(s / c)`` with a soft-cap ``c``, then the mask.
* a pair ``(t, s)`` is visible when causal allows it (``pos_q >= pos_kv``), the window
  ``(left, right)`` allows it (``-right <= pos_q - pos_kv <= left``) and, with segment ids,
  both ids are equal and non-zero (0 is padding, attended by nothing).
* a sink ``z_n`` per query head is one more logit with no value, in the softmax's
  denominator once: ``lse = log(exp(z_n) + sum_s exp(s))``.
* a row with no visible key (and no sink) has output 0, ``lse = -inf`` and no gradient.
"""

from __future__ import annotations

import numpy as np

#: The token orders the kit knows: which global positions device ``i`` of ``n`` holds.
LAYOUT_NAMES = ("contiguous", "zigzag", "striped")


def layout_permutation(layout: str, ring: int, length: int) -> np.ndarray:
  """``perm[j]`` = natural position of the token at index ``j`` of layout order.

  contiguous: device ``i`` holds ``[i*L/n, (i+1)*L/n)``; zigzag: the sequence in ``2n``
  chunks, device ``i`` holds chunks ``i`` and ``2n-1-i``; striped: token ``t`` lives on
  device ``t mod n``. Layout order is the devices' shards one after another.
  """
  local = length // ring
  if layout == "contiguous":
    return np.arange(length)
  if layout == "striped":
    return np.concatenate([np.arange(i, length, ring) for i in range(ring)])
  if layout == "zigzag":
    chunk = local // 2
    return np.concatenate([np.r_[i * chunk:(i + 1) * chunk,
                                 (2 * ring - 1 - i) * chunk:(2 * ring - i) * chunk]
                           for i in range(ring)])
  raise ValueError(f"the kit knows the layouts {LAYOUT_NAMES}, got {layout!r}")


def visibility(q_pos, kv_pos, is_causal: bool, window=None, q_seg=None, kv_seg=None):
  """bool ``[B or 1, T, S]``: which (query, key) pairs are visible."""
  d = np.asarray(q_pos, np.int64)[:, None] - np.asarray(kv_pos, np.int64)[None, :]
  vis = np.ones(d.shape, bool)
  if is_causal:
    vis &= d >= 0
  if window is not None:
    vis &= (d <= window[0]) & (d >= -window[1])
  vis = vis[None]
  if q_seg is not None:
    qs, ks = np.asarray(q_seg)[:, :, None], np.asarray(kv_seg)[:, None, :]
    vis = vis & (qs == ks) & (qs != 0)
  return vis


def attention(q, k, v, vis, scale, do, dlse=None, sinks=None, soft_cap=None):
  """float64 attention over visible pairs and the gradients of
  ``<out, do> + <lse, dlse>`` (the lse term only where lse is finite).

  Returns a dict: ``out`` ``[B, T, N, Hv]``, ``lse`` ``[B, T, N]``, ``dq``, ``dk``, ``dv``
  and, with ``sinks`` ``[N]``, ``dsinks``.
  """
  q, k, v, do = (np.asarray(x, np.float64) for x in (q, k, v, do))
  b, t, n, _ = q.shape
  kh = k.shape[2]
  g = n // kh
  dlse = np.zeros((b, t, n)) if dlse is None else np.asarray(dlse, np.float64)
  kr, vr = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
  raw = np.einsum("btnh,bsnh->bnts", q, kr) * scale
  s = soft_cap * np.tanh(raw / soft_cap) if soft_cap else raw
  vis = np.broadcast_to(np.asarray(vis)[:, None], s.shape)
  m = np.where(vis, s, -np.inf).max(-1, keepdims=True)
  if sinks is not None:
    z = np.asarray(sinks, np.float64)[None, :, None, None]
    m = np.maximum(m, z)
  m = np.where(np.isfinite(m), m, 0.0)
  p = np.where(vis, np.exp(np.where(vis, s, 0.0) - m), 0.0)
  l = p.sum(-1, keepdims=True)
  if sinks is not None:
    l = l + np.exp(z - m)
  empty = l == 0
  pn = p / np.where(empty, 1.0, l)
  out = np.einsum("bnts,bsnh->btnh", pn, vr)
  lse = np.where(empty, -np.inf, m + np.log(np.where(empty, 1.0, l)))[..., 0].transpose(0, 2, 1)
  dlse = np.where(np.isfinite(lse), dlse, 0.0)
  dv = np.einsum("bnts,btnh->bsnh", pn, do)
  dp = np.einsum("btnh,bsnh->bnts", do, vr)
  delta = np.einsum("btnh,btnh->bnt", do, out)[..., None] - dlse.transpose(0, 2, 1)[..., None]
  ds = pn * (dp - delta)
  if soft_cap:
    ds = ds * (1.0 - np.tanh(raw / soft_cap) ** 2)
  ds = ds * scale
  dq = np.einsum("bnts,bsnh->btnh", ds, kr)
  dk = np.einsum("bnts,btnh->bsnh", ds, q)
  group = lambda x: x.reshape(b, x.shape[1], kh, g, x.shape[-1]).sum(3)
  result = dict(out=out, lse=lse, dq=dq, dk=group(dk), dv=group(dv))
  if sinks is not None:
    # d lse / d z = p_sink; d out / d z = -p_sink * out.
    p_sink = np.where(empty, 0.0, np.exp(z - m) / np.where(empty, 1.0, l))[..., 0]  # [B,N,T]
    result["dsinks"] = (p_sink * -delta[..., 0]).sum((0, 2))
  return result
