"""Decoding against a sequence-sharded KV cache: local partial attention + exact LSE merge.

During decoding each step has a handful of new queries (one token per row)
and a KV cache far too long for one device. The cache stays where it is,
sharded over the sequence mesh axis; every device attends the new queries to
its own share of the cache and returns a *partial* result ``(o_i, lse_i)``:
the softmax-normalised output over its keys and the log-sum-exp of its
scores. The exact attention over all keys is then

  ``lse = log sum_i exp(lse_i)``,  ``o = sum_i exp(lse_i - lse) * o_i``,

computed with one ``pmax`` and two ``psum`` over the axis (no key or value
moves; what crosses devices is ``[B, T, N, H]`` plus ``[B, T, N]``). A device
whose keys are all masked has ``lse_i = -inf`` and weight 0; a query that sees
no key anywhere gets output 0 (as :func:`ring_jax.reference_attention`).

The cache is a *set* of entries, each with its own position and segment id
(0 = empty or padding), so the order of entries, and which device holds which,
does not matter for the result: masks come from the stored positions
(causal: key position <= query position) and segment ids (equal and nonzero).

Pure JAX (no Flax). :func:`write_slot` stores a new entry on the one device
that owns its slot.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ring_jax import validation
from ring_jax.hop import add_sinks


def partial_attention(q_BTNH, k_BSKH, v_BSKH, mask_BTS, scale: float | None = None,
                      logits_soft_cap: float | None = None):
  """``(o [B, T, N, Hv] float32, lse [B, T, N] float32)`` of queries over local keys.

  ``v`` ``[B, S, K, Hv]``: V's head size ``Hv`` may differ from Q/K's ``H`` (MLA); K and V
  stay two arrays. ``logits_soft_cap`` ``c``: scores become ``c * tanh(score / c)`` before
  masking (as :func:`ring_jax.ring_attention`'s).

  GQA: query head ``n`` uses key/value head ``n // (N // K)``. ``o`` is
  normalised over the visible keys (0 where none is visible, with
  ``lse = -inf``). Scores and softmax in float32; the matmuls take the cache in
  its own dtype (no float32 copy of it) and accumulate in float32, with the
  probabilities cast to the values' dtype as in the ring's hop kernel.
  """
  b, t, n, h = q_BTNH.shape
  kh = k_BSKH.shape[2]
  if n % kh:
    raise ValueError(f"query heads {n} are not a multiple of key/value heads {kh}.")
  if k_BSKH.shape[-1] != h or v_BSKH.shape[:3] != k_BSKH.shape[:3]:
    raise ValueError(f"keys {k_BSKH.shape} must be [B, S, K, {h}] (the query's head size) and "
                     f"values {v_BSKH.shape} [B, S, K, Hv] (the keys' B, S, K; any Hv).")
  scale = validation.check_scale(scale, h, jnp.float32)
  cap = validation.check_soft_cap(logits_soft_cap)
  # The cache stays in its dtype: matmuls accumulate in float32 without a float32 copy of
  # the keys/values (a bf16 product is exact in float32, as in the float32 oracle).
  q = q_BTNH.astype(k_BSKH.dtype).reshape(b, t, kh, n // kh, h)
  s_BKGTS = jnp.einsum("btkgh,bskh->bkgts", q, k_BSKH,
                       preferred_element_type=jnp.float32) * scale
  if cap is not None:
    s_BKGTS = cap * jnp.tanh(s_BKGTS / cap)
  visible = mask_BTS[:, None, None]
  s_BKGTS = jnp.where(visible, s_BKGTS, -jnp.inf)
  m = jnp.max(s_BKGTS, axis=-1, keepdims=True)
  m_safe = jnp.where(m == -jnp.inf, 0.0, m)
  p = jnp.where(visible, jnp.exp(s_BKGTS - m_safe), 0.0)
  denom = jnp.sum(p, axis=-1, keepdims=True)
  # p in the values' dtype, float32 accumulation: as the ring's hop kernel (ring_jax/hop.py).
  p = (p / jnp.where(denom == 0, 1.0, denom)).astype(v_BSKH.dtype)
  o = jnp.einsum("bkgts,bskh->btkgh", p, v_BSKH, preferred_element_type=jnp.float32)
  lse = jnp.where(denom[..., 0] == 0, -jnp.inf, m_safe[..., 0] + jnp.log(denom[..., 0]))
  lse_BTN = jnp.moveaxis(lse.reshape(b, n, t), 1, 2)
  return o.reshape(b, t, n, v_BSKH.shape[-1]), lse_BTN


def merge_partials(o_BTNH, lse_BTN, axis_name):
  """The exact attention ``(o, lse)`` from every device's partial result over ``axis_name``.

  Inside ``shard_map``. ``o`` comes back in float32, the same on every
  device of the axis.
  """
  m = jax.lax.pmax(lse_BTN, axis_name)
  m_safe = jnp.where(m == -jnp.inf, 0.0, m)
  w_BTN = jnp.exp(lse_BTN - m_safe)  # 0 for a device that saw nothing
  total = jax.lax.psum(w_BTN, axis_name)
  o = jax.lax.psum(o_BTNH.astype(jnp.float32) * w_BTN[..., None], axis_name)
  o = o / jnp.where(total == 0, 1.0, total)[..., None]
  lse = jnp.where(total == 0, -jnp.inf, m_safe + jnp.log(jnp.where(total == 0, 1.0, total)))
  return o, lse


def cache_mask(q_positions_BT, q_segment_ids_BT, kv_positions_BS, kv_segment_ids_BS):
  """``[B, T, S]``: key visible iff same nonzero segment and key position <= query position."""
  same = (q_segment_ids_BT[:, :, None] == kv_segment_ids_BS[:, None, :]) & (
      kv_segment_ids_BS[:, None, :] != 0)
  return same & (kv_positions_BS[:, None, :] <= q_positions_BT[:, :, None])


def combine(o1_BTNH, lse1_BTN, o2_BTNH, lse2_BTN):
  """The exact ``(o, lse)`` over the union of two disjoint key sets, from their partials."""
  m = jnp.maximum(lse1_BTN, lse2_BTN)
  m_safe = jnp.where(m == -jnp.inf, 0.0, m)
  w1, w2 = jnp.exp(lse1_BTN - m_safe), jnp.exp(lse2_BTN - m_safe)
  total = w1 + w2
  safe = jnp.where(total == 0, 1.0, total)
  o = (o1_BTNH * w1[..., None] + o2_BTNH * w2[..., None]) / safe[..., None]
  return o, jnp.where(total == 0, -jnp.inf, m_safe + jnp.log(safe))


def cache_attention(q_BTNH, k_BSKH, v_BSKH, q_positions_BT, q_segment_ids_BT,
                    kv_positions_BS, kv_segment_ids_BS, *, new_kv=None, axis_name=None,
                    scale: float | None = None, logits_soft_cap: float | None = None,
                    sinks=None):
  """Causal attention of a few queries over a KV cache sharded over ``axis_name``.

  Inside ``shard_map`` (``axis_name`` the sequence axis the cache is sharded
  over; the queries are the same on every device of it), or on one device
  with ``axis_name=None``. ``new_kv=(k [B, T, K, H], v)``: the queries' own
  keys and values, not in the cache (yet); they share the queries' positions
  and segment ids, are attended causally among themselves on every device
  (no communication) and merged into the result exactly. ``logits_soft_cap``
  caps every score (:func:`partial_attention`); ``sinks`` ``[N]`` (this device's query
  heads) join the merged result once (:func:`ring_jax.hop.add_sinks`). Values may have
  their own head size ``Hv`` (:func:`partial_attention`). Returns ``[B, T, N, Hv]`` in
  ``q``'s dtype.
  """
  mask = cache_mask(q_positions_BT, q_segment_ids_BT, kv_positions_BS, kv_segment_ids_BS)
  o, lse = partial_attention(q_BTNH, k_BSKH, v_BSKH, mask, scale, logits_soft_cap)
  if axis_name is not None:
    o, lse = merge_partials(o, lse, axis_name)
  if new_kv is not None:
    own_mask = cache_mask(q_positions_BT, q_segment_ids_BT, q_positions_BT, q_segment_ids_BT)
    o_own, lse_own = partial_attention(q_BTNH, *new_kv, own_mask, scale, logits_soft_cap)
    o, lse = combine(o, lse, o_own, lse_own)
  if sinks is not None:
    o, lse = add_sinks(o, lse, validation.check_sinks(sinks, q_BTNH.shape[2]))
  return o.astype(q_BTNH.dtype)


def write_slot(cache_BS, new_BT, slot, axis_name=None, axis: int = 1):
  """Writes ``new`` at global slot ``slot`` of a cache sharded contiguously over ``axis_name``.

  Inside ``shard_map``: the local cache holds global slots ``[d*C, (d+1)*C)``
  on device ``d`` of the axis (``C`` its local length along ``axis``). Only
  the owner of ``slot`` (``slot // C``) changes its shard; the others write
  their own old values back (same program on every device, no data moves).
  ``new`` spans ``T`` slots starting at ``slot``, all on the same device.
  """
  local_len = cache_BS.shape[axis]
  slot = jnp.asarray(slot, jnp.int32)
  if axis_name is None:
    owner_here, local = jnp.bool_(True), slot
  else:
    owner_here = slot // local_len == jax.lax.axis_index(axis_name)
    local = slot % local_len
  start = [jnp.int32(0)] * cache_BS.ndim
  start[axis] = local
  old = jax.lax.dynamic_slice(cache_BS, start, new_BT.shape)
  value = jnp.where(owner_here, new_BT.astype(cache_BS.dtype), old)
  return jax.lax.dynamic_update_slice(cache_BS, value, start)
