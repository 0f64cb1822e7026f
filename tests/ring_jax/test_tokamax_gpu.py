"""The hop on tokamax (ring_jax/kernels/tokamax_gpu.py), what this CPU machine can check.

tokamax's Mosaic GPU kernels run on sm90/sm100 GPUs only (``NotImplementedError`` on CPU),
so the translation around them (layout, GQA, per-query key ranges for causal/window/segment
ids, lse from ``(m, l)``, the backward's residuals and the lse cotangent's extra column,
the exactness and non-finite guards) runs here with:
* the forward: tokamax's own XLA implementation of the same op (``base.DotProductAttention``:
  same signature, same ``Mask``, same residuals);
* the backward: :func:`mosaic_vjp_contract`, a jnp reference of what tokamax 0.0.17's Mosaic
  VJP computes from the residuals it is handed (read from
  ``pallas_mosaic_gpu_vjp_kernel_sm90.py``; tokamax's XLA VJP recomputes the softmax from
  the inputs instead, so it cannot stand in for a ring's hop).
With that kernel (:func:`cpu_kernel`) tests/ring_jax/test_hop.py runs its whole conformance suite
(every case at one hop, rings of 2 and 4 against the float64 oracle, the bf16 ring). On a
GPU, ``hop_kernel="auto"`` runs tokamax only after its self-check on the device.

tokamax needs Python >= 3.12 and jax >= 0.11.1: leg 2 of CI (``[gpu]`` extra) runs these;
on leg 1 only the refusals without tokamax run.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ring_jax
from ring_jax import hop
from ring_jax.hop import HopMasks, HopSpec
from ring_jax.kernels import tokamax_gpu
from ring_jax.testing.oracle import visibility

HAVE_TOKAMAX = importlib.util.find_spec("tokamax") is not None
needs_tokamax = pytest.mark.skipif(
    not HAVE_TOKAMAX, reason="pip install -e '.[dev,gpu]' (tokamax: Python >= 3.12)")


@functools.cache
def mosaic_vjp_contract():
  """A tokamax VJP op (``base.DotProductAttentionVjp``) whose ``_fwd`` is what tokamax
  0.0.17's Mosaic GPU attention VJP (sm90/sm100) computes from what it is given:
  ``p = exp(s * scale - m) / l`` at keys ``k_start <= j < k_end``, ``delta =
  rowsum(out * dout)`` (float32), ``dS = p (dP - delta)`` with ``dP = dout V^T``,
  ``dQ = scale dS K``, ``dK = scale dS^T Q``, ``dV = P^T dout``; query head ``n`` reads K/V
  head ``n // G``; gradients in the inputs' dtypes. What it would refuse or apply otherwise
  (bias, soft cap, dropout, index arrays, a causal flag) must not be passed."""
  from tokamax._src.ops.attention import base  # noqa: PLC0415

  @dataclasses.dataclass(frozen=True)
  class MosaicVjpContract(base.DotProductAttentionVjp):
    def _fwd(self, residuals, out, dout, q, k, v, *, precision, logits_dtype, logits_scale,
             bias, logits_soft_cap, mask, dropout_mask, dropout_rate, paging_info,
             q_indices, k_indices, normalize_output, return_residuals, config):
      assert bias is None and logits_soft_cap is None and dropout_mask is None
      assert q_indices is None and k_indices is None and normalize_output
      assert not return_residuals and paging_info is None
      m, l = residuals                                      # [B, N, T]
      b, t, n, _ = q.shape
      s_len, kh = k.shape[1], k.shape[2]
      g = n // kh
      rep = lambda x: jnp.repeat(x, g, axis=2)  # noqa: E731
      f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
      s = jnp.einsum("btnh,bsnh->bnts", f32(q), f32(rep(k)))
      p = jnp.exp(s * logits_scale - m[..., None]) / l[..., None]
      assert mask.bool_mask is None and mask.causal_mask is None and mask.q_start is None
      j = jnp.arange(s_len)
      if mask.k_start is not None:
        p = jnp.where(j >= mask.k_start[..., None], p, 0.0)     # k_start [B, 1, T]
      if mask.k_end is not None:
        p = jnp.where(j < mask.k_end[..., None], p, 0.0)
      dp = jnp.einsum("btnd,bsnd->bnts", f32(dout), f32(rep(v)))
      delta = jnp.einsum("btnd,btnd->bnt", f32(out), f32(dout))
      ds = p * (dp - delta[..., None])
      group = lambda x: x.reshape(b, s_len, kh, g, -1).sum(3)  # noqa: E731
      dq = logits_scale * jnp.einsum("bnts,bsnh->btnh", ds, f32(rep(k)))
      dk = group(logits_scale * jnp.einsum("bnts,btnh->bsnh", ds, f32(q)))
      dv = group(jnp.einsum("bnts,btnd->bsnd", p, f32(dout)))
      grads = base.DotProductAttentionGrads(q=dq.astype(q.dtype), k=dk.astype(k.dtype),
                                            v=dv.astype(v.dtype), bias=None)
      return grads, None

  return MosaicVjpContract()


@dataclasses.dataclass(frozen=True)
class CpuTokamaxHopKernel(tokamax_gpu.TokamaxHopKernel):
  """The tokamax hop with tokamax's XLA forward and the VJP reference, taking float32 too
  (the translation does not depend on the dtype; the real kernel's bf16/f16-only backward
  is what check() refuses float32 for, tested below)."""

  def check(self, q_shape, kv_shape, dtype, spec) -> None:
    super().check(q_shape, kv_shape, jnp.bfloat16, spec)


def cpu_kernel() -> tokamax_gpu.TokamaxHopKernel:
  from tokamax._src.ops.attention import base  # noqa: PLC0415
  return CpuTokamaxHopKernel(forward_op=base.DotProductAttention(),
                             vjp_op=mosaic_vjp_contract())


# --- Refusals --------------------------------------------------------------------------------

SPEC = HopSpec(scale=0.125, is_causal=True, window=None, block_q=128, block_kv=128)


def test_named_kernel_refuses_where_it_cannot_run_and_names_the_fallback():
  """hop_kernel='tokamax' on this CPU backend: one ValueError saying why (jax too old,
  tokamax missing, or no sm90/sm100 GPU) and naming 'xla'; 'auto' on CPU is XLA."""
  kernel = ring_jax.get_hop_kernel("tokamax", "cpu")
  assert isinstance(kernel, tokamax_gpu.TokamaxHopKernel)
  with pytest.raises(ValueError, match=r"hop_kernel='tokamax': .*use hop_kernel='xla'"):
    kernel.check((1, 128, 1, 2, 64), (1, 128, 1, 64), jnp.bfloat16, SPEC)
  why = kernel.unavailable("cpu")
  if not HAVE_TOKAMAX:
    assert ("jax >= 0.11.1" in why) or ("tokamax is not installed" in why), why
  else:
    assert "NVIDIA GPUs; this backend is cpu" in why
  mesh = jax.make_mesh((2,), ("sequence",))
  q = jnp.zeros((1, 256, 2, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match="use hop_kernel='xla'"):
    ring_jax.ring_attention_sharded(q, q, q, mesh=mesh, is_causal=True, hop_kernel="tokamax")
  assert ring_jax.get_hop_kernel("auto", "cpu").name == "xla"


@needs_tokamax
def test_check_refuses_float32_and_high_precision_with_the_fix():
  kernel = tokamax_gpu.TokamaxHopKernel(forward_op=cpu_kernel().forward_op)
  kernel.check((1, 128, 1, 2, 64), (1, 128, 1, 64), jnp.bfloat16, SPEC)
  with pytest.raises(ValueError, match="bfloat16/float16 inputs, not float32; cast"):
    kernel.check((1, 128, 1, 2, 64), (1, 128, 1, 64), jnp.float32, SPEC)
  with pytest.raises(ValueError, match="default matmul precision"):
    kernel.check((1, 128, 1, 2, 64), (1, 128, 1, 64), jnp.bfloat16,
                 dataclasses.replace(SPEC, precision=jax.lax.Precision.HIGHEST))


def test_describe_says_why_auto_does_not_run_tokamax_on_a_gpu_without_it(monkeypatch):
  """describe() (train.py prints it) names the reason tokamax cannot run, not "shapes"."""
  monkeypatch.setattr(tokamax_gpu, "unavailable_reason",
                      lambda platform=None, device_check=True: "tokamax is not installed: x")
  line = ring_jax.kernels.describe("auto", "gpu")
  assert line == "hop kernel: xla (auto on gpu: tokamax cannot run: tokamax is not installed: x)"


def test_version_and_jax_floor(monkeypatch):
  monkeypatch.setattr(tokamax_gpu.jax, "__version__", "0.10.2")
  assert "needs jax >= 0.11.1" in tokamax_gpu.unavailable_reason("gpu")
  monkeypatch.setattr(tokamax_gpu.jax, "__version__", "0.12.0")
  monkeypatch.setattr(tokamax_gpu.importlib.metadata, "version", lambda name: "0.0.99")
  why = tokamax_gpu.unavailable_reason("gpu")
  assert "tokamax 0.0.99 is installed" in why and "tokamax==0.0.17" in why


# --- The key ranges --------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "striped"])
@pytest.mark.parametrize("is_causal,window", [(True, None), (True, (150, 0)),
                                              (False, (40, 300)), (False, None)])
def test_key_ranges_with_packed_documents_are_exact_at_every_hop(layout, is_causal, window):
  """Documents packed in position order (what the data pipeline makes), any ring layout:
  each query's [k_start, k_end) holds exactly its visible keys, at every hop of a ring of
  4, and the ranges say so (exact)."""
  rng = np.random.default_rng(0)
  length, ring = 1024, 4
  seg = np.zeros((2, length), np.int32)
  cuts = np.sort(rng.choice(np.arange(1, length - 40), size=9, replace=False))
  for i, (a, b) in enumerate(zip([0, *cuts], [*cuts, length - 40])):
    seg[0, a:b] = i + 1
  seg[1, :600] = -3                                 # one long document (negative id), padding
  pos = np.asarray(ring_jax.layout_positions(layout, ring, length))
  spec = HopSpec(scale=1.0, is_causal=is_causal, window=window, block_q=128, block_kv=128)
  for qd in range(ring):
    for kd in range(ring):
      qi = pos[qd * 256:(qd + 1) * 256]
      ki = pos[kd * 256:(kd + 1) * 256]
      q_seg = seg[:, qi]
      kv_seg = seg[:, ki]
      masks = HopMasks(jnp.asarray(qi, jnp.int32), jnp.asarray(ki, jnp.int32),
                       jnp.asarray(q_seg), jnp.asarray(kv_seg))
      start, end, exact = jax.device_get(tokamax_gpu.hop_key_ranges(masks, spec, 2))
      assert exact
      idx = np.arange(256)[None, None, :]
      got = (idx >= start[..., None]) & (idx < end[..., None])
      want = visibility(qi, ki, is_causal, window, q_seg, kv_seg)
      np.testing.assert_array_equal(got, want)


def test_key_ranges_flag_ids_that_are_not_one_run():
  """An id in two places of the key shard (a rolled or reordered row) is not one range:
  exact is False, so the hop takes the XLA kernel; ranges of ids in one run stay right."""
  kv = np.array([[1, 1, 2, 2, 1, 0, 3, 3]], np.int32)
  q = np.array([[1, 2, 3, 0, 4, 2, 2, 3]], np.int32)
  start, end, exact = jax.device_get(hop.segment_key_ranges(jnp.asarray(q), jnp.asarray(kv)))
  assert not exact
  np.testing.assert_array_equal(start[0, 1:], [2, 6, 0, 0, 2, 2, 6])
  np.testing.assert_array_equal(end[0, 1:], [4, 8, 0, 0, 4, 4, 8])
  kv_ok = np.array([[1, 1, 1, 2, 2, 0, 3, 3]], np.int32)
  assert jax.device_get(hop.segment_key_ranges(jnp.asarray(q), jnp.asarray(kv_ok))[2])


# --- The hop against the XLA kernel where a guard sends it --------------------------------------

def _hop(what):
  """(q, k, v, masks, spec) of one causal hop with two documents; ``what`` varies it."""
  rng = np.random.default_rng(1)
  b, t, kh, g, h = 1, 128, 1, 2, 32
  q = jnp.asarray(rng.normal(size=(b, t, kh, g, h)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(b, t, kh, h)), jnp.float32) for _ in range(2))
  pos = jnp.arange(t, dtype=jnp.int32)
  seg = np.ones((b, t), np.int32)
  seg[:, 100:] = 2
  spec = HopSpec(scale=h ** -0.5, is_causal=True, window=None, block_q=128, block_kv=128)
  kv_seg = seg
  if what == "ids-not-one-run":
    kv_seg = np.roll(seg, 40, axis=1)             # document 1 wraps around: two runs
  if what == "nan-in-masked-v":
    seg[:, 120:] = 0                              # keys 120.. are padding: nobody sees them
    kv_seg = seg
    v = v.at[:, 125].set(jnp.nan)
  return q, k, v, HopMasks.build(spec, pos, pos, jnp.asarray(seg), jnp.asarray(kv_seg)), spec


@needs_tokamax
@pytest.mark.parametrize("what", ["ids-not-one-run", "nan-in-masked-v", "lse-cotangent"])
def test_guarded_hops_equal_the_xla_kernel(what):
  """A hop whose ids are not one run per id, or whose V holds a NaN at keys no query sees,
  runs exactly the XLA kernel's arithmetic (forward and backward); with an lse cotangent
  the extra column gives the XLA kernel's gradients."""
  q, k, v, masks, spec = _hop(what)
  rng = np.random.default_rng(2)
  kernel, xla = cpu_kernel(), ring_jax.XlaHopKernel()
  got, want = kernel.forward(q, k, v, masks, spec), xla.forward(q, k, v, masks, spec)
  for a, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(w), rtol=2e-5, atol=2e-5)
  out, lse = want
  res = hop.HopResiduals(out, hop.lse_for_backward(lse),
                         jnp.asarray(rng.normal(size=q.shape), jnp.float32),
                         jnp.asarray(rng.normal(size=lse.shape), jnp.float32)
                         if what == "lse-cotangent" else None)
  zeros = hop.zero_grads(q, k, v)
  got = kernel.backward(q, k, v, masks, spec, res, zeros)
  want = xla.backward(q, k, v, masks, spec, res, zeros)
  for name, a, w in zip("qkv", got, want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(w), rtol=2e-5, atol=2e-5,
                               err_msg=f"d{name}")
    assert np.isfinite(np.asarray(a)).all(), f"d{name}"


@needs_tokamax
@pytest.mark.parametrize("what,guarded", [("one-run", False), ("ids-not-one-run", True),
                                          ("nan-in-masked-v", True)])
def test_tokamax_runs_unless_a_guard_sends_the_hop_to_xla(what, guarded):
  """With a forward op that doubles its output, exactly the hops no guard catches come out
  doubled: the guards route to XLA where they must and nowhere else."""
  from tokamax._src.ops.attention import base  # noqa: PLC0415

  @dataclasses.dataclass(frozen=True)
  class Doubled(base.DotProductAttention):
    def _fwd(self, q, k, v, *, precision, logits_dtype, logits_scale, bias, logits_soft_cap,
             mask, dropout_mask, dropout_rate, paging_info, q_indices, k_indices,
             normalize_output, return_residuals, config):
      out, residuals = super()._fwd(
          q, k, v, precision=precision, logits_dtype=logits_dtype, logits_scale=logits_scale,
          bias=bias, logits_soft_cap=logits_soft_cap, mask=mask, dropout_mask=dropout_mask,
          dropout_rate=dropout_rate, paging_info=paging_info, q_indices=q_indices,
          k_indices=k_indices, normalize_output=normalize_output,
          return_residuals=return_residuals, config=config)
      return 2 * out, residuals

  q, k, v, masks, spec = _hop(what)
  kernel = dataclasses.replace(cpu_kernel(), forward_op=Doubled())
  out, _ = kernel.forward(q, k, v, masks, spec)
  want, _ = ring_jax.XlaHopKernel().forward(q, k, v, masks, spec)
  np.testing.assert_allclose(np.asarray(out), np.asarray(want) * (1 if guarded else 2),
                             rtol=2e-5, atol=2e-5)


@needs_tokamax
def test_auto_runs_tokamax_after_its_self_check_and_xla_for_float32(monkeypatch):
  """GPU's ``auto`` route, played on CPU: tokamax (its XLA forward, the VJP reference; the
  real dtype check) registered as auto's choice, as on an sm90 GPU with the extra. A bf16
  ring runs it after its self-check passes; a float32 ring runs XLA, no check."""
  from tokamax._src.ops.attention import base  # noqa: PLC0415
  from ring_jax import kernels  # noqa: PLC0415
  from ring_jax.kernels import selfcheck  # noqa: PLC0415
  kernel = tokamax_gpu.TokamaxHopKernel(forward_op=base.DotProductAttention(),
                                        vjp_op=mosaic_vjp_contract())
  monkeypatch.setitem(kernels.HOP_KERNELS, "tokamax", lambda platform: kernel)
  monkeypatch.setitem(kernels.AUTO, "cpu", "tokamax")
  selfcheck.reset()
  try:
    rng = np.random.default_rng(0)
    mesh = jax.make_mesh((2,), ("sequence",))
    q = jnp.asarray(rng.normal(size=(1, 512, 4, 64)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(1, 512, 2, 64)), jnp.float32)
    want = ring_jax.ring_attention_sharded(q, k, k, mesh=mesh, is_causal=True,
                                           hop_kernel="xla")
    got = ring_jax.ring_attention_sharded(*(x.astype(jnp.bfloat16) for x in (q, k, k)),
                                          mesh=mesh, is_causal=True, hop_kernel="auto")
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), atol=3e-2)
    (verdict,) = selfcheck.verdicts()
    assert verdict.ok and verdict.kernel == "tokamax" and verdict.dtype == "bfloat16", verdict
    assert kernels.describe("auto", "cpu").startswith("hop kernel: tokamax (auto on cpu")
    assert isinstance(kernels.AutoHopKernel("cpu").resolve(
        (1, 256, 2, 2, 64), (1, 256, 2, 64), jnp.float32, SPEC), ring_jax.XlaHopKernel)
    assert len(selfcheck.verdicts()) == 1       # float32 was not checked: check() refused it
  finally:
    selfcheck.reset()
