"""The hop on tokamax's Mosaic GPU flash attention (NVIDIA sm90/sm100): ``hop_kernel="tokamax"``.

tokamax (``openxla/tokamax``) is the kernel library JAX points GPU users to now that Pallas'
Triton backend is deprecated (``jax.experimental.pallas.ops.gpu.attention`` says "Please use
tokamax.dot_product_attention instead"). Its ``PallasMosaicGpuFlashAttention`` is a
FlashAttention forward written in Pallas' Mosaic GPU backend (sm80+), and its VJP op runs
FlashAttention-2's backward (sm90 and sm100 only) from residuals handed to it. Both fit the
hop seam (:mod:`ring_jax.hop`) as follows; the op classes are tokamax's private modules, so
the ``[gpu]`` extra pins tokamax exactly (:data:`TOKAMAX_VERSION`) and leg 2 of CI runs
this module's tests against that version.

* **Layout and GQA.** tokamax takes ``q [B, T, N, H]``, ``k/v [B, S, K, H]`` with query head
  ``n`` reading K/V head ``n // G``: our ``[B, T, K, G, H]`` queries reshaped, no repeat.
* **The hop's mask as per-query key ranges.** tokamax's ``Mask(k_start=, k_end=)`` gives each
  query row one visible key range ``[k_start, k_end)``, and its kernels derive per-block loop
  bounds from them, so blocks outside every row's range are skipped (what the ring's block
  table does for the other kernels). Causal and window ranges are exact in every layout
  (:func:`ring_jax.hop.key_ranges`: positions increase within a shard). Segment ids become
  the run of the query's id in the key shard (:func:`ring_jax.hop.segment_key_ranges`),
  exact when each id is one run there (documents packed in position order, any ring layout
  but ``document``); when a hop's ids are not, the hop runs the XLA kernel (``lax.cond``),
  so the result stays exact. Padding (id 0) sees nothing.
* **lse.** The forward's residuals are ``(m, l)``: the row max of the scaled logits
  (natural log units) and the softmax denominator, so ``lse = m + log(l)``. Rows without a
  visible key come back as ``(0, -inf)``, the seam's convention, decided from the ranges
  (not from the kernel's fill values).
* **Backward from the ring's final out/lse.** The VJP op computes
  ``p = exp(s * scale - m) / l`` and ``delta = rowsum(out * dout)`` from what it is given,
  so it gets ``m = lse`` (the whole ring's, ``+inf`` in rows that saw no key: ``p = 0``),
  ``l = 1`` and the final ``out``. The lse cotangent enters ``delta`` (``delta - dlse``)
  by one more column: ``v' = [v, 0]``, ``dout' = [dout, 1]``, ``out' = [out, -dlse]``
  (float32) leave ``dP = dout V^T`` and ``dV`` unchanged and give ``rowsum(out' dout') =
  delta - dlse``; it costs a head dim of ``H + 1`` (tokamax pads to 64) in hops whose ring
  returns its lse, nothing otherwise.
* **dtype.** The VJP takes bfloat16/float16 at the default precision, so float32 inputs are
  refused by :meth:`TokamaxHopKernel.check` (``"auto"`` runs XLA for them): no silent
  downcast. Outputs come back in the input dtype; the ring merges and accumulates in float32.
* **Non-finite inputs.** As in splash, masked scores are dropped after the matmuls, so a NaN
  held at a masked key would leak into rows that do not see it (``0 * NaN``); a hop whose
  V (forward) or Q/K/V (backward) holds a non-finite value runs the XLA kernel.
* ``spec.block_q`` / ``block_kv`` do not apply: tokamax picks its own tiles per GPU.

Not run on a GPU yet (no sm90 machine in this project's sessions so far); ``"auto"`` uses it
on sm90/sm100 only after it passed its self-check on the device against the XLA kernel
(:mod:`ring_jax.kernels.selfcheck`). On CPU the tests drive the same translation with
tokamax's own XLA implementation of the forward, and the backward with a reference of the
VJP contract above (tests/ring_jax/test_tokamax_gpu.py).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from ring_jax import hop
from ring_jax import topology
from ring_jax.kernels.xla import XlaHopKernel

TOKAMAX_VERSION = "0.0.17"   # the one the [gpu] extra pins (private op modules)
MIN_JAX = (0, 11, 1)         # tokamax's own floor
_FALLBACK = "use hop_kernel='xla' (what hop_kernel='auto' runs there)"


def _jax_version() -> tuple[int, ...]:
  return tuple(int(p) for p in jax.__version__.split(".")[:3] if p.isdigit())


def unavailable_reason(platform: str | None = None, *, device_check: bool = True) -> str | None:
  """Why tokamax's Mosaic GPU attention cannot run here, or None when it can: jax older
  than 0.11.1, tokamax missing or not the pinned version, and (``device_check``) a backend
  that is not an sm90/sm100 NVIDIA GPU (tokamax's backward runs on those only)."""
  if _jax_version() < MIN_JAX:
    return (f"tokamax needs jax >= {'.'.join(map(str, MIN_JAX))} (Python >= 3.12); this is "
            f"jax {jax.__version__}")
  try:
    version = importlib.metadata.version("tokamax")
  except importlib.metadata.PackageNotFoundError:
    return (f"tokamax is not installed: pip install 'ring_jax[gpu]' (tokamax=={TOKAMAX_VERSION}, "
            "Python >= 3.12)")
  if version != TOKAMAX_VERSION:
    return (f"tokamax {version} is installed; ring_jax drives its attention op classes as of "
            f"tokamax=={TOKAMAX_VERSION} exactly: pip install 'ring_jax[gpu]'")
  if not device_check:
    return None
  platform = topology.target_platform() if platform is None else platform
  if platform != "gpu":
    return f"tokamax's Mosaic GPU kernels run on NVIDIA GPUs; this backend is {platform}"
  device = jax.devices("gpu")[0]
  cc = getattr(device, "compute_capability", None)
  if cc is None or not 9.0 <= float(cc) < 11.0:
    return (f"tokamax's attention backward runs on sm90/sm100 (H100/H200, B200); this GPU is "
            f"{device.device_kind} (compute capability {cc})")
  return None


def hop_key_ranges(masks: hop.HopMasks, spec: hop.HopSpec, batch: int):
  """int32 ``(k_start [B, T], k_end [B, T])``: each query's visible keys of this hop as one
  index range (causal, window and segment ids together), and a bool scalar: whether that
  range is exact for every query (segment ids each one run of the key shard), or None when
  nothing masks the hop (no range needed)."""
  segments = masks.q_segment_ids is not None
  if not (spec.is_causal or spec.window is not None or segments):
    return None
  t = masks.q_positions.shape[0]
  start, end = hop.key_ranges(masks.q_positions, masks.kv_positions, spec.is_causal,
                              spec.window)
  start, end = jnp.broadcast_to(start, (batch, t)), jnp.broadcast_to(end, (batch, t))
  exact = jnp.bool_(True)
  if segments:
    dtype = jnp.promote_types(masks.q_segment_ids.dtype, masks.kv_segment_ids.dtype)
    seg_start, seg_end, exact = hop.segment_key_ranges(masks.q_segment_ids.astype(dtype),
                                                       masks.kv_segment_ids.astype(dtype))
    start, end = jnp.maximum(start, seg_start), jnp.minimum(end, seg_end)
  return start, jnp.maximum(end, start), exact


def _run(op, *args, **kwargs):
  """tokamax ``op(*args, **kwargs)`` without ``Op.__call__``'s wrappers: bind the arguments
  (tokamax's canonical form), take its config (autotuning cache, else heuristics), run the
  op's ``_fwd``. ``Op.__call__`` wraps ``_fwd`` in a ``custom_vjp`` and ``custom_batching``
  that JAX traces again when it lowers, outside :func:`ring_jax.hop.call_unchecked_vma`,
  where shard_map's varying-axes check refuses the kernel; the ring differentiates the hop
  itself, so those wrappers have nothing to do here. Returns ``_fwd``'s ``(result,
  residuals)``."""
  bound = op.bind(*args, **kwargs)
  return op._fwd(*bound.args, config=bound.default_config, **bound.kwargs)


@dataclasses.dataclass(frozen=True)
class TokamaxHopKernel:
  """The hop on tokamax's Mosaic GPU flash attention and its VJP (module docstring),
  ``hop_kernel="tokamax"``.

  Attributes:
    forward_op: a tokamax ``DotProductAttention`` op; None (default): tokamax's
      ``PallasMosaicGpuFlashAttention()``. Another op (say tokamax's XLA
      ``DotProductAttention()``, as the CPU tests do) runs the same translation.
    vjp_op: a tokamax ``DotProductAttentionVjp`` op, run as ``((m, l), out, dout, q, k, v,
      **the forward's keyword arguments)`` -> grads ``{"q", "k", "v"}``; None:
      ``forward_op.vjp``.
  """
  name: ClassVar[str] = "tokamax"
  forward_op: Any = None
  vjp_op: Any = None

  def _forward_op(self):
    if self.forward_op is not None:
      return self.forward_op
    from tokamax._src.ops.attention import pallas_mosaic_gpu  # noqa: PLC0415 (optional extra)
    return pallas_mosaic_gpu.PallasMosaicGpuFlashAttention()

  def _vjp_op(self):
    return self._forward_op().vjp if self.vjp_op is None else self.vjp_op

  def unavailable(self, platform: str | None = None) -> str | None:
    """Why this kernel cannot run on ``platform`` (None: it can): see
    :func:`unavailable_reason`; injected ops skip the device check."""
    return unavailable_reason(platform, device_check=self.forward_op is None)

  def check(self, q_shape, kv_shape, dtype, spec) -> None:
    """Raises ``ValueError`` naming the fallback when tokamax cannot run this hop here."""
    why = self.unavailable()
    if why is not None:
      raise ValueError(f"hop_kernel='tokamax': {why}; {_FALLBACK}.")
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
      raise ValueError(
          f"hop_kernel='tokamax': tokamax's attention backward takes bfloat16/float16 "
          f"inputs, not {jnp.dtype(dtype).name}; cast q/k/v, or {_FALLBACK}.")
    if spec.precision not in (None, jax.lax.Precision.DEFAULT):
      raise ValueError(f"hop_kernel='tokamax' runs at the default matmul precision, not "
                       f"precision={spec.precision}; {_FALLBACK}.")
    if q_shape[-1] != kv_shape[-1]:
      raise ValueError(f"hop_kernel='tokamax': q head dim {q_shape[-1]} != k/v head dim "
                       f"{kv_shape[-1]}.")
    if spec.value_head_dim is not None:
      raise ValueError(f"hop_kernel='tokamax': V's head size {spec.value_head_dim} differs "
                       f"from Q/K's {q_shape[-1]}; {_FALLBACK}.")
    if spec.logits_soft_cap is not None:
      raise ValueError("hop_kernel='tokamax' does not apply a logits soft-cap here (not "
                       f"wired or tested); {_FALLBACK}.")

  def _call_kwargs(self, q4, k, v, range_arrays, scale):
    """tokamax's canonical keyword arguments of this hop (``bind`` fills its defaults);
    ``range_arrays``: ``()`` (nothing masked) or ``(k_start, k_end)`` ``[B, T]``."""
    from tokamax._src.ops.attention import base  # noqa: PLC0415 (optional extra)
    mask = None
    if range_arrays:
      start, end = range_arrays
      mask = base.Mask(k_start=start[:, None], k_end=end[:, None])   # [B, 1 (heads), T]
    bound = self._forward_op().bind(q4, k, v, mask=mask, logits_scale=scale)
    return {name: value for name, value in bound.kwargs.items() if name != "return_residuals"}

  # ---- forward ----------------------------------------------------------------------------

  def forward(self, q, k, v, masks, spec):
    """``(out_h [B,T,K,G,H] f32, lse_h [B,T,K,G] f32)`` of this hop."""
    b, t, kh, g, h = q.shape
    ranges = hop_key_ranges(masks, spec, b)

    def fused(q, k, v):
      def call(q4, k, v, *range_arrays):
        kwargs = self._call_kwargs(q4, k, v, range_arrays, spec.scale)
        return _run(self._forward_op(), q4, k, v, return_residuals=True, **kwargs)

      range_arrays = () if ranges is None else ranges[:2]
      out, (m, l) = hop.call_unchecked_vma(call, q.reshape(b, t, kh * g, h), k, v,
                                           *range_arrays)
      lse = m.astype(jnp.float32) + jnp.log(l.astype(jnp.float32))        # [B, N, T]
      lse = jnp.transpose(lse, (0, 2, 1)).reshape(b, t, kh, g)
      out = out.astype(jnp.float32).reshape(q.shape)
      if ranges is None:
        return out, lse
      empty = (ranges[1] <= ranges[0])[:, :, None, None]                  # [B, T, 1, 1]
      return jnp.where(empty[..., None], 0.0, out), jnp.where(empty, -jnp.inf, lse)

    guarded = lambda q, k, v: XlaHopKernel().forward(q, k, v, masks, spec)  # noqa: E731
    ok = hop.v_is_finite(masks, v)
    if ranges is not None:
      ok = ok & ranges[2]
    return jax.lax.cond(ok, fused, guarded, q, k, v)

  # ---- backward ---------------------------------------------------------------------------

  def backward(self, q, k, v, masks, spec, res: hop.HopResiduals,
               acc: hop.HopGrads) -> hop.HopGrads:
    """``acc`` plus this hop's (dq, dk, dv), from tokamax's VJP op given the ring's final
    out and lse (module docstring)."""
    b, t, kh, g, h = q.shape
    n = kh * g
    ranges = hop_key_ranges(masks, spec, b)

    def fused(q, k, v, res, acc):
      heads = lambda x: x.reshape(b, t, n, *x.shape[4:])  # noqa: E731
      m = jnp.transpose(heads(res.lse.astype(jnp.float32)), (0, 2, 1))  # [B, N, T]
      l = jnp.ones_like(m)
      q4, out4, do4, v1 = heads(q), heads(res.out), heads(res.do).astype(q.dtype), v
      if res.dlse is not None:   # delta - dlse through one more column (module docstring)
        out4 = jnp.concatenate([out4.astype(jnp.float32),
                                -heads(res.dlse.astype(jnp.float32))[..., None]], axis=-1)
        do4 = jnp.concatenate([do4, jnp.ones((b, t, n, 1), do4.dtype)], axis=-1)
        v1 = jnp.concatenate([v, jnp.zeros((*v.shape[:-1], 1), v.dtype)], axis=-1)

      def call(q4, k, v1, out4, do4, m, l, *range_arrays):
        kwargs = self._call_kwargs(q4, k, v1, range_arrays, spec.scale)
        grads, _ = _run(self._vjp_op(), (m, l), out4, do4, q4, k, v1, **kwargs)
        return grads["q"], grads["k"], grads["v"]

      range_arrays = () if ranges is None else ranges[:2]
      dq, dk, dv = hop.call_unchecked_vma(call, q4, k, v1, out4, do4, m, l, *range_arrays)
      dq = dq.astype(jnp.float32).reshape(q.shape)
      dk, dv = dk.astype(jnp.float32), dv[..., :h].astype(jnp.float32)
      return hop.HopGrads(acc.dq + dq, acc.dk + dk, acc.dv + dv)

    guarded = lambda q, k, v, res, acc: XlaHopKernel().backward(  # noqa: E731
        q, k, v, masks, spec, res, acc)
    ok = hop.v_is_finite(masks, v) & jnp.isfinite(q).all() & jnp.isfinite(k).all()
    if ranges is not None:
      ok = ok & ranges[2]
    return jax.lax.cond(ok, fused, guarded, q, k, v, res, acc)


def make_kernel(platform: str) -> TokamaxHopKernel:
  """Registry factory (:data:`ring_jax.kernels.HOP_KERNELS`). The kernel runs on sm90/sm100
  GPUs; elsewhere its ``check()`` says why and names the fallback."""
  del platform  # check() reads the backend
  return TokamaxHopKernel()
