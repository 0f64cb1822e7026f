"""Hop kernels by name: the one registry of per-hop attention kernels.

``HOP_KERNELS`` maps a name to ``factory(platform) -> HopKernel`` (see
:class:`ring_jax.hop.HopKernel`); ``platform`` is the JAX platform the ring
runs on (``"cpu"``, ``"gpu"``, ``"tpu"``), so a Pallas kernel named on a CPU
backend can build itself in interpret mode (slow; for tests). Kernel modules
are imported only when their name is chosen (:func:`_lazy`), so importing
``ring_jax`` never imports Pallas.

Names: ``"xla"`` (:class:`ring_jax.kernels.xla.XlaHopKernel`, every
platform); ``"splash"`` (JAX's splash attention on TPU,
:mod:`ring_jax.kernels.splash`); ``"pallas_tpu"`` and ``"pallas_gpu"`` (our
own fused kernels). Fused kernels register here under their own names and are
opt-in by name. A kernel class's ``name`` (a ``ClassVar``) is its key here. ``"auto"`` resolves through :data:`AUTO`; it means ``"xla"`` on every
platform until a fused kernel's hardware check (date, device, jax version) is
recorded in the README, and only then gains an entry for that platform.
"""

from __future__ import annotations

import importlib
from typing import Callable

import jax

from ring_jax.hop import HopKernel
from ring_jax.kernels.xla import XlaHopKernel


def _lazy(module: str, attr: str) -> Callable[[str], HopKernel]:
  """A factory that imports ``module`` on first use and returns ``module.attr(platform)``."""
  def factory(platform: str) -> HopKernel:
    return getattr(importlib.import_module(module), attr)(platform)
  return factory


HOP_KERNELS: dict[str, Callable[[str], HopKernel]] = {
    "xla": lambda platform: XlaHopKernel(),
    # Fused kernels: one line each.
    "pallas_gpu": _lazy("ring_jax.kernels.pallas_gpu", "make_kernel"),
    "pallas_tpu": _lazy("ring_jax.kernels.pallas_tpu", "make_kernel"),
    "splash": _lazy("ring_jax.kernels.splash", "make_kernel"),
}

# platform -> kernel name that "auto" picks there; absent platforms get "xla". An entry is
# added only together with a recorded hardware check of that kernel (README).
AUTO: dict[str, str] = {}


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
  (default ``jax.default_backend()``), or a :class:`~ring_jax.hop.HopKernel` instance
  returned as is.

  Raises ``ValueError`` for an unknown name (listing the known ones) and
  ``TypeError`` for an object without the protocol's methods.
  """
  if name_or_instance is None:
    name_or_instance = "auto"
  if isinstance(name_or_instance, str):
    check_name(name_or_instance)
    platform = jax.default_backend() if platform is None else platform
    name = name_or_instance
    if name == "auto":
      name = AUTO.get(platform, "xla")
    return HOP_KERNELS[name](platform)
  missing = [m for m in ("check", "forward", "backward")
             if not callable(getattr(name_or_instance, m, None))]
  if missing:
    raise TypeError(
        f"hop_kernel={name_or_instance!r} is neither a kernel name {kernel_names()} nor a "
        f"ring_jax.hop.HopKernel (missing {', '.join(missing)}).")
  return name_or_instance


__all__ = ["AUTO", "HOP_KERNELS", "XlaHopKernel", "check_name", "get_hop_kernel",
           "kernel_names"]
