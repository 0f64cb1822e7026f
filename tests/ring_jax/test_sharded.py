"""ring_attention_sharded on global arrays vs the dense oracle, forward and gradients."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ring_jax
from attn_utils import assert_close, grads, make_mesh, out_and_grads, packed_segments, qkv

LAYOUTS = ring_jax.LAYOUTS


def check_against_reference(mesh, q, k, v, *, rtol=1e-5, atol=1e-5, forward_alone=False,
                            **kw):
  """The ring's output and gradients (one program: out_and_grads) against the dense
  reference's; ``forward_alone``: the ring's forward compiled on its own too (the path of a
  call without gradients)."""
  ring = functools.partial(ring_jax.ring_attention_sharded, mesh=mesh, **kw)
  kw.pop("layout", None), kw.pop("block_q", None), kw.pop("block_kv", None)
  ref = functools.partial(ring_jax.reference_attention, **kw)
  cot = jax.random.normal(jax.random.key(7), q.shape, jnp.float32)
  out, got = out_and_grads(ring, q, k, v, cot)
  expected = ref(q, k, v)
  assert_close(out, expected, rtol, atol, "forward")
  if forward_alone:
    assert_close(jax.jit(ring)(q, k, v), expected, rtol, atol, "forward alone")
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
    (1, "contiguous"), (2, "zigzag"), (3, "zigzag"), (3, "striped"), (8, "zigzag"),
    (8, "striped")])
def test_ring_sizes(ring_size, layout):
  """Causal + packed segments across ring sizes, odd ones included."""
  mesh = make_mesh((ring_size,), ("sequence",))
  length = 12 * ring_size
  q, k, v = qkv(ring_size, 1, length, 2, 1, 8)
  seg = packed_segments(1, length, seed=ring_size)
  check_against_reference(mesh, q, k, v, is_causal=True, segment_ids=seg, layout=layout,
                          block_q=2, block_kv=3)


@pytest.mark.parametrize("kv_heads,layout", [(1, "zigzag"), (2, "contiguous"), (4, "zigzag")])
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
                          local_window_size=(2, 7), block_q=4, block_kv=4, forward_alone=True)


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
                                     layout="zigzag", block_q=2, block_kv=2,
                                     forward_alone=True)
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
  """Reordering natural-order inputs happens shard by shard: fwd+bwd temp memory exceeds that
  of inputs already in layout order by a few local shards (a reordered copy of q, k, v), far
  less than one gathered sequence (a global reorder would all-gather it)."""
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
  shard_bytes = 2048 // 8 * 2 * 32 * 4
  # Measured 2026-12-04 (blocks of 64): 3 shards more (q, k, v reordered); a gather: >= 8.
  assert temps[False] - temps[True] <= 4 * shard_bytes, (temps, shard_bytes)


def test_bfloat16_inputs_keep_dtype_and_accuracy():
  mesh = make_mesh((4,), ("sequence",))
  q, k, v = qkv(9, 1, 64, 2, 1, 16)
  out = jax.jit(functools.partial(ring_jax.ring_attention_sharded, mesh=mesh, is_causal=True,
                                  layout="zigzag"))(*(x.astype(jnp.bfloat16) for x in (q, k, v)))
  chex.assert_type(out, jnp.bfloat16)
  chex.assert_shape(out, q.shape)
  expected = ring_jax.reference_attention(q, k, v, is_causal=True)
  assert_close(out, expected, rtol=2e-2, atol=2e-2, what="bf16 forward")


class TestErrors:
  mesh = make_mesh((2, 4), ("data", "sequence"))

  def call(self, q, k, v, **kw):
    kw.setdefault("mesh", self.mesh)
    return ring_jax.ring_attention_sharded(q, k, v, **kw)

  def test_inputs_in_layout_must_split(self):
    """Inputs already in layout order cannot be padded at their end: the length must split."""
    q, k, v = qkv(0, 2, 30, 2, 2, 8)
    with pytest.raises(ValueError, match="not divisible by the ring size"):
      self.call(q, k, v, inputs_in_layout=True)
    q, k, v = qkv(0, 2, 12, 2, 2, 8)  # local length 3
    with pytest.raises(ValueError, match="must be even"):
      self.call(q, k, v, layout="zigzag", inputs_in_layout=True)

  def test_cross_attention_lengths_that_do_not_split(self):
    q, _, _ = qkv(0, 2, 30, 2, 2, 8)
    _, k, v = qkv(1, 2, 16, 2, 2, 8)
    with pytest.raises(ValueError, match="padding is automatic for equal lengths only"):
      self.call(q, k, v)

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
    with pytest.raises(ValueError, match="batch=3 is not divisible"):
      self.call(q, k, v)
    mesh = make_mesh((2, 4), ("tensor", "sequence"))
    q, k, v = qkv(0, 1, 16, 6, 3, 8)
    with pytest.raises(ValueError, match="key/value heads=3 is not divisible"):
      self.call(q, k, v, mesh=mesh)

  def test_causal_needs_equal_lengths(self):
    q, k, v = qkv(0, 2, 16, 2, 2, 8, kv_len=32)
    with pytest.raises(ValueError, match="T == S"):
      self.call(q, k, v, is_causal=True)

  def test_no_mesh(self):
    q, k, v = qkv(0, 2, 16, 2, 2, 8)
    with pytest.raises(ValueError, match="no mesh"):
      ring_jax.ring_attention_sharded(q, k, v)


# --- Inputs that once gave silent wrong answers ------------------------------------------------

def ring_fn(mesh, **kw):
  kw.setdefault("layout", "zigzag")
  kw.setdefault("block_q", 4)
  kw.setdefault("block_kv", 4)
  return jax.jit(functools.partial(ring_jax.ring_attention_sharded, mesh=mesh, **kw))


def renumbered(seg):
  """The same documents as int32 ids 1, 2, ... per row (0 stays padding)."""
  seg = np.asarray(seg)
  out = np.zeros(seg.shape, np.int32)
  for r, row in enumerate(seg):
    for i, doc in enumerate(x for x in dict.fromkeys(row.tolist()) if x != 0):
      out[r][row == doc] = i + 1
  return jnp.asarray(out)


def signed_id_rows(length):
  """Rows of ids the block skip once mistook for padding (anything <= 0 or >= 2**31)."""
  big, small = np.iinfo(np.int32).max, np.iinfo(np.int32).min
  half = length // 2
  rows = np.zeros((4, length), np.int64)
  rows[0] = -1                                        # one document with a negative id
  rows[1, :half], rows[1, half:] = 1, -1              # two documents, one negative
  rows[2, :half], rows[2, half:-3] = big, small       # extreme ids, then padding
  rows[3, :5], rows[3, 5:20], rows[3, 20:] = -3, 0, 7  # padding between documents
  return rows


@pytest.mark.parametrize("dtype", ["int32", "uint32", "int16"])
def test_segment_ids_every_nonzero_id_is_a_document(dtype):
  """0 is padding; negative, huge and unsigned (>= 2**31) ids are documents, compared exactly.

  Checked against the oracle run on the same documents renumbered 1, 2, ... as int32, so
  the test does not rest on the oracle's handling of odd ids either.
  """
  mesh = make_mesh((4,), ("sequence",))
  length = 32
  rows = signed_id_rows(length)
  if dtype == "uint32":
    rows = np.where(rows < 0, rows + 2**32, rows)     # -1 -> 2**32 - 1, int32 min -> 2**31
  elif dtype == "int16":
    rows = np.clip(rows, np.iinfo(np.int16).min, np.iinfo(np.int16).max)
  seg = jnp.asarray(rows.astype(dtype))
  q, k, v = qkv(11, 4, length, 2, 1, 8)
  want = ring_jax.reference_attention(q, k, v, is_causal=True, segment_ids=renumbered(seg))
  assert_close(ring_jax.reference_attention(q, k, v, is_causal=True, segment_ids=seg), want,
               what="oracle on raw ids")
  out = ring_fn(mesh, is_causal=True)(q, k, v, segment_ids=seg)
  assert_close(out, want, what=f"ring, {dtype} ids")
  assert np.all(np.asarray(out)[3, 5:20] == 0)          # padding queries output 0


def test_64_bit_segment_ids():
  """With x64 on, ids that differ only above bit 32 stay different documents; with it off, host
  ids that JAX would wrap are refused."""
  mesh = make_mesh((4,), ("sequence",))
  q, k, v = qkv(12, 1, 32, 2, 2, 8)
  ids = np.full((1, 32), 2**32 + 1, np.int64)
  ids[0, 10:] = 1                                       # same low 32 bits as the first document
  with pytest.raises(ValueError, match="outside int32"):
    ring_jax.ring_attention_sharded(q, k, v, mesh=mesh, segment_ids=ids)
  want = ring_jax.reference_attention(q, k, v, segment_ids=renumbered(ids))
  with jax.enable_x64(True):
    out = ring_fn(mesh)(q, k, v, segment_ids=jnp.asarray(ids))
  assert_close(out, want)


def assert_nonfinite_exactly_where(out, expected_bad, ref, what=""):
  """``out`` is non-finite exactly where ``expected_bad`` says, and equals ``ref`` elsewhere."""
  out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
  np.testing.assert_array_equal(~np.isfinite(out), expected_bad, err_msg=what)
  np.testing.assert_array_equal(~np.isfinite(ref), expected_bad, err_msg=f"oracle: {what}")
  assert_close(out[~expected_bad], ref[~expected_bad], what=what)


# (tensor, index [batch, position, head, dim], value). Queries have 4 heads on 2 K/V heads, so a
# bad K/V head 1 reaches query heads 2 and 3; a bad V element only that element's column.
NON_FINITE_CASES = {
    "nan key, non-causal": ("k", (0, 13, 1, 2), np.nan, False),
    "nan key, causal": ("k", (0, 13, 1, 2), np.nan, True),
    "inf key, causal": ("k", (0, 13, 1, 2), np.inf, True),
    "nan value, causal": ("v", (0, 13, 1, 2), np.nan, True),
    "inf value, causal": ("v", (0, 13, 1, 2), -np.inf, True),
    "nan query, causal": ("q", (0, 13, 3, 2), np.nan, True),
}


@pytest.mark.parametrize("case", NON_FINITE_CASES)
def test_non_finite_inputs_stay_visible(case):
  """A NaN/inf in q, k or v makes exactly the outputs that read it non-finite (not 0); every
  other row, and the other batch element, stays exact."""
  name, (b, pos, head, dim), bad_value, is_causal = NON_FINITE_CASES[case]
  mesh = make_mesh((4,), ("sequence",))
  length = 32
  q, k, v = qkv(13, 2, length, 4, 2, 8)
  tensors = {"q": q, "k": k, "v": v}
  tensors[name] = tensors[name].at[b, pos, head, dim].set(bad_value)
  q, k, v = tensors["q"], tensors["k"], tensors["v"]
  out = ring_fn(mesh, is_causal=is_causal)(q, k, v)
  ref = ring_jax.reference_attention(q, k, v, is_causal=is_causal)
  bad = np.zeros(out.shape, bool)                        # [B, L, N, H]
  rows = slice(pos, None) if is_causal else slice(None)  # the queries that see key `pos`
  if name == "q":
    bad[b, pos, head] = True                             # only that query row and head
  elif name == "k" and np.isnan(bad_value):
    bad[b, rows, 2 * head:2 * head + 2] = True           # whole rows of the heads using it
  elif name == "k":  # score q.k = +-inf: +inf rows are NaN (inf - inf), -inf rows drop the key
    q_sign = np.asarray(q)[b, rows, 2 * head:2 * head + 2, dim] * np.sign(bad_value)
    bad[b, rows, 2 * head:2 * head + 2] = (q_sign > 0)[..., None]
  else:
    bad[b, rows, 2 * head:2 * head + 2, dim] = True      # one column of those rows
  assert_nonfinite_exactly_where(out, bad, ref, case)


def test_non_finite_gradients_are_not_laundered():
  """A NaN key gives NaN gradients to the queries that see it, not zeros; the other batch
  element's gradients stay exact, and the earlier rows' dq finite."""
  mesh = make_mesh((4,), ("sequence",))
  q, k, v = qkv(14, 2, 32, 2, 2, 8)
  k = k.at[0, 21, 0, 1].set(jnp.nan)  # mid-block: query 20 meets key 21 masked in one pair
  ring = functools.partial(ring_jax.ring_attention_sharded, mesh=mesh, is_causal=True,
                           layout="zigzag", block_q=4, block_kv=4)
  ref = functools.partial(ring_jax.reference_attention, is_causal=True)
  cot = jax.random.normal(jax.random.key(7), q.shape, jnp.float32)
  dq, dk, dv = jax.jit(functools.partial(grads, ring))(q, k, v, cot)
  want = grads(ref, q[1:], k[1:], v[1:], cot[1:])
  for name, g, w in zip("qkv", (dq, dk, dv), want):
    assert_close(np.asarray(g)[1:], w, what=f"d{name}, clean batch element")
  dq = np.asarray(dq)
  assert np.isnan(dq[0, 21:, 0]).all()       # query head 0 uses K/V head 0 and sees key 21
  assert np.isfinite(dq[0, :21]).all() and np.isfinite(dq[0, :, 1]).all()
  assert np.isnan(np.asarray(dk)[0, 21, 0]).all()


def test_nan_values_in_padding_are_never_read():
  """Padding tokens (segment id 0) may hold anything, NaN included: outputs are unchanged."""
  mesh = make_mesh((4,), ("sequence",))
  q, k, v = qkv(15, 2, 32, 2, 1, 8)
  seg = np.ones((2, 32), np.int32)
  seg[0, 24:] = 0
  seg = jnp.asarray(seg)
  k, v = k.at[0, 24:].set(jnp.nan), v.at[0, 24:].set(jnp.inf)
  for is_causal in (False, True):
    want = ring_jax.reference_attention(q, k, v, is_causal=is_causal, segment_ids=seg)
    out = ring_fn(mesh, is_causal=is_causal)(q, k, v, segment_ids=seg)
    assert_close(out, want, what=f"causal={is_causal}")


@pytest.mark.parametrize("scale", [1e30, -1e30, 1e-30])
def test_extreme_finite_scales_match_the_oracle(scale):
  """Huge scores are not confused with masked ones (no finite mask floor)."""
  mesh = make_mesh((4,), ("sequence",))
  q, k, v = qkv(16, 2, 32, 2, 2, 8)
  out = ring_fn(mesh, is_causal=True, scale=scale)(q, k, v)
  want = ring_jax.reference_attention(q, k, v, is_causal=True, scale=scale)
  assert_close(out, want)
  assert np.abs(np.asarray(out)).max(axis=-1).min() > 0  # no row zeroed


@pytest.mark.parametrize("scale", [np.nan, np.inf, -np.inf, 1e40])
def test_non_finite_scale_is_refused(scale):
  mesh = make_mesh((4,), ("sequence",))
  q, k, v = qkv(0, 1, 16, 2, 2, 8)
  with pytest.raises(ValueError, match="not a finite float32"):
    ring_jax.ring_attention_sharded(q, k, v, mesh=mesh, scale=scale)
  with pytest.raises(ValueError, match="not a finite float32"):
    ring_jax.reference_attention(q, k, v, scale=scale)


@pytest.mark.parametrize("window,match", [(2**40, "2\\*\\*31 - 1"), ((2.5, 1), "integers"),
                                          ((3, -1), ">= 0")])
def test_bad_window_is_a_value_error(window, match):
  mesh = make_mesh((4,), ("sequence",))
  q, k, v = qkv(0, 1, 16, 2, 2, 8)
  with pytest.raises(ValueError, match=match):
    ring_jax.ring_attention_sharded(q, k, v, mesh=mesh, local_window_size=window)
  with pytest.raises(ValueError, match=match):
    ring_jax.reference_attention(q, k, v, local_window_size=window)


@pytest.mark.parametrize("kwargs,match", [
    (dict(sinks=np.zeros((3,), np.float32)),
     r"sinks must be one float logit per query head, shape \(4,\)"),
    (dict(sinks=np.zeros((4,), np.int32)), "sinks must be floating point"),
    (dict(logits_soft_cap=0.0), "logits_soft_cap=0.0 must be a finite number > 0"),
    (dict(logits_soft_cap=float("inf")), "must be a finite number > 0"),
])
def test_sinks_and_soft_cap_bad_input_is_one_clear_error(kwargs, match):
  mesh = make_mesh((4,), ("sequence",))
  q, k, v = qkv(0, 1, 32, 4, 2, 8)
  with pytest.raises(ValueError, match=match):
    ring_jax.ring_attention_sharded(q, k, v, mesh=mesh, **kwargs)


def test_value_head_dim_in_ring_attention_sharded():
  """V's own head size (every strategy and kernel: tests/ring_jax/test_value_head_dim.py)."""
  mesh = make_mesh((4,), ("sequence",))
  q, k, v = qkv(0, 1, 512, 4, 4, 8)
  v = v[..., :4]
  out = ring_jax.ring_attention_sharded(q, k, v, mesh=mesh, is_causal=True)
  assert out.shape == (1, 512, 4, 4)
  assert_close(out, ring_jax.reference_attention(q, k, v, is_causal=True), what="Dv")
