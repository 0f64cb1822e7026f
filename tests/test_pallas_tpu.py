"""The fused TPU hop kernel (Mosaic Pallas, interpret mode on CPU) against a float64 oracle.

One hop, forward ``(out_h, lse_h)`` and backward (given the FINAL ``out``/``lse`` of
a ring that also saw a second key/value shard), across position sets of the three
layouts, causal and not, windows, segment ids with padding, GQA and MQA, T != S.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ring_jax.hop import HopMasks as Masks
from ring_jax.hop import HopResiduals, HopSpec, zero_grads
from ring_jax.kernels.pallas_tpu import PallasTpuHopKernel

# specialize=True: the code a TPU runs (unmasked body on pairs visible everywhere, V guard
# chosen at run time); the conformance suite (tests/test_hop.py) runs the registry's CPU
# build, which compiles only the masked body.
KERNEL = PallasTpuHopKernel(interpret=True, specialize=True)


# ---- float64 oracle ------------------------------------------------------------------------

def _visible(qp, kp, qs, ks, causal, window):
  """bool [B, T, S]."""
  diff = qp[:, None] - kp[None, :]
  vis = np.ones(diff.shape, bool)
  if causal:
    vis &= diff >= 0
  if window is not None:
    vis &= (diff <= window[0]) & (diff >= -window[1])
  vis = np.broadcast_to(vis[None], (1 if qs is None else qs.shape[0], *diff.shape))
  if qs is not None:
    vis = vis & (qs[:, :, None] == ks[:, None, :]) & (qs[:, :, None] != 0)
  return vis


def _scores(q, k, scale, vis):
  s = np.einsum("btkgh,bskh->bkgts", q.astype(np.float64), k.astype(np.float64)) * scale
  return np.where(vis[:, None, None], s, -np.inf)


def oracle_forward(q, k, v, vis, scale):
  """(out [B,T,K,G,H], lse [B,T,K,G]) float64; rows with no visible key: 0 / -inf."""
  s = _scores(q, k, scale, vis)
  mx = s.max(-1, keepdims=True)
  mx = np.where(np.isfinite(mx), mx, 0.0)
  p = np.exp(s - mx)
  l = p.sum(-1, keepdims=True)
  out = np.einsum("bkgts,bskh->btkgh", p / np.where(l == 0, 1, l), v.astype(np.float64))
  lse = np.where(l[..., 0] == 0, -np.inf, np.log(np.where(l[..., 0] == 0, 1, l[..., 0]))
                 + mx[..., 0])
  return out, np.transpose(lse, (0, 3, 1, 2))


def oracle_backward(q, k, v, out, lse, do, vis, scale):
  """This hop's (dq, dk, dv) float64 given the final out / lse (+inf on empty rows)."""
  s = _scores(q, k, scale, vis)
  lse_t = np.transpose(lse, (0, 2, 3, 1))[..., None]
  p = np.where(vis[:, None, None], np.exp(s - lse_t), 0.0)
  do64 = do.astype(np.float64)
  delta = np.transpose((do64 * out).sum(-1), (0, 2, 3, 1))[..., None]
  dv = np.einsum("bkgts,btkgh->bskh", p, do64)
  dp = np.einsum("btkgh,bskh->bkgts", do64, v.astype(np.float64))
  ds = p * (dp - delta) * scale
  dq = np.einsum("bkgts,bskh->btkgh", ds, k.astype(np.float64))
  dk = np.einsum("bkgts,btkgh->bskh", ds, q.astype(np.float64))
  return dq, dk, dv


def merge(out_a, lse_a, out_b, lse_b):
  """Final (out, lse) of two hops; rows that saw no key anywhere: out 0, lse +inf."""
  lse = np.logaddexp(lse_a, lse_b)
  empty = lse == -np.inf
  safe = np.where(empty, 0.0, lse)
  wa = np.where(lse_a == -np.inf, 0.0, np.exp(lse_a - safe))[..., None]
  wb = np.where(lse_b == -np.inf, 0.0, np.exp(lse_b - safe))[..., None]
  return out_a * wa + out_b * wb, np.where(empty, np.inf, lse)


# ---- cases -----------------------------------------------------------------------------------

def _positions(layout, t, s):
  """(q positions [T], this hop's kv positions [S], the other hop's kv positions [S])."""
  if layout == "contiguous":     # device 1 of 2: q = [T, 2T); kv from device 0 and its own
    return np.arange(t, 2 * t), np.arange(s), np.arange(t, t + s)
  if layout == "zigzag":         # ring 2, chunks of T/2: device 0 holds chunks 0 and 3
    c = t // 2
    q = np.r_[np.arange(0, c), np.arange(3 * c, 4 * c)]
    return q, np.r_[np.arange(c, 2 * c), np.arange(2 * c, 3 * c)], q
  if layout == "striped":        # ring 4, device 2 (queries), kv from devices 3 and 2
    return 2 + 4 * np.arange(t), 3 + 4 * np.arange(s), 2 + 4 * np.arange(s)
  raise ValueError(layout)


CASES = {
    # name: (layout, causal, window, segments, K, G, T, S, H)
    "contig_full_mha": ("contiguous", False, None, False, 2, 1, 256, 256, 64),
    "zigzag_causal_gqa_seg": ("zigzag", True, None, True, 2, 2, 256, 256, 64),
    "zigzag_causal_mha": ("zigzag", True, None, False, 2, 1, 256, 256, 64),
    "striped_window_mqa": ("striped", True, (200, 0), False, 1, 3, 256, 256, 128),
    "contig_window_seg_t_ne_s": ("contiguous", False, (90, 40), True, 1, 2, 256, 384, 64),
}


def _make(name, dtype=np.float32, seed=0):
  layout, causal, window, seg, kh, g, t, s, h = CASES[name]
  rng = np.random.default_rng(seed)
  b = 2 if seg else 1
  q = rng.standard_normal((b, t, kh, g, h))
  k = rng.standard_normal((b, s, kh, h))
  v = rng.standard_normal((b, s, kh, h))
  k2, v2 = rng.standard_normal((b, s, kh, h)), rng.standard_normal((b, s, kh, h))
  do = rng.standard_normal((b, t, kh, g, h))
  qp, kp, kp2 = _positions(layout, t, s)
  if seg:
    # Packed documents (ids 1, 2, -5) with padding (0). Row 0 has blocks of one id
    # (pairs visible everywhere skip the element mask); row 1 mixes ids and padding
    # inside blocks, and a quarter of its queries are padding.
    qs = np.stack([np.repeat([1, 2], t // 2), np.repeat([2, 0, -5, 1], t // 4)])
    ks = np.stack([np.r_[np.full(s // 2, 2), np.full(s // 2 - 10, 1), np.zeros(10, int)],
                   np.repeat([2, 0, 0, -5, 1, 1], s // 6 + 1)[:s]])
    ks2 = ks[:, ::-1].copy()
  else:
    qs = ks = ks2 = None
  spec = HopSpec(scale=h ** -0.5, is_causal=causal, window=window, block_q=128, block_kv=128)
  cast = lambda x: np.asarray(jnp.asarray(x, dtype))  # noqa: E731
  return dict(q=cast(q), k=cast(k), v=cast(v), k2=cast(k2), v2=cast(v2), do=cast(do),
              qp=qp, kp=kp, kp2=kp2, qs=qs, ks=ks, ks2=ks2, spec=spec)


def _masks(c, second=False):
  to = lambda x: None if x is None else jnp.asarray(x, jnp.int32)  # noqa: E731
  return Masks.build(c["spec"], to(c["qp"]), to(c["kp2"] if second else c["kp"]),
                     to(c["qs"]), to(c["ks2"] if second else c["ks"]))


def _oracle(c):
  """Forward of hop 1; final out/lse over both hops; hop 1's gradient contribution."""
  spec = c["spec"]
  vis1 = _visible(c["qp"], c["kp"], c["qs"], c["ks"], spec.is_causal, spec.window)
  vis2 = _visible(c["qp"], c["kp2"], c["qs"], c["ks2"], spec.is_causal, spec.window)
  o1, l1 = oracle_forward(c["q"], c["k"], c["v"], vis1, spec.scale)
  o2, l2 = oracle_forward(c["q"], c["k2"], c["v2"], vis2, spec.scale)
  out, lse = merge(o1, l1, o2, l2)
  grads = oracle_backward(c["q"], c["k"], c["v"], out, lse, c["do"], vis1, spec.scale)
  return (o1, l1), (out, lse), grads


def _run_kernel(c, out, lse, kernel=KERNEL):
  m, spec = _masks(c), c["spec"]
  fwd = jax.jit(lambda q, k, v: kernel.forward(q, k, v, m, spec))(c["q"], c["k"], c["v"])
  bwd = jax.jit(lambda q, k, v, o, l, do: kernel.backward(q, k, v, m, spec, HopResiduals(o, l, do),
                                                     zero_grads(q, k, v)))(
      c["q"], c["k"], c["v"], jnp.asarray(out, c["q"].dtype), jnp.asarray(lse, jnp.float32),
      c["do"])
  return jax.device_get(fwd), jax.device_get(bwd)


def _rel(x, ref):
  """max |x - ref| / max |ref| over finite entries (same non-finite pattern required)."""
  x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
  np.testing.assert_array_equal(np.isfinite(x), np.isfinite(ref))
  np.testing.assert_array_equal(x[~np.isfinite(x)], ref[~np.isfinite(ref)])
  fin = np.isfinite(ref)
  return float(np.abs(x[fin] - ref[fin]).max() / max(np.abs(ref[fin]).max(), 1e-30))


@pytest.mark.parametrize("name", sorted(CASES))
def test_hop_matches_float64_oracle(name):
  c = _make(name)
  (o1, l1), (out, lse), (dq, dk, dv) = _oracle(c)
  (out_h, lse_h), (kdq, kdk, kdv) = _run_kernel(c, out, lse)
  assert out_h.dtype == lse_h.dtype == kdq.dtype == kdk.dtype == kdv.dtype == np.float32
  assert out_h.shape == c["q"].shape and lse_h.shape == c["q"].shape[:-1]
  assert kdk.shape == kdv.shape == c["k"].shape
  for got, ref in ((out_h, o1), (lse_h, l1), (kdq, dq), (kdk, dk), (kdv, dv)):
    assert np.all(np.isfinite(got) | (got == -np.inf))  # never NaN
    assert _rel(got, ref) < 1e-5
  # Rows with no visible key in this hop: output exactly 0, lse -inf.
  empty = l1 == -np.inf
  if c["qs"] is not None:
    assert empty.any()
  np.testing.assert_array_equal(out_h[empty], 0.0)


def test_bfloat16_error_within_xla_reference():
  """bf16 inputs: the kernel's error vs float64 is at most 1.1x that of a plain XLA
  implementation doing the same float32-accumulating matmuls."""
  name = "zigzag_causal_gqa_seg"
  c = _make(name, dtype=jnp.bfloat16, seed=1)
  (o1, l1), (out, lse), (dq, dk, dv) = _oracle(c)
  (out_h, lse_h), grads = _run_kernel(c, out, lse)
  ref_fwd, ref_grads = _xla_reference(c, out, lse)
  for got, ref_got, exact in zip((out_h, lse_h, *grads), (*ref_fwd, *ref_grads),
                                 (o1, l1, dq, dk, dv)):
    e_kernel, e_xla = _rel(got, exact), _rel(ref_got, exact)
    assert e_kernel <= 1.1 * e_xla + 1e-7, (e_kernel, e_xla)


def _xla_reference(c, out, lse):
  """Dense XLA hop in the input dtype with float32 accumulation (as the XLA kernel)."""
  spec = c["spec"]
  vis = jnp.asarray(_visible(c["qp"], c["kp"], c["qs"], c["ks"], spec.is_causal,
                             spec.window))[:, None, None]
  q, k, v, do = (jnp.asarray(c[x]) for x in ("q", "k", "v", "do"))
  f32 = jnp.float32
  s = jnp.einsum("btkgh,bskh->bkgts", q, k, preferred_element_type=f32) * spec.scale
  s = jnp.where(vis, s, -jnp.inf)
  mx = s.max(-1, keepdims=True)
  p = jnp.exp(s - jnp.where(mx == -jnp.inf, 0.0, mx))
  l = p.sum(-1)
  o = jnp.einsum("bkgts,bskh->btkgh", p.astype(v.dtype), v, preferred_element_type=f32)
  inv = jnp.where(l == 0, 0.0, 1.0 / jnp.where(l == 0, 1.0, l))
  o = o * jnp.einsum("bkgt->btkg", inv)[..., None]
  lse_h = jnp.einsum("bkgt->btkg", jnp.where(l == 0, -jnp.inf, mx[..., 0] + jnp.log(
      jnp.where(l == 0, 1.0, l))))
  out, lse = jnp.asarray(out, q.dtype), jnp.asarray(lse, f32)
  p = jnp.where(vis, jnp.exp(s - jnp.einsum("btkg->bkgt", lse)[..., None]), 0.0)
  delta = jnp.einsum("btkg->bkgt", (do.astype(f32) * out.astype(f32)).sum(-1))[..., None]
  dv = jnp.einsum("bkgts,btkgh->bskh", p.astype(do.dtype), do, preferred_element_type=f32)
  dp = jnp.einsum("btkgh,bskh->bkgts", do, v, preferred_element_type=f32)
  ds = (p * (dp - delta) * spec.scale).astype(q.dtype)
  dq = jnp.einsum("bkgts,bskh->btkgh", ds, k, preferred_element_type=f32)
  dk = jnp.einsum("bkgts,btkgh->bskh", ds, q, preferred_element_type=f32)
  return jax.device_get((o, lse_h)), jax.device_get((dq, dk, dv))


def test_no_t_by_s_arrays():
  """Memory stays linear: no intermediate of the jitted forward or backward has both a
  T-sized and an S-sized axis (no [T, S] or [heads, T, S] mask or score array)."""
  c = _make("contig_window_seg_t_ne_s")
  t, s = c["q"].shape[1], c["k"].shape[1]
  m, spec = _masks(c), c["spec"]
  lse = jnp.zeros(c["q"].shape[:-1], jnp.float32)

  def shapes(jaxpr):
    for eqn in jaxpr.eqns:
      for var in eqn.outvars:
        yield tuple(getattr(var.aval, "shape", ()))
      for param in eqn.params.values():  # nested jaxprs (jit, cond, the kernel body)
        sub = getattr(param, "jaxpr", param)
        if hasattr(sub, "eqns"):
          yield from shapes(sub)

  for fn, args in (
      (lambda q, k, v: KERNEL.forward(q, k, v, m, spec), (c["q"], c["k"], c["v"])),
      (lambda q, k, v, o, l, do: KERNEL.backward(q, k, v, m, spec, HopResiduals(o, l, do),
                                                     zero_grads(q, k, v)),
       (c["q"], c["k"], c["v"], c["q"], lse, c["do"]))):
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    for shape in shapes(jaxpr):
      assert not (t in shape and s in shape), shape


@pytest.mark.parametrize("bad, match", [
    (dict(block_q=64), r"block_q=64: the TPU kernel needs multiples of 128; pass block_q=128"),
    (dict(block_kv=200), r"block_kv=200: the TPU kernel needs multiples of 128; pass "
                         r"block_kv=256"),
    (dict(block_q=512), r"block_q=512 does not divide T"),
])
def test_check_names_the_fix(bad, match):
  spec = HopSpec(**{**dict(scale=1.0, is_causal=True, window=None, block_q=128,
                           block_kv=128), **bad})
  with pytest.raises(ValueError, match=match):
    KERNEL.check((1, 256, 2, 2, 64), (1, 256, 2, 64), jnp.float32, spec)
  with pytest.raises(ValueError, match="head_dim=192"):
    KERNEL.check((1, 256, 2, 2, 192), (1, 256, 2, 192), jnp.float32,
                 HopSpec(scale=1.0, is_causal=True, window=None, block_q=128, block_kv=128))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_lowers_for_tpu(dtype):
  """The real (non-interpret) kernels lower to Mosaic for a TPU target on this CPU
  machine (jax.export, platforms=["tpu"]): Pallas -> Mosaic lowering errors show up
  here. Mosaic's own compilation runs only on a TPU (not checked)."""
  from jax import export
  kern = PallasTpuHopKernel(interpret=False)  # specialize: as on a TPU
  b, t, s, kh, g, h = 2, 256, 384, 2, 2, 64
  q = jax.ShapeDtypeStruct((b, t, kh, g, h), dtype)
  kv = jax.ShapeDtypeStruct((b, s, kh, h), dtype)
  lse = jax.ShapeDtypeStruct((b, t, kh, g), jnp.float32)
  spec = HopSpec(scale=0.125, is_causal=True, window=(100, 3), block_q=128, block_kv=128)
  m = Masks.build(spec, jnp.arange(t), jnp.arange(s), jnp.ones((b, t), jnp.int32),
                  jnp.ones((b, s), jnp.int32))
  fwd = export.export(jax.jit(lambda q, k, v: kern.forward(q, k, v, m, spec)),
                      platforms=["tpu"])(q, kv, kv)
  bwd = export.export(
      jax.jit(lambda q, k, v, o, l, do: kern.backward(q, k, v, m, spec, HopResiduals(o, l, do),
                                                     zero_grads(q, k, v))),
      platforms=["tpu"])(q, kv, kv, q, lse, q)
  # Forward: the plain and the V-guarded kernel (lax.cond on V being finite).
  assert fwd.mlir_module().count("tpu_custom_call") == 2
  assert bwd.mlir_module().count("tpu_custom_call") == 2


def test_non_finite_values_reach_only_rows_that_see_them():
  """As the XLA kernel: a NaN in V (or K) at a key makes NaN exactly the outputs and
  gradients of queries that see that key, not those of rows that only share its block
  pair (masked by segment); an inf in a padding key changes nothing."""
  c = _make("zigzag_causal_gqa_seg")
  spec = c["spec"]
  k, v = c["k"].copy(), c["v"].copy()
  # Batch row 1, q block 1 holds documents -5 (rows 128..191) and 1 (rows 192..255);
  # kv block 1 holds keys of both: each bad key is seen by half of the block's rows.
  v[1, 140, 0, 5] = np.nan
  k[1, 200, 1, 3] = np.nan
  k[0, 250, 0, 1] = np.inf            # a padding key (id 0) of batch row 0
  assert c["ks"][0, 250] == 0
  vis = _visible(c["qp"], c["kp"], c["qs"], c["ks"], spec.is_causal, spec.window)
  sees_v, sees_k = vis[1, :, 140], vis[1, :, 200]
  assert sees_v[128:].any() and (~sees_v[128:]).any()
  assert sees_k[128:].any() and (~sees_k[128:]).any()
  m = _masks(c)
  out_h, lse_h = jax.jit(lambda q, k, v: KERNEL.forward(q, k, v, m, spec))(c["q"], k, v)
  out_h = np.asarray(out_h)
  np.testing.assert_array_equal(np.isnan(out_h[1, :, 0, :, 5]), sees_v[:, None].repeat(2, 1))
  np.testing.assert_array_equal(np.isnan(out_h[1, :, 0]).sum(-1) > 1, False)  # column 5 only
  np.testing.assert_array_equal(np.isnan(out_h[1, :, 1]).all(-1), sees_k[:, None].repeat(2, 1))
  assert not np.isnan(out_h[0]).any()
  # Backward: queries that do not see a bad key keep finite gradients; those that see
  # the NaN key get NaN gradients (through the scores), not zeros.
  lse = np.where(np.asarray(lse_h) == -np.inf, np.inf, np.asarray(lse_h))
  dq, _, _ = jax.jit(lambda q, k, v, o, l, do: KERNEL.backward(q, k, v, m, spec, HopResiduals(o, l, do),
                                                     zero_grads(q, k, v)))(
      c["q"], k, v, np.nan_to_num(out_h), lse, c["do"])
  dq = np.asarray(dq)
  assert np.isfinite(dq[1, ~sees_k, 1]).all() and np.isfinite(dq[0]).all()
  assert np.isnan(dq[1, sees_k, 1]).any(axis=(-1, -2)).all()
  assert np.isfinite(dq[1, ~sees_v, 0]).all()


def test_ring_lowers_for_tpu_under_shard_map():
  """A ring of 2 (zigzag, causal, segment ids, GQA) with the real kernel, forward and
  gradients, inside shard_map(check_vma=True), lowers for a TPU target: 8 Mosaic calls
  (per hop position: the forward's plain and guarded variants; dQ and dK/dV)."""
  import functools

  from jax import export
  from jax.sharding import PartitionSpec as P

  import ring_jax
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("sequence",))
  attend = functools.partial(ring_jax.ring_attention, axis_name="sequence", is_causal=True,
                             layout="zigzag", block_q=128, block_kv=128,
                             hop_kernel=PallasTpuHopKernel(interpret=False))
  row = P(None, "sequence")
  fn = jax.shard_map(lambda q, k, v, s: attend(q, k, v, segment_ids=s), mesh=mesh,
                     in_specs=(row,) * 4, out_specs=row)
  q = jax.ShapeDtypeStruct((1, 512, 4, 64), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((1, 512, 2, 64), jnp.bfloat16)
  seg = jax.ShapeDtypeStruct((1, 512), jnp.int32)
  loss = lambda q, k, v, s: fn(q, k, v, s).astype(jnp.float32).sum()  # noqa: E731
  exported = export.export(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), platforms=["tpu"])(
      q, kv, kv, seg)
  assert exported.mlir_module().count("tpu_custom_call") == 8


def test_registry_builds_pallas_tpu():
  import ring_jax
  assert "pallas_tpu" in ring_jax.kernels.kernel_names()
  on_cpu, on_tpu = (ring_jax.get_hop_kernel("pallas_tpu", p) for p in ("cpu", "tpu"))
  assert isinstance(on_cpu, PallasTpuHopKernel) and on_cpu.name == "pallas_tpu"
  assert on_cpu.interpret is True and on_tpu.interpret is False
  # auto on a TPU: splash after its self-check (tests/test_selfcheck.py), never pallas_tpu
  assert ring_jax.get_hop_kernel("auto", "tpu") == ring_jax.kernels.AutoHopKernel("tpu")
  hash(on_cpu)  # static configuration of the ring's custom_vjp
