"""ring_attention_sharded on global arrays vs the dense oracle, forward and gradients."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ring_jax
from attn_utils import assert_close, grads, make_mesh, packed_segments, qkv

LAYOUTS = ring_jax.LAYOUTS


def check_against_reference(mesh, q, k, v, *, rtol=1e-5, atol=1e-5, **kw):
  ring = functools.partial(ring_jax.ring_attention_sharded, mesh=mesh, **kw)
  kw.pop("layout", None), kw.pop("block_q", None), kw.pop("block_kv", None)
  ref = functools.partial(ring_jax.reference_attention, **kw)
  cot = jax.random.normal(jax.random.key(7), q.shape, jnp.float32)
  out = jax.jit(ring)(q, k, v)
  expected = ref(q, k, v)
  assert_close(out, expected, rtol, atol, "forward")
  got = jax.jit(functools.partial(grads, ring))(q, k, v, cot)
  want = grads(ref, q, k, v, cot)
  for name, g, w in zip("qkv", got, want):
    assert_close(g, w, rtol, atol, f"d{name}")
  return out, got


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("with_segments", [False, True])
def test_matches_dense(layout, is_causal, with_segments):
  """data=2 x sequence=4, GQA (4 query heads on 2 K/V heads), blocks smaller than shards."""
  mesh = make_mesh((2, 4), ("data", "sequence"))
  q, k, v = qkv(0, 2, 64, 4, 2, 16)
  seg = packed_segments(2, 64, seed=1) if with_segments else None
  check_against_reference(mesh, q, k, v, is_causal=is_causal, segment_ids=seg, layout=layout,
                          block_q=4, block_kv=4)


@pytest.mark.parametrize("ring_size,layout", [
    (1, "contiguous"), (2, "zigzag"), (3, "contiguous"), (3, "zigzag"), (3, "striped"),
    (8, "zigzag"), (8, "striped"), (8, "contiguous")])
def test_ring_sizes(ring_size, layout):
  """Causal + packed segments across ring sizes, odd ones included."""
  mesh = make_mesh((ring_size,), ("sequence",))
  length = 12 * ring_size
  q, k, v = qkv(ring_size, 1, length, 2, 1, 8)
  seg = packed_segments(1, length, seed=ring_size)
  check_against_reference(mesh, q, k, v, is_causal=True, segment_ids=seg, layout=layout,
                          block_q=2, block_kv=3)


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_tensor_and_sequence_parallel(kv_heads, layout):
  """Heads sharded over tensor=2 while the sequence rings over 4: MHA, GQA, MQA."""
  mesh = make_mesh((2, 4), ("tensor", "sequence"))
  q, k, v = qkv(3, 1, 32, 4, kv_heads, 8)
  check_against_reference(mesh, q, k, v, is_causal=True, layout=layout)


def test_three_axis_mesh_with_window():
  mesh = make_mesh((2, 2, 2), ("data", "tensor", "sequence"))
  q, k, v = qkv(4, 2, 32, 4, 2, 8)
  seg = packed_segments(2, 32, seed=4)
  check_against_reference(mesh, q, k, v, is_causal=False, segment_ids=seg, layout="striped",
                          local_window_size=(2, 7), block_q=4, block_kv=4)


def test_causal_window_zigzag():
  mesh = make_mesh((4,), ("sequence",))
  q, k, v = qkv(10, 1, 64, 2, 1, 8)
  check_against_reference(mesh, q, k, v, is_causal=True, local_window_size=5, layout="zigzag",
                          block_q=4, block_kv=4)


def test_padding_rows_and_long_segment():
  """A row that is all padding outputs 0 with finite grads; a document spans all 8 shards."""
  mesh = make_mesh((8,), ("sequence",))
  q, k, v = qkv(5, 3, 64, 2, 2, 8)
  seg = np.zeros((3, 64), np.int32)
  seg[0, :60] = 1          # one document over every shard, then padding
  seg[2, :10], seg[2, 10:50] = 1, 2
  seg = jnp.asarray(seg)   # row 1: nothing but padding
  out, got = check_against_reference(mesh, q, k, v, is_causal=True, segment_ids=seg,
                                     layout="zigzag", block_q=2, block_kv=2)
  assert np.all(np.asarray(out)[1] == 0) and np.all(np.asarray(out)[0, 60:] == 0)
  for g in got:
    assert np.isfinite(np.asarray(g)).all()
    assert np.all(np.asarray(g)[1] == 0)


def test_cross_attention_different_lengths():
  """Non-causal attention with kv length != query length (contiguous ring)."""
  mesh = make_mesh((4,), ("sequence",))
  q, k, v = qkv(6, 1, 16, 2, 2, 8, kv_len=32)
  check_against_reference(mesh, q, k, v, block_q=2, block_kv=4)


@pytest.mark.parametrize("layout", ["zigzag", "striped"])
def test_explicit_mesh_and_context_mesh(layout):
  """jax.make_mesh's default Explicit axes, mesh taken from jax.set_mesh, inputs in layout."""
  mesh = make_mesh((2, 4), ("data", "sequence"), explicit=True)
  q, k, v = qkv(8, 2, 32, 2, 2, 8)
  ring = 4
  expected = ring_jax.reference_attention(q, k, v, is_causal=True)
  ql, kl, vl = (ring_jax.to_layout(x, layout, ring) for x in (q, k, v))
  with jax.set_mesh(mesh):
    out_natural = jax.jit(functools.partial(
        ring_jax.ring_attention_sharded, is_causal=True, layout=layout))(q, k, v)
    out_layout = jax.jit(functools.partial(
        ring_jax.ring_attention_sharded, is_causal=True, layout=layout,
        inputs_in_layout=True))(ql, kl, vl)
    g = jax.jit(jax.grad(lambda q: ring_jax.ring_attention_sharded(
        q, k, v, is_causal=True, layout=layout).sum()))(q)
  assert_close(out_natural, expected, what="natural order")
  assert_close(ring_jax.from_layout(out_layout, layout, ring), expected, what="layout order")
  g_ref = jax.grad(lambda q: ring_jax.reference_attention(q, k, v, is_causal=True).sum())(q)
  assert_close(g, g_ref, what="dq")


def test_natural_order_inputs_cost_no_extra_memory():
  """Reordering natural-order inputs happens shard by shard: fwd+bwd temp memory stays at
  that of inputs already in layout order (a global reorder would gather the sequence)."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  mesh = make_mesh((8,), ("sequence",))
  shape = jax.ShapeDtypeStruct((1, 2048, 2, 32), jnp.float32,
                               sharding=NamedSharding(mesh, P(None, "sequence")))
  temps = {}
  for in_layout in (False, True):
    fn = functools.partial(ring_jax.ring_attention_sharded, mesh=mesh, is_causal=True,
                           layout="zigzag", inputs_in_layout=in_layout)
    grad = jax.jit(jax.grad(lambda q, k, v: fn(q, k, v).sum(), argnums=(0, 1, 2)))
    temps[in_layout] = grad.lower(shape, shape, shape).compile().memory_analysis(
    ).temp_size_in_bytes
  assert temps[False] <= 1.1 * temps[True], temps


def test_bfloat16_inputs_keep_dtype_and_accuracy():
  mesh = make_mesh((4,), ("sequence",))
  q, k, v = qkv(9, 1, 64, 2, 1, 16)
  out = jax.jit(functools.partial(ring_jax.ring_attention_sharded, mesh=mesh, is_causal=True,
                                  layout="zigzag"))(*(x.astype(jnp.bfloat16) for x in (q, k, v)))
  assert out.dtype == jnp.bfloat16
  expected = ring_jax.reference_attention(q, k, v, is_causal=True)
  assert_close(out, expected, rtol=2e-2, atol=2e-2, what="bf16 forward")


class TestErrors:
  mesh = make_mesh((2, 4), ("data", "sequence"))

  def call(self, q, k, v, **kw):
    kw.setdefault("mesh", self.mesh)
    return ring_jax.ring_attention_sharded(q, k, v, **kw)

  def test_length_not_divisible_by_ring(self):
    q, k, v = qkv(0, 2, 30, 2, 2, 8)
    with pytest.raises(ValueError, match="not divisible by the ring size"):
      self.call(q, k, v)

  def test_zigzag_needs_even_local_length(self):
    q, k, v = qkv(0, 2, 12, 2, 2, 8)  # local length 3
    with pytest.raises(ValueError, match="must be even"):
      self.call(q, k, v, layout="zigzag")

  def test_bad_layout(self):
    q, k, v = qkv(0, 2, 16, 2, 2, 8)
    with pytest.raises(ValueError, match="layout must be one of"):
      self.call(q, k, v, layout="zig-zag")

  def test_mismatched_shapes_and_dtypes(self):
    q, k, v = qkv(0, 2, 16, 4, 2, 8)
    with pytest.raises(ValueError, match="head_dim"):
      self.call(q, k[..., :4], v[..., :4])
    with pytest.raises(ValueError, match="key and value shapes differ"):
      self.call(q, k, v[:, :8])
    with pytest.raises(TypeError, match="share a dtype"):
      self.call(q, k.astype(jnp.bfloat16), v)
    with pytest.raises(ValueError, match="4-D"):
      self.call(q[0], k, v)

  def test_heads_not_divisible(self):
    q, k, v = qkv(0, 2, 16, 3, 2, 8)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
      self.call(q, k, v)

  def test_segment_ids(self):
    q, k, v = qkv(0, 2, 16, 2, 2, 8)
    with pytest.raises(ValueError, match="segment_ids must have shape"):
      self.call(q, k, v, segment_ids=jnp.ones((2, 8), jnp.int32))
    with pytest.raises(TypeError, match="integer"):
      self.call(q, k, v, segment_ids=jnp.ones((2, 16), jnp.float32))

  def test_axis_names(self):
    q, k, v = qkv(0, 2, 16, 2, 2, 8)
    with pytest.raises(ValueError, match="seq_axis='seq'"):
      self.call(q, k, v, seq_axis="seq")
    with pytest.raises(ValueError, match="head_axis='model'"):
      self.call(q, k, v, head_axis="model")

  def test_block_size_must_divide(self):
    q, k, v = qkv(0, 2, 16, 2, 2, 8)
    with pytest.raises(ValueError, match="block_q=3 does not divide"):
      self.call(q, k, v, block_q=3)

  def test_batch_and_heads_vs_mesh(self):
    q, k, v = qkv(0, 3, 16, 2, 2, 8)
    with pytest.raises(ValueError, match="batch 3 is not divisible"):
      self.call(q, k, v)
    mesh = make_mesh((2, 4), ("tensor", "sequence"))
    q, k, v = qkv(0, 1, 16, 6, 3, 8)
    with pytest.raises(ValueError, match="key/value heads 3 are not divisible"):
      self.call(q, k, v, mesh=mesh)

  def test_causal_needs_equal_lengths(self):
    q, k, v = qkv(0, 2, 16, 2, 2, 8, kv_len=32)
    with pytest.raises(ValueError, match="T == S"):
      self.call(q, k, v, is_causal=True)

  def test_no_mesh(self):
    q, k, v = qkv(0, 2, 16, 2, 2, 8)
    with pytest.raises(ValueError, match="no mesh"):
      ring_jax.ring_attention_sharded(q, k, v)
