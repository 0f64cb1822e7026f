"""The "document" layout: per-document balance of packed rows, exact against the oracle."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ring_jax
from attn_utils import assert_close, make_mesh, packed_segments, qkv
from ring_jax import documents


def random_rows(rng, rows, length, max_doc, pad=True, shuffle_ids=False):
  """Packed rows of random document lengths (1..max_doc), optional trailing padding."""
  seg = np.zeros((rows, length), np.int32)
  for r in range(rows):
    end = length - (rng.integers(0, length // 4 + 1) if pad else 0)
    pos, doc = 0, 1
    while pos < end:
      size = int(rng.integers(1, max_doc + 1))
      seg[r, pos:min(end, pos + size)] = doc
      pos, doc = pos + size, doc + 1
    if shuffle_ids:  # arbitrary ids, one id in two separate runs
      ids = rng.permutation(np.arange(-50, 50))
      ids = ids[ids != 0]
      seg[r] = np.where(seg[r] > 0, ids[seg[r] % 7], 0)
  return seg


@pytest.mark.parametrize("ring_size", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_permutation_round_trip_and_mask_positions(ring_size, seed):
  """A per-row permutation; to/from_layout invert it; ids renumbered one-to-one; within each
  document the mask positions increase with the original positions (what makes it exact);
  and each device's causal work is the same up to rounding."""
  rng = np.random.default_rng(seed)
  length = 2 * ring_size * int(rng.integers(4, 24))
  seg = random_rows(rng, 3, length, max_doc=int(rng.integers(1, length)),
                    shuffle_ids=seed == 2)
  doc = ring_jax.document_layout(seg, ring_size)
  perm = doc.permutation
  assert perm.shape == seg.shape and perm.dtype == np.int32
  x = np.arange(3 * length * 2).reshape(3, length, 2)
  y = ring_jax.to_layout(x, "document", ring_size, permutation=perm)
  np.testing.assert_array_equal(ring_jax.from_layout(y, "document", ring_size,
                                                     permutation=perm), x)
  yj = ring_jax.to_layout(jnp.asarray(x), "document", ring_size, permutation=perm)
  np.testing.assert_array_equal(np.asarray(yj), y)
  mask_pos = ring_jax.layout_positions("zigzag", ring_size, length)
  for r in range(3):
    assert sorted(perm[r].tolist()) == list(range(length))
    orig = seg[r][perm[r]]
    new = doc.segment_ids[r]
    np.testing.assert_array_equal(orig == 0, new == 0)
    pairs = set(zip(orig.tolist(), new.tolist()))
    assert len(pairs) == len({o for o, _ in pairs}) == len({n for _, n in pairs})
    for d in set(orig.tolist()) - {0}:
      slots = np.flatnonzero(orig == d)
      by_origin = slots[np.argsort(perm[r][slots])]
      assert (np.diff(mask_pos[by_origin]) > 0).all(), (r, d)
  work = documents.token_work(seg, perm, ring_size)
  sizes = [np.bincount(seg[r][seg[r] != 0] - seg[r].min() + 1) for r in range(3)]
  slack = 2 * ring_size * max(int(s.max()) for s in sizes if s.size) + 4 * length
  assert (work.max(1) - work.min(1) <= slack).all(), work


def test_one_document_is_zigzag():
  seg = np.ones((2, 32), np.int32)
  doc = ring_jax.document_layout(seg, 4)
  np.testing.assert_array_equal(doc.permutation[0], ring_jax.layout_positions("zigzag", 4, 32))
  np.testing.assert_array_equal(doc.segment_ids, seg)


def test_balance_on_lognormal_rows():
  """The block pairs the ring's kernels compute (its own block tables) are within 10% of the
  mean on every device, every hop near balanced; zigzag is far from it. Token pairs stay
  close too (the layout evens the kernel's masked pairs around split documents, not tokens)."""
  rng = np.random.default_rng(0)
  n, length = 8, 8192
  seg = np.zeros((8, length), np.int32)
  for r in range(8):
    pos, d = 0, 1
    while pos < length:
      size = max(1, int(rng.lognormal(np.log(1024) - 0.5, 1.0)))
      seg[r, pos:pos + size], pos, d = d, pos + size, d + 1
  doc = ring_jax.document_layout(seg, n)
  ratio = lambda w: w.max(1) / w.mean(1)  # noqa: E731
  assert ratio(documents.token_work(seg, doc.permutation, n)).max() <= 1.2
  zigzag = ring_jax.layout_positions("zigzag", n, length)
  assert np.median(ratio(documents.token_work(seg, zigzag, n))) > 1.3
  blocks = documents.block_work(doc.segment_ids[:3], "document", n, 64, 64)
  assert ratio(blocks.sum(-1)).max() <= 1.10
  # Hops are synchronous: the critical path is close to the mean device's work.
  assert (blocks.max(1).sum(-1) <= 1.15 * blocks.sum(-1).mean(-1)).all()
  zz_blocks = documents.block_work(seg[:3, zigzag], "zigzag", n, 64, 64)
  # Finer pieces cost masked pairs, so a row of short documents may not gain; these do overall.
  assert blocks.max(1).sum() < zz_blocks.max(1).sum()


@pytest.mark.parametrize("ring_size,batch", [(2, 2), (3, 1), (4, 1), (8, 1)])
def test_ring_matches_oracle(ring_size, batch):
  """Causal, packed documents with padding, GQA: forward and every gradient."""
  mesh = make_mesh((ring_size,), ("sequence",))
  length = 8 * ring_size
  q, k, v = qkv(ring_size, batch, length, 2, 1, 8)
  seg = np.asarray(packed_segments(batch, length, seed=ring_size))
  doc = ring_jax.document_layout(seg, ring_size)
  to = functools.partial(ring_jax.to_layout, layout="document", ring_size=ring_size,
                         permutation=doc.permutation)
  ring = functools.partial(ring_jax.ring_attention_sharded, mesh=mesh, is_causal=True,
                           segment_ids=jnp.asarray(doc.segment_ids), layout="document",
                           inputs_in_layout=True, block_q=4, block_kv=4)
  in_natural = lambda q, k, v: ring_jax.from_layout(  # noqa: E731
      ring(to(q), to(k), to(v)), "document", ring_size, permutation=doc.permutation)
  cot = jax.random.normal(jax.random.key(3), q.shape, jnp.float32)

  def out_and_grads(fn, q, k, v, cot):  # one compile for the forward and all gradients
    out, vjp = jax.vjp(fn, q, k, v)
    return out, vjp(cot.astype(out.dtype))

  with jax.enable_x64(True):
    q64, k64, v64 = (jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v))
    ref = functools.partial(ring_jax.reference_attention, is_causal=True,
                            segment_ids=jnp.asarray(seg))
    want, want_grads = jax.jit(functools.partial(out_and_grads, ref))(q64, k64, v64, cot)
  got, got_grads = jax.jit(functools.partial(out_and_grads, in_natural))(q, k, v, cot)
  assert_close(got, want, what="forward")
  for name, g, w in zip("qkv", got_grads, want_grads):
    assert_close(g, w, what=f"d{name}")


@pytest.mark.parametrize("strategy", ["all_gather", "ulysses", "hybrid"])
def test_other_strategies_take_the_layout(strategy):
  """attention_sharded runs every strategy on document-layout inputs (the model's path)."""
  mesh = make_mesh((4, 2), ("sequence", "tensor"))
  length = 32
  q, k, v = qkv(5, 1, length, 4, 2, 8)
  seg = np.asarray(packed_segments(1, length, seed=5))
  doc = ring_jax.document_layout(seg, 4)
  to = functools.partial(ring_jax.to_layout, layout="document", ring_size=4,
                         permutation=doc.permutation)
  seq = ("sequence", "tensor") if strategy == "hybrid" else "sequence"
  out = jax.jit(functools.partial(
      ring_jax.attention_sharded, mesh=mesh, strategy=strategy, seq_axis=seq,
      head_axis="tensor" if strategy == "all_gather" else None, is_causal=True, layout="document",
      inputs_in_layout=True, block_q=2, block_kv=2))(to(q), to(k), to(v),
                                                     segment_ids=jnp.asarray(doc.segment_ids))
  want = ring_jax.reference_attention(q, k, v, is_causal=True, segment_ids=jnp.asarray(seg))
  assert_close(ring_jax.from_layout(out, "document", 4, permutation=doc.permutation), want)


def test_ring_attention_in_a_users_shard_map():
  """ring_attention(layout="document") on local shards, segment ids passed with them."""
  from jax.sharding import PartitionSpec as P

  mesh = make_mesh((2,), ("sequence",))
  q, k, v = qkv(6, 1, 16, 2, 1, 4)
  seg = np.asarray(packed_segments(1, 16, seed=6))
  doc = ring_jax.document_layout(seg, 2)
  to = functools.partial(ring_jax.to_layout, layout="document", ring_size=2,
                         permutation=doc.permutation)
  spec, seg_spec = P(None, "sequence", None, None), P(None, "sequence")
  fn = jax.shard_map(lambda q, k, v, s: ring_jax.ring_attention(
      q, k, v, axis_name="sequence", is_causal=True, segment_ids=s, layout="document",
      block_q=2, block_kv=2), mesh=mesh, in_specs=(spec, spec, spec, seg_spec), out_specs=spec)
  out = jax.jit(fn)(to(q), to(k), to(v), jnp.asarray(doc.segment_ids))
  want = ring_jax.reference_attention(q, k, v, is_causal=True, segment_ids=jnp.asarray(seg))
  assert_close(ring_jax.from_layout(out, "document", 2, permutation=doc.permutation), want)
  no_ids = jax.shard_map(lambda q, k, v: ring_jax.ring_attention(
      q, k, v, axis_name="sequence", is_causal=True, layout="document"), mesh=mesh,
      in_specs=(spec,) * 3, out_specs=spec)
  with pytest.raises(ValueError, match="needs segment_ids"):
    no_ids(q, k, v)


def test_errors_name_the_fix():
  mesh = make_mesh((2,), ("sequence",))
  q, k, v = qkv(0, 1, 8, 2, 2, 4)
  seg = jnp.ones((1, 8), jnp.int32)
  run = functools.partial(ring_jax.ring_attention_sharded, q, k, v, mesh=mesh, is_causal=True,
                          layout="document")
  with pytest.raises(ValueError, match="needs segment_ids"):
    run(inputs_in_layout=True)
  with pytest.raises(ValueError, match="local_window_size"):
    run(segment_ids=seg, inputs_in_layout=True, local_window_size=2)
  with pytest.raises(ValueError, match="inputs_in_layout=True"):
    run(segment_ids=seg)
  with pytest.raises(ValueError, match="document_layout"):
    ring_jax.to_layout(q, "document", 2)
  with pytest.raises(ValueError, match="document_layout"):
    ring_jax.layout_positions("document", 2, 8)
  with pytest.raises(ValueError, match="permutation= is for layout='document'"):
    ring_jax.to_layout(q, "zigzag", 2, permutation=np.zeros((1, 8), np.int32))
  with pytest.raises(ValueError, match="multiple of 8"):
    ring_jax.document_layout(np.ones((1, 12), np.int32), 4)
