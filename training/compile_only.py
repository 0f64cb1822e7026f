"""What ``train.py --compile_only`` and ``benchmarks/fit.py`` compile for: the attached
devices, or a TPU slice (``--topology v5p:4x4x4``, ``--topology_slices N``) compiled with the
real TPU compiler and nothing run (:mod:`ring_jax.topology`); the per-chip report of a
compiled train step. Errors before compiling are one-line ConfigErrors."""

from __future__ import annotations

import contextlib
import dataclasses
import re
import time
import warnings

import jax

import ring_jax
from ring_jax import analysis
from ring_jax import topology as topo_lib
from models import attention as attn_lib
from training import buckets as buckets_lib
from training import mesh as mesh_lib
from training import metrics as metrics_lib
from training import stages as stages_lib
from training import validation as val_lib
from training.errors import ConfigError, reraise_as

GIB = 2 ** 30


@dataclasses.dataclass(frozen=True)
class Target:
  """The devices a step is compiled for: TPU topology ``name`` (``"v5p:4x4x4"``) times
  ``slices``, or the attached devices (``name=None``); ``devices`` are set by :meth:`resolve`
  (compile-only ones for a topology)."""
  name: str | None
  slices: int
  chips: int
  devices: tuple | None = None

  @property
  def label(self) -> str:
    """``"TPU slice v5p:4x4x4 (64 chips)"``, ``"2 slices of v5e:2x2 (8 chips)"``, ``"cpu"``."""
    if self.name is None:
      return jax.default_backend()
    slices = "TPU slice" if self.slices == 1 else f"{self.slices} slices of"
    return f"{slices} {self.name} ({self.chips} chips)"

  def resolve(self) -> "Target":
    """This target with its devices (a topology's need libtpu, the one jax pins: a
    ConfigError naming the extra that installs it)."""
    if self.name is None:
      return dataclasses.replace(self, devices=tuple(jax.devices()))
    with reraise_as(ConfigError, "--topology: ", catch=topo_lib.TopologyError):
      return dataclasses.replace(self, devices=topo_lib.devices(self.name, self.slices))

  @property
  def hbm_bytes(self) -> int | None:
    """HBM per chip of the resolved target (:mod:`ring_jax.hardware`); None for devices the
    table lacks (CPU)."""
    device = self.devices[0]
    return None if not self.name and device.platform == "cpu" else topo_lib.hbm_bytes(device)


def target(topology: str | None, slices: int = 1) -> Target:
  """The target of ``--topology`` / ``--topology_slices`` (devices not yet created);
  ConfigError for an unknown topology, ``slices < 1``, or slices without a topology."""
  if slices < 1:
    raise ConfigError(f"--topology_slices must be >= 1, got {slices}.")
  if topology is None:
    if slices != 1:
      raise ConfigError("--topology_slices needs --topology (the slices' TPU topology).")
    return Target(name=None, slices=1, chips=jax.device_count())
  name = topology.strip().lower()
  with reraise_as(ConfigError, "--topology: ", catch=topo_lib.TopologyError):
    return Target(name=name, slices=slices, chips=topo_lib.chips(name, slices))


def check_kernel(hop_kernel: str, where: Target) -> None:
  """For a topology: ``hop_kernel`` compiles for TPU (:data:`ring_jax.kernels.PLATFORM`)."""
  kernel_platform = ring_jax.kernels.PLATFORM.get(hop_kernel)
  if where.name is not None and kernel_platform not in (None, "tpu"):
    raise ConfigError(
        f"model.hop_kernel={hop_kernel!r} is a {kernel_platform.upper()} kernel and --topology "
        f"compiles for TPU: use --config.model.hop_kernel=auto (splash on TPU), splash or xla.")


class CompileFailed(RuntimeError):
  """The compiler refused the train step (e.g. a Mosaic kernel's VMEM); one line
  (:func:`compiling`)."""


@contextlib.contextmanager
def compiling(where: Target):
  """Around a compile for ``where``: the compiler's refusal as a :class:`CompileFailed` of one
  line (its error and, where it names them, the scoped allocation and the op); for a topology,
  without JAX's warning that a cached compile-only program cannot be loaded."""
  with warnings.catch_warnings():
    if where.name is not None:
      warnings.filterwarnings("ignore", message="Error reading persistent compilation cache")
    try:
      yield
    except jax.errors.JaxRuntimeError as e:
      text = str(e)
      lines = [line.strip() for line in text.splitlines() if line.strip()]
      parts = [lines[0].rstrip(":") if lines else type(e).__name__]
      scoped = re.search(r"Scoped allocation with size \S+ and limit \S+ exceeded .*? by "
                         r"[\d.]+[KMG]?", text)
      op = re.search(r'op_name="([^"]+)"', text)
      if scoped:
        parts.append(scoped.group(0))
      if op:  # the op's last two name scopes, e.g. splash_mha_fwd/pallas_call
        parts.append("in " + "/".join(op.group(1).split("/")[-2:]))
      raise CompileFailed(f"the compiler refused the train step for {where.label}: "
                          + "; ".join(parts)) from None


def memory_lines(compiled, where: Target, compile_s: float) -> tuple[list[str], dict]:
  """Lines and a dict: per chip arguments, temporaries, total (:func:`ring_jax.topology.
  per_device_bytes`) against the chip's HBM, fits or not, compile seconds."""
  memory = topo_lib.compiled_memory(compiled)
  total = topo_lib.per_device_bytes(memory)
  hbm = where.hbm_bytes
  row = {f"{part}_bytes": memory.get(f"{part}_size_in_bytes")
         for part in ("argument", "temp", "output", "alias")}
  row.update(per_chip_bytes=total, hbm_bytes=hbm,
             fits=None if total is None or hbm is None else bool(total <= hbm),
             compile_s=round(compile_s, 1))
  if total is None:
    return [f"compiled in {compile_s:.1f}s; the compiler reports no memory analysis"], row
  kind = where.devices[0].device_kind
  against = ("no HBM figure for this device kind" if hbm is None else
             f"of {hbm / GIB:.2f} GiB HBM ({kind}): "
             f"{'fits' if row['fits'] else 'does NOT fit'} ({100 * total / hbm:.0f}%)")
  return [f"per chip: arguments {row['argument_bytes'] / GIB:.3f} GiB, temporaries "
          f"{row['temp_bytes'] / GIB:.3f} GiB, outputs not aliasing arguments "
          f"{(row['output_bytes'] - row['alias_bytes']) / GIB:.3f} GiB; total "
          f"{total / GIB:.3f} GiB {against}",
          f"compiled in {compile_s:.1f}s"], row


def compile_stages(config, topology: str | None = None, slices: int = 1) -> list[dict]:
  """``train.py --compile_only``: compiles each stage's train step as the run builds it, from
  abstract values, for the attached devices or ``slices`` x TPU ``topology``; logs per chip
  its memory against HBM, the compile time, the hop kernel and the overlap summary, and
  returns one row per stage (:func:`memory_lines`' dict with ``seq_len`` and ``overlap``).

  Raises:
    ConfigError: before anything compiles (any check :func:`train.train` makes too).
    CompileFailed: the compiler refused the step.
  """
  log = metrics_lib.log
  where = target(topology, slices)
  # Before any device exists: the kernel compiles there, the mesh fits the chips and slices.
  check_kernel(config.model.get("hop_kernel", "auto"), where)
  sizes = mesh_lib.mesh_shape(config.mesh, where.chips, where=where.label)
  if where.slices > 1:
    mesh_lib.dcn_shape(sizes, where.slices)
  where = where.resolve()
  config = val_lib.resolve_run(config, where.chips, log)
  sizes = val_lib.validate_config(config, where.chips)
  mesh = mesh_lib.make_mesh(config.mesh, where.devices)
  log(f"compile only, for {where.label} ({where.devices[0].device_kind}): mesh {sizes}"
      + (f"; libtpu {ring_jax.topology.check_libtpu()}" if where.name else ""))
  rows = []
  with jax.set_mesh(mesh):
    stages = stages_lib.plan(config)
    for stage in stages:
      setup = stages_lib.build_stage(stage, mesh)
      c, m = stage.config, setup.model_cfg
      if stage.index == 0:  # build_stage logs the later stages'
        log(setup.attention_line)
      log(f"{stage.describe() + ': ' if len(stages) > 1 else ''}train step of "
          f"{m.num_params() / 1e6:,.2f}M params, batch {setup.train_shape[0]} x "
          f"{setup.train_shape[1]} tokens, attention={m.attention} layout={m.layout} "
          f"remat_policy={m.remat_policy}")
      t0 = time.perf_counter()
      with compiling(where):
        compiled = setup.train_step.compile(setup.train_shape)
      lines, row = memory_lines(compiled, where, time.perf_counter() - t0)
      log("\n".join(lines))
      buckets = buckets_lib.plan(c, m, mesh)
      if buckets:  # every bucket's program, as the run compiles them
        log(buckets_lib.describe(buckets))
        with compiling(where):
          count = len(buckets_lib.compile_steps(setup.train_step, buckets[:-1], c.microbatches))
        log(buckets_lib.compiled_count_line(count + 1))
      if m.attention != "dense":
        log(ring_jax.kernels.describe(m.hop_kernel, platform="tpu" if where.name else None))
        log(attn_lib.describe_routing(m, mesh))
      overlap = list(analysis.overlap_report(compiled).summary_lines())
      for line in overlap:
        log(line)
      rows.append(dict(row, seq_len=c.data.seq_len, overlap=overlap))
  return rows
