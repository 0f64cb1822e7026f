"""Smoke test of the all-gather context-parallel baseline used by benchmarks/attention.py."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ring_jax
from benchmarks.baselines import allgather_attention_sharded


@pytest.mark.parametrize("layout,is_causal", [("contiguous", True), ("zigzag", True),
                                              ("striped", False)])
def test_allgather_baseline_matches_dense(layout, is_causal):
  n = 4
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:n]), ("sequence",))
  ks = jax.random.split(jax.random.key(0), 4)
  b, l, nh, kh, h = 1, 64, 4, 2, 16
  q = jax.random.normal(ks[0], (b, l, nh, h), jnp.float32)
  k = jax.random.normal(ks[1], (b, l, kh, h), jnp.float32)
  v = jax.random.normal(ks[2], (b, l, kh, h), jnp.float32)
  do = jax.random.normal(ks[3], (b, l, nh, h), jnp.float32)

  def loss(f, q, k, v):
    return jnp.sum(f(q, k, v) * do)

  ag = lambda q, k, v: allgather_attention_sharded(q, k, v, mesh=mesh, is_causal=is_causal,
                                                   layout=layout, block_q=4, block_kv=4)
  ref = lambda q, k, v: ring_jax.reference_attention(q, k, v, is_causal=is_causal)
  np.testing.assert_allclose(jax.jit(ag)(q, k, v), ref(q, k, v), atol=2e-5, rtol=2e-5)
  g = jax.jit(jax.grad(lambda *a: loss(ag, *a), argnums=(0, 1, 2)))(q, k, v)
  g_ref = jax.grad(lambda *a: loss(ref, *a), argnums=(0, 1, 2))(q, k, v)
  for x, y in zip(g, g_ref):
    np.testing.assert_allclose(x, y, atol=1e-4, rtol=1e-4)
