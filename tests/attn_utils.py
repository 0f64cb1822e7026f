"""Shared helpers for the attention tests: random inputs, meshes, tolerances."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType

from ring_jax.kernels.xla import XlaHopKernel


def make_mesh(shape, names, explicit=False):
  """A mesh over the first prod(shape) fake CPU devices, Auto or Explicit axes."""
  types = (AxisType.Explicit if explicit else AxisType.Auto,) * len(shape)
  return jax.make_mesh(shape, names, axis_types=types,
                       devices=jax.devices()[:int(np.prod(shape))])


def qkv(key, b, length, n, k, h, dtype=jnp.float32, kv_len=None):
  kq, kk, kv = jax.random.split(jax.random.key(key), 3)
  kv_len = length if kv_len is None else kv_len
  return (jax.random.normal(kq, (b, length, n, h), dtype),
          jax.random.normal(kk, (b, kv_len, k, h), dtype),
          jax.random.normal(kv, (b, kv_len, k, h), dtype))


def packed_segments(b, length, seed=0, pad_rows=()):
  """Packed documents: random-length runs of ids 1, 2, ..., trailing padding (0).

  Rows listed in ``pad_rows`` are entirely padding. Documents are long enough
  that some span several shards of any ring up to size 8.
  """
  rng = np.random.default_rng(seed)
  seg = np.zeros((b, length), np.int32)
  for r in range(b):
    if r in pad_rows:
      continue
    pos, doc = 0, 1
    end = length - rng.integers(0, length // 8 + 1)  # trailing padding
    while pos < end:
      n = int(rng.integers(1, max(2, length // 2)))
      seg[r, pos:min(end, pos + n)] = doc
      pos, doc = pos + n, doc + 1
  return jnp.asarray(seg)


def grads(fn, q, k, v, cot):
  """Gradients of <fn(q, k, v), cot> w.r.t. q, k, v (a random cotangent probes every entry)."""
  return jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) * cot),
                  argnums=(0, 1, 2))(q, k, v)


def out_and_grads(fn, q, k, v, cot):
  """``(fn(q, k, v), grads(fn, q, k, v, cot))`` as one jitted program: the forward of the
  pass the gradients come from (a custom_vjp's fwd rule runs the same forward as its primal),
  so a test compiles its function once, not once per pass."""
  def both(q, k, v):
    out, vjp = jax.vjp(fn, q, k, v)
    return out, vjp(cot.astype(out.dtype))
  return jax.jit(both)(q, k, v)


def assert_close(actual, expected, rtol=1e-5, atol=1e-5, what=""):
  actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
  assert not np.isnan(actual).any(), f"{what}: NaN in result"
  err = np.abs(actual - expected)
  bound = atol + rtol * np.abs(expected)
  worst = np.unravel_index(np.argmax(err - bound), err.shape)
  assert (err <= bound).all(), (
      f"{what}: max abs err {err.max():.3g}; worst at {worst}: "
      f"{actual[worst]} vs {expected[worst]}")


def programs_compiled(caplog, fn, *args, **kwargs):
  """``(fn(*args, **kwargs), [what XLA compiled meanwhile])``, from ``jax.log_compiles``."""
  caplog.clear()
  with jax.log_compiles(), caplog.at_level("WARNING"):
    result = fn(*args, **kwargs)
  return result, [r.getMessage() for r in caplog.records
                  if r.getMessage().startswith("Finished XLA compilation")]


def may_mask_recorder():
  """``(kernel, seen)``: an XLA hop kernel that appends each traced hop's
  ``masks.table().may_mask`` to ``seen["fwd"]`` / ``seen["bwd"]`` (which hops compile the
  masked block loop)."""
  seen = {"fwd": [], "bwd": []}

  @dataclasses.dataclass(frozen=True)
  class Recording(XlaHopKernel):
    def forward(self, q, k, v, masks, spec):
      seen["fwd"].append(masks.table().may_mask)
      return super().forward(q, k, v, masks, spec)

    def backward(self, q, k, v, masks, spec, res, acc):
      seen["bwd"].append(masks.table().may_mask)
      return super().backward(q, k, v, masks, spec, res, acc)

  return Recording(), seen
