"""The Pallas GPU hop kernel (Triton lowering) against a float64 numpy oracle.

Runs in Pallas interpret mode on CPU (the kernel picks it on a CPU backend).
One hop is checked on its own: forward ``(out_h, lse_h)`` and, given the FINAL
``(out, lse)`` of an attention over this hop's keys plus another hop's keys,
the backward ``(dq, dk, dv)``. Positions follow the ring layouts (contiguous,
zigzag, striped: increasing within a shard, not contiguous), with causal and
window masks, packed segment ids with padding, GQA and MQA, T != S, and rows
that see no key in this hop. ``test_lowers_to_triton`` lowers the kernels for
the ``cuda`` platform (Pallas -> Triton IR on CPU); running them on a GPU is
not checked here.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from ring_jax import hop, scheduling
from ring_jax.kernels.pallas_gpu import PallasGpuHopKernel

RTOL = 1e-5


def _visible(qp, kp, qs, ks, causal, window):
  """bool ``[B or 1, T, S]`` in numpy, from the library's one definition of the masks."""
  vis = scheduling.position_mask(np.asarray(qp), np.asarray(kp), causal, window)[None]
  if qs is not None:
    vis = vis & scheduling.segment_mask(np.asarray(qs), np.asarray(ks))
  return vis


def _attend(q, k, v, vis, scale):
  """float64 softmax attention: ``(out [B,T,K,G,H], lse [B,T,K,G], p, s)``.

  Rows with no visible key: out 0, lse -inf.
  """
  s = np.einsum("btkgh,bskh->bkgts", q, k) * scale
  vis = np.broadcast_to(vis[:, None, None], s.shape)
  s = np.where(vis, s, -np.inf)
  m = s.max(-1, keepdims=True)
  m = np.where(np.isfinite(m), m, 0.0)
  p = np.exp(s - m)
  l = p.sum(-1)
  l_safe = np.where(l > 0, l, 1.0)
  lse = np.where(l > 0, np.log(l_safe) + m[..., 0], -np.inf)
  out = np.einsum("bkgts,bskh->btkgh", p / l_safe[..., None], v)
  return out, np.einsum("bkgt->btkg", lse)


def _oracle_bwd(q, k, v, out, lse, do, dlse, vis, scale):
  """float64 gradient of the hop's keys given the FINAL out/lse and the cotangents of both
  (FlashAttention-2 formulas; ``d lse / d s = p``)."""
  s = np.einsum("btkgh,bskh->bkgts", q, k) * scale
  vis = np.broadcast_to(vis[:, None, None], s.shape)
  lse_t = np.einsum("btkg->bkgt", lse)[..., None]
  with np.errstate(invalid="ignore"):
    p = np.where(vis, np.exp(s - lse_t), 0.0)  # lse = +inf (padding): p = 0
  delta = np.einsum("btkgh,btkgh->bkgt", do, out)[..., None]
  delta = delta - np.einsum("btkg->bkgt", dlse)[..., None]
  dp = np.einsum("btkgh,bskh->bkgts", do, v)
  ds = p * (dp - delta) * scale
  dq = np.einsum("bkgts,bskh->btkgh", ds, k)
  dk = np.einsum("bkgts,btkgh->bskh", ds, q)
  dv = np.einsum("bkgts,btkgh->bskh", p, do)
  return dq, dk, dv


def _rel_err(actual, expected):
  actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
  return np.abs(actual - expected).max() / max(np.abs(expected).max(), 1e-30)


# Each case: one hop (q positions `qp`, this hop's kv positions `kp`) plus another hop's keys
# (`kp_other`) that make the final out/lse differ from the hop's own.
_CASES = {
    # contiguous ring of 2, device 1 at hop 1 (keys of device 0), non-causal, GQA 2x2
    "contiguous_noncausal_gqa": dict(
        t=128, s=128, k=2, g=2, h=32, bq=32, bk=64, causal=False, window=None, seg=False,
        qp=np.arange(128, 256), kp=np.arange(0, 128), kp_other=np.arange(128, 256)),
    # contiguous ring of 2, device 0 at hop 0 (the causal diagonal: blocks below it are fully
    # visible and run without the element mask), MQA; the other hop's keys are all in the future
    "contiguous_causal_diagonal_mqa": dict(
        t=128, s=128, k=1, g=2, h=32, bq=32, bk=32, causal=True, window=None, seg=False,
        qp=np.arange(0, 128), kp=np.arange(0, 128), kp_other=np.arange(128, 256)),
    # zigzag ring of 2 (chunks of 64), device 1 at hop 0 (its own keys, positions 64..191;
    # the other hop brings 0..63 and 192..255); causal, packed segments with padding
    # (query and key pads), GQA 2x2
    "zigzag_causal_segments_gqa": dict(
        t=128, s=128, k=2, g=2, h=32, bq=32, bk=32, causal=True, window=None, seg=True,
        qp=np.r_[64:192], kp=np.r_[64:192], kp_other=np.r_[0:64, 192:256]),
    # striped ring of 2, window (30, 6) both sides, MQA (1 kv head, 4 query heads)
    "striped_window_mqa": dict(
        t=128, s=128, k=1, g=4, h=64, bq=64, bk=32, causal=False, window=(30, 6), seg=True,
        qp=np.arange(128) * 2, kp=np.arange(128) * 2 + 1, kp_other=np.arange(128) * 2),
    # T != S, causal + window (40, 0), MHA; queries 64..99 see no key of this hop (they see
    # the other hop's), so out_h = 0, lse_h = -inf there
    "t_ne_s_causal_window_empty_rows": dict(
        t=128, s=256, k=2, g=1, h=64, bq=32, bk=64, causal=True, window=(40, 0), seg=False,
        qp=np.arange(64, 192), kp=np.arange(100, 356), kp_other=np.arange(0, 100)),
}


def _segments(b, positions):
  """Packed documents of 48 positions (query and key shards agree through the positions),
  a run of padding inside row 0 and a padding tail in row 1."""
  pos = np.asarray(positions)
  seg = (pos // 48 + 1).astype(np.int32)[None].repeat(b, 0)
  seg[0, (pos >= 100) & (pos < 104)] = 0
  seg[1, pos >= 170] = 0
  return seg


def _problem(name, dtype=np.float32, seed=0):
  c = _CASES[name]
  rng = np.random.default_rng(seed)
  b = 2
  def rnd(*shape):
    x = jnp.asarray(rng.standard_normal(shape).astype(np.float32)).astype(dtype)
    return np.asarray(x.astype(jnp.float32), np.float64), x
  q64, q = rnd(b, c["t"], c["k"], c["g"], c["h"])
  k64, k = rnd(b, c["s"], c["k"], c["h"])
  v64, v = rnd(b, c["s"], c["k"], c["h"])
  ko64, _ = rnd(b, len(c["kp_other"]), c["k"], c["h"])
  vo64, _ = rnd(b, len(c["kp_other"]), c["k"], c["h"])
  do64, do = rnd(b, c["t"], c["k"], c["g"], c["h"])
  dlse = rng.standard_normal((b, c["t"], c["k"], c["g"])).astype(np.float32)
  qp, kp, kpo = (np.asarray(x, np.int32) for x in (c["qp"], c["kp"], c["kp_other"]))
  if c["seg"]:
    qs, ks, kso = (_segments(b, p) for p in (qp, kp, kpo))
  else:
    qs = ks = kso = None
  scale = c["h"] ** -0.5
  vis = _visible(qp, kp, qs, ks, c["causal"], c["window"])
  vis_other = _visible(qp, kpo, qs, kso, c["causal"], c["window"])
  out_h, lse_h = _attend(q64, k64, v64, vis, scale)
  # The final attention of the ring: this hop's keys and the other hop's together.
  out, lse = _attend(q64, np.concatenate([ko64, k64], 1), np.concatenate([vo64, v64], 1),
                     np.concatenate([np.broadcast_to(vis_other, (b,) + vis_other.shape[1:]),
                                     np.broadcast_to(vis, (b,) + vis.shape[1:])], -1), scale)
  lse = np.where(np.isneginf(lse), np.inf, lse)  # the ring's convention for rows that saw nothing
  spec = hop.HopSpec(scale=scale, is_causal=c["causal"], window=c["window"], block_q=c["bq"],
                     block_kv=c["bk"])
  masks = hop.HopMasks.build(spec, jnp.asarray(qp), jnp.asarray(kp),
                             None if qs is None else jnp.asarray(qs),
                             None if ks is None else jnp.asarray(ks))
  return dict(q=q, k=k, v=v, do=do, dlse=dlse, q64=q64, k64=k64, v64=v64, do64=do64, vis=vis,
              out_h=out_h, lse_h=lse_h, out=out, lse=lse, spec=spec, masks=masks, scale=scale)


def _run(kernel, pb, fns=None):
  """Kernel forward and backward (the backward given the final out/lse) under jit.

  ``fns``: the jitted ``(fwd, bwd)`` of an earlier call with the same masks and
  spec, to run new values without compiling again.
  """
  masks, spec = pb["masks"], pb["spec"]
  if fns is None:
    fns = (jax.jit(lambda q, k, v: kernel.forward(q, k, v, masks, spec)),
           jax.jit(lambda q, k, v, o, l, do, dlse: kernel.backward(
               q, k, v, masks, spec, hop.HopResiduals(o, l, do, dlse), hop.zero_grads(q, k, v))))
  fwd, bwd = fns
  out_h, lse_h = fwd(pb["q"], pb["k"], pb["v"])
  grads = bwd(pb["q"], pb["k"], pb["v"], jnp.asarray(pb["out"], jnp.float32).astype(pb["q"].dtype),
              jnp.asarray(pb["lse"], jnp.float32), pb["do"], jnp.asarray(pb["dlse"]))
  return (np.asarray(out_h), np.asarray(lse_h)), tuple(np.asarray(g) for g in grads), fns


@pytest.mark.parametrize("name", list(_CASES))
def test_one_hop_matches_float64_oracle(name):
  pb = _problem(name)
  (out_h, lse_h), (dq, dk, dv), _ = _run(PallasGpuHopKernel(), pb)
  assert out_h.dtype == lse_h.dtype == dq.dtype == dk.dtype == dv.dtype == np.float32
  assert out_h.shape == pb["q"].shape and dk.shape == dv.shape == pb["k"].shape
  empty = np.isneginf(pb["lse_h"])
  np.testing.assert_array_equal(np.isneginf(lse_h), empty)  # no visible key: lse_h = -inf
  assert not np.isnan(lse_h).any()
  assert (out_h[empty] == 0).all()
  assert np.abs(lse_h[~empty] - pb["lse_h"][~empty]).max() <= RTOL * np.abs(pb["lse_h"][~empty]).max()
  assert _rel_err(out_h, pb["out_h"]) <= RTOL
  ref = _oracle_bwd(pb["q64"], pb["k64"], pb["v64"], pb["out"], pb["lse"], pb["do64"], pb["dlse"],
                    pb["vis"], pb["scale"])
  for what, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), ref):
    assert np.isfinite(got).all(), what
    assert _rel_err(got, want) <= RTOL, (what, _rel_err(got, want))
  if name == "zigzag_causal_segments_gqa":
    assert empty.any()  # the padding queries of row 1 see nothing
    assert (dq[empty] == 0).all()
  if name == "contiguous_causal_diagonal_mqa":  # the unmasked loop ran, in both directions
    blocks = pb["masks"].blocks
    for ranges in (blocks.q_ranges, blocks.kv_ranges):
      lo, full_lo, full_hi, hi = np.asarray(ranges).reshape(-1, 4).T
      assert (lo <= full_lo).all() and (full_lo <= full_hi).all() and (full_hi <= hi).all()
      assert (full_hi > full_lo).any()


def _xla_reference(pb):
  """Plain dense XLA hop with bf16 matmul inputs and float32 accumulation (the bar to meet)."""
  q, k, v, do = pb["q"], pb["k"], pb["v"], pb["do"]
  scale, vis = pb["scale"], jnp.asarray(pb["vis"])[:, None, None]
  f32 = dict(preferred_element_type=jnp.float32)
  s = jnp.einsum("btkgh,bskh->bkgts", q, k, **f32) * scale
  s = jnp.where(vis, s, -jnp.inf)
  m = s.max(-1, keepdims=True)
  m = jnp.where(m == -jnp.inf, 0.0, m)
  p = jnp.exp(s - m)
  l = p.sum(-1)
  l_safe = jnp.where(l == 0, 1.0, l)
  out_h = jnp.einsum("bkgts,bskh->btkgh", p.astype(v.dtype), v, **f32)
  out_h = out_h / jnp.einsum("bkgt->btkg", l_safe)[..., None]
  lse_h = jnp.einsum("bkgt->btkg", jnp.where(l == 0, -jnp.inf, m[..., 0] + jnp.log(l_safe)))
  out = jnp.asarray(pb["out"], jnp.float32).astype(q.dtype)
  lse = jnp.einsum("btkg->bkgt", jnp.asarray(pb["lse"], jnp.float32))[..., None]
  pg = jnp.where(vis, jnp.exp(s - lse), 0.0)
  delta = jnp.einsum("btkgh,btkgh->bkgt", do.astype(jnp.float32), out.astype(jnp.float32))
  delta = delta - jnp.einsum("btkg->bkgt", jnp.asarray(pb["dlse"]))
  dp = jnp.einsum("btkgh,bskh->bkgts", do, v, **f32)
  ds = (pg * (dp - delta[..., None]) * scale).astype(q.dtype)
  dq = jnp.einsum("bkgts,bskh->btkgh", ds, k, **f32)
  dk = jnp.einsum("bkgts,btkgh->bskh", ds, q, **f32)
  dv = jnp.einsum("bkgts,btkgh->bskh", pg.astype(do.dtype), do, **f32)
  return [np.asarray(x) for x in (out_h, lse_h, dq, dk, dv)]


def test_bfloat16_error_within_xla_reference():
  """bf16 inputs: the kernel's error vs float64 is at most 1.1x a plain f32-accumulating XLA hop's.

  Holds for out_h, dq, dk, dv (errors ~1e-3, from the bf16 casts both make). The
  lse of bf16 inputs is only off by float32 rounding (products of bf16 values are
  exact in float32), ~1e-7 for both, where a ratio measures rounding luck: it is
  held to float32-level accuracy (RTOL / 10) instead.
  """
  pb = _problem("zigzag_causal_segments_gqa", dtype=jnp.bfloat16, seed=1)
  # The final output the backward reads is stored in bf16, as the ring stores it.
  out_bf16 = np.asarray(jnp.asarray(pb["out"], jnp.float32).astype(jnp.bfloat16), np.float64)
  (out_h, lse_h), grads, _ = _run(PallasGpuHopKernel(), pb)
  ref_dq, ref_dk, ref_dv = _oracle_bwd(pb["q64"], pb["k64"], pb["v64"], out_bf16, pb["lse"],
                                       pb["do64"], pb["dlse"], pb["vis"], pb["scale"])
  fin = np.isfinite(pb["lse_h"])
  assert _rel_err(lse_h[fin], pb["lse_h"][fin]) <= RTOL / 10
  xla = _xla_reference(pb)
  for what, got, x, want in zip(("out_h", "dq", "dk", "dv"), (out_h, *grads),
                                (xla[0], *xla[2:]), (pb["out_h"], ref_dq, ref_dk, ref_dv)):
    kernel_err, xla_err = _rel_err(got, want), _rel_err(x, want)
    assert 1e-4 < xla_err < 1e-2, (what, xla_err)  # bf16-level, so the ratio means something
    assert kernel_err <= 1.1 * xla_err, (what, kernel_err, xla_err)


def test_nonfinite_values_at_invisible_keys_stay_out():
  """NaN/inf in K and V at a padding key (visible to no query) reaches no output or gradient."""
  pb = _problem("zigzag_causal_segments_gqa", seed=2)
  pad_key = int(np.nonzero(np.asarray(pb["masks"].kv_segment_ids)[1] == 0)[0][0])
  k = pb["k"].at[1, pad_key].set(jnp.nan)
  v = pb["v"].at[1, pad_key, 0].set(jnp.inf).at[1, pad_key, 1].set(jnp.nan)
  *clean, fns = _run(PallasGpuHopKernel(), pb)
  *dirty, _ = _run(PallasGpuHopKernel(), dict(pb, k=k, v=v), fns)
  for c, d in zip(jax.tree.leaves(clean), jax.tree.leaves(dirty)):
    c, d = np.asarray(c), np.asarray(d)
    assert not np.isnan(d).any()
    np.testing.assert_allclose(d, c, rtol=1e-6, atol=1e-6)


def test_check_names_the_fix():
  kernel = PallasGpuHopKernel()
  spec = hop.HopSpec(scale=0.1, is_causal=True, window=None, block_q=64, block_kv=64)
  kernel.check((1, 128, 2, 2, 64), (1, 256, 2, 64), jnp.bfloat16, spec)  # qualifies
  bad = [
      ((1, 128, 2, 2, 48), (1, 128, 2, 48), jnp.float32, spec, "head dim 48"),
      ((1, 128, 2, 2, 8), (1, 128, 2, 8), jnp.float32, spec, "head dim 8"),
      ((1, 96, 2, 2, 64), (1, 128, 2, 64), jnp.float32, spec, "must divide the local query"),
      ((1, 128, 2, 2, 64), (1, 128, 2, 64), jnp.float32,
       hop.HopSpec(scale=0.1, is_causal=False, window=None, block_q=48, block_kv=64),
       "block_q=48 must be a power of two"),
      ((1, 128, 2, 2, 64), (1, 128, 2, 64), jnp.float32,
       hop.HopSpec(scale=0.1, is_causal=False, window=None, block_q=64, block_kv=8),
       "block_kv=8 must be a power of two"),
      ((1, 128, 2, 2, 64), (1, 128, 2, 64), jnp.int8, spec, "dtype int8"),
      ((1, 128, 2, 2, 64), (1, 128, 4, 64), jnp.float32, spec, "disagree"),
  ]
  for q_shape, kv_shape, dtype, sp, msg in bad:
    with pytest.raises(ValueError, match=msg):
      kernel.check(q_shape, kv_shape, dtype, sp)


@pytest.mark.parametrize("dtype,causal,window,segments,precision", [
    (jnp.bfloat16, True, (100, 0), True, None),
    (jnp.float32, False, None, False, jax.lax.Precision.HIGHEST),
])
def test_lowers_to_triton(dtype, causal, window, segments, precision):
  """Forward and backward lower to Triton kernels for the cuda platform.

  This runs the Pallas -> Triton IR lowering on CPU (power-of-two tensor sizes,
  matmul shapes, indexing, loops); Triton's own compile to PTX and a run need a
  GPU and are not checked here.
  """
  b, t, s, kh, g, h = 1, 128, 256, 2, 2, 64
  sd = jax.ShapeDtypeStruct
  q, kv = sd((b, t, kh, g, h), dtype), sd((b, s, kh, h), dtype)
  i32 = lambda *shape: sd(shape, jnp.int32)
  spec = hop.HopSpec(scale=0.125, is_causal=causal, window=window, block_q=64, block_kv=32,
                     precision=precision)
  kernel = PallasGpuHopKernel(interpret=False)
  segs = (i32(b, t), i32(b, s)) if segments else ()

  def masks(qp, kp, *seg):
    return hop.HopMasks.build(spec, qp, kp, *(seg if seg else (None, None)))

  def fwd(q, k, v, *m):
    return kernel.forward(q, k, v, masks(*m), spec)

  def bwd(q, k, v, o, l, do, dlse, *m):
    return kernel.backward(q, k, v, masks(*m), spec, hop.HopResiduals(o, l, do, dlse),
                           hop.zero_grads(q, k, v))

  checks = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
  # With no GPU attached, jax >= 0.12 takes the target GPU from the abstract mesh's device.
  target = jax.sharding.AbstractMesh(
      (1,), ("gpu",), abstract_device=jax.sharding.AbstractDevice(
          device_kind="NVIDIA H200", num_cores=None, platform="cuda"))
  with jax.sharding.use_abstract_mesh(target):
    fwd_hlo = export.export(jax.jit(fwd), platforms=["cuda"], disabled_checks=checks)(
        q, kv, kv, i32(t), i32(s), *segs).mlir_module()
    bwd_hlo = export.export(jax.jit(bwd), platforms=["cuda"], disabled_checks=checks)(
        q, kv, kv, q, sd((b, t, kh, g), jnp.float32), q, sd((b, t, kh, g), jnp.float32),
        i32(t), i32(s), *segs).mlir_module()
  # masked: a finite-V and a guarded-V forward variant; unmasked: one
  assert fwd_hlo.count("__gpu$xla.gpu.triton") == (2 if causal or segments else 1)
  assert bwd_hlo.count("__gpu$xla.gpu.triton") == 2  # dQ and dK/dV


@pytest.mark.parametrize("name", list(_CASES))
def test_block_table_covers_exactly_what_is_needed(name):
  """Every block pair holding a visible score (in its batch row) is in the hop's block table;
  pairs run unmasked are fully visible."""
  pb = _problem(name)
  spec, vis = pb["spec"], np.broadcast_to(pb["vis"], (2,) + pb["vis"].shape[1:])
  bq, bk = spec.block_q, spec.block_kv
  nq, nk = vis.shape[1] // bq, vis.shape[2] // bk
  blocks = vis.reshape(2, nq, bq, nk, bk).transpose(0, 1, 3, 2, 4).reshape(2, nq, nk, -1)
  any_, all_ = blocks.any(-1), blocks.all(-1)
  table = pb["masks"].blocks
  for ranges, a, f in ((table.q_ranges, any_, all_),
                       (table.kv_ranges, any_.swapaxes(1, 2), all_.swapaxes(1, 2))):
    ranges = np.broadcast_to(np.asarray(ranges), (2,) + ranges.shape[1:])
    for r in range(2):
      for row, (lo, full_lo, full_hi, hi) in enumerate(ranges[r]):
        visited = np.zeros(a.shape[-1], bool)
        visited[lo:hi] = True
        assert not (a[r, row] & ~visited).any()       # nothing visible is skipped
        assert f[r, row, full_lo:full_hi].all()       # unmasked blocks need no mask


def test_interpret_inside_shard_map_matches():
  """Inside shard_map(check_vma=True) (inputs varying over a mesh axis) interpret mode runs the
  kernels through _interpret_grid; it gives what pallas_call(interpret=True) gives outside."""
  pb = _problem("zigzag_causal_segments_gqa", seed=3)
  kernel = PallasGpuHopKernel()
  *outside, _ = _run(kernel, pb)
  m, spec = pb["masks"], pb["spec"]
  mesh = jax.make_mesh((2,), ("batch",), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:2])

  def both(q, k, v, out, lse, do, dlse, q_seg, kv_seg):
    masks = hop.HopMasks.build(spec, m.q_positions, m.kv_positions, q_seg, kv_seg)
    return (kernel.forward(q, k, v, masks, spec),
            kernel.backward(q, k, v, masks, spec, hop.HopResiduals(out, lse, do, dlse),
                            hop.zero_grads(q, k, v)))

  rows = jax.sharding.PartitionSpec("batch")
  fn = jax.jit(jax.shard_map(both, mesh=mesh, in_specs=(rows,) * 9, out_specs=rows))
  inside = fn(pb["q"], pb["k"], pb["v"], jnp.asarray(pb["out"], jnp.float32),
              jnp.asarray(pb["lse"], jnp.float32), pb["do"], jnp.asarray(pb["dlse"]),
              m.q_segment_ids, m.kv_segment_ids)
  for a, b in zip(jax.tree.leaves(outside), jax.tree.leaves(inside)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6, atol=1e-6)
