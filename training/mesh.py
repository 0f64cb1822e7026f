"""The run's device mesh: ``config.mesh`` sizes resolved against the devices, the mesh, and
enough simulated CPU devices to build it on a laptop (before the first JAX operation)."""

from __future__ import annotations

import math
import os
import sys

import jax

from models.sharding import MESH_AXES
from training.errors import ConfigError


def mesh_shape(mesh_config, num_devices: int, where: str | None = None) -> dict[str, int]:
  """Resolves the ``config.mesh`` sizes; one axis may be -1 (= the remaining devices).
  ``where``: what the devices are, for the error (default: the JAX backend's name)."""
  sizes = {axis: int(mesh_config.get(axis, 1)) for axis in MESH_AXES}
  where = where or jax.default_backend()
  if unknown := set(mesh_config.keys()) - set(MESH_AXES):
    raise ConfigError(f"config.mesh has unknown axes {sorted(unknown)}; axes are {MESH_AXES}.")
  fill = [a for a, s in sizes.items() if s == -1]
  if len(fill) > 1:
    raise ConfigError(f"config.mesh: at most one axis may be -1, got {fill}.")
  if any(s < 1 and s != -1 for s in sizes.values()):
    raise ConfigError(f"config.mesh sizes must be >= 1 or -1, got {sizes}.")
  fixed = math.prod(s for s in sizes.values() if s != -1)
  if fill and num_devices % fixed:
    raise ConfigError(
        f"config.mesh={sizes}: the fixed axes multiply to {fixed}, which does not divide "
        f"the {num_devices} devices ({where}), so '{fill[0]}=-1' cannot fill the rest.")
  if fill:
    sizes[fill[0]] = num_devices // fixed
  if math.prod(sizes.values()) != num_devices:
    raise ConfigError(
        f"config.mesh={sizes} needs {math.prod(sizes.values())} devices but "
        f"{num_devices} are available ({where}). Set one axis to -1 to use all devices, or "
        "change the sizes.")
  return sizes


def make_mesh(mesh_config, devices=None) -> jax.sharding.Mesh:
  """The :data:`MESH_AXES` mesh of ``devices`` (default ``jax.devices()``) with Auto axes
  (shardings are stated at the jit boundary). ``jax.make_mesh`` orders the devices for the
  physical topology, so ``sequence`` neighbours are physical neighbours; several TPU slices
  are split over the data center network by :func:`dcn_shape`. ConfigError if they do not fit."""
  devices = jax.devices() if devices is None else list(devices)
  sizes = mesh_shape(mesh_config, len(devices))
  shape = tuple(sizes[a] for a in MESH_AXES)
  auto = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
  slices = len({getattr(d, "slice_index", 0) for d in devices})
  if slices == 1:
    return jax.make_mesh(shape, MESH_AXES, axis_types=auto, devices=devices)
  from jax.experimental import mesh_utils
  dcn = dcn_shape(sizes, slices)
  ici = tuple(s // d for s, d in zip(shape, dcn))
  return jax.sharding.Mesh(
      mesh_utils.create_hybrid_device_mesh(ici, dcn, devices=devices,
                                           allow_split_physical_axes=True),
      MESH_AXES, axis_types=auto)


#: The axes that may span slices (the data center network), in the order they take them.
DCN_AXES = ("sequence_outer", "data", "pipeline")


def dcn_shape(sizes: dict[str, int], slices: int) -> tuple[int, ...]:
  """How many slices each of :data:`MESH_AXES` spans: :data:`DCN_AXES` in order, each taking
  the largest share of the remaining slices its size allows (ConfigError if they cannot)."""
  left, dcn = slices, dict.fromkeys(MESH_AXES, 1)
  for axis in DCN_AXES:
    share = math.gcd(left, sizes[axis])
    dcn[axis], left = share, left // share
  if left != 1:
    raise ConfigError(
        f"config.mesh={sizes} cannot span {slices} slices: only the axes {DCN_AXES} may "
        f"cross slices, and their sizes do not split into {slices} equal parts; e.g. "
        f"--config.mesh.data={slices} or --config.mesh.sequence_outer={slices}.")
  return tuple(dcn[a] for a in MESH_AXES)


def simulate_cpu_devices(config, num_processes: int = 1) -> None:
  """Sizes the CPU client (``jax_num_cpu_devices``; harmless on accelerator hosts) for
  ``config.mesh``, each of ``num_processes`` its share (an axis of -1: ``config.cpu_devices``
  in all); ``--xla_force_host_platform_device_count`` in ``XLA_FLAGS`` wins."""
  if "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
    return
  sizes = [int(config.mesh.get(a, 1)) for a in config.mesh.keys()]
  count = math.prod(sizes) if all(s > 0 for s in sizes) else int(config.cpu_devices)
  count = max(1, count // num_processes)
  try:
    jax.config.update("jax_num_cpu_devices", count)
  except RuntimeError:  # Backends already up (e.g. called from a notebook): keep them.
    print("note: JAX backends already initialised; not changing the CPU device count",
          file=sys.stderr, flush=True)
