"""V's own head size (Dv != D, as MLA's D=192 / Dv=128; here D=24, Dv=16) in every strategy
of attention_sharded (all_gather, ulysses, hybrid, the two-level ring, auto) and every
layout, in the in-shard_map strategy functions, in decode (ring_jax.decode) and in plan()'s
figures; on 8 fake devices against the float64 oracle: forward, lse and the gradients of
q, k, v (and the sinks where given)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import ring_jax
from attn_utils import assert_close, make_mesh, packed_segments
from ring_jax import decode
from ring_jax.testing import oracle

B, L, N, K, H, HV = 2, 32, 8, 2, 24, 16  # GQA: 4 query heads per key/value head
SINKS = np.array([10.0, -10.0, 3.0, -4.0, 0.5, 7.0, -2.0, 1.0], np.float32)


def inputs(seed):
  """q ``[B,L,N,H]``, k ``[B,L,K,H]``, v ``[B,L,K,HV]``, packed segment ids with padding,
  and the output / lse cotangents."""
  rng = np.random.default_rng(seed)
  normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)  # noqa: E731
  q, k, v = normal(B, L, N, H), normal(B, L, K, H), normal(B, L, K, HV)
  seg = packed_segments(B, L, seed=seed).at[0, -3:].set(0)
  return q, k, v, seg, normal(B, L, N, HV), normal(B, L, N)


def float64_oracle(q, k, v, seg, do, dlse, *, is_causal, sinks=None, cap=None):
  pos = np.arange(L)
  vis = oracle.visibility(pos, pos, is_causal, None, seg, seg)
  return oracle.attention(q, k, v, vis, H ** -0.5, do, dlse, sinks=sinks, soft_cap=cap)


def check(fn, seed, *, is_causal, sinks=None, cap=None, what):
  """``fn(q, k, v, seg, sinks) -> (out, lse)`` vs the float64 oracle (and
  reference_attention in float64), forward and gradients."""
  q, k, v, seg, do, dlse = inputs(seed)
  want = float64_oracle(q, k, v, seg, do, dlse, is_causal=is_causal, sinks=sinks, cap=cap)
  z = None if sinks is None else jnp.asarray(sinks)

  def loss(q, k, v, z):  # the output comes with the gradients: one program
    out, lse = fn(q, k, v, seg, z)
    return jnp.sum(out * do) + jnp.sum(lse * dlse), (out, lse)

  names = ("dq", "dk", "dv") + (("dsinks",) if sinks is not None else ())
  got, (out, lse) = jax.jit(jax.grad(loss, argnums=tuple(range(len(names))), has_aux=True))(
      q, k, v, z)
  assert out.shape == (B, L, N, HV), what
  with jax.enable_x64(True):
    ref = ring_jax.reference_attention(
        *(jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v)), is_causal=is_causal,
        segment_ids=seg, logits_soft_cap=cap,
        sinks=None if sinks is None else jnp.asarray(sinks, jnp.float64))
    assert_close(out, np.asarray(ref), what=f"{what} out vs reference_attention")
  assert_close(out, want["out"], what=f"{what} out")
  empty = np.isneginf(want["lse"])  # padding rows without sinks: no key, lse -inf
  np.testing.assert_array_equal(np.isneginf(np.asarray(lse)), empty)
  assert_close(np.where(empty, 0.0, lse), np.where(empty, 0.0, want["lse"]),
               what=f"{what} lse")
  for name, g in zip(names, got):
    assert g.shape == want[name].shape, (what, name)
    assert_close(g, want[name], rtol=1e-4, atol=1e-5, what=f"{what} {name}")


# strategy, mesh shape, mesh axes, seq_axis, layout, causal, with sinks and a soft-cap
CASES = [
    ("all_gather", (8,), ("sequence",), "sequence", "zigzag", True, False),
    ("all_gather", (8,), ("sequence",), "sequence", "striped", True, True),
    ("all_gather", (2, 4), ("data", "sequence"), "sequence", "contiguous", False, False),
    # heads over tensor=2, Ulysses over 4: its one K/V head per device repeated to 4
    ("ulysses", (2, 4), ("tensor", "sequence"), "sequence", "contiguous", True, True),
    ("ulysses", (8,), ("sequence",), "sequence", "zigzag", False, False),
    ("hybrid", (2, 4), ("ring", "ulysses"), ("ring", "ulysses"), "zigzag", True, True),
    ("hybrid", (4, 2), ("ring", "ulysses"), ("ring", "ulysses"), "striped", True, False),
    ("hybrid", (2, 4), ("ring", "ulysses"), ("ring", "ulysses"), "contiguous", False, False),
    ("ring", (2, 4), ("outer", "inner"), ("outer", "inner"), "zigzag", True, True),
    ("auto", (8,), ("sequence",), "sequence", "zigzag", True, False),
]


@pytest.mark.parametrize("strategy,shape,names,seq_axis,layout,causal,extras", CASES,
                         ids=[f"{c[0]}-{'x'.join(map(str, c[1]))}-{c[4]}"
                              f"{'-causal' if c[5] else ''}{'-sinks-cap' if c[6] else ''}"
                              for c in CASES])
def test_every_strategy_and_layout_matches_float64_oracle(strategy, shape, names, seq_axis,
                                                          layout, causal, extras):
  mesh = make_mesh(shape, names)
  cap = 2.0 if extras else None

  def fn(q, k, v, seg, sinks):
    return ring_jax.attention_sharded(q, k, v, mesh=mesh, strategy=strategy,
                                      seq_axis=seq_axis, is_causal=causal, segment_ids=seg,
                                      layout=layout, block_q=2, block_kv=2, sinks=sinks,
                                      logits_soft_cap=cap, return_lse=True)

  check(fn, seed=len(strategy) + len(layout), is_causal=causal,
        sinks=SINKS if extras else None, cap=cap, what=f"{strategy}/{layout}")


@pytest.mark.parametrize("fn", [ring_jax.all_gather_attention, ring_jax.ulysses_attention,
                                ring_jax.hybrid_attention], ids=lambda f: f.__name__)
def test_in_shard_map_strategy_functions(fn):
  """The in-shard_map functions on local shards (contiguous), forward + gradients."""
  mesh = make_mesh((2, 4), ("ring", "ulysses"))
  axes = ("ring", "ulysses")
  spec = P(None, axes)
  local = functools.partial(fn, axis_name=axes, return_lse=True, is_causal=True)
  mapped = jax.shard_map(lambda q, k, v, s: local(q, k, v, segment_ids=s), mesh=mesh,
                         in_specs=(spec,) * 4, out_specs=(spec, P(None, axes, None)))
  check(lambda q, k, v, seg, _: mapped(q, k, v, seg), seed=21, is_causal=True,
        what=fn.__name__)


def test_plan_follows_value_head_dim():
  """plan(): FLOPs, bytes moved and memory follow V's head size (K and V as two buffers):
  with Dv = D the figures are those without it; with Dv < D every strategy moves and holds
  less, the ring's K/V bytes in the ratio (D + Dv) / 2D."""
  kw = dict(batch=1, seq_len=131072, heads=16, kv_heads=16, head_dim=192, sequence=8,
            device="TPU v5p", is_causal=True)
  base = ring_jax.plan(**kw)
  same = ring_jax.plan(**kw, value_head_dim=192)
  mla = ring_jax.plan(**kw, value_head_dim=128)
  for e in base.estimates:
    assert same.estimate(e.name) == e
    m = mla.estimate(e.name)
    assert m.flops < e.flops and m.bytes_moved < e.bytes_moved, e.name
    assert m.memory_bytes < e.memory_bytes, e.name
  ring, ring_mla = base.estimate("ring"), mla.estimate("ring")
  np.testing.assert_allclose(ring_mla.bytes_moved / ring.bytes_moved, (192 + 128) / 384)
  np.testing.assert_allclose(ring_mla.flops / ring.flops, (192 + 128) / 384)
  assert "dv=128" in mla.setting and "dv=" not in base.setting


def test_auto_plans_with_value_head_dim():
  """"auto" with Dv runs plan(value_head_dim=Dv)'s pick, equal to that strategy's result."""
  mesh = make_mesh((8,), ("sequence",))
  q, k, v, seg, _, _ = inputs(5)
  chosen = ring_jax.plan(batch=B, seq_len=L, heads=N, kv_heads=K, head_dim=H,
                         value_head_dim=HV, dtype=q.dtype, is_causal=True, layout="zigzag",
                         sequence=8, device=jax.devices()[0].device_kind,
                         strategies=("ring", "all_gather", "ulysses")).strategy
  run = lambda strategy: jax.jit(functools.partial(  # noqa: E731
      ring_jax.attention_sharded, mesh=mesh, strategy=strategy, is_causal=True,
      layout="zigzag", segment_ids=seg))(q, k, v)
  np.testing.assert_array_equal(np.asarray(run("auto")), np.asarray(run(chosen)))


def test_splash_takes_value_head_dim():
  """Splash's kernels take V's own head size (Pallas interpret mode here): all_gather over 2
  devices, one splash call over the whole K/V, causal with a soft-cap, fwd + grads vs the
  float64 oracle. Tokamax's refuses it naming the xla kernel (tests/ring_jax/test_hop.py)."""
  mesh = make_mesh((2,), ("sequence",))
  rng = np.random.default_rng(0)
  length, hv = 256, 8
  normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)  # noqa: E731
  q, k, v = normal(1, length, 2, 16), normal(1, length, 1, 16), normal(1, length, 1, hv)
  do = rng.normal(size=(1, length, 2, hv))
  vis = oracle.visibility(np.arange(length), np.arange(length), True)
  want = oracle.attention(q, k, v, vis, 16 ** -0.5, do, soft_cap=5.0)

  def loss(q, k, v):
    out = ring_jax.attention_sharded(q, k, v, mesh=mesh, strategy="all_gather",
                                     hop_kernel="splash", is_causal=True, logits_soft_cap=5.0,
                                     block_q=128, block_kv=128)
    return jnp.sum(out * do), out

  (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
  assert_close(out, want["out"], what="splash Dv out")
  for name, g in zip(("dq", "dk", "dv"), grads):
    assert_close(g, want[name], rtol=1e-4, atol=1e-4, what=f"splash Dv {name}")


def test_value_shape_must_match_key_but_head_size():
  q, k, v, *_ = inputs(0)
  with pytest.raises(ValueError, match="they may differ in the head size only"):
    ring_jax.attention_sharded(q, k, v[:, :, :1], mesh=make_mesh((8,), ("sequence",)),
                               strategy="all_gather")


@pytest.mark.parametrize("with_new,with_sinks", [(False, False), (True, True)])
def test_decode_cache_attention_with_value_head_dim(with_new, with_sinks):
  """ring_jax.decode.cache_attention over a cache split over 4 devices (K ``[.., H]`` and V
  ``[.., HV]`` as two arrays), the queries' own K/V merged in, sinks once: equal to dense
  attention over the same keys in float64."""
  mesh = make_mesh((4,), ("sequence",))
  rng = np.random.default_rng(3)
  s, t = 32, 2
  normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)  # noqa: E731
  q, k_cache, v_cache = normal(B, t, N, H), normal(B, s, K, H), normal(B, s, K, HV)
  k_new, v_new = normal(B, t, K, H), normal(B, t, K, HV)
  kv_pos = jnp.tile(jnp.arange(s, dtype=jnp.int32), (B, 1))
  kv_seg = jnp.ones((B, s), jnp.int32).at[1, 20:].set(0)  # row 1: a shorter cache
  q_pos = jnp.tile(jnp.arange(s, s + t, dtype=jnp.int32), (B, 1))
  q_seg = jnp.ones((B, t), jnp.int32)
  sinks = jnp.asarray(SINKS) if with_sinks else None

  def local(q, kc, vc, kp, ks, qp, qs, kn, vn):
    return decode.cache_attention(q, kc, vc, qp, qs, kp, ks, axis_name="sequence",
                                  new_kv=(kn, vn) if with_new else None, sinks=sinks)

  cache, rep = P(None, "sequence"), P()
  out = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(rep, cache, cache, cache, cache,
                                                          rep, rep, rep, rep),
                              out_specs=rep))(q, k_cache, v_cache, kv_pos, kv_seg, q_pos,
                                              q_seg, k_new, v_new)
  assert out.shape == (B, t, N, HV)
  # Dense: the cache's visible keys, then the queries' own (causal among themselves).
  keys = jnp.concatenate([k_cache, k_new], 1) if with_new else k_cache
  values = jnp.concatenate([v_cache, v_new], 1) if with_new else v_cache
  pos = jnp.concatenate([kv_pos, q_pos], 1) if with_new else kv_pos
  seg = jnp.concatenate([kv_seg, q_seg], 1) if with_new else kv_seg
  vis = (np.asarray(seg)[:, None, :] != 0) & (
      np.asarray(pos)[:, None, :] <= np.asarray(q_pos)[:, :, None])
  want = oracle.attention(q, keys, values, vis, H ** -0.5, np.zeros((B, t, N, HV)),
                          sinks=None if sinks is None else SINKS)["out"]
  assert_close(out, want, what="decode Dv")
