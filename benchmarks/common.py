"""The benchmarks' one harness: runs (fake CPU devices, the shared flags, provenance, result
files), timing (round-robin over cases, wall and process CPU seconds), compiled memory,
meshes, the collectives of a compiled program, and :class:`Clock`, a time budget.

Needs only JAX and NumPy (the model's axis names come from ``models.sharding``, which imports
without Flax), so every benchmark, on every accelerator image, uses it.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import functools
import glob
import json
import math
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import traceback
import types
from typing import Any, Callable, Sequence

import jax
import numpy as np

from ring_jax import analysis, topology

GIB = 2 ** 30
MIB = 2 ** 20

# configs/common.py's optimizer without warmup, for the benchmarks that time the train step
# (every timed step does a full AdamW update; the schedule does not change the cost).
OPTIM = types.SimpleNamespace(lr=3e-4, warmup_steps=0, min_lr_ratio=0.1, weight_decay=0.1,
                              b1=0.9, b2=0.95, eps=1e-8, grad_clip=1.0)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")


# --- Runs: devices, flags, provenance, result files -----------------------------------------------

def fake_cpu_devices(n: int = 8) -> None:
  """``n`` fake CPU devices, unless ``XLA_FLAGS`` already sets a count (the caller's wins;
  harmless on GPU/TPU, where only the CPU client is affected). Call before JAX's backend
  starts (the first ``jax.devices()``)."""
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def items(kind: Callable) -> Callable[[str], list]:
  """A flag type: the comma-separated values of ``kind`` (empty items skipped)."""
  def parse(text: str) -> list:
    return [kind(x) for x in text.split(",") if x]
  parse.__name__ = kind.__name__  # argparse names it in its errors
  return parse


ints, strs, floats = items(int), items(str), items(float)


def mesh_arg(text: str) -> dict[str, int]:
  """:func:`parse_mesh` for argparse (a bad mesh is a usage error, one line)."""
  try:
    return parse_mesh(text)
  except ValueError as e:
    raise argparse.ArgumentTypeError(str(e)) from None


#: The shared flags :func:`parser` adds when given a default: name -> (type, help).
SHARED_FLAGS = dict(
    repeats=(int, "timed calls per case"), lengths=(ints, "sequence lengths"),
    length=(int, "global sequence length"),
    mesh=(mesh_arg, "axis=size pairs, e.g. data=1,sequence=8"),
    ring=(int, "devices on the sequence axis"), heads=(int, "attention heads"),
    head_dim=(int, "size of a head"))


def parser(doc: str | None, *, out: str | None = None, **defaults) -> argparse.ArgumentParser:
  """An ``ArgumentParser`` (described by ``doc``'s first line) with ``--out`` (a result file
  name resolves into ``benchmarks/results``) and each of :data:`SHARED_FLAGS` given a default
  in ``defaults`` (``head_dim``: ``--head-dim``). Starts the run's clock (:func:`elapsed`)."""
  global _started
  _started = time.perf_counter()
  ap = argparse.ArgumentParser(description=(doc or "").strip().split("\n")[0])
  if out is not None:
    ap.add_argument("--out", default=out if os.path.dirname(out) or not out
                    else os.path.join(RESULTS, out), help="result file (JSON)")
  for name, default in defaults.items():
    kind, text = SHARED_FLAGS[name]
    ap.add_argument("--" + name.replace("_", "-"), type=kind, help=text,
                    default=list(default) if isinstance(default, tuple) else default)
  return ap


def git_state() -> str | None:
  """Commit of the checkout (and whether ring_jax/ had local edits) for the record."""
  def git(*args):
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=10).stdout.strip()
  try:
    return git("rev-parse", "--short", "HEAD") + (
        " (ring_jax/ modified)" if git("status", "--porcelain", "ring_jax") else "")
  except Exception:  # noqa: BLE001
    return None


def run_meta(argv: Sequence[str] | None = None, script: str | None = None, *,
             devices: bool = True, **fields) -> dict:
  """What a result file records of its run: UTC date, the command (``python <script>
  <argv>``; default the running script and ``sys.argv``), jax, platform, device kind and
  count (``devices=False``: none of these, for a run that uses no JAX), CPU count and
  architecture, Python, host, git commit, then ``fields``."""
  script = os.path.relpath(os.path.abspath(script or sys.argv[0]), ROOT)
  argv = sys.argv[1:] if argv is None else list(argv)
  out = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
             command=" ".join(["python", script, *argv]))
  if devices:
    dev = jax.devices()[0]
    out.update(jax=jax.__version__, platform=dev.platform, device_kind=dev.device_kind,
               num_devices=jax.device_count())
  return dict(out, cpu_count=os.cpu_count(), machine=platform.machine(),
              python=platform.python_version(), host=platform.node(), git=git_state(), **fields)


def write_result(path: str, result: dict, log: str | None = None) -> None:
  """Write a benchmark's result file (``benchmarks/results/*.json``), creating its folder;
  ``log``: also the printed table, next to it as ``.log``."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as fh:
    json.dump(result, fh, indent=1)
    fh.write("\n")
  if log is not None:
    with open(os.path.splitext(path)[0] + ".log", "w") as fh:
      fh.write(log.rstrip("\n") + "\n")


def save(path: str, result: dict, log: str | None = None) -> dict:
  """:func:`write_result` and a line saying where, unless ``path`` is empty (a run that writes
  nothing); returns ``result``."""
  if path:
    write_result(path, result, log)
    print(f"wrote {path}")
  return result


def error_line(e: BaseException, n: int = 200) -> str:
  """``"Type: first line of the message"`` (at most ``n`` characters of it), for a row that
  failed."""
  lines = str(e).splitlines()
  return f"{type(e).__name__}: {lines[0][:n] if lines else ''}"


# --- Timing ---------------------------------------------------------------------------------------

_started = time.perf_counter()  # the run's start: the last parser() call, else the import


def elapsed() -> float:
  """Seconds since the run began (the last :func:`parser` call, every benchmark's first step;
  else the harness's import), to 0.1 s, for its result file."""
  return round(time.perf_counter() - _started, 1)


def timed_call(fn: Callable, *args) -> tuple[float, float, Any]:
  """``(wall seconds, process CPU seconds, result)`` of ``fn(*args)``, waited for. The CPU
  seconds (user + system, every thread) measure the process's own work, which on a shared
  host varies less than the wall time."""
  c0, t0 = time.process_time(), time.perf_counter()
  out = jax.block_until_ready(fn(*args))
  return time.perf_counter() - t0, time.process_time() - c0, out


def time_calls(fn: Callable, args: Sequence = (), repeats: int = 5, *,
               warmup: int = 1) -> list[float]:
  """Wall seconds of each of ``repeats`` calls ``fn(*args)`` after ``warmup`` untimed ones
  (a step that returns new state: ``fn`` closes over it, ``lambda: s.update(step(s))``)."""
  return interleaved({0: (fn, args)}, repeats, warmup)[0]["wall"]


def interleaved(cases: dict[str, tuple[Callable, Sequence]], repeats: int, warmup: int = 1,
                on_error: Callable[[str, Exception], None] | None = None,
                before: Callable[[str, int], None] | None = None) -> dict[str, dict]:
  """``{name: {"wall": [s, ...], "cpu": [s, ...]}}`` of ``repeats`` calls ``fn(*args)`` per
  case after ``warmup`` untimed ones, timed round-robin (call 1 of every case, then call 2,
  ...), so a shared host's slow phases spread over all cases instead of penalising whichever
  ran then. ``before(name, round)`` runs before each call, untimed (e.g. a barrier across
  processes). A case whose call or ``before`` raises is dropped from later rounds
  (``on_error(name, exc)``; without it the exception propagates)."""
  out = {name: {"wall": [], "cpu": []} for name in cases}
  live = dict(cases)
  for it in range(warmup + repeats):
    for name, (fn, args) in list(live.items()):
      try:
        if before is not None:
          before(name, it)
        wall, cpu, _ = timed_call(fn, *args)
      except Exception as e:  # noqa: BLE001  (a real OOM on an accelerator, ...)
        if on_error is None:
          raise
        on_error(name, e)
        del live[name]
        continue
      if it >= warmup:
        out[name]["wall"].append(wall)
        out[name]["cpu"].append(cpu)
  return out


def fwd_bwd(f: Callable) -> Callable:
  """``(q, k, v, do) -> (out, dq, dk, dv)``: ``f``'s output and its VJP at ``do``."""
  def g(q, k, v, do):
    out, vjp = jax.vjp(f, q, k, v)
    return (out,) + tuple(vjp(do))
  return g


def median(times: Sequence[float]) -> float:
  return float(np.median(times))


# --- Compiled memory ------------------------------------------------------------------------------

# One definition, in the library: the bytes a compiled program holds per device.
MEMORY_FIELDS, compiled_memory = topology.MEMORY_FIELDS, topology.compiled_memory
per_device_bytes = topology.per_device_bytes


def temp_bytes(fn: Callable, *args) -> int:
  """Compiled temporary memory per device (``memory_analysis()``) of ``jax.jit(fn)`` at
  ``args`` (arrays or ``jax.ShapeDtypeStruct``s)."""
  return compiled_memory(jax.jit(fn).lower(*args).compile())["temp_size_in_bytes"]


def host_memory_available() -> int | None:
  """``MemAvailable`` of ``/proc/meminfo`` in bytes (None where there is none)."""
  try:
    with open("/proc/meminfo") as fh:
      return int(re.search(r"^MemAvailable:\s+(\d+)", fh.read(), re.M).group(1)) * 1024
  except (OSError, AttributeError):
    return None


def device_bytes_limit(device=None) -> int | None:
  """The memory XLA may use on ``device`` (``memory_stats()['bytes_limit']``), else None."""
  try:
    stats = (device or jax.devices()[0]).memory_stats() or {}
    return int(stats.get("bytes_limit", 0)) or None
  except Exception:  # noqa: BLE001  (CPU: no stats)
    return None


# --- Meshes ---------------------------------------------------------------------------------------

def parse_mesh(text: str, axes: Sequence[str] | None = None) -> dict[str, int]:
  """``'data=1,sequence=8'`` -> ``{'data': 1, 'pipeline': 1, 'sequence_outer': 1,
  'sequence': 8, 'tensor': 1}`` (one entry per axis of ``axes``, in its order; axes not
  named are 1; ``axes``: the trainer's ``models.sharding.MESH_AXES`` by default).

  Raises:
    ValueError: an unknown axis or a size that is not an integer, naming the format.
  """
  axes = _trainer_axes() if axes is None else tuple(axes)
  sizes = dict.fromkeys(axes, 1)
  for part in filter(None, text.split(",")):
    name, _, value = part.partition("=")
    if name.strip() not in axes or not value.strip().lstrip("-").isdigit():
      raise ValueError(f"mesh {text!r}: write axis=size pairs over {axes}, e.g. "
                       "'data=1,sequence=8'.")
    sizes[name.strip()] = int(value)
  return sizes


def make_mesh(sizes: dict[str, int] | Sequence[int], axes: Sequence[str] | None = None,
              devices=None) -> jax.sharding.Mesh:
  """A mesh with Auto axis types over the first ``prod(sizes)`` of ``devices``.

  ``sizes``: ``{axis: size}`` (axes in the trainer's order, as
  ``training.mesh.make_mesh`` builds them) or a shape for ``axes``.
  """
  if isinstance(sizes, dict):
    axes = _trainer_axes() if axes is None else tuple(axes)
    shape = tuple(int(sizes.get(a, 1)) for a in axes)
  else:
    shape, axes = tuple(sizes), tuple(axes or ("sequence",))
  devices = list(jax.devices() if devices is None else devices)[:math.prod(shape)]
  return jax.sharding.Mesh(np.asarray(devices).reshape(shape), axes,
                           axis_types=(jax.sharding.AxisType.Auto,) * len(axes))


def _trainer_axes() -> tuple[str, ...]:
  from models.sharding import MESH_AXES  # imports without Flax
  return tuple(MESH_AXES)


# --- Collectives of a compiled program ------------------------------------------------------------

COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_ARRAY = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
_ITEM_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "f32": 4, "s32": 4,
               "u32": 4, "f64": 8, "s64": 8, "u64": 8}


def shape_bytes(shape: str, first: bool = False) -> int:
  """Bytes of an HLO shape's arrays (``f32[4,8]{1,0}``, a tuple of them); ``first``: of its
  first array only (an async op's operand)."""
  arrays = _ARRAY.findall(shape)[:1] if first else _ARRAY.findall(shape)
  return sum(_ITEM_BYTES.get(t, 4) * math.prod(int(d) for d in dims.split(",") if d)
             for t, dims in arrays)


@contextlib.contextmanager
def without_persistent_cache():
  """JAX's persistent compilation cache off (then back as it was): an executable loaded
  from it (the dump options are not part of its key) ran no XLA passes and dumps
  nothing. ``reset_cache`` makes JAX re-read the setting, which it reads once."""
  from jax.experimental.compilation_cache import compilation_cache

  enabled = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)
  compilation_cache.reset_cache()
  try:
    yield
  finally:
    jax.config.update("jax_enable_compilation_cache", enabled)
    compilation_cache.reset_cache()


def compile_partitioned(lowered):
  """``(compiled, hlo)``: ``lowered.compile()`` and the HLO text the SPMD partitioner
  produced for it (dumped during that one compile, which bypasses JAX's persistent
  compilation cache), the program :func:`count_collectives` reads."""
  with tempfile.TemporaryDirectory(prefix="fit_hlo_", ignore_cleanup_errors=True) as directory:
    with without_persistent_cache():
      compiled = lowered.compile(compiler_options={
          "xla_dump_to": directory, "xla_dump_hlo_pass_re": "spmd-partitioning"})
    found = sorted(glob.glob(os.path.join(directory, "*after_spmd-partitioning*.txt")))
    if not found:
      raise RuntimeError(f"XLA wrote no partitioned HLO into {directory}")
    with open(found[-1]) as f:
      return compiled, f.read()


def count_collectives(hlo: str) -> dict[str, dict[str, int]]:
  """``{kind: {"count", "bytes"}}`` of the collectives in HLO text, per device.

  Read from the SPMD partitioner's output (:func:`compile_partitioned`), which writes a
  reduce-scatter as an ``all-reduce`` whose result each device only slices (``dynamic-slice``,
  maybe after adding other such partial sums): XLA:GPU/TPU rewrite it into a
  ``reduce-scatter`` (``ReduceScatterCreator``), XLA:CPU keeps it, so it counts here as a
  reduce-scatter. ``bytes``: each result's size (a reduce-scatter's: the buffer reduced). A
  loop body (the layer scan) counts once, not once per iteration.
  """
  ops, users = {}, collections.defaultdict(list)
  for inst in filter(None, map(analysis.parse_instruction, hlo.splitlines())):
    ops[inst.name] = (inst.shape, inst.opcode)
    for operand in inst.operands:
      users[operand].append(inst.name)
  out = {kind: {"count": 0, "bytes": 0} for kind in COLLECTIVES}
  for name, (shape, op) in ops.items():
    kind = op.removesuffix("-start")
    if kind not in COLLECTIVES:
      continue
    if kind == "all-reduce" and _only_sliced(name, ops, users):
      kind = "reduce-scatter"
    out[kind]["count"] += 1
    out[kind]["bytes"] += shape_bytes(shape)
  return out


# Ops a partial sum may pass through on its way to the slice that makes it a reduce-scatter.
_PASS_THROUGH = ("add", "copy", "bitcast", "reshape", "convert")


def _only_sliced(name: str, ops, users, depth: int = 0) -> bool:
  """Whether every use of ``name`` ends, through :data:`_PASS_THROUGH` ops, in a slice."""
  found = users.get(name, ())
  if not found or depth > 8:
    return False
  return all(ops[u][1] == "dynamic-slice" or (
      ops[u][1] in _PASS_THROUGH and _only_sliced(u, ops, users, depth + 1)) for u in found)


# --- Budgeted checks (one accelerator slot) -------------------------------------------------------

class Clock:
  """A run's clock against a time budget: :meth:`say` prints with the elapsed seconds,
  :meth:`left` the seconds left, :meth:`section` wraps a function so a failure is printed
  (with a short traceback) and the run goes on."""

  def __init__(self, budget_s: float):
    self.t0, self.budget_s = time.perf_counter(), budget_s

  def elapsed(self) -> float:
    return time.perf_counter() - self.t0

  def left(self) -> float:
    return self.budget_s - self.elapsed()

  def say(self, *a) -> None:
    print(f"[{self.elapsed():6.1f}s]", *a, flush=True)

  def section(self, fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapped(*a, **k):
      self.say(f"===== {fn.__name__} =====")
      try:
        return fn(*a, **k)
      except Exception as e:  # noqa: BLE001
        self.say(f"SECTION FAILED: {type(e).__name__}: {e}")
        traceback.print_exc(limit=3)
        return None
    return wrapped


# --- Child processes ------------------------------------------------------------------------------

def run_python(args: Sequence[str], timeout: float = 1800, env: dict | None = None) -> str:
  """The standard output of ``python args...`` run in the repository's root (this Python),
  with ``env`` added to this process's environment.

  Raises:
    RuntimeError: the command failed, with its exit status and the end of its stderr.
  """
  proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                        timeout=timeout, env={**os.environ, **(env or {})})
  if proc.returncode:
    raise RuntimeError(f"{os.path.basename(args[0])} failed ({proc.returncode}):\n"
                       f"{proc.stderr[-2000:]}")
  return proc.stdout


# --- Ring attention inputs on a sequence mesh ----------------------------------------------------

#: ``[B, L, ...]`` split over the mesh axis ``sequence`` on its dim 1.
SEQ_SPEC = jax.sharding.PartitionSpec(None, "sequence")


def ring_mesh(n: int) -> jax.sharding.Mesh:
  """A mesh of the first ``n`` devices on one axis, ``sequence``."""
  return make_mesh((n,), ("sequence",))


def abstract_qkv(mesh: jax.sharding.Mesh, shape: Sequence[int],
                 dtype=np.float32) -> jax.ShapeDtypeStruct:
  """A ``jax.ShapeDtypeStruct`` of ``shape`` (``[B, L, N, H]``) split over ``mesh``'s
  ``sequence`` axis: what a compile-only benchmark lowers the attention at."""
  return jax.ShapeDtypeStruct(tuple(shape), dtype,
                              sharding=jax.sharding.NamedSharding(mesh, SEQ_SPEC))


def normal_arrays(key, shapes: Sequence[Sequence[int]], dtype=np.float32,
                  sharding=None) -> list[jax.Array]:
  """One standard normal array per shape of ``shapes`` (drawn in float32 from its own key of
  ``jax.random.split(key, len(shapes))``, then cast to ``dtype``), placed with ``sharding``,
  else uncommitted (usable on one device or a mesh)."""
  keys = jax.random.split(key, len(shapes))
  xs = [jax.random.normal(k, tuple(s), np.float32).astype(dtype) for k, s in zip(keys, shapes)]
  return xs if sharding is None else [jax.device_put(x, sharding) for x in xs]
