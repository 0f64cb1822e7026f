"""The two-level ring (strategy="ring", seq_axis=(outer, inner)) vs the float64 dense oracle,
forward and gradients, on (2, 4), (4, 2), (8, 1) and (1, 8) splits of 8 fake devices, full and
routed (causal_routing: the outer transfers under a causal mask); its errors; the bytes its
compiled HLO sends over each axis; plan()'s choice on two link levels."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import ring_jax
from benchmarks import two_level as bench
from attn_utils import (assert_close, grads, make_mesh, may_mask_recorder, out_and_grads,
                        packed_segments, qkv)
from ring_jax import routing
from ring_jax.two_level import two_level_ring_attention

AXES = ("outer", "inner")


def oracle(q, k, v, cot, **kw):
  """float64 output and gradients of the dense reference (the oracle)."""
  with jax.enable_x64(True):
    q64, k64, v64, c64 = (jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v, cot))
    ref = functools.partial(ring_jax.reference_attention, **kw)
    return [np.asarray(ref(q64, k64, v64))] + [np.asarray(g) for g in grads(ref, q64, k64, v64,
                                                                             c64)]


@pytest.mark.parametrize("split,layout,is_causal,segments,overlap_dkv", [
    ((2, 4), "zigzag", True, True, False), ((4, 2), "contiguous", True, False, True),
    ((4, 2), "striped", False, False, False), ((8, 1), "zigzag", True, False, False),
    ((1, 8), "contiguous", False, True, False)])
def test_matches_float64_oracle(split, layout, is_causal, segments, overlap_dkv):
  """GQA (4 query heads on 2 K/V heads); natural-order global arrays in and out. Causal
  contiguous skips whole hops (the block table of a later shard is empty); that case runs
  through ring_attention_sharded with overlap_dkv. Few cases: each compiles a ring forward
  and backward (~10 s here)."""
  mesh = make_mesh(split, AXES)
  q, k, v = qkv(11, 1, 32, 4, 2, 8)
  seg = packed_segments(1, 32, seed=4) if segments else None
  cot = jax.random.normal(jax.random.key(5), q.shape, jnp.float32)
  if overlap_dkv:
    fn = functools.partial(ring_jax.ring_attention_sharded, overlap_dkv=True)
  else:
    fn = functools.partial(ring_jax.attention_sharded, strategy="ring")
  fn = functools.partial(fn, mesh=mesh, seq_axis=AXES, is_causal=is_causal, segment_ids=seg,
                         layout=layout, block_q=4, block_kv=4)
  out, dqkv = out_and_grads(fn, q, k, v, cot)  # one program (tests/attn_utils.py)
  got = [out, *dqkv]
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
  seg = jnp.ones((1, 16), jnp.int32)

  def document(with_ids, **kw):  # layout='document': the flat ring's checks, same messages
    local = lambda q, k, v, s: two_level_ring_attention(  # noqa: E731
        q, k, v, axis_name=AXES, is_causal=True, layout="document",
        segment_ids=s if with_ids else None, **kw)
    return jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 4, out_specs=spec)(q, k, v, seg)

  with pytest.raises(ValueError, match="layout='document' needs segment_ids"):
    document(False)
  with pytest.raises(ValueError, match="cannot apply local_window_size"):
    document(True, local_window_size=2)
  with pytest.raises(ValueError, match="zigzag"):  # the layout spans the ring of 8
    ring_jax.attention_sharded(q[:, :8], k[:, :8], v[:, :8], mesh=mesh, strategy="ring",
                               seq_axis=AXES, layout="zigzag", inputs_in_layout=True)
  with pytest.raises(TypeError, match="causal_routing must be None"):
    ring_jax.attention_sharded(q, k, v, mesh=mesh, strategy="ring", seq_axis=AXES,
                               is_causal=True, causal_routing="yes")


def test_bytes_over_each_axis_from_hlo():
  """Forward, ring of 8 as 2 groups of 4: the flat ring's 7 hops each send K and V over the
  outer links (2 pairs of 8 cross); the two-level ring crosses them once (K and V), and
  sends 2 x 3 inner hops within the groups. Every executed permute moves one shard."""
  shard = 1 * 8 * 2 * 16 * 4  # 64 tokens / 8 devices, 2 K/V heads, head_dim 16, float32
  got = {}
  for two_level in (False, True):
    text = bench.compile_ring((2, 4), two_level=two_level, backward=False, is_causal=False,
                              length=64, heads=4, kv_heads=2, head_dim=16).as_text()
    ops = bench.permute_traffic(text, (2, 4))
    assert all(op["bytes"] == shard for op in ops), ops
    got[two_level] = bench.axis_summary(ops)
  assert got[False] == dict(outer_transfers=14, outer_bytes=14 * shard, inner_transfers=14,
                            inner_bytes=14 * shard)
  assert got[True] == dict(outer_transfers=2, outer_bytes=2 * shard, inner_transfers=12,
                           inner_bytes=12 * shard)


def test_group_routes():
  """The outer ring's routes (groups as members): contiguous buffer j goes to groups
  j+1..n_o-1 and its dK/dV home from group n_o-1; zigzag both chunks backward, early ones
  around the whole outer ring, the late chunk of group j to groups 0..j only."""
  con = routing.group_routes("contiguous", 4, 2, 16, True)
  (stream,) = con.streams
  assert stream.step == 1 and [p for p in stream.arrive] == [
      (), ((0, 1), (1, 2), (2, 3)), ((1, 2), (2, 3)), ((2, 3),)]
  assert stream.home == ((), ((3, 2),), ((3, 1),), ((3, 0),)) and stream.done_home[0] == (3,)
  assert con.kv_fraction() == 0.5 and con.dkv_fraction() == 9 / 16
  early, late = routing.group_routes("zigzag", 4, 2, 16, True).streams
  assert (early.step, late.step) == (-1, -1)
  assert [len(p) for p in early.arrive] == [0, 4, 4, 4]
  assert late.arrive == ((), ((1, 0), (2, 1), (3, 2)), ((1, 0), (2, 1)), ((1, 0),))
  assert late.home == ((), ((0, 1),), ((0, 2),), ((0, 3),)) and late.done_home[0] == (0,)
  assert routing.group_routes("zigzag", 2, 4, 16, True).kv_fraction() == 0.75
  # Nothing to drop: striped, or no causal mask; routed=False is the full rotation.
  assert not routing.group_routes("striped", 4, 2, 16, True).routed
  assert not routing.group_routes("contiguous", 4, 2, 16, False).routed
  full = routing.group_routes("zigzag", 4, 2, 16, True, routed=False)
  assert not full.routed and full.kv_fraction() == 1 and full.dkv_fraction() == 1


@pytest.mark.parametrize("split,layout,window", [
    ((2, 4), "zigzag", None), ((4, 2), "document", None), ((2, 4), "contiguous", 9)])
def test_routed_matches_float64_oracle(split, layout, window):
  """causal_routing=True, causal, GQA, packed segment ids: forward and dq, dk, dv against the
  float64 oracle (the document layout's arrays reordered by its permutation and back). The
  routed contiguous ring without a window is the default, checked above (4 x 2)."""
  mesh = make_mesh(split, AXES)
  q, k, v = qkv(21, 1, 64, 4, 2, 8)
  seg = packed_segments(1, 64, seed=6)
  cot = jax.random.normal(jax.random.key(7), q.shape, jnp.float32)
  want = oracle(q, k, v, cot, is_causal=True, segment_ids=seg, local_window_size=window)
  to = back = lambda x: x  # noqa: E731
  run_seg = seg
  if layout == "document":
    doc = ring_jax.document_layout(np.asarray(seg), 8)
    perm = doc.permutation
    to = lambda x: ring_jax.to_layout(x, "document", 8, permutation=perm)  # noqa: E731
    back = lambda x: ring_jax.from_layout(x, "document", 8, permutation=perm)  # noqa: E731
    run_seg = jnp.asarray(doc.segment_ids)
  fn = functools.partial(ring_jax.ring_attention_sharded, mesh=mesh, seq_axis=AXES,
                         is_causal=True, segment_ids=run_seg, layout=layout, block_q=4,
                         block_kv=4, local_window_size=window, causal_routing=True,
                         inputs_in_layout=layout == "document")

  def out_and_grads(q, k, v, cot):  # one program: compiling dominates these shapes
    out, vjp = jax.vjp(fn, q, k, v)
    return (out, *vjp(cot))

  got = jax.jit(out_and_grads)(*(to(x) for x in (q, k, v, cot)))
  for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
    assert_close(back(g), w, what=f"{split} {layout} {name}")


def test_routed_outer_bytes_from_hlo():
  """4 x 2, causal: the bytes the compiled program sends over the outer axis (all outer
  links together), routed and in full rotation, forward (the ops named two_level_fwd) and
  forward + backward, are exactly what the outer routes move (routing.group_routes), routed:
  K/V at steps 1..3 forward, 2..3 backward (step 1's parts are the forward's, kept), the
  dK/dV on with their parts and home. Routed over full: contiguous 0.5 and 0.5, zigzag
  0.75 and 0.75. The full rotation's backward runs both rings own shard last: over the
  outer links K/V at steps 2..4 and dK/dV on with them (the same outer bytes), over the
  inner links per step one K/V and one dK/dV transfer and none home, fewer than the routed
  rings' (which send each step's inner accumulators home). (The full rotation moves the
  same in every layout: compiled once, zigzag.)"""
  split, length = (4, 2), 128
  shard = length // 8 * 2 * 8 * 4  # one device's K (or V): 16 tokens, 2 heads of 8, float32
  group = 2 * shard  # over the 2 device pairs of a group pair

  def measured(layout, routed):
    text = bench.compile_ring(split, two_level=True, backward=True, is_causal=True,
                              length=length, heads=2, kv_heads=2, head_dim=8, layout=layout,
                              causal_routing=routed).as_text()
    ops = bench.permute_traffic(text, split)
    return (bench.outer_total(ops, "/two_level_fwd/"), bench.outer_total(ops),
            bench.axis_summary(ops)["inner_bytes"])

  def derived(layout, routed):
    route = routing.group_routes(layout, 4, 2, length // 8, True, routed=routed)

    def moved(hops, kind="arrive"):  # whole group buffers moved over these steps
      return sum(len(getattr(s, kind)[h]) * (s.stop - s.start) for s in route.streams
                 for h in hops) / route.local_len

    fwd = 2 * moved(range(1, 4)) * group  # K and V
    dkv = 2 * (moved(range(1, 4)) + moved(range(4), "home")) * group
    return fwd, fwd + 2 * moved(range(2, 4)) * group + dkv

  full = measured("zigzag", False)
  # full rotation: K/V 3 steps x 4 groups forward and backward, dK/dV with the backward's
  assert full[:2] == (2 * 12 * group, (2 * 12 + 2 * 12 + 2 * 12) * group)
  n_o, n_i = split  # inner: n_i - 1 K/V transfers (K and V) per step forward, K/V + dK/dV back
  assert full[2] == n_o * (n_i - 1) * (2 + 2 + 2) * shard
  inner_routed = set()
  for layout, frac in (("contiguous", 0.5), ("zigzag", 0.75)):
    routed = measured(layout, True)
    assert routed[:2] == derived(layout, True), layout
    inner_routed.add(routed[2])
    assert (routed[0] / full[0], routed[1] / full[1]) == (frac, frac), layout
  assert len(inner_routed) == 1 and inner_routed.pop() > full[2]


GQA = dict(batch=1, heads=32, kv_heads=8, head_dim=128)


def test_plan_two_link_levels():
  """4 H200 nodes of 8 (NVLink inside, 400 Gb/s InfiniBand between): the flat ring's hops
  wait for InfiniBand, the two-level ring hides it behind 8 hops; all-gather over both axes
  is exposed. On TPU v5p slices of 16 over DCN likewise."""
  p = ring_jax.plan(seq_len=131072, sequence=(4, 8), device="H200", **GQA)
  assert (p.strategy, p.split) == ("ring", (4, 8))
  two, flat = p.estimate("ring4x8"), p.estimate("ring")
  assert two.hidden and not flat.hidden
  assert two.time_s < flat.time_s / 2 and two.exposed_comm_s < flat.exposed_comm_s / 10
  assert "two levels: 3 transfers over the outer links" in " ".join(p.reasons)
  # The outer threshold is the inner ring's: l* of the network over 8 hops.
  assert flat.min_local_len / 8 <= two.min_local_len < flat.min_local_len
  # Routed (zigzag: 0.75x the outer K/V bytes): fewer bytes moved, the same time (a step
  # still sends a whole buffer over its busiest outer link).
  routed = ring_jax.plan(seq_len=131072, sequence=(4, 8), device="H200", layout="zigzag",
                         causal_routing=True, **GQA).estimate("ring4x8")
  full = ring_jax.plan(seq_len=131072, sequence=(4, 8), device="H200", layout="zigzag",
                       causal_routing=False, **GQA).estimate("ring4x8")
  assert routed.time_s == full.time_s and routed.bytes_moved < full.bytes_moved
  v5p = ring_jax.plan(seq_len=262144, sequence=(4, 16), device="TPU v5p", fast_domain=16,
                      **GQA)
  assert v5p.strategy == "ring" and v5p.split == (4, 16)
  assert not v5p.estimate("ring").hidden and not v5p.estimate("hybrid4x16").hidden
  # Inside one fast domain both rings are the same time; the two-level one is chosen.
  one = ring_jax.plan(seq_len=1 << 20, sequence=(2, 4), device="H200", **GQA)
  assert one.estimate("ring2x4").time_s == pytest.approx(one.estimate("ring").time_s)
  assert one.split == (2, 4)


@pytest.mark.parametrize("strategy", ["all_gather", "auto"])
def test_other_strategies_over_a_pair(strategy):
  """all_gather gathers over both axes; "auto" asks plan() among the pair's candidates."""
  mesh = make_mesh((2, 4), AXES)
  q, k, v = qkv(12, 1, 32, 4, 2, 8)
  fn = functools.partial(ring_jax.attention_sharded, mesh=mesh, strategy=strategy,
                         seq_axis=AXES, is_causal=True, layout="zigzag")
  want = oracle(q, k, v, jnp.zeros_like(q), is_causal=True)[0]
  assert_close(jax.jit(fn)(q, k, v), want, what=strategy)


def test_same_as_the_flat_ring_with_window_and_lse():
  """Inside shard_map: the two-level ring and the flat ring over the same pair of axes give
  the same output and log-sum-exp (causal, a window, striped on 4 x 2)."""
  mesh = make_mesh((4, 2), AXES)
  q, k, v = (ring_jax.to_layout(x, "striped", 8) for x in qkv(13, 1, 32, 4, 2, 8))
  spec, lse_spec = P(None, AXES), P(None, AXES, None)
  kw = dict(axis_name=AXES, is_causal=True, local_window_size=9, layout="striped",
            return_lse=True)

  def run(attend):
    fn = jax.shard_map(functools.partial(attend, **kw), mesh=mesh, in_specs=(spec,) * 3,
                       out_specs=(spec, lse_spec))
    return jax.jit(fn)(q, k, v)

  (out2, lse2), (out1, lse1) = run(two_level_ring_attention), run(ring_jax.ring_attention)
  assert_close(out2, out1, what="out")
  assert_close(lse2, lse1, what="lse")
  want = ring_jax.reference_attention(*(ring_jax.from_layout(x, "striped", 8) for x in (q, k, v)),
                                      is_causal=True, local_window_size=9)
  assert_close(ring_jax.from_layout(out2, "striped", 8), want, what="vs reference")


@pytest.mark.parametrize("routed,value_head_dim", [(False, 8), (True, 8), (True, 4)])
def test_sinks_and_soft_cap_same_as_the_flat_ring(routed, value_head_dim):
  """Sinks (one logit per query head, counted once), a logit soft-cap and V's own head size
  on the two-level ring (2 x 2, causal zigzag, routed or not) give the flat ring's output,
  lse and gradients of q, k, v and the sinks (the flat ring meets the float64 oracle in
  test_hop.py)."""
  mesh = make_mesh((2, 2), AXES)
  q, k, v = (ring_jax.to_layout(x, "zigzag", 4) for x in qkv(17, 1, 32, 4, 2, 8))
  v = v[..., :value_head_dim]
  sinks = jnp.asarray(np.random.default_rng(3).normal(3.0, 1.0, size=4), jnp.float32)
  spec, lse_spec = P(None, AXES), P(None, AXES, None)
  kw = dict(axis_name=AXES, is_causal=True, layout="zigzag", return_lse=True,
            logits_soft_cap=2.0, causal_routing=routed, block_q=4, block_kv=4)

  def run(attend):
    fn = jax.shard_map(lambda q, k, v, z: attend(q, k, v, sinks=z, **kw), mesh=mesh,
                       in_specs=(spec,) * 3 + (P(),), out_specs=(spec, lse_spec))
    def loss(*a):  # the output comes with the gradients: one program
      o = fn(*a)
      return jnp.sum(o[0] ** 2) + jnp.sum(jnp.sin(o[1])), o

    grads_, out = jax.jit(jax.grad(loss, (0, 1, 2, 3), has_aux=True))(q, k, v, sinks)
    return out, grads_

  (out2, lse2), g2 = run(two_level_ring_attention)
  (out1, lse1), g1 = run(ring_jax.ring_attention)
  assert_close(out2, out1, what="out")
  assert_close(lse2, lse1, what="lse")
  for name, a, b in zip(("dq", "dk", "dv", "dsinks"), g2, g1):
    assert_close(a, b, what=name)
  assert float(jnp.abs(g1[3]).min()) > 1e-3  # the sinks' gradient is not trivially zero


@pytest.mark.parametrize("layout,masked_fwd,masked_bwd", [
    ("zigzag", [True, False, False, False], [False] * 5 + [True]),
    ("striped", [True], [True])])
def test_steps_between_whole_chunks_compile_only_unmasked_blocks(layout, masked_fwd,
                                                                 masked_bwd):
  """As the flat ring (tests/ring_jax/test_ring.py): where no device of the combined ring
  holds a partly masked block pair at any outer step and inner hop a compiled step may be, the
  hop kernel gets a block table that masks nothing. Causal zigzag, (2, 4): only the parts
  that hold a device's own shard (the forward's first step's inner loop, the backward's
  last step's last hop) keep the mask; every striped hop keeps it. Output and gradients as
  the oracle's."""
  recording, seen = may_mask_recorder()

  mesh = make_mesh((2, 4), AXES)
  q, k, v = qkv(12, 1, 64, 4, 2, 8)
  cot = jax.random.normal(jax.random.key(6), q.shape, jnp.float32)
  fn = functools.partial(ring_jax.ring_attention_sharded, mesh=mesh, seq_axis=AXES,
                         is_causal=True, layout=layout, batch_axis=None, block_q=4,
                         block_kv=4, hop_kernel=recording)
  out, dqkv = out_and_grads(fn, q, k, v, cot)
  for name, want in (("fwd", masked_fwd), ("bwd", masked_bwd)):  # traced once per pass or more
    assert seen[name] and seen[name] == want * (len(seen[name]) // len(want)), (name, seen[name])
  for name, g, w in zip(("out", "dq", "dk", "dv"), [out, *dqkv], oracle(q, k, v, cot,
                                                                      is_causal=True)):
    assert_close(g, w, what=f"{layout} {name}")
