"""Dense single-device attention: the oracle every ring result is checked against."""

from __future__ import annotations

import jax.numpy as jnp

from ring_jax import layouts
from ring_jax import validation


def reference_attention(query, key, value, *, is_causal: bool = False, segment_ids=None,
                        scale: float | None = None, local_window_size=None,
                        q_positions=None, kv_positions=None):
  """Materialises the full ``[T, S]`` score matrix; softmax in float32 (or float64).

  Args:
    query: ``[B, T, N, H]``.
    key, value: ``[B, S, K, H]`` with ``N % K == 0`` (GQA/MQA share K/V heads).
    is_causal: key position must not exceed query position.
    segment_ids: int ``[B, T]`` (requires ``T == S``): tokens attend only within
      equal ids; id 0 is padding (its queries output 0, its keys are never attended).
    scale: score scale, default ``1/sqrt(H)``.
    local_window_size: ``int`` or ``(left, right)``: query at position ``p``
      attends keys in ``[p-left, p+right]`` (as in ``jax.nn.dot_product_attention``).
    q_positions, kv_positions: int ``[T]`` / ``[S]`` or ``[B, T]`` / ``[B, S]``
      global positions for the causal/window mask; default ``arange``. Pass
      :func:`ring_jax.layout_positions` to attend over a layout-ordered sequence.

  Returns:
    ``[B, T, N, H]`` in ``query.dtype``. Rows that attend nothing are 0.
  """
  validation.check_qkv(query, key, value, is_causal=is_causal or local_window_size is not None,
                       segment_ids=segment_ids)
  window = layouts.normalize_window(local_window_size)
  b, t, n, h = query.shape
  s, kh = key.shape[1], key.shape[2]
  g = n // kh
  if scale is None:
    scale = h ** -0.5
  acc = jnp.float64 if query.dtype == jnp.float64 else jnp.float32
  q = query.astype(acc).reshape(b, t, kh, g, h)
  k, v = key.astype(acc), value.astype(acc)
  scores = jnp.einsum("btkgh,bskh->bkgts", q, k) * scale
  qp = jnp.arange(t, dtype=jnp.int32) if q_positions is None else jnp.asarray(q_positions)
  kp = jnp.arange(s, dtype=jnp.int32) if kv_positions is None else jnp.asarray(kv_positions)
  mask = layouts.position_mask(qp, kp, is_causal, window)
  mask = jnp.broadcast_to(mask, (b, t, s)) if mask.ndim == 3 else mask[None]
  if segment_ids is not None:
    seg = jnp.asarray(segment_ids)
    mask = mask & (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] != 0)
  mask = mask[:, None, None]  # [B, 1, 1, T, S]
  scores = jnp.where(mask, scores, -jnp.inf)
  row_max = jnp.max(scores, axis=-1, keepdims=True)
  row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
  p = jnp.where(mask, jnp.exp(scores - row_max), 0.0)
  denom = p.sum(-1, keepdims=True)
  p = p / jnp.where(denom > 0, denom, 1.0)
  out = jnp.einsum("bkgts,bskh->btkgh", p, v).reshape(b, t, n, h)
  return out.astype(query.dtype)
