"""Argument checks shared by the public entry points.

Every check runs on static shapes/dtypes at trace time, so bad input fails with
a message naming the fix before anything is compiled or run.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def check_qkv(query, key, value, *, is_causal: bool, segment_ids) -> None:
  """Shapes ``[B,T,N,H]``, ``[B,S,K,H]``, ``[B,S,K,H]``; same float dtype; ``N % K == 0``."""
  for name, x in (("query", query), ("key", key), ("value", value)):
    if getattr(x, "ndim", None) != 4:
      raise ValueError(
          f"{name} must be 4-D [batch, length, heads, head_dim], got shape "
          f"{getattr(x, 'shape', None)}.")
  if not (query.dtype == key.dtype == value.dtype):
    raise TypeError(
        f"query, key and value must share a dtype, got {query.dtype}, {key.dtype}, "
        f"{value.dtype}; cast them (e.g. all to bfloat16) before calling.")
  if not jnp.issubdtype(query.dtype, jnp.floating):
    raise TypeError(f"attention inputs must be floating point, got {query.dtype}.")
  if key.shape != value.shape:
    raise ValueError(f"key and value shapes differ: {key.shape} vs {value.shape}.")
  b, t, n, h = query.shape
  bk, s, k, hk = key.shape
  if b != bk or h != hk:
    raise ValueError(
        f"query {query.shape} and key {key.shape} must agree on batch and head_dim "
        "([B, T, N, H] vs [B, S, K, H]).")
  if n % k:
    raise ValueError(
        f"query heads N={n} must be a multiple of key/value heads K={k} (GQA groups); "
        "choose K dividing N.")
  if (is_causal or segment_ids is not None) and t != s:
    raise ValueError(
        f"causal masks, local windows and segment_ids need self-attention lengths (T == S); got "
        f"T={t}, S={s}.")
  if segment_ids is not None:
    check_segment_ids(segment_ids, (b, t))


def check_segment_ids(segment_ids, shape) -> None:
  seg_shape = tuple(np.shape(segment_ids))
  if seg_shape != tuple(shape):
    raise ValueError(
        f"segment_ids must have shape [batch, length] = {tuple(shape)}, got {seg_shape}.")
  dtype = segment_ids.dtype if hasattr(segment_ids, "dtype") else np.asarray(segment_ids).dtype
  if not jnp.issubdtype(dtype, jnp.integer):
    raise TypeError(
        f"segment_ids must be an integer array (int32; 0 = padding), got dtype {dtype}.")


def check_block(name: str, block: int, local_len: int) -> None:
  if not isinstance(block, (int, np.integer)) or block < 1:
    raise ValueError(f"{name} must be a positive int, got {block!r}.")
  if local_len % block:
    raise ValueError(
        f"{name}={block} does not divide the local sequence length {local_len}; pick a "
        f"divisor of {local_len} (or leave {name}=None to choose one).")
