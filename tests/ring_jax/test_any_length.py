"""Any sequence length on the global-array entry points (ring_jax.strategies.global_arrays:
padded to what the split needs, the padding masked as segment 0, the result sliced back):
forward and gradients equal the dense oracle at lengths the ring does not divide."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ring_jax
from attn_utils import assert_close, make_mesh, qkv
from ring_jax.strategies import global_arrays
from ring_jax.strategies import ring as ring_strategy
from ring_jax.strategies.options import AttentionOptions


def _check(fn, q, k, v, forward_alone=False, **kw):
  """``fn``'s output and gradients (one program) against the dense reference's;
  ``forward_alone``: its forward compiled on its own too (a call without gradients)."""
  ref = lambda q, k, v: ring_jax.reference_attention(q, k, v, **kw)  # noqa: E731

  def loss(f):  # the output comes with the gradients: one program
    def value(*args):
      out = f(*args)
      return jnp.sum(jnp.sin(out)), out
    return value

  got, out = jax.jit(jax.grad(loss(fn), (0, 1, 2), has_aux=True))(q, k, v)
  assert out.shape == q.shape
  expected = ref(q, k, v)
  assert_close(out, expected, what="out")
  if forward_alone:
    assert_close(jax.jit(fn)(q, k, v), expected, what="forward alone")
  want, _ = jax.grad(loss(ref), (0, 1, 2), has_aux=True)(q, k, v)
  for name, g, w in zip(("dq", "dk", "dv"), got, want):
    assert_close(g, w, what=name)


# L = 1, n - 1, 2n + 1, primes, L smaller than the ring; zigzag needs multiples of 2n = 8.
@pytest.mark.parametrize("length", [1, 3, 9, 13, 37])
@pytest.mark.parametrize("layout,is_causal", [("zigzag", True), ("contiguous", False),
                                              ("striped", True)])
def test_ring_any_length(length, layout, is_causal):
  mesh = make_mesh((4,), ("sequence",))
  q, k, v = qkv(length, 2, length, 4, 2, 8)
  fn = lambda q, k, v: ring_jax.ring_attention_sharded(  # noqa: E731
      q, k, v, mesh=mesh, is_causal=is_causal, layout=layout)
  _check(fn, q, k, v, forward_alone=length == 37, is_causal=is_causal)


def test_segments_window_blocks_lse_and_sinks_at_any_length():
  """The caller's segment ids (padding 0 included) stay theirs; a window, explicit blocks
  (the padding makes every layout chunk a multiple of them), the lse and sinks all hold."""
  mesh = make_mesh((4,), ("sequence",))
  length = 45
  q, k, v = qkv(5, 2, length, 4, 2, 8)
  ids = jnp.asarray(np.sort(np.random.default_rng(0).integers(0, 3, (2, length)), axis=1),
                    jnp.int32)
  fn = lambda q, k, v: ring_jax.ring_attention_sharded(  # noqa: E731
      q, k, v, mesh=mesh, is_causal=True, layout="contiguous", segment_ids=ids,
      local_window_size=(6, 0), block_q=4, block_kv=4)
  _check(fn, q, k, v, is_causal=True, segment_ids=ids, local_window_size=(6, 0))
  out, lse = ring_jax.ring_attention_sharded(q, k, v, mesh=mesh, is_causal=True,
                                             return_lse=True, sinks=jnp.ones(4))
  assert out.shape == q.shape and lse.shape == (2, length, 4)
  assert bool(jnp.all(jnp.isfinite(lse)))


@pytest.mark.parametrize("strategy,shape,axes", [
    ("ring", (2, 2), ("outer", "inner")),      # the two-level ring: one ring of 4
    ("all_gather", (4,), ("sequence",)),
    ("ulysses", (4,), ("sequence",)),
    ("hybrid", (2, 2), ("ring", "ulysses")),
    ("auto", (4,), ("sequence",)),             # planned at the length every strategy splits
    ("auto", (2, 2), ("outer", "inner")),
])
def test_every_strategy_any_length(strategy, shape, axes):
  mesh = make_mesh(shape, axes)
  seq = axes if len(axes) == 2 else axes[0]
  q, k, v = qkv(11, 1, 37, 4, 4, 8)
  fn = lambda q, k, v: ring_jax.attention_sharded(  # noqa: E731
      q, k, v, mesh=mesh, seq_axis=seq, strategy=strategy, is_causal=True, layout="zigzag")
  _check(fn, q, k, v, is_causal=True)


def test_padded_length_is_the_smallest_that_splits():
  """Zigzag on 4 devices: multiples of 8; with splash (blocks of multiples of 128) every
  layout chunk a multiple of 128: multiples of 4 x 2 x 128."""
  mesh = make_mesh((4,), ("sequence",))
  where = global_arrays.placement(mesh, "sequence", None, None, batch=1, heads=4, kv_heads=4)
  options = AttentionOptions(layout="zigzag", hop_kernel=ring_jax.XlaHopKernel())
  assert [global_arrays.padded_length(ring_strategy.STRATEGY, where, options, n)
          for n in (1, 8, 9, 17)] == [8, 8, 16, 24]
  splash = AttentionOptions(layout="zigzag", hop_kernel=ring_jax.get_hop_kernel("splash", "cpu"))
  assert global_arrays.padded_length(ring_strategy.STRATEGY, where, splash, 9) == 1024


def test_explicit_mesh_any_length():
  """On a mesh with Explicit axes the sliced result has its sequence dimension unsharded (37
  tokens cannot split over 4 devices); values and gradients as on an Auto mesh."""
  mesh = make_mesh((2, 4), ("data", "sequence"), explicit=True)
  q, k, v = qkv(2, 2, 37, 4, 2, 8)
  fn = lambda q, k, v: ring_jax.ring_attention_sharded(  # noqa: E731
      q, k, v, mesh=mesh, is_causal=True, layout="zigzag")
  with jax.set_mesh(mesh):
    _check(fn, q, k, v, is_causal=True)


@pytest.mark.parametrize("sequence,length,padding", [
    (4, 37, {"ring": 3, "all_gather": 3, "ulysses": 3, "hybrid2x2": 3}),
    (4, 100, {"ring": 4, "all_gather": 4, "ulysses": 0, "hybrid2x2": 0}),
    ((2, 4), 100, {"ring2x4": 12, "ring": 12, "all_gather": 12, "hybrid2x4": 4}),
])
def test_plan_costs_a_length_at_the_length_it_pads_to(sequence, length, padding):
  """plan() at a length a strategy does not split: its estimate is the one at the padded
  length (zigzag: multiples of 2n; Ulysses: of u; the hybrid: of 2r and r*u), padding told."""
  kw = dict(batch=2, heads=8, kv_heads=4, head_dim=64, layout="zigzag", sequence=sequence,
            device="TPU v5p")
  plan = ring_jax.plan(seq_len=length, **kw)
  assert {e.name: e.padding for e in plan.estimates} == padding
  for e in plan.estimates:
    at = ring_jax.plan(seq_len=length + e.padding, **kw).estimate(e.name)
    assert at.padding == 0
    assert (e.flops, e.memory_bytes, e.time_s, e.bytes_moved) == (
        at.flops, at.memory_bytes, at.time_s, at.bytes_moved)
  chosen = plan.estimate(ring_jax.planning._name(plan.strategy, plan.split))
  table = plan.table()
  assert f"pads +{padding['ring' if 'ring' in padding else 'ring2x4']} tokens/row" in table
  if chosen.padding:
    assert f"pads each row by {chosen.padding} tokens to the next length it splits" in table
