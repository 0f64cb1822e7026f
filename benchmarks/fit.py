r"""How long a context fits: the longest ``seq_len`` whose train step fits in memory.

  python benchmarks/fit.py --config configs/llama_1b.py:long --devices 8 --memory_gib 128
  python benchmarks/fit.py --config configs/llama_7b.py --devices 8 \
      --mesh data=1,sequence=2,tensor=4 --config.batch_size=1 --seq_len 65536 --collectives
  python benchmarks/fit.py --config configs/llama_7b.py --topology v5p:4x4x4  # a TPU slice

Compiles the train step ``train.py`` compiles ahead of time against abstract inputs, on
``--devices`` fake CPU devices or a TPU slice's compile-only devices (``--topology``), and
searches the lengths on its ``memory_analysis()`` (:class:`Planner`, :func:`search`): a table
row per compiled length, then, as the LAST line, one JSON object. What a row counts, and what
the CPU plan can and cannot show: docs/performance.md, "How long a context fits".
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import common  # noqa: E402  (imports JAX but starts no backend)
from benchmarks.common import GIB, MIB  # noqa: E402


def define_flags() -> dict:
  """The command-line flags, defined only when run as a script (tests import this module
  next to train.py, which defines --config too; the accelerator image, which imports
  :func:`search`, has no ml_collections)."""
  from absl import flags
  from ml_collections import config_flags

  return dict(
      config=config_flags.DEFINE_config_file(
          "config", None, "ml_collections config (`path.py` or `path.py:arg`); override "
          "fields with --config.<field>=<value>, as for train.py.", lock_config=True),
      devices=flags.DEFINE_integer("devices", 1, "Devices of the mesh (fake CPU devices).",
                                   lower_bound=1),
      memory_gib=flags.DEFINE_float("memory_gib", None, "Memory per device, GiB (default: "
                                    "128, or the HBM of a --topology's chip)."),
      topology=flags.DEFINE_string(
          "topology", None, "Compile for this TPU slice (e.g. v5p:4x4x4) with the real TPU "
          "compiler instead of --devices CPU devices (needs the [tpu] extra)."),
      topology_slices=flags.DEFINE_integer(
          "topology_slices", 1, "With --topology: this many slices over the data center "
          "network.", lower_bound=1),
      seq_len=flags.DEFINE_integer("seq_len", None,
                                   "Check this one length instead of searching."),
      mesh=flags.DEFINE_string(
          "mesh", None, "Mesh axis sizes replacing config.mesh, e.g. 'data=1,sequence=8' "
          "(axes not named are 1; one may be -1)."),
      start=flags.DEFINE_integer("start", 131072, "First length of the power-of-two search "
                                 "(rounded to the length granularity).", lower_bound=1),
      xla_flags=flags.DEFINE_string("xla_flags", "", "Extra XLA flags for the compile."),
      out=flags.DEFINE_string("out", None, "Also write the final JSON object to this file."),
      collectives=flags.DEFINE_bool(
          "collectives", False, "Also count each compiled step's collectives (count and "
          "bytes per kind, read from its partitioned HLO) into the rows."),
  )


class FitError(ValueError):
  """A setting the planner cannot use; the message names the fix."""


def resolve_mesh(config, devices: int, mesh_text: str | None,
                 where: str | None = None) -> dict[str, int]:
  """The mesh sizes for ``devices``: ``--mesh`` (e.g. ``'data=1,sequence=8'``) or config.mesh;
  errors name the override. ``where``: what the devices are (a topology), for the error."""
  from training import errors
  from training import mesh as mesh_lib

  try:
    mesh_config = common.parse_mesh(mesh_text) if mesh_text else dict(config.mesh)
  except ValueError as e:
    raise FitError(f"--{e}") from None
  try:
    return mesh_lib.mesh_shape(mesh_config, devices, where=where)
  except errors.ConfigError as e:
    flag = "the topology's" if where else f"--devices={devices}"
    raise FitError(f"{e} For {flag} {devices} devices pass e.g. --mesh data=1,sequence="
                   f"{devices} or --config.mesh.sequence={devices} --config.mesh.data=-1."
                   ) from None


class Planner:
  """Compiles the config's train step at given lengths and records the memory of each."""

  def __init__(self, config, sizes: dict[str, int], limit_bytes: int,
               collectives: bool = False, devices=None):
    import jax

    from models import lengths
    from models import sharding as shd
    from training import mesh as mesh_lib
    from training import step as step_lib
    from training import validation as val_lib

    self.ring = shd.ring_size(sizes)
    # init.hf_dir's model fields, config.stages and model.layout="auto": what train.py
    # resolves at startup for this data and ring.
    config, _ = val_lib.resolve_config(config, self.ring)
    self.limit, self.collectives = limit_bytes, collectives
    devices = jax.devices() if devices is None else devices
    self.mesh = mesh_lib.make_mesh(sizes, devices[:math.prod(sizes.values())])
    self.platform = self.mesh.devices.flat[0].platform
    # attention="auto" stays: its backend asks ring_jax.plan at each compiled length, what
    # train.py would decide at startup for that data.seq_len.
    self.model_cfg = val_lib.llama_config(config)
    self.multiple = lengths.length_multiple(self.model_cfg, self.ring)
    self.rows = config.batch_size
    micro = config.microbatches
    if self.rows % micro or (self.rows // micro) % sizes["data"]:
      raise FitError(f"batch_size={self.rows} / microbatches={micro} must be divisible by the "
                     f"mesh 'data' axis ({sizes['data']}); e.g. --config.batch_size="
                     f"{sizes['data'] * micro}.")
    val_lib.check_pipeline(config, sizes)  # a ConfigError: main prints it in one line too
    tx = step_lib.make_optimizer(config.optim, config.total_steps)
    self.step = step_lib.build_train_step(self.model_cfg, self.mesh, tx, microbatches=micro,
                                          seed=config.seed)
    self.rows_by_length: dict[int, dict] = {}
    self.unit = "GiB" if limit_bytes >= GIB else "MiB"  # of the printed table

  def check(self, length: int) -> dict:
    """Compiles the step at ``length`` (padded to :func:`training.validation.run_length`,
    the row's ``run_len``); returns (and prints) its row of the table."""
    from training import errors
    from training import validation as val_lib

    if length in self.rows_by_length:
      return self.rows_by_length[length]
    try:  # a length the ring does not split runs padded, as train.py runs it
      run_len = val_lib.run_length(self.model_cfg, self.ring, length)
    except errors.ConfigError as e:
      raise FitError(str(e)) from None
    t0, shape, m = time.perf_counter(), (self.rows, run_len), self.model_cfg
    if self.collectives:
      compiled, hlo = common.compile_partitioned(self.step.lower(shape))
    else:
      compiled = self.step.compile(shape)
    ma = common.compiled_memory(compiled, common.MEMORY_FIELDS + ("host_temp_size_in_bytes",))
    total = common.per_device_bytes(ma)
    offloaded = (self.step.offloaded_bytes(shape, layers=m.num_layers if m.scan_layers else 1)
                 if "offload" in m.remat_policy and self.platform == "cpu" else 0)
    row = dict(seq_len=length, run_len=run_len,
               **{f"{k}_bytes": ma.get(f"{k}_size_in_bytes", 0)
                  for k in ("argument", "temp", "output", "alias", "host_temp")},
               compiled_per_device_bytes=total, offloaded_bytes=offloaded,
               per_device_bytes=total - offloaded, fits=bool(total - offloaded <= self.limit),
               compile_s=round(time.perf_counter() - t0, 1))
    if self.collectives:
      row["collectives"] = common.count_collectives(hlo)
    if self.platform == "tpu":  # the TPU compiler's schedule: ring transfers in flight
      from ring_jax import analysis
      report = analysis.overlap_report(compiled)
      row["ring_in_flight"], row["ring_transfers"] = report.ring()
      row["transfers"] = {k: list(v) for k, v in report.kinds().items()}
      row["exposed"] = sorted({f"{t.kind}: {t.scope}" for t in report.exposed()})
    self.rows_by_length[length] = row
    print(table_line(row, self.unit), flush=True)
    return row


def search(fits, start: int, max_len: int, multiple: int = 1,
           resolution: float = 0.125) -> tuple[int | None, bool]:
  """``(longest length that fits or None, whether a length that does not fit bounds it)``:
  ``fits(length)`` at multiples of ``multiple``, doubling from ``start`` (rounded down) up to
  ``max_len`` until one does not fit, or halving until one does, then bisecting until the
  bounds are within ``resolution`` of the answer (``resolution=1``: powers of two only)."""
  g = multiple
  length = max(g, start // g * g)
  best, bad = (length, None) if fits(length) else (None, length)
  while bad is None and 2 * best <= max_len:  # doubling until a length does not fit
    if fits(2 * best):
      best *= 2
    else:
      bad = 2 * best
  while best is None and bad // 2 >= g and (bad // 2) % g == 0:  # halving until one fits
    if fits(bad // 2):
      best = bad // 2
    else:
      bad //= 2
  while best is not None and bad is not None and bad - best > max(g, resolution * best):
    mid = (best + bad) // 2 // g * g
    if mid <= best:
      break
    if fits(mid):
      best = mid
    else:
      bad = mid
  return best, bad is not None


COLUMNS = (("argument", "argument_bytes"), ("temp", "temp_bytes"), ("output", "output_bytes"),
           ("aliased", "alias_bytes"), ("to host", "offloaded_bytes"),
           ("per-device", "per_device_bytes"))


def table_line(row: dict | None, unit: str) -> str:
  """The printed table's header (``row=None``) or ``row``'s line, bytes in ``unit``."""
  if row is None:
    cells = ["seq_len", *(f"{name} {unit}" for name, _ in COLUMNS), "fits", "compile s"]
  else:
    cells = [row["seq_len"], *(f"{row[key] / (GIB if unit == 'GiB' else MIB):.2f}"
                               for _, key in COLUMNS),
             "yes" if row["fits"] else "no", f"{row['compile_s']:.1f}"]
  return " ".join(f"{c:>{w}}" for c, w in zip(cells, (10,) + (16,) * len(COLUMNS) + (5, 10)))


def run(config, *, devices: int = 1, memory_gib: float | None = None,
        seq_len: int | None = None, mesh: str | None = None, start: int = 131072,
        max_len: int = 2 ** 26, resolution: float = 0.125, collectives: bool = False,
        topology: str | None = None, topology_slices: int = 1) -> dict:
  """The planner on the current JAX backend's devices, or on the compile-only devices of
  ``topology_slices`` slices of TPU ``topology``; returns the final JSON object as a dict.
  ``memory_gib`` defaults to the topology chip's HBM, else 128."""
  import jax

  from training import compile_only as compile_lib

  # Every check before the first compile (check_kernel: a topology's; no devices yet).
  where = (compile_lib.target(topology, topology_slices) if topology is not None
           else compile_lib.Target(name=None, slices=1, chips=devices))
  devices = where.chips
  sizes = resolve_mesh(config, devices, mesh, where=where.label if topology else None)
  compile_lib.check_kernel(config.model.get("hop_kernel", "auto"), where)
  if topology is None and len(jax.devices()) < devices:
    raise FitError(f"--devices={devices} but JAX has {len(jax.devices())} devices; run "
                   "benchmarks/fit.py as a script (it creates the fake CPU devices).")
  where = where.resolve()
  if memory_gib is None:
    memory_gib = where.hbm_bytes / GIB if topology and where.hbm_bytes else 128.0
  limit = int(memory_gib * GIB)
  planner = Planner(config, sizes, limit, collectives=collectives, devices=list(where.devices))
  device = where.devices[0]
  m = planner.model_cfg
  print(f"train step of {m.num_params() / 1e9:.3f}B params (remat_policy={m.remat_policy}, "
        f"layout={m.layout}, attention={m.attention}, tensor_sequence_parallel="
        f"{m.tensor_sequence_parallel}, dtype={m.dtype}, param_dtype="
        f"{m.param_dtype}); mesh {sizes}; batch {planner.rows} rows; lengths in multiples of "
        f"{planner.multiple}; limit {memory_gib:g} GiB per device; compiled for "
        f"{device.platform} ({device.device_kind}"
        + (f", TPU slice {topology} x {topology_slices}" if topology else "") + ")", flush=True)
  print(table_line(None, planner.unit), flush=True)
  with compile_lib.compiling(where) if topology else contextlib.nullcontext():  # the search
    if seq_len is not None:
      row, bounded = planner.check(seq_len), True
    else:
      best, bounded = search(lambda length: planner.check(length)["fits"], start, max_len,
                             planner.multiple, resolution)
      # nothing fits: report the shortest length tried
      row = planner.rows_by_length[min(planner.rows_by_length) if best is None else best]
      if not bounded and row["fits"]:
        print(f"note: every length up to {max_len} fits; the answer is a lower bound", flush=True)
    return dict(seq_len=row["seq_len"], per_device_bytes=row["per_device_bytes"],
                fits=row["fits"], memory_bytes=limit, devices=devices, mesh=sizes,
                batch_rows=planner.rows, remat_policy=m.remat_policy, platform=device.platform,
                topology=topology, topology_slices=topology_slices if topology else None,
                xla_flags=os.environ.get("XLA_FLAGS", ""), upper_bounded=bounded,
                checked=sorted(planner.rows_by_length.values(), key=lambda r: r["seq_len"]))


def main(argv) -> None:
  from absl import app

  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  kw = {name: flag.value for name, flag in _FLAGS.items()}
  xla_flags, out = kw.pop("xla_flags"), kw.pop("out")
  if kw["config"] is None:
    raise app.UsageError("--config is required, e.g. --config configs/llama_1b.py:long")
  import jax  # CPU devices (before JAX starts), ignored by --topology; the caller's count wins
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {xla_flags}".strip()
  common.fake_cpu_devices(kw["devices"])
  jax.config.update("jax_platforms", "cpu")
  from training import compile_only as compile_lib
  from training.errors import ConfigError

  try:
    result = run(**kw)
  except (FitError, ConfigError, compile_lib.CompileFailed) as e:  # each names the fix
    print(f"error: {e}", file=sys.stderr, flush=True)
    sys.exit(1 if isinstance(e, compile_lib.CompileFailed) else 2)  # 1: the TPU compiler's
  if out:
    common.write_result(out, dict(result, meta=common.run_meta(script=__file__)))
  print(json.dumps(result, separators=(",", ":")), flush=True)


if __name__ == "__main__":
  from absl import app

  _FLAGS = define_flags()
  app.run(main)
