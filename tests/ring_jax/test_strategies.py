"""attention_sharded's strategies (all_gather, ulysses, hybrid, auto) vs the dense oracle,
forward and gradients, on 8 fake devices; their errors; what they keep between the passes."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import ring_jax
from attn_utils import (assert_close, make_mesh, out_and_grads, packed_segments,
                        programs_compiled, qkv)


def check(mesh, q, k, v, *, strategy, seq_axis="sequence", forward_alone=False, **kw):
  """The strategy's output and gradients (one program each: out_and_grads) against the
  dense reference's; ``forward_alone``: its forward compiled on its own too (the path of a
  call without gradients)."""
  fn = functools.partial(ring_jax.attention_sharded, mesh=mesh, strategy=strategy,
                         seq_axis=seq_axis, **kw)
  for arg in ("layout", "block_q", "block_kv", "head_axis", "batch_axis"):
    kw.pop(arg, None)
  ref = functools.partial(ring_jax.reference_attention, **kw)
  cot = jax.random.normal(jax.random.key(7), q.shape, jnp.float32)
  out, got = out_and_grads(fn, q, k, v, cot)
  want_out, want = out_and_grads(ref, q, k, v, cot)
  assert_close(out, want_out, what=f"{strategy} forward")
  if forward_alone:
    assert_close(jax.jit(fn)(q, k, v), want_out, what=f"{strategy} forward alone")
  for name, g, w in zip("qkv", got, want):
    assert_close(g, w, what=f"{strategy} d{name}")


@pytest.mark.parametrize("strategy,layout,is_causal,segments", [
    ("all_gather", "contiguous", False, True), ("all_gather", "zigzag", True, True),
    ("ulysses", "contiguous", True, True), ("ulysses", "zigzag", False, True)])
def test_matches_dense(strategy, layout, is_causal, segments):
  """sequence=8; GQA 8 query on 4 (all_gather) or 8 (ulysses: one head per device) K/V heads."""
  mesh = make_mesh((8,), ("sequence",))
  q, k, v = qkv(0, 1, 32, 8, 4 if strategy == "all_gather" else 8, 8)
  seg = packed_segments(1, 32, seed=2) if segments else None
  check(mesh, q, k, v, strategy=strategy, is_causal=is_causal, segment_ids=seg, layout=layout,
        block_q=2, block_kv=2, forward_alone=is_causal)  # one case of each strategy


def test_all_gather_striped_window_and_data_axis():
  mesh = make_mesh((2, 4), ("data", "sequence"))
  q, k, v = qkv(1, 2, 16, 2, 1, 8)
  check(mesh, q, k, v, strategy="all_gather", is_causal=True, local_window_size=5,
        layout="striped", segment_ids=packed_segments(2, 16, seed=3))


def test_ulysses_replicates_fewer_kv_heads():
  """A K/V head count below the axis size (MQA here, GQA in the hybrid test) is repeated up
  to it, as in USP; the gradients add back up. With a two-sided window."""
  mesh = make_mesh((4,), ("sequence",))
  q, k, v = qkv(2, 1, 32, 4, 1, 8)
  check(mesh, q, k, v, strategy="ulysses", local_window_size=(3, 6))


@pytest.mark.parametrize("strategy", ["all_gather", "ulysses"])
def test_tensor_and_sequence_mqa(strategy):
  """Heads over tensor=2 while the sequence is split over 4; one K/V head replicated (MQA)."""
  mesh = make_mesh((2, 4), ("tensor", "sequence"))
  q, k, v = qkv(3, 1, 32, 8, 1, 8)
  check(mesh, q, k, v, strategy=strategy, is_causal=True, layout="zigzag")


@pytest.mark.parametrize("layout,segments", [("contiguous", True), ("zigzag", False)])
def test_hybrid_2x4(layout, segments):
  """seq_axis=(ring, ulysses) on a 2 x 4 mesh: Ulysses over 4, a ring of 2 across."""
  mesh = make_mesh((2, 4), ("ring", "ulysses"))
  q, k, v = qkv(4, 1, 32, 4, 2, 8)
  seg = packed_segments(1, 32, seed=5) if segments else None
  check(mesh, q, k, v, strategy="hybrid", seq_axis=("ring", "ulysses"), is_causal=True,
        segment_ids=seg, layout=layout, block_q=2, block_kv=2, forward_alone=segments)


def test_inputs_in_layout_and_explicit_mesh():
  """Layout-ordered inputs come back in layout order; Explicit mesh axes work too."""
  mesh = make_mesh((8,), ("sequence",), explicit=True)
  q, k, v = qkv(5, 1, 32, 8, 8, 8)
  to = functools.partial(ring_jax.to_layout, layout="zigzag", ring_size=8)
  expected = to(ring_jax.reference_attention(q, k, v, is_causal=True))
  for strategy in ("all_gather", "ulysses"):
    fn = jax.jit(functools.partial(ring_jax.attention_sharded, mesh=mesh, strategy=strategy,
                                   is_causal=True, layout="zigzag", inputs_in_layout=True))
    assert_close(fn(to(q), to(k), to(v)), expected, what=strategy)


def test_in_shard_map():
  """The strategies are usable inside a user's own shard_map, like ring_attention."""
  mesh = make_mesh((2, 4), ("ring", "ulysses"))
  q, k, v = qkv(6, 1, 32, 8, 8, 8)
  expected = ring_jax.reference_attention(q, k, v, is_causal=True)
  spec = P(None, ("ring", "ulysses"))
  for fn, axis in ((ring_jax.all_gather_attention, ("ring", "ulysses")),
                   (ring_jax.ulysses_attention, ("ring", "ulysses")),
                   (ring_jax.hybrid_attention, ("ring", "ulysses"))):
    local = functools.partial(fn, axis_name=axis, is_causal=True)
    out = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec))(q, k, v)
    assert_close(out, expected, what=fn.__name__)


def test_auto_runs_what_plan_picks():
  mesh = make_mesh((8,), ("sequence",))
  q, k, v = qkv(7, 1, 64, 8, 8, 8)
  chosen = ring_jax.plan(batch=1, seq_len=64, heads=8, kv_heads=8, head_dim=8, dtype=q.dtype,
                         is_causal=True, layout="zigzag", sequence=8,
                         device=jax.devices()[0].device_kind,
                         strategies=("ring", "all_gather", "ulysses"))
  assert chosen.strategy in ("ring", "all_gather", "ulysses")
  run = lambda strategy: jax.jit(functools.partial(
      ring_jax.attention_sharded, mesh=mesh, strategy=strategy, is_causal=True,
      layout="zigzag"))(q, k, v)
  auto, picked = run("auto"), run(chosen.strategy)
  np.testing.assert_array_equal(np.asarray(auto), np.asarray(picked))
  assert_close(auto, ring_jax.reference_attention(q, k, v, is_causal=True), what="auto")


def test_all_gather_keeps_only_local_kv_between_passes():
  """The custom_vjp saves the local K/V and gathers again in the backward: no residual is
  larger than one input (the gathered K/V would be n = 8 times larger on every device)."""
  mesh = make_mesh((8,), ("sequence",))
  q, k, v = qkv(8, 1, 64, 4, 4, 8)
  fn = functools.partial(ring_jax.attention_sharded, mesh=mesh, strategy="all_gather",
                         is_causal=True)
  vjp = jax.eval_shape(lambda q, k, v: jax.vjp(fn, q, k, v)[1], q, k, v)  # traced only
  sizes = [x.size for x in jax.tree.leaves(vjp)]
  assert sizes and max(sizes) <= k.size, sizes


@pytest.mark.parametrize("heads,kv_heads,strategy,match", [
    (6, 6, "ulysses", "query heads on each device \\(6\\) divisible by the size of axis"),
    (12, 6, "ulysses", "key/value heads on each device \\(6\\) divisible by the size"),
    (12, 6, "hybrid", "key/value heads on each device \\(6\\) divisible by the size"),
])
def test_head_errors(heads, kv_heads, strategy, match):
  """Ulysses over an axis of 4: heads must split over it (K/V heads may also divide it)."""
  mesh = make_mesh((2, 4), ("ring", "sequence"))
  q, k, v = qkv(9, 1, 32, heads, kv_heads, 8)
  axis = ("ring", "sequence") if strategy == "hybrid" else "sequence"
  with pytest.raises(ValueError, match=match):
    ring_jax.attention_sharded(q, k, v, mesh=mesh, strategy=strategy, seq_axis=axis)


def test_argument_errors():
  mesh = make_mesh((2, 4), ("ring", "sequence"))
  q, k, v = qkv(10, 1, 32, 4, 4, 8)
  with pytest.raises(ValueError, match="needs seq_axis=\\(ring_axis, ulysses_axis\\)"):
    ring_jax.attention_sharded(q, k, v, mesh=mesh, strategy="hybrid")
  with pytest.raises(ValueError, match="strategy must be one of"):
    ring_jax.attention_sharded(q, k, v, mesh=mesh, strategy="ringg")
  with pytest.raises(ValueError, match="not an axis of the mesh"):
    ring_jax.attention_sharded(q, k, v, mesh=mesh, strategy="ulysses", seq_axis="seq")


@pytest.mark.parametrize("fn,axis", [
    (ring_jax.all_gather_attention, "sequence"), (ring_jax.ulysses_attention, "sequence"),
    (ring_jax.hybrid_attention, ("ring", "sequence"))])
def test_document_layout_errors_in_shard_map(fn, axis):
  """The entry points inside shard_map refuse layout='document' as ring_attention does
  (segment ids needed, no window), before any collective."""
  mesh = make_mesh((2, 4), ("ring", "sequence"))
  q, k, v = qkv(10, 1, 32, 4, 4, 8)
  seg = jnp.ones((1, 32), jnp.int32)
  spec, seg_spec = P(None, ("ring", "sequence")), P(None, ("ring", "sequence"))
  with pytest.raises(ValueError, match="layout='document' needs segment_ids"):
    jax.shard_map(functools.partial(fn, axis_name=axis, is_causal=True, layout="document"),
                  mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)(q, k, v)
  with pytest.raises(ValueError, match="cannot apply local_window_size"):
    jax.shard_map(lambda q, k, v, s: fn(q, k, v, axis_name=axis, is_causal=True, segment_ids=s,
                                        layout="document", local_window_size=4),
                  mesh=mesh, in_specs=(spec,) * 3 + (seg_spec,), out_specs=spec)(q, k, v, seg)


@pytest.mark.parametrize("strategy,heads,kv_heads", [("all_gather", 2, 1), ("ulysses", 3, 3)])
def test_odd_axis_size(strategy, heads, kv_heads):
  """Three sequence devices: causal, packed documents with padding."""
  mesh = make_mesh((3,), ("sequence",))
  q, k, v = qkv(11, 1, 24, heads, kv_heads, 8)
  check(mesh, q, k, v, strategy=strategy, is_causal=True,
        segment_ids=packed_segments(1, 24, seed=11), block_q=2, block_kv=2)


def test_attention_axes():
  """One rule for the batch / head axes: heads and K/V heads over the head axis, a single K/V
  head (MQA) replicated; an axis that does not divide raises, or with drop=True is dropped."""
  sizes = {"data": 2, "tensor": 4}
  axes = functools.partial(ring_jax.attention_axes, sizes, batch=4, heads=8,
                           batch_axis="data", head_axis="tensor")
  assert axes(kv_heads=4) == ring_jax.AttentionAxes("data", "tensor", "tensor")
  assert axes(kv_heads=1) == ring_jax.AttentionAxes("data", "tensor", None)
  with pytest.raises(ValueError, match="key/value heads=2 is not divisible by the mesh 'tensor'"):
    axes(kv_heads=2)
  assert axes(kv_heads=2, drop=True) == ring_jax.AttentionAxes("data", None, None)
  assert axes(kv_heads=4, batch=3, drop=True) == ring_jax.AttentionAxes(None, "tensor", "tensor")
  with pytest.raises(ValueError, match="model.num_heads=6 is not divisible"):
    axes(kv_heads=1, heads=6, names=("batch", "model.num_heads", "model.num_kv_heads"))


def test_plan_and_hybrid_share_the_length_rule():
  """plan() costs a hybrid length at the length the strategy runs it: 12 tokens over a
  zigzag ring of 2 (local 6, even) and Ulysses 2 (3 each) run as they are; 10 (local 5) run
  padded to 12 (any length, test_any_length.py), and plan() counts those 2 tokens."""
  mesh = make_mesh((2, 2), ("ring", "ulysses"))
  kw = dict(batch=1, heads=2, kv_heads=2, head_dim=8, is_causal=True, layout="zigzag",
            sequence=(2, 2), device="cpu")
  assert ring_jax.plan(seq_len=12, **kw).estimate("hybrid").feasible
  q, k, v = qkv(12, 1, 12, 2, 2, 8)
  run = functools.partial(ring_jax.attention_sharded, mesh=mesh, strategy="hybrid",
                          seq_axis=("ring", "ulysses"), is_causal=True, layout="zigzag",
                          block_q=1, block_kv=1)
  assert_close(jax.jit(run)(q, k, v), ring_jax.reference_attention(q, k, v, is_causal=True),
               what="hybrid at 12 tokens")
  assert ring_jax.plan(seq_len=12, **kw).estimate("hybrid").padding == 0
  padded = ring_jax.plan(seq_len=10, **kw).estimate("hybrid")
  assert padded.feasible and padded.padding == 2
  q, k, v = qkv(13, 1, 10, 2, 2, 8)  # padded to 12 inside
  assert_close(jax.jit(run)(q, k, v), ring_jax.reference_attention(q, k, v, is_causal=True),
               what="hybrid at 10 tokens")
  with pytest.raises(ValueError, match="must be even"):
    run(q, k, v, inputs_in_layout=True)


@pytest.mark.parametrize("strategy,seq_axis", [
    ("ring", "sequence"), ("all_gather", "sequence"), ("ulysses", "sequence"),
    ("hybrid", ("data", "sequence"))])
def test_an_eager_call_compiles_the_sharded_attention_once(caplog, strategy, seq_axis):
  """Outside jit, a bare shard_map would run its body op by op (one program per operation);
  attention_sharded runs it as one program (and at most one more to place the inputs)."""
  mesh = make_mesh((2, 4), ("data", "sequence"))
  q, k, v = qkv(12, 1, 32, 4, 4, 8)
  out, compiled = programs_compiled(
      caplog, ring_jax.attention_sharded, q, k, v, mesh=mesh, strategy=strategy,
      seq_axis=seq_axis, batch_axis=None, is_causal=True, layout="zigzag")
  assert 1 <= len(compiled) <= 2, compiled
  assert_close(out, ring_jax.reference_attention(q, k, v, is_causal=True), what=strategy)
