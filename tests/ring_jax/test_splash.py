"""The hop on JAX's splash attention (ring_jax/kernels/splash.py), beyond the conformance
suite (tests/ring_jax/test_hop.py runs it against the float64 oracle, one hop and rings of 2 and 4,
in interpret mode): the mask translation, padding ids, non-finite inputs, the refusals,
and lowering for a TPU target on this CPU machine."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax.sharding import PartitionSpec as P

import ring_jax
from ring_jax import hop
from ring_jax.hop import HopGrads, HopMasks, HopResiduals, HopSpec, lse_for_backward, zero_grads
from ring_jax.kernels import splash
from ring_jax.kernels.xla import XlaHopKernel

KERNEL = splash.SplashHopKernel(interpret=True)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "striped"])
@pytest.mark.parametrize("is_causal,window", [(True, None), (True, (150, 0)),
                                              (False, (40, 300)), (False, None)])
def test_key_ranges_are_each_querys_visible_keys(layout, is_causal, window):
  """Per query, [start, end) holds exactly the keys the causal mask and window let it see
  (and per key, hop.query_ranges exactly the queries that see it), for every hop of a ring
  of 4 (positions from the layout itself)."""
  for qd in range(4):
    for kd in range(4):
      q_pos = np.asarray(ring_jax.local_positions(layout, 4, 256, qd))
      kv_pos = np.asarray(ring_jax.local_positions(layout, 4, 256, kd))
      d = q_pos[:, None] - kv_pos[None, :]
      vis = np.ones(d.shape, bool)
      if is_causal:
        vis &= d >= 0
      if window is not None:
        vis &= (d <= window[0]) & (d >= -window[1])
      start, end = jax.device_get(hop.key_ranges(jnp.asarray(q_pos), jnp.asarray(kv_pos),
                                                    is_causal, window))
      idx = np.arange(len(kv_pos))[None, :]
      np.testing.assert_array_equal((idx >= start[:, None]) & (idx < end[:, None]), vis)
      q_start, q_end = jax.device_get(hop.query_ranges(jnp.asarray(q_pos), jnp.asarray(kv_pos),
                                                        is_causal, window))
      q_idx = np.arange(len(q_pos))[:, None]  # per key, the queries that see it
      np.testing.assert_array_equal((q_idx >= q_start[None]) & (q_idx < q_end[None]), vis)
      if window is not None:  # the packed code decodes to the same range
        code = (start.astype(np.int64) << 16) | end
        np.testing.assert_array_equal(
            np.asarray(splash._keys_within(jnp.asarray(code, jnp.int32)[:, None],
                                           jnp.asarray(idx))), vis)


@pytest.mark.parametrize("seed", range(4))
def test_flagged_in_ranges_is_any_flag_in_each_range(seed):
  """hop.flagged_in_ranges against a dense any(): random flags [B, X, K, H], random ranges
  (empty, whole, at either end), per batch row; and ranges open at one side (None)."""
  rng = np.random.default_rng(seed)
  b, nx, ny = 2, 37, 29
  flags = rng.random((b, nx, 3, 4)) < 0.05
  start = rng.integers(0, nx + 1, ny)
  end = np.minimum(nx, start + rng.integers(0, nx + 1, ny))
  end[:3], start[3], end[3] = start[:3], 0, nx  # empty ranges and the whole axis

  def want(start, end):
    inside = (np.arange(nx)[None] >= start[:, None]) & (np.arange(nx)[None] < end[:, None])
    return np.einsum("yx,bxkh->bykh", inside.astype(int), flags.astype(int)) > 0

  i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
  got = hop.flagged_in_ranges(jnp.asarray(flags), i32(start), i32(end))
  np.testing.assert_array_equal(np.asarray(got), want(start, end))
  assert want(start, end).any() and not want(start, end).all()
  # Ranges open at one side (None): [0, end) and [start, X), empty ones included.
  got = hop.flagged_in_ranges(jnp.asarray(flags), None, i32(end))
  np.testing.assert_array_equal(np.asarray(got), want(np.zeros_like(end), end))
  got = hop.flagged_in_ranges(jnp.asarray(flags), i32(start), None)
  np.testing.assert_array_equal(np.asarray(got), want(start, np.full_like(start, nx)))


@pytest.mark.parametrize("low", [0, -7, np.iinfo(np.int32).min, np.iinfo(np.int32).min + 1])
def test_segment_ids_padding_sees_nothing_and_equality_is_kept(low):
  """Splash compares ids for equality only: documents keep their pairs, query padding and
  key padding (id 0) match nothing, even with ids at int32's minimum."""
  rng = np.random.default_rng(abs(int(low)) % 97)
  ids = np.array([low, 3, -2, 0, 5], np.int64)
  qs = rng.choice(ids, size=(2, 64)).astype(np.int32)
  ks = rng.choice(ids, size=(2, 48)).astype(np.int32)
  cq, ck = jax.device_get(splash.splash_segment_ids(jnp.asarray(qs), jnp.asarray(ks)))
  want = (qs[:, :, None] == ks[:, None, :]) & (qs[:, :, None] != 0)
  np.testing.assert_array_equal(cq[:, :, None] == ck[:, None, :], want)


def _hop(nan_at=None, segments=False, value=np.nan, tensor="v"):
  """A causal zigzag hop (q shard 2, kv shard 1 of a ring of 4) with GQA; ``tensor`` (q, k
  or v) gets ``value`` at ``nan_at`` (its index: (batch, position, head[, group], dim))."""
  rng = np.random.default_rng(0)
  b, t, kh, g, h = 2, 256, 2, 2, 32
  q = rng.standard_normal((b, t, kh, g, h)).astype(np.float32)
  k, v = (rng.standard_normal((b, t, kh, h)).astype(np.float32) for _ in range(2))
  if nan_at is not None:
    {"q": q, "k": k, "v": v}[tensor][nan_at] = value
  spec = HopSpec(scale=h ** -0.5, is_causal=True, window=None, block_q=128, block_kv=128)
  q_pos = ring_jax.local_positions("zigzag", 4, t, 2)
  kv_pos = ring_jax.local_positions("zigzag", 4, t, 1)
  seg = None
  if segments:
    seg = jnp.asarray(np.repeat(np.arange(1, 5), t // 4)[None].repeat(b, 0), jnp.int32)
  masks = HopMasks.build(spec, jnp.asarray(q_pos, jnp.int32), jnp.asarray(kv_pos, jnp.int32),
                         seg, seg)
  return q, k, v, masks, spec


def _same_non_finite(got, want, what=""):
  """Same NaN and same +-inf entries; the rest equal to float32 rounding."""
  got, want = np.asarray(got), np.asarray(want)
  np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=f"{what}: NaN")
  np.testing.assert_array_equal(np.isinf(got) * np.sign(np.nan_to_num(got)),
                                np.isinf(want) * np.sign(np.nan_to_num(want)),
                                err_msg=f"{what}: inf")
  fin = np.isfinite(want)
  np.testing.assert_allclose(got[fin], want[fin], rtol=1e-5, atol=1e-5, err_msg=what)


@pytest.mark.parametrize("segments", [True, False])
def test_non_finite_v_reaches_exactly_the_rows_that_see_it(segments):
  """A NaN in V at a key that only some queries of its block pair see: splash's matmuls
  would spread it (0 * NaN) to the rest; outputs and gradients equal the XLA kernel's, NaN
  exactly where it is (backward: given finite residuals, as a hop after another kernel's
  output may get them), with segment ids (the branch to the XLA kernel) and without them
  (V's finite part read, NaN put back where a visible pair reads it)."""
  # Key 100 (document 2 of 4, position 228) is seen by queries 64..127 alone; the other
  # queries of its block pair (documents 1, 2) see other keys of that pair.
  q, k, v, masks, spec = _hop(nan_at=(1, 100, 0, 5), segments=segments)
  got = jax.jit(KERNEL.forward, static_argnums=4)(q, k, v, masks, spec)
  want = jax.jit(XlaHopKernel().forward, static_argnums=4)(q, k, v, masks, spec)
  nan_rows = np.isnan(np.asarray(want[0])).any(axis=(2, 3, 4))
  seen_by = np.arange(64, 128) if segments else np.arange(256)  # causal: every query
  assert (np.nonzero(nan_rows[1])[0] == seen_by).all() and not nan_rows[0].any()
  for g, w in zip(got, want):
    _same_non_finite(g, w)
  out, lse = want
  res = HopResiduals(jnp.nan_to_num(out), lse_for_backward(lse), jnp.asarray(q), None)
  bwd = lambda kern: jax.jit(kern.backward, static_argnums=4)(  # noqa: E731
      q, k, v, masks, spec, res, zero_grads(q, k, v))
  for g, w in zip(bwd(KERNEL), bwd(XlaHopKernel())):
    assert np.isfinite(np.asarray(w)).all()
    _same_non_finite(g, w)


# (tensor, index, value): V's entries reach single columns; K's and Q's whole rows through
# the scores (an infinite K entry: +inf scores make NaN rows, -inf ones drop the key).
NON_FINITE = {
    "nan value": ("v", (1, 100, 0, 5), np.nan),
    "-inf value": ("v", (0, 20, 1, 3), -np.inf),
    "nan key": ("k", (1, 100, 0, 5), np.nan),
    "inf key": ("k", (0, 20, 1, 3), np.inf),
    "nan query": ("q", (1, 70, 0, 1, 5), np.nan),
}


@pytest.mark.parametrize("case,segments", [(c, False) for c in NON_FINITE] +
                         [("nan value", True), ("inf key", True)])
def test_non_finite_inputs_match_the_xla_kernel(case, segments):
  """With a NaN/inf in q, k or v, splash's forward, and its backward given that forward's
  own out/lse (as the ring passes them), equal the XLA kernel's, NaN and inf exactly where
  the XLA kernel has them: handled around splash without segment ids, by the branch to the
  XLA kernel with them."""
  tensor, at, value = NON_FINITE[case]
  q, k, v, masks, spec = _hop(nan_at=at, segments=segments, value=value, tensor=tensor)
  want = jax.jit(XlaHopKernel().forward, static_argnums=4)(q, k, v, masks, spec)
  got = jax.jit(KERNEL.forward, static_argnums=4)(q, k, v, masks, spec)
  assert not np.isfinite(np.asarray(want[0])).all()
  for name, g, w in zip(("out", "lse"), got, want):
    _same_non_finite(g, w, name)
  out, lse = want
  do = np.random.default_rng(1).standard_normal(q.shape).astype(np.float32)
  res = HopResiduals(out, lse_for_backward(lse), jnp.asarray(do), None)
  bwd = lambda kern: jax.jit(kern.backward, static_argnums=4)(  # noqa: E731
      q, k, v, masks, spec, res, zero_grads(q, k, v))
  got, want = bwd(KERNEL), bwd(XlaHopKernel())
  assert not all(np.isfinite(np.asarray(w)).all() for w in want)
  for name, g, w in zip(("dq", "dk", "dv"), got, want):
    _same_non_finite(g, w, name)


@pytest.mark.parametrize("bad_in,unroll", [("k", 0), ("k", 4), ("v", 4)])
def test_ring_with_a_nan_key_or_value_matches_the_xla_ring(monkeypatch, bad_in, unroll):
  """A ring of 2 (causal zigzag, GQA 4:2, blocks of 128) with one NaN in K or V: splash at
  every hop gives the XLA ring's outputs and gradients, NaN exactly where it has them (the
  rows that see the NaN, not the other rows nor the other batch element). ``unroll=4``: the
  hops unrolled (the TPU's structure for rings up to 4, set here for the CPU), where the
  backward reads K/V cleaned once per pass (``SplashHopKernel.prepare_backward``), not at
  every hop."""
  from ring_jax import testing  # noqa: PLC0415
  monkeypatch.setitem(ring_jax.ring.PLATFORM_DEFAULTS, "cpu", {"unroll_hops": unroll})
  seen = []

  @dataclasses.dataclass(frozen=True)
  class Recording(splash.SplashHopKernel):
    def backward(self, q, k, v, masks, spec, res, acc):
      seen.append(self.kv_prepared)
      return super().backward(q, k, v, masks, spec, res, acc)

  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("sequence",))
  rng = np.random.default_rng(3)
  q = rng.standard_normal((2, 512, 4, 32)).astype(np.float32)
  k, v = (rng.standard_normal((2, 512, 2, 32)).astype(np.float32) for _ in range(2))
  at = (0, 300, 1, 2)
  {"k": k, "v": v}[bad_in][at] = np.nan
  cot = rng.standard_normal(q.shape).astype(np.float32)

  def run(kernel):
    ring = testing.hop_kernel_attention(kernel, block=128, check_vma=False)
    fn = lambda q, k, v: ring(q, k, v, is_causal=True, layout="zigzag", mesh=mesh)  # noqa: E731
    out, vjp = jax.vjp(fn, q, k, v)
    return (out, *vjp(jnp.asarray(cot)))

  got = jax.jit(lambda: run(Recording(interpret=True)))()
  want = jax.jit(lambda: run(XlaHopKernel()))()
  assert seen and set(seen) == {unroll > 0}
  bad = np.isnan(np.asarray(want[0]))
  assert bad.any() and not bad[1 - at[0]].any() and not bad[at[0], :at[1]].any()
  for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
    _same_non_finite(g, w, name)


@pytest.mark.parametrize("is_causal", [True, False])
def test_one_loop_ring_matches_the_xla_ring(monkeypatch, is_causal):
  """Splash's structure on TPU (every hop of the full rotation in one loop per pass,
  ``PLATFORM_DEFAULTS["tpu"]["one_loop"]``), here set for the CPU: a ring of 4 (zigzag, GQA
  4:2, segment ids) gives the peeled XLA ring's outputs and gradients, and the compiled
  program names no peeled hop."""
  import re  # noqa: PLC0415
  from ring_jax import testing  # noqa: PLC0415
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("sequence",))
  rng = np.random.default_rng(5)
  q = rng.standard_normal((1, 512, 4, 32)).astype(np.float32)
  k, v = (rng.standard_normal((1, 512, 2, 32)).astype(np.float32) for _ in range(2))
  seg = np.repeat(np.array([[1, 2, 3]], np.int32), [200, 200, 112], axis=1)
  cot = rng.standard_normal(q.shape).astype(np.float32)

  def run(kernel):
    ring = testing.hop_kernel_attention(kernel, block=128, check_vma=False)
    fn = lambda q, k, v: ring(q, k, v, is_causal=is_causal, layout="zigzag",  # noqa: E731
                              segment_ids=seg, mesh=mesh)
    out, vjp = jax.vjp(fn, q, k, v)
    return (out, *vjp(jnp.asarray(cot)))

  want = jax.jit(lambda: run(XlaHopKernel()))()
  monkeypatch.setitem(ring_jax.ring.PLATFORM_DEFAULTS, "cpu", {"one_loop": ("splash",)})
  lowered = jax.jit(lambda: run(KERNEL)).lower()
  scopes = {part for loc in re.findall(r'loc\("([^"]*)"', lowered.as_text(debug_info=True))
            for part in loc.split("/")}
  assert "hop" in scopes and not {"hop_0", "last_hop"} & scopes
  got = lowered.compile()()
  for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-5,
                               err_msg=name)


def test_no_branch_in_the_hop():
  """Without segment ids the non-finite handling is arithmetic around splash, not a
  ``cond`` to another kernel: neither pass holds a ``cond``."""
  q, k, v, masks, spec = _hop(segments=False)
  lse = jnp.zeros(q.shape[:4])
  for fn, args in ((lambda q, k, v: KERNEL.forward(q, k, v, masks, spec), (q, k, v)),
                   (lambda q, k, v, o, l, do: KERNEL.backward(
                       q, k, v, masks, spec, HopResiduals(o, l, do), zero_grads(q, k, v)),
                    (q, k, v, q, lse, q))):
    found = list(_primitives(jax.make_jaxpr(fn)(*args).jaxpr))
    assert "pallas_call" in found and "cond" not in found


def _primitives(jaxpr):
  """Primitive names of ``jaxpr`` and its sub-jaxprs, not looking inside Pallas kernels."""
  for eqn in jaxpr.eqns:
    yield eqn.primitive.name
    if eqn.primitive.name != "pallas_call":
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        yield from _primitives(sub)


@pytest.mark.parametrize("segments", [False, True])
def test_blocks_above_the_largest_tile_run_at_splash_tiles(monkeypatch, segments):
  """A ring block above :data:`splash.MAX_TILE` (2048 overflows v5p's VMEM) runs splash at
  the largest tile that divides it (here MAX_TILE 128 under 256-token blocks), its block
  mask rebuilt at those tiles: outputs and gradients equal the XLA kernel's at the ring's
  blocks."""
  monkeypatch.setattr(splash, "MAX_TILE", 128)
  q, k, v, _, spec = _hop(segments=segments)
  spec = dataclasses.replace(spec, block_q=256, block_kv=256)
  seg = None
  if segments:
    seg = jnp.asarray(np.repeat(np.arange(1, 5), q.shape[1] // 4)[None].repeat(q.shape[0], 0),
                      jnp.int32)
  masks = HopMasks.build(spec, jnp.asarray(ring_jax.local_positions("zigzag", 4, 256, 2)),
                         jnp.asarray(ring_jax.local_positions("zigzag", 4, 256, 1)), seg, seg)
  tiled_masks, tiled = KERNEL._tiled(masks, spec)
  assert (tiled.block_q, tiled.block_kv) == (128, 128)
  assert tiled_masks.table().q_ranges.shape[-2] == 2  # two 128-query tiles, one table row each
  got = jax.jit(KERNEL.forward, static_argnums=4)(q, k, v, masks, spec)
  want = jax.jit(XlaHopKernel().forward, static_argnums=4)(q, k, v, masks, spec)
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)
  out, lse = want
  res = HopResiduals(out, lse_for_backward(lse), jnp.asarray(q), None)
  bwd = lambda kern: jax.jit(kern.backward, static_argnums=4)(  # noqa: E731
      q, k, v, masks, spec, res, zero_grads(q, k, v))
  for g, w in zip(bwd(KERNEL), bwd(XlaHopKernel())):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)


def test_no_t_by_s_arrays():
  """The mask stays block-sparse: no intermediate of the forward or backward has both a
  T-sized and an S-sized axis (T != S here, so the check can tell them apart)."""
  b, t, s, kh, g, h = 1, 384, 256, 2, 2, 32
  spec = HopSpec(scale=0.2, is_causal=True, window=(100, 0), block_q=128, block_kv=128)
  seg_q, seg_kv = jnp.ones((b, t), jnp.int32), jnp.ones((b, s), jnp.int32)
  masks = HopMasks.build(spec, jnp.arange(t) + 200, jnp.arange(s), seg_q, seg_kv)
  q = jnp.zeros((b, t, kh, g, h))
  kv = jnp.zeros((b, s, kh, h))
  lse = jnp.zeros((b, t, kh, g))

  def shapes(jaxpr):
    for eqn in jaxpr.eqns:
      for var in eqn.outvars:
        yield tuple(getattr(var.aval, "shape", ()))
      for param in eqn.params.values():
        for sub in (param if isinstance(param, (tuple, list)) else (param,)):
          sub = getattr(sub, "jaxpr", sub)
          if hasattr(sub, "eqns"):
            yield from shapes(sub)

  for fn, args in ((lambda q, k, v: KERNEL.forward(q, k, v, masks, spec), (q, kv, kv)),
                   (lambda q, k, v, o, l, do: KERNEL.backward(
                       q, k, v, masks, spec, HopResiduals(o, l, do), zero_grads(q, k, v)),
                    (q, kv, kv, q, lse, q))):
    for shape in shapes(jax.make_jaxpr(fn)(*args).jaxpr):
      assert not (t in shape and s in shape), shape


@pytest.mark.parametrize("shape_q, shape_kv, spec, dtype, match", [
    ((1, 256, 2, 2, 64), (1, 256, 2, 64), dict(block_q=64), jnp.float32,
     r"block_q=64: splash needs multiples of 128; pass block_q=128"),
    ((1, 256, 2, 2, 64), (1, 256, 2, 64), dict(block_kv=512), jnp.float32,
     r"block_kv=512 does not divide S"),
    ((1, 256, 2, 2, 64), (1, 256, 2, 64), dict(), jnp.float16, r"dtype float16"),
    ((1, 256, 2, 2, 64), (1, 32768, 2, 64), dict(window=(100, 0)), jnp.bfloat16,
     r"S=32768 > 32767"),
    ((1, 256, 2, 2, 64), (1, 256, 1, 64), dict(), jnp.float32, r"do not match q"),
])
def test_check_names_the_fix(shape_q, shape_kv, spec, dtype, match):
  spec = HopSpec(**{**dict(scale=1.0, is_causal=True, window=None, block_q=128,
                           block_kv=128), **spec})
  with pytest.raises(ValueError, match=match):
    KERNEL.check(shape_q, shape_kv, dtype, spec)


@pytest.mark.parametrize("window", [None, (300, 0)])
def test_ring_lowers_for_tpu_under_shard_map(window):
  """A ring of 2 (zigzag, causal, segment ids, GQA, bf16) on the real (non-interpret)
  splash kernels, forward and gradients, inside shard_map(check_vma=True), lowers for a
  TPU target on this CPU machine (jax.export): splash's Pallas -> Mosaic lowering errors
  would show here. Mosaic's own compile runs only on a TPU (not checked)."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("sequence",))
  attend = functools.partial(ring_jax.ring_attention, axis_name="sequence", is_causal=True,
                             layout="zigzag", block_q=128, block_kv=128,
                             local_window_size=window,
                             hop_kernel=splash.SplashHopKernel(interpret=False))
  row = P(None, "sequence")
  fn = jax.shard_map(lambda q, k, v, s: attend(q, k, v, segment_ids=s), mesh=mesh,
                     in_specs=(row,) * 4, out_specs=row)
  q = jax.ShapeDtypeStruct((1, 512, 4, 64), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((1, 512, 2, 64), jnp.bfloat16)
  seg = jax.ShapeDtypeStruct((1, 512), jnp.int32)
  loss = lambda q, k, v, s: fn(q, k, v, s).astype(jnp.float32).sum()  # noqa: E731
  exported = export.export(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), platforms=["tpu"])(
      q, kv, kv, seg)
  text = exported.mlir_module()
  # Forward and backward per hop position: splash's forward, dQ and dK/dV kernels.
  for kernel in ("splash_mha_fwd", "splash_mha_dq", "splash_mha_dkv"):
    assert kernel in text, kernel


def test_registry_builds_splash():
  assert "splash" in ring_jax.kernels.kernel_names()
  on_cpu, on_tpu = (ring_jax.get_hop_kernel("splash", p) for p in ("cpu", "tpu"))
  assert isinstance(on_cpu, splash.SplashHopKernel) and on_cpu.name == "splash"
  assert on_cpu.interpret is True and on_tpu.interpret is False
  hash(on_cpu)  # static configuration of the ring's custom_vjp
