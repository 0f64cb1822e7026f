"""Hop kernels by name: the one registry of per-hop attention kernels.

``HOP_KERNELS`` maps a name to ``factory(platform) -> HopKernel`` (see
:class:`ring_jax.hop.HopKernel`); ``platform`` is the JAX platform the ring
runs on (``"cpu"``, ``"gpu"``, ``"tpu"``), so a Pallas kernel named on a CPU
backend can build itself in interpret mode (slow; for tests). Kernel modules
are imported only when their name is chosen (:func:`_lazy`), so importing
``ring_jax`` never imports Pallas.

Names: ``"xla"`` (:class:`ring_jax.kernels.xla.XlaHopKernel`, every
platform); ``"splash"`` (JAX's splash attention on TPU,
:mod:`ring_jax.kernels.splash`); ``"tokamax"`` (tokamax's Mosaic GPU flash
attention on sm90/sm100, :mod:`ring_jax.kernels.tokamax_gpu`, the ``[gpu]``
extra).
A kernel class's ``name`` (a ``ClassVar``) is its key here.

``"auto"`` (the default) means the platform's maintained fused kernel,
:data:`AUTO` (TPU: ``"splash"``; GPU: ``"tokamax"``), once it has passed its
self-check on the device (:mod:`ring_jax.kernels.selfcheck`), and only where it
runs and for shapes and dtypes it takes (its ``check()``: tokamax needs the
extra, an sm90/sm100 GPU and bfloat16/float16); otherwise, and on platforms
without an entry, ``"xla"``.
It is :class:`AutoHopKernel`, which makes that choice per call (cached) and
runs the chosen kernel.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Callable, ClassVar

from ring_jax import topology
from ring_jax.hop import HopKernel
from ring_jax.kernels import selfcheck
from ring_jax.kernels.xla import XlaHopKernel


def _lazy(module: str, attr: str) -> Callable[[str], HopKernel]:
  """A factory that imports ``module`` on first use and returns ``module.attr(platform)``."""
  def factory(platform: str) -> HopKernel:
    return getattr(importlib.import_module(module), attr)(platform)
  return factory


#: The hop kernels by name: ``name -> factory(platform) -> HopKernel``; every name, and
#: ``"auto"`` (the default), is a value of ``hop_kernel=`` (see :func:`get_hop_kernel`).
HOP_KERNELS: dict[str, Callable[[str], HopKernel]] = {
    "xla": lambda platform: XlaHopKernel(),
    # Fused kernels: one line each.
    "splash": _lazy("ring_jax.kernels.splash", "make_kernel"),
    "tokamax": _lazy("ring_jax.kernels.tokamax_gpu", "make_kernel"),
}

#: The platform each fused kernel compiles for (anywhere else only Pallas' interpret mode runs
#: it, for tests); "xla" compiles for every platform.
PLATFORM: dict[str, str] = {"splash": "tpu", "tokamax": "gpu"}

# platform -> the maintained fused kernel "auto" tries there (after its self-check on the
# device, selfcheck.py); absent platforms get "xla".
AUTO: dict[str, str] = {"tpu": "splash", "gpu": "tokamax"}


@dataclasses.dataclass(frozen=True)
class AutoHopKernel:
  """``hop_kernel="auto"`` on a platform with an :data:`AUTO` entry: a
  :class:`~ring_jax.hop.HopKernel` that runs that fused kernel where it takes the shapes
  (its ``check()``) and passed its self-check on the device for this dtype and these
  features (cached per process, :func:`ring_jax.kernels.selfcheck.verdict`), else the XLA
  kernel. Forward and backward of one call resolve the same way (same cached verdict)."""
  name: ClassVar[str] = "auto"
  platform: str

  def resolve(self, q_shape, kv_shape, dtype, spec, *, segments: bool = True) -> HopKernel:
    """The kernel these shapes, dtype and spec run (``segments``: segment ids in use)."""
    name = AUTO.get(self.platform)
    if name is None:
      return XlaHopKernel()
    kernel = HOP_KERNELS[name](self.platform)
    try:
      kernel.check(q_shape, kv_shape, dtype, spec)
    except ValueError:  # shapes it does not take (say blocks of 64): XLA, no warning
      return XlaHopKernel()
    verdict = selfcheck.verdict(name, kernel, self.platform, dtype,
                                is_causal=spec.is_causal or spec.window is not None,
                                segments=segments, grouped=q_shape[3] > 1)
    return kernel if verdict.ok else XlaHopKernel()

  def _for(self, q, k, masks, spec) -> HopKernel:
    return self.resolve(q.shape, k.shape, q.dtype, spec,
                        segments=masks.q_segment_ids is not None)

  def check(self, q_shape, kv_shape, dtype, spec) -> None:
    # Shapes only: the self-check runs with the call's features (segment ids are known
    # only to forward/backward), so a check here would be a second one.
    name = AUTO.get(self.platform)
    if name is not None:
      try:
        return HOP_KERNELS[name](self.platform).check(q_shape, kv_shape, dtype, spec)
      except ValueError:
        pass
    XlaHopKernel().check(q_shape, kv_shape, dtype, spec)

  def forward(self, q, k, v, masks, spec):
    return self._for(q, k, masks, spec).forward(q, k, v, masks, spec)

  def prepare_backward(self, q, k, v, seg, spec):
    """The resolved kernel's ``prepare_backward`` (:func:`ring_jax.hop.prepare_backward`),
    resolved as every hop of the pass would be; ``(self, k, v)`` where it has none."""
    kernel = self.resolve(q.shape, k.shape, q.dtype, spec, segments=seg is not None)
    prepare = getattr(kernel, "prepare_backward", None)
    return (self, k, v) if prepare is None else prepare(q, k, v, seg, spec)

  def backward(self, q, k, v, masks, spec, res, acc):
    return self._for(q, k, masks, spec).backward(q, k, v, masks, spec, res, acc)


def kernel_names() -> tuple[str, ...]:
  """Every name :func:`get_hop_kernel` accepts (``"auto"`` included)."""
  return ("auto", *HOP_KERNELS)


def check_name(name: str) -> None:
  """Raises ``ValueError`` listing the known names if ``name`` is not one of them."""
  if name not in kernel_names():
    raise ValueError(
        f"hop_kernel={name!r} is not a known hop kernel; choose one of {kernel_names()} or pass "
        "an object implementing ring_jax.hop.HopKernel.")


def get_hop_kernel(name_or_instance, platform: str | None = None) -> HopKernel:
  """The kernel to run: a name (``None`` means ``"auto"``) resolved for ``platform``
  (default :func:`ring_jax.topology.target_platform`: the current mesh's, else
  ``jax.default_backend()``), or a :class:`~ring_jax.hop.HopKernel` instance
  returned as is.

  Raises ``ValueError`` for an unknown name (listing the known ones) and
  ``TypeError`` for an object without the protocol's methods.
  """
  if name_or_instance is None:
    name_or_instance = "auto"
  if isinstance(name_or_instance, str):
    check_name(name_or_instance)
    platform = topology.target_platform() if platform is None else platform
    name = name_or_instance
    if name == "auto":
      if platform not in AUTO:
        return XlaHopKernel()
      return AutoHopKernel(platform)
    return HOP_KERNELS[name](platform)
  missing = [m for m in ("check", "forward", "backward")
             if not callable(getattr(name_or_instance, m, None))]
  if missing:
    raise TypeError(
        f"hop_kernel={name_or_instance!r} is neither a kernel name {kernel_names()} nor a "
        f"ring_jax.hop.HopKernel (missing {', '.join(missing)}).")
  return name_or_instance


def describe(name_or_instance, platform: str | None = None) -> str:
  """One line: which hop kernel ``hop_kernel=name_or_instance`` ran on ``platform`` in this
  process, and for ``"auto"`` why (the self-check's verdicts; train.py prints it)."""
  platform = topology.target_platform() if platform is None else platform
  if not (name_or_instance is None or name_or_instance == "auto"):
    return f"hop kernel: {getattr(name_or_instance, 'name', name_or_instance)}"
  fused = AUTO.get(platform)
  if fused is None:
    return f"hop kernel: xla (auto: no fused kernel is picked on {platform})"
  seen = [v for v in selfcheck.verdicts() if v.platform == platform and v.kernel == fused]
  if not seen:
    unavailable = getattr(HOP_KERNELS[fused](platform), "unavailable", None)
    why = unavailable(platform) if unavailable is not None else None
    if why is not None:
      return f"hop kernel: xla (auto on {platform}: {fused} cannot run: {why})"
    return (f"hop kernel: xla (auto: {fused} not tried on {platform}: these shapes or this "
            "dtype do not suit it, see its check())")
  parts = [f"{v.dtype}: " + ("self-check skipped: no device attached, compile only" if v.skipped
                            else "self-check passed" if v.ok else
                            "self-check FAILED: " + v.reason) for v in seen]
  chosen = fused if all(v.ok for v in seen) else (
      "xla" if not any(v.ok for v in seen) else f"{fused} where it passed, else xla")
  return f"hop kernel: {chosen} (auto on {platform}: {fused} " + "; ".join(parts) + ")"


__all__ = ["AUTO", "HOP_KERNELS", "PLATFORM", "AutoHopKernel", "XlaHopKernel", "check_name",
           "describe", "get_hop_kernel", "kernel_names"]
