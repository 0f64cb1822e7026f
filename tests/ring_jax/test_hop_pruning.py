"""Sliding windows prune ring hops: only the shards holding keys inside a device's windows
travel (contiguous layout), counted in the jaxpr; results and gradients stay exact."""

import functools

import jax
import jax.extend
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import ring_jax
from attn_utils import assert_close, grads, make_mesh, out_and_grads, qkv


def _count(jaxpr, name):
  """Occurrences of primitive ``name`` in a jaxpr and its sub-jaxprs, and whether any sits
  inside a loop (a loop body's ops run once per trip)."""
  count, in_loop = 0, False
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == name:
      count += 1
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      c, loop = _count(sub, name)
      count += c
      in_loop |= loop or (c > 0 and eqn.primitive.name in ("while", "scan"))
  return count, in_loop


def test_window_of_one_shard_on_a_ring_of_8():
  """Causal window = one shard's length: each device needs its own shard and the previous
  one, so the forward sends K and V once (2 ppermutes, no loop) instead of 7 times."""
  mesh = make_mesh((8,), ("sequence",))
  q, k, v = qkv(0, 1, 64, 2, 1, 8)
  spec = P(None, "sequence")
  local = functools.partial(ring_jax.ring_attention, axis_name="sequence", is_causal=True,
                            local_window_size=8)
  fn = jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
  jaxpr = jax.make_jaxpr(fn)(q, k, v).jaxpr
  assert _count(jaxpr, "ppermute") == (2, False)
  full = jax.shard_map(functools.partial(local, local_window_size=None), mesh=mesh,
                       in_specs=(spec,) * 3, out_specs=spec)
  n_full, in_loop = _count(jax.make_jaxpr(full)(q, k, v).jaxpr, "ppermute")
  assert in_loop  # the whole ring: a loop of 7 trips
  s = ring_jax.schedule("contiguous", 8, 8, 4, 4, is_causal=True, local_window_size=8)
  assert s.hops == (0, 1)
  assert s.num_pairs[:, 2:].sum() == 0  # no pair beyond the hops that run
  ref = functools.partial(ring_jax.reference_attention, is_causal=True, local_window_size=8)
  assert_close(jax.jit(fn)(q, k, v), ref(q, k, v), what="forward")


@pytest.mark.parametrize("is_causal,window", [(True, 8), (False, (3, 6)), (False, 5)])
def test_pruned_ring_matches_dense(is_causal, window):
  """Forward and gradients; a two-sided window starts from later shards (hop < 0)."""
  mesh = make_mesh((8,), ("sequence",))
  q, k, v = qkv(1, 1, 32, 2, 1, 8)
  assert ring_jax.schedule("contiguous", 8, 4, 4, 4, is_causal, window).hops != (0, 7)
  fn = functools.partial(ring_jax.ring_attention_sharded, mesh=mesh, is_causal=is_causal,
                         local_window_size=window)
  ref = functools.partial(ring_jax.reference_attention, is_causal=is_causal,
                          local_window_size=window)
  cot = jax.random.normal(jax.random.key(3), q.shape, jnp.float32)
  out, got = out_and_grads(fn, q, k, v, cot)  # one program (tests/attn_utils.py)
  assert_close(out, ref(q, k, v), what="forward")
  for name, g, w in zip("qkv", got, grads(ref, q, k, v, cot)):
    assert_close(g, w, what=f"d{name}")
