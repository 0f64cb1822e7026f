"""Compile targets: the platform a program is compiled for, and named TPU slices as
compile-only devices.

A TPU slice is named as Cloud TPU names its topologies, ``"<generation>:<chips per
dimension>"``: ``"v5e:2x2"``, ``"v6e:16x16"`` (2D tori), ``"v5p:4x4x4"`` (3D).
:func:`devices` turns a name into the compile-only devices of that slice
(``jax.experimental.topologies.get_topology_desc``): ``jax.jit(f).lower(...)`` of
``jax.ShapeDtypeStruct`` inputs sharded over a ``Mesh`` of them ``.compile()``\\ s with the
real TPU compiler, and ``memory_analysis()``, ``cost_analysis()`` and the scheduled HLO
(``as_text()``) describe the TPU program, with no TPU attached. Nothing can run on these
devices and nothing concrete may be created on them (any eager op fails). The compiler is
``libtpu``, which ``pip install "ring_jax[tpu]"`` installs in the version the installed jax
pins (jax's own ``[tpu]`` extra; :func:`check_libtpu`). A chip's HBM is
:mod:`ring_jax.hardware`'s figure for its ``device_kind``; :func:`per_device_bytes` what one
device holds while a compiled program runs, to hold against it.

:func:`target_platform` is the platform being compiled for: that of the devices of the mesh
set with ``jax.set_mesh`` (also while tracing, inside ``jit`` and ``shard_map``), else
``jax.default_backend()``; the hop kernels, their ``"auto"`` choice and the default block
sizes are decided for it, so a program traced for a TPU slice on a CPU machine is the one a
TPU run would trace.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import re
import sys
import tempfile
from typing import Sequence

import jax

from ring_jax import hardware

#: The TPU generations a name may start with -> the number of torus dimensions.
GENERATIONS: dict[str, int] = {"v5e": 2, "v6e": 2, "v5p": 3}

#: What :func:`parse` accepts, for error messages.
FORMS = ("v5e:AxB and v6e:AxB (2D, e.g. v5e:2x2, v6e:16x16) or v5p:AxBxC (3D, e.g. "
         "v5p:2x2x1, v5p:4x4x4); chips per dimension, A and B each 1 or even")

#: The pip extra that installs the TPU compiler matching the installed jax.
EXTRA = "ring_jax[tpu]"

_NAME = re.compile(r"^(v5e|v6e|v5p):(\d+(?:x\d+)*)$")

# What libtpu prints on its first use on a machine without a TPU, harmless for compiling
# (TPU-COMPILE-NOTES: no accelerator type or worker hostnames in the environment).
_HARMLESS = ("TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES", "Failed to find host bounds",
             "Logging before InitGoogle", "=== Source Location Trace", "libtpu_init_utils.cc",
             "common_lib.cc")


class TopologyError(ValueError):
  """A topology name, slice count or compiler installation that cannot be used; the one-line
  message names the fix."""


def parse(name: str) -> tuple[str, tuple[int, ...]]:
  """``"v5p:4x4x4"`` -> ``("v5p", (4, 4, 4))``; raises :class:`TopologyError` (listing the
  accepted forms) for anything else."""
  match = _NAME.match(name.strip().lower())
  if match is None:
    raise TopologyError(f"unknown TPU topology {name!r}; the forms that work: {FORMS}.")
  generation, dims = match.group(1), tuple(int(d) for d in match.group(2).split("x"))
  if (len(dims) != GENERATIONS[generation] or any(d < 1 for d in dims)
      or any(d != 1 and d % 2 for d in dims[:2])):
    raise TopologyError(f"TPU topology {name!r} needs {GENERATIONS[generation]} dimensions "
                        f"for {generation}, the first two 1 or even; the forms that work: {FORMS}.")
  return generation, dims


def chips(name: str, slices: int = 1) -> int:
  """The chips (devices) of ``slices`` slices of topology ``name``."""
  _, dims = parse(name)
  count = 1
  for d in dims:
    count *= d
  return count * slices


def check_libtpu() -> str:
  """The installed libtpu's version if it is the one the installed jax pins; else raises
  :class:`TopologyError` naming the extra that installs it."""
  try:
    installed = importlib.metadata.version("libtpu")
  except importlib.metadata.PackageNotFoundError:
    raise TopologyError(
        f"compiling for a TPU topology needs libtpu, the TPU compiler, which is not "
        f"installed: pip install \"{EXTRA}\" (the libtpu jax {jax.__version__} pins).") from None
  wanted = _pinned_libtpu()
  if wanted is not None and not _matches(installed, wanted):
    raise TopologyError(
        f"libtpu {installed} does not match jax {jax.__version__}, which pins libtpu{wanted}: "
        f"pip install \"{EXTRA}\" (or pip install \"jax[tpu]=={jax.__version__}\").")
  return installed


def _pinned_libtpu() -> str | None:
  """The libtpu version specifier of jax's ``[tpu]`` extra (e.g. ``"==0.0.42.*"``)."""
  for requirement in importlib.metadata.requires("jax") or ():
    match = re.match(r"^libtpu\s*(==\s*[\w.*]+)\s*;.*extra\s*==\s*['\"]tpu['\"]",
                     requirement)
    if match:
      return match.group(1).replace(" ", "")
  return None


def _matches(version: str, specifier: str) -> bool:
  """``version`` against an ``==X`` or ``==X.*`` specifier (the forms jax pins libtpu with)."""
  pinned = specifier[2:]
  if pinned.endswith(".*"):
    return version == pinned[:-2] or version.startswith(pinned[:-1])
  return version == pinned


def devices(name: str, slices: int = 1) -> tuple:
  """The compile-only devices of ``slices`` slices of TPU topology ``name`` (several slices
  talk over the data center network; ``device.slice_index`` tells them apart).

  Raises:
    TopologyError: an unknown name, ``slices < 1``, libtpu missing or not the one jax pins,
      or a shape the TPU runtime refuses (its reason in one line).
  """
  generation, dims = parse(name)
  if slices < 1:
    raise TopologyError(f"the number of slices must be >= 1, got {slices}.")
  check_libtpu()
  from jax.experimental import topologies

  full = (*dims, 1) if len(dims) == 2 else dims
  host = tuple(min(2, d) for d in full[:2]) + (1,)  # 4-chip hosts (2x2x1), or what fits
  try:
    with quiet_libtpu():
      topology = topologies.get_topology_desc(
          platform="tpu", topology_name=f"{generation}:{'x'.join(map(str, dims))}",
          chip_config_name="default", chips_per_host_bounds=host, num_slices=slices,
          wrap=(False, False, False))
  except Exception as e:  # noqa: BLE001 - the runtime's refusal, rephrased in one line
    reason = " ".join(str(e).split())
    raise TopologyError(f"TPU topology {name!r} was refused by libtpu: {reason[:300]}; the "
                        f"forms that work: {FORMS}.") from None
  return tuple(topology.devices)


def hbm_bytes(device) -> int | None:
  """HBM per chip of ``device``'s kind (:mod:`ring_jax.hardware`), or None if unknown."""
  spec = hardware.lookup(device.device_kind)
  return None if spec is None or spec.memory_bytes is None else int(spec.memory_bytes)


#: The ``memory_analysis()`` fields :func:`compiled_memory` reads by default.
MEMORY_FIELDS = ("temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes",
                 "alias_size_in_bytes", "peak_memory_in_bytes")


def compiled_memory(compiled, fields: Sequence[str] = MEMORY_FIELDS) -> dict[str, int]:
  """``fields`` of ``compiled.memory_analysis()`` (bytes per device) that the backend
  reports; ``{}`` when it reports none."""
  try:
    ma = compiled.memory_analysis()
  except Exception:  # noqa: BLE001  (some backends raise instead of returning None)
    return {}
  if ma is None:
    return {}
  return {f: int(getattr(ma, f)) for f in fields if getattr(ma, f, None) is not None}


def per_device_bytes(memory) -> int | None:
  """Bytes one device holds while the program runs: arguments + outputs + temporaries,
  minus outputs that alias (donated) arguments. ``memory``: a compiled program or
  :func:`compiled_memory`'s dict; None when the backend reports no analysis."""
  if not isinstance(memory, dict):
    memory = compiled_memory(memory)
  if not memory:
    return None
  return (memory["argument_size_in_bytes"] + memory["output_size_in_bytes"]
          + memory["temp_size_in_bytes"] - memory.get("alias_size_in_bytes", 0))


def target_platform() -> str:
  """The platform being compiled for: that of the current mesh's devices (``jax.set_mesh``;
  also while tracing), else ``jax.default_backend()``."""
  device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
  platform = getattr(device, "platform", None)
  return platform if platform else jax.default_backend()


@contextlib.contextmanager
def quiet_libtpu():
  """Drops the startup lines libtpu writes to the process's stderr on a machine without a
  TPU (:data:`_HARMLESS`); every other line it wrote is written on afterwards."""
  try:
    sys.stderr.flush()
    saved = os.dup(2)
  except (OSError, ValueError):  # no real stderr (e.g. captured by a notebook): leave it
    yield
    return
  with tempfile.TemporaryFile(mode="w+b") as captured:
    os.dup2(captured.fileno(), 2)
    try:
      yield
    finally:
      os.dup2(saved, 2)
      os.close(saved)
      captured.seek(0)
      kept = [line for line in captured.read().decode(errors="replace").splitlines()
              if line.strip() and not any(h in line for h in _HARMLESS)]
      if kept:
        print("\n".join(kept), file=sys.stderr, flush=True)
