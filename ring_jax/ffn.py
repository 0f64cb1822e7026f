"""Blockwise feed-forward (Liu & Abbeel, "Blockwise Parallel Transformer", 2023, Sec. 3).

A position-wise feed-forward ``fn`` maps ``[B, c, D] -> [B, c, D']`` chunk by
chunk under ``lax.scan``; with rematerialisation the ``[B, L, F]`` hidden
activation of an MLP exists for one chunk at a time, in the forward pass and
in the backward pass (which recomputes it per chunk).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp


def blockwise_ffn(fn: Callable, x, chunk_size: int, *, axis: int = 1, remat: bool = True,
                  policy: Callable | None = None):
  """Applies position-wise ``fn`` over ``chunk_size``-long chunks of ``x`` along ``axis``.

  Args:
    fn: maps an array shaped like ``x`` but with ``chunk_size`` along ``axis``
      to one with the same leading/sequence dims (last dim may change). It must
      be position-wise: no mixing across the sequence axis.
    x: input, e.g. ``[B, L, D]``.
    chunk_size: tokens per chunk; must divide ``x.shape[axis]``.
    axis: the sequence axis.
    remat: wrap ``fn`` in ``jax.checkpoint`` so the backward pass recomputes
      each chunk's hidden activation instead of storing all of them.
    policy: optional ``jax.checkpoint_policies`` policy for that remat.

  Returns:
    ``fn`` applied to every position, same as ``fn(x)`` up to float rounding.
  """
  length = x.shape[axis]
  if not isinstance(chunk_size, int) or chunk_size < 1:
    raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}.")
  if length % chunk_size:
    raise ValueError(
        f"chunk_size={chunk_size} does not divide the sequence length {length} (axis {axis}).")
  if chunk_size == length:
    return fn(x)
  axis = axis % x.ndim
  body = jax.checkpoint(fn, policy=policy) if remat else fn
  num = length // chunk_size
  # [..., L, ...] -> [num, ..., chunk, ...] so scan walks the chunks.
  xs = x.reshape(x.shape[:axis] + (num, chunk_size) + x.shape[axis + 1:])
  xs = jnp.moveaxis(xs, axis, 0)

  def step(carry, chunk):
    return carry, body(chunk)

  _, ys = jax.lax.scan(step, None, xs)
  ys = jnp.moveaxis(ys, 0, axis)
  return ys.reshape(ys.shape[:axis] + (length,) + ys.shape[axis + 2:])
