"""The two-level ring (strategy="ring", seq_axis=(outer, inner)) vs the float64 dense oracle,
forward and gradients, on (2, 4) and (4, 2) splits of 8 fake devices; its errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import ring_jax
from attn_utils import assert_close, grads, make_mesh, packed_segments, qkv
from ring_jax.two_level import two_level_ring_attention

AXES = ("outer", "inner")


def oracle(q, k, v, cot, **kw):
  """float64 output and gradients of the dense reference (the oracle)."""
  with jax.enable_x64(True):
    q64, k64, v64, c64 = (jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v, cot))
    ref = functools.partial(ring_jax.reference_attention, **kw)
    return [np.asarray(ref(q64, k64, v64))] + [np.asarray(g) for g in grads(ref, q64, k64, v64,
                                                                             c64)]


@pytest.mark.parametrize("split,layout,is_causal,segments", [
    ((2, 4), "zigzag", True, True), ((4, 2), "contiguous", True, False),
    ((4, 2), "striped", False, False)])
def test_matches_float64_oracle(split, layout, is_causal, segments):
  """GQA (4 query heads on 2 K/V heads); natural-order global arrays in and out. Causal
  contiguous skips whole hops (the block table of a later shard is empty). Few cases: each
  compiles a ring forward and backward (~10 s here)."""
  mesh = make_mesh(split, AXES)
  q, k, v = qkv(11, 1, 32, 4, 2, 8)
  seg = packed_segments(1, 32, seed=4) if segments else None
  cot = jax.random.normal(jax.random.key(5), q.shape, jnp.float32)
  fn = functools.partial(ring_jax.attention_sharded, mesh=mesh, strategy="ring", seq_axis=AXES,
                         is_causal=is_causal, segment_ids=seg, layout=layout, block_q=4,
                         block_kv=4)
  got = [jax.jit(fn)(q, k, v)] + list(jax.jit(functools.partial(grads, fn))(q, k, v, cot))
  want = oracle(q, k, v, cot, is_causal=is_causal, segment_ids=seg)
  for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
    assert_close(g, w, what=f"{split} {layout} {name}")


def test_errors():
  mesh = make_mesh((2, 4), AXES)
  q, k, v = qkv(0, 1, 16, 2, 2, 4)
  with pytest.raises(ValueError, match="strategy='ring' takes one axis or a pair"):
    ring_jax.attention_sharded(q, k, v, mesh=mesh, strategy="ulysses", seq_axis=AXES)
  spec = P(None, AXES)
  with pytest.raises(ValueError, match="a pair of different mesh axes"):
    jax.shard_map(lambda q, k, v: two_level_ring_attention(q, k, v, axis_name="outer"),
                  mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)(q, k, v)
  with pytest.raises(ValueError, match="zigzag"):  # the layout spans the ring of 8
    ring_jax.attention_sharded(q[:, :8], k[:, :8], v[:, :8], mesh=mesh, strategy="ring",
                               seq_axis=AXES, layout="zigzag")
