"""Argument checks shared by the public entry points.

Every check runs on static shapes/dtypes at trace time, so bad input fails with
a message naming the fix before anything is compiled or run.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from ring_jax import layouts


def check_qkv(query, key, value, *, is_causal: bool, segment_ids) -> None:
  """Shapes ``[B,T,N,H]``, ``[B,S,K,H]``, ``[B,S,K,Hv]`` (V's head size ``Hv`` its own, as
  in MLA); same float dtype; ``N % K == 0``."""
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
  if key.shape[:3] != value.shape[:3]:
    raise ValueError(f"key and value shapes differ: {key.shape} vs {value.shape} (they may "
                     "differ in the head size only).")
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
  """Shape ``[B, T]`` and an integer dtype whose values JAX will keep.

  Ids are compared in their own dtype (0 = padding, any other value a
  document), so unsigned and 64-bit ids are fine as long as JAX holds them:
  with ``jax_enable_x64`` off, a host (numpy) array of 64-bit ids becomes 32
  bits on the way in, so its values must fit.
  """
  seg_shape = tuple(np.shape(segment_ids))
  if seg_shape != tuple(shape):
    raise ValueError(
        f"segment_ids must have shape [batch, length] = {tuple(shape)}, got {seg_shape}.")
  dtype = segment_ids.dtype if hasattr(segment_ids, "dtype") else np.asarray(segment_ids).dtype
  if not jnp.issubdtype(dtype, jnp.integer):
    raise TypeError(
        f"segment_ids must be an integer array (e.g. int32; 0 = padding), got dtype {dtype}.")
  if isinstance(segment_ids, jax.Array):  # traced values too
    return  # already a JAX value: its dtype is what the kernel compares
  canonical = jax.dtypes.canonicalize_dtype(dtype)
  if canonical != dtype:
    values = np.asarray(segment_ids)
    info = np.iinfo(canonical)
    if values.size and (values.min() < info.min or values.max() > info.max):
      raise ValueError(
          f"segment_ids hold values outside {canonical} ([{values.min()}, {values.max()}]) "
          f"while jax_enable_x64 is off, so JAX would wrap them into {canonical} and could "
          "merge documents or turn one into padding (0). Renumber the documents (ids only "
          "need to be distinct within a row; 0 = padding) or enable jax_enable_x64.")


def check_scale(scale, head_dim: int, score_dtype) -> float:
  """The score scale as a Python float: ``1/sqrt(head_dim)`` for None; finite in ``score_dtype``.

  Scores are computed in ``score_dtype``; a scale that is NaN, infinite, or
  overflows it (e.g. ``1e40`` for float32) would give NaN or infinite scores
  for every row, so it is refused here.
  """
  if scale is None:
    return float(head_dim ** -0.5)
  try:
    value = float(scale)
  except TypeError:
    raise TypeError(
        f"scale must be a Python or numpy float (a static value), got {scale!r}.") from None
  limit = float(jnp.finfo(score_dtype).max)
  if not math.isfinite(value) or abs(value) > limit:
    raise ValueError(
        f"scale={scale!r} is not a finite {jnp.dtype(score_dtype).name} (the dtype of the "
        f"scores); pass a finite scale with |scale| <= {limit:.3g}, or None for "
        "1/sqrt(head_dim).")
  return value


def check_soft_cap(cap) -> float | None:
  """``logits_soft_cap`` as a Python float (None: off): finite and > 0."""
  if cap is None:
    return None
  try:
    value = float(cap)
  except TypeError:
    raise TypeError(f"logits_soft_cap must be None or a Python float (a static value), got "
                    f"{cap!r}.") from None
  if not (math.isfinite(value) and value > 0):
    raise ValueError(f"logits_soft_cap={cap!r} must be a finite number > 0 (scores become "
                     "cap * tanh(score / cap)), or None for no cap.")
  return value


def check_sinks(sinks, heads: int):
  """``sinks`` (one logit per query head) as a float32 ``[heads]`` array; ValueError naming
  the shape otherwise. None stays None."""
  if sinks is None:
    return None
  shape = getattr(sinks, "shape", None)
  if shape is None or tuple(shape) != (heads,):
    raise ValueError(f"sinks must be one float logit per query head, shape ({heads},), got "
                     f"{shape if shape is not None else type(sinks).__name__}.")
  if not jnp.issubdtype(sinks.dtype, jnp.floating):
    raise ValueError(f"sinks must be floating point (float32 recommended), got {sinks.dtype}.")
  return jnp.asarray(sinks).astype(jnp.float32)


def check_split(layout: str, ring_size: int, length: int, *, ulysses: int = 1,
                what: str = "sequence length") -> int:
  """The length rule of every strategy: returns the ring's local length ``length // ring_size``.

  ``length`` tokens must split over a ring of ``ring_size`` devices in
  ``layout`` (:func:`ring_jax.layouts.check_length`: one shard per device, two
  equal chunks of it for zigzag), and, for the hybrid, each ring shard further
  over the ``ulysses`` devices of its Ulysses axis. Block sizes must then divide
  the length they tile (:func:`check_block`). Raises ValueError naming the
  length to pad to; :func:`split_problem` returns that message instead.
  """
  local_len = layouts.check_length(layout, ring_size, length, what)
  if local_len % ulysses:
    multiple = split_multiple(layout, ring_size, ulysses=ulysses)
    raise ValueError(
        f"{what} {length}: each ring shard of {local_len} tokens must split over the "
        f"{ulysses} devices of the Ulysses axis; pad it to a multiple of {multiple}.")
  return local_len


def split_multiple(layout: str, ring_size: int, *, ulysses: int = 1) -> int:
  """The step between the lengths :func:`check_split` accepts: the layout's multiple of the
  ring (:func:`ring_jax.layouts.length_multiple`) and ``ring_size * ulysses``."""
  return math.lcm(layouts.length_multiple(layout, ring_size), ring_size * ulysses)


def split_problem(layout: str, ring_size: int, length: int, *, ulysses: int = 1) -> str | None:
  """Why :func:`check_split` refuses ``length`` (its message), or None when it splits."""
  try:
    check_split(layout, ring_size, length, ulysses=ulysses)
  except ValueError as e:
    return str(e)
  return None


def ulysses_repeat(nh: int, kh: int, u: int, axis_name=None) -> int:
  """How often Ulysses repeats each key/value head before its all_to_all (1: not at all).

  ``nh``/``kh``: query / key-value heads on each device; ``u``: the size of
  the Ulysses axis ``axis_name``. The query heads must split over it; the
  key/value heads must too, or divide it (then they are repeated up to ``u``,
  as USP does). Raises ValueError naming the fix.
  """
  axis = "the Ulysses axis" if axis_name is None else f"axis {axis_name!r}"
  if nh % u:
    raise ValueError(
        f"ulysses needs the query heads on each device ({nh}) divisible by the size of {axis} "
        f"({u}), and {nh} is not divisible by {u}; use a head count that is a multiple of {u}, "
        "a smaller Ulysses axis (strategy='hybrid' with the rest of the sequence on a ring "
        "axis), or strategy='ring'/'all_gather'.")
  if kh % u == 0:
    return 1
  if u % kh == 0:
    return u // kh  # USP: replicate the K/V heads up to one per device
  raise ValueError(
      f"ulysses needs the key/value heads on each device ({kh}) divisible by the size of "
      f"{axis} ({u}), or dividing it (then they are repeated); use a number of key/value "
      "heads that is a multiple or a divisor of it, or strategy='ring'/'all_gather'.")


def check_block(name: str, block: int, local_len: int) -> None:
  """``block`` is a positive int dividing ``local_len``, the length its blocks tile."""
  if not isinstance(block, (int, np.integer)) or block < 1:
    raise ValueError(f"{name} must be a positive int, got {block!r}.")
  if local_len % block:
    raise ValueError(
        f"{name}={block} does not divide the local sequence length {local_len}; pick a "
        f"divisor of {local_len} (or leave {name}=None to choose one).")


def axis_size(axis_name, who: str, sharded: str = "ring_jax.attention_sharded") -> int:
  """Size of the bound mesh axis ``axis_name`` (inside ``jax.shard_map``); a ValueError
  naming the fix (call ``who`` inside shard_map, or use ``sharded`` on global arrays)."""
  try:
    return jax.lax.axis_size(axis_name)
  except NameError as e:
    raise ValueError(
        f"axis_name={axis_name!r} is not a mesh axis bound here: call {who} inside "
        f"jax.shard_map over a mesh with that axis (or use {sharded}).") from e
