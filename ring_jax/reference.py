"""Dense single-device attention: the oracle every ring result is checked against."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ring_jax import masking
from ring_jax import validation


def reference_attention(query, key, value, *, is_causal: bool = False, segment_ids=None,
                        scale: float | None = None, local_window_size=None,
                        q_positions=None, kv_positions=None, sinks=None,
                        logits_soft_cap: float | None = None):
  """Dense single-device attention, the oracle the sharded functions are tested against
  (the same arguments, on whole arrays). Materialises the full ``[T, S]`` score matrix;
  softmax in float32 (or float64).

  Args:
    query: ``[B, T, N, H]``.
    key, value: ``[B, S, K, H]`` and ``[B, S, K, Hv]`` with ``N % K == 0`` (GQA/MQA share
      K/V heads; ``Hv``, V's head size, may differ from ``H``, as in MLA).
    is_causal: key position must not exceed query position.
    segment_ids: integer ``[B, T]`` (requires ``T == S``): tokens attend only
      within equal ids; id 0 is padding (its queries output 0, its keys are
      never attended); any other value, negative included, is a document id.
    scale: score scale, default ``1/sqrt(H)``; must be finite in the score
      dtype (float32, or float64 for float64 inputs).
    local_window_size: ``int`` or ``(left, right)``: query at position ``p``
      attends keys in ``[p-left, p+right]`` (as in ``jax.nn.dot_product_attention``).
    q_positions, kv_positions: int ``[T]`` / ``[S]`` or ``[B, T]`` / ``[B, S]``
      global positions for the causal/window mask; default ``arange``. Pass
      :func:`ring_jax.layout_positions` to attend over a layout-ordered sequence.
    sinks: ``[N]`` attention sinks (GPT-OSS), one logit per query head with no value in
      each row's softmax denominator (:func:`ring_jax.hop.add_sinks`); differentiable.
    logits_soft_cap: ``c > 0``: scores become ``c * tanh(score / c)`` before masking and
      softmax (Gemma 2); None: no cap.

  Returns:
    ``[B, T, N, Hv]`` in ``query.dtype``. Rows that attend nothing are 0.
    Masked (including padding) keys are never read: a non-finite value there
    changes nothing. A non-finite value in a visible score makes its row
    non-finite (as dense IEEE arithmetic would), and an output element that
    reads a non-finite value of ``value`` through a visible pair is NaN.
  """
  validation.check_qkv(query, key, value, is_causal=is_causal or local_window_size is not None,
                       segment_ids=segment_ids)
  window = masking.normalize_window(local_window_size)
  scale = validation.check_scale(scale, query.shape[-1], _score_dtype(query.dtype))
  cap = validation.check_soft_cap(logits_soft_cap)
  sinks = validation.check_sinks(sinks, query.shape[2])
  # One compiled program per shape and static choice: called eagerly (a test's oracle, a
  # notebook), op-by-op dispatch would compile each of its ~20 operations on its own.
  return _dense(query, key, value, segment_ids, q_positions, kv_positions, sinks,
                is_causal=bool(is_causal), scale=scale, window=window, cap=cap)


def _score_dtype(dtype):
  """Scores and softmax run in float64 for float64 inputs, else in float32."""
  return jnp.float64 if dtype == jnp.float64 else jnp.float32


@functools.partial(jax.jit, static_argnames=("is_causal", "scale", "window", "cap"))
def _dense(query, key, value, segment_ids, q_positions, kv_positions, sinks, *,
           is_causal: bool, scale: float, window, cap):
  """:func:`reference_attention` after its checks (``window`` normalised, ``scale`` a float)."""
  b, t, n, h = query.shape
  s, kh = key.shape[1], key.shape[2]
  g = n // kh
  acc = _score_dtype(query.dtype)
  q = query.astype(acc).reshape(b, t, kh, g, h)
  k, v = key.astype(acc), value.astype(acc)
  scores = jnp.einsum("btkgh,bskh->bkgts", q, k) * scale
  if cap is not None:
    scores = cap * jnp.tanh(scores / cap)
  qp = jnp.arange(t, dtype=jnp.int32) if q_positions is None else jnp.asarray(q_positions)
  kp = jnp.arange(s, dtype=jnp.int32) if kv_positions is None else jnp.asarray(kv_positions)
  mask = masking.position_mask(qp, kp, is_causal, window)
  mask = jnp.broadcast_to(mask, (b, t, s))
  if segment_ids is not None:
    mask = mask & masking.segment_mask(jnp.asarray(segment_ids), jnp.asarray(segment_ids))
  scores = jnp.where(mask[:, None, None], scores, -jnp.inf)  # mask [B, 1, 1, T, S]
  row_max = jnp.max(scores, axis=-1, keepdims=True)
  # Only an all -inf row (nothing visible) is shifted by 0 instead; +inf and NaN stay.
  if sinks is not None:  # the sink logit [K, G] joins every row's max and denominator
    sink = sinks.astype(acc).reshape(1, kh, g, 1, 1)
    row_max = jnp.maximum(row_max, sink)
  row_max = jnp.where(row_max == -jnp.inf, 0.0, row_max)
  p = jnp.where(mask[:, None, None], jnp.exp(scores - row_max), 0.0)
  denom = p.sum(-1, keepdims=True)
  if sinks is not None:
    denom = denom + jnp.exp(sink - row_max)
  p = p / jnp.where(denom == 0, 1.0, denom)
  def p_at_v():
    return jnp.einsum("bkgts,bskh->btkgh", p, v)

  def p_at_finite_v():
    # p is 0 at masked pairs, but 0 * NaN = NaN: read only V's finite values, and mark
    # the output elements that see a non-finite one through a visible pair.
    bad = ~jnp.isfinite(v)
    out = jnp.einsum("bkgts,bskh->btkgh", p, jnp.where(bad, 0, v))
    reads_bad = jnp.einsum("bts,bskh->btkh", mask.astype(acc), bad.astype(acc)) > 0
    return jnp.where(reads_bad[:, :, :, None, :], jnp.nan, out)

  # The second matmul only when V holds a non-finite value (the dense model path runs this).
  out = jax.lax.cond(jnp.isfinite(v).all(), p_at_v, p_at_finite_v)
  return out.reshape(b, t, n, v.shape[-1]).astype(query.dtype)
