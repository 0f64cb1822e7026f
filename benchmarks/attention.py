"""Side-by-side attention benchmark: ring_jax vs all-gather CP vs dense vs the paper's code.

The sections of :data:`SECTIONS` (time and compiled memory per device, correctness, bf16
error, a fixed-block memory scan, a block-size sweep) write ``<out>/attention_<platform>.json``
(``--tag``); implementations, sections and commands: benchmarks/README.md, "Attention". On
GPU/TPU the same command uses the real devices and bfloat16.

  PYTHONPATH=. python benchmarks/attention.py --lengths 2048 --repeats 2 --variants ring,paper
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ring_jax  # noqa: E402
from ring_jax.ring import default_block  # noqa: E402
from benchmarks import common  # noqa: E402
from benchmarks.common import GIB, MIB, fwd_bwd, ints, strs  # noqa: E402,F401
# The conformance kit's adapter of ringattention 0.1.2 (one import, one call).
from benchmarks.conformance import import_ringattention as import_paper  # noqa: E402
from benchmarks.conformance import paper_local  # noqa: E402

common.fake_cpu_devices()

AXIS = "sequence"
SPEC = P(None, AXIS, None, None)
MODES = ("fwd", "fwdbwd")
ERR_RINGS = (1, 2, 4, 8)  # the bf16 section's ring sizes (those the devices allow)
GRADS = ("out", "dq", "dk", "dv")

CPU_NOTE = (
    "CPU caveat: the fake devices are threads sharing this machine's cores, so wall time "
    "measures the TOTAL work of all devices, not the busiest device: causal load balancing "
    "(zigzag/striped vs contiguous; benchmarks/core_report.py, benchmarks/balance.py) and "
    "communication overlap (ppermute/all-gather are memcpys here) do not show.")


# --- Implementations as functions of global [B, L, N, H] arrays (inputs in layout order) ----------

#: ``ring-<layout>+<suffix>`` -> the ring's keywords (no routing suffix: the library's default
#: ``causal_routing``, routed for causal contiguous only, ``ring_jax.routing.check_routing``).
RING_SUFFIXES = {"routed": dict(causal_routing=True), "full": dict(causal_routing=False),
                 "overlap": dict(overlap_dkv=True)}


def ring_options(name):
  """``"ring-<layout>[+routed|+full][+overlap][:<hop kernel>]"`` -> ``(layout, keywords of
  ring_jax.ring_attention)``: ``hop_kernel`` (default ``"auto"``), ``causal_routing`` (None)
  and ``overlap_dkv`` (False), set by :data:`RING_SUFFIXES` (which combine)."""
  layout, _, kernel = name[len("ring-"):].partition(":")
  layout, *suffixes = layout.split("+")
  kw = dict(hop_kernel=kernel or "auto", causal_routing=None, overlap_dkv=False)
  for suffix in suffixes:
    if suffix not in RING_SUFFIXES:
      raise ValueError(f"{name!r}: the suffix after '+' must be one of {list(RING_SUFFIXES)}.")
    kw.update(RING_SUFFIXES[suffix])
  return layout, kw


def ring_variant(name):
  """``(layout, hop kernel name, causal_routing)`` of a ring variant (:func:`ring_options`)."""
  layout, kw = ring_options(name)
  return layout, kw["hop_kernel"], kw["causal_routing"]


def impl_layout(name):
  """The layout an implementation takes its inputs in (a ring's own, else contiguous)."""
  return ring_options(name)[0] if name.startswith("ring-") else "contiguous"


def make_impl(name, *, mesh, is_causal, dtype, block, paper_fn=None):
  """Returns ``(f(q, k, v) -> out, layout, on_one_device)`` or raises."""
  layout = impl_layout(name)
  if name == "dense":
    return functools.partial(jax.nn.dot_product_attention, is_causal=is_causal), layout, True
  blocks = dict(axis_name=AXIS, is_causal=is_causal, layout=layout, block_q=block, block_kv=block)
  if name.startswith("ring-"):
    local = functools.partial(ring_jax.ring_attention, **ring_options(name)[1], **blocks)
  elif name == "allgather":
    local = functools.partial(ring_jax.all_gather_attention, **blocks)
  elif name == "paper":
    if paper_fn is None:
      raise RuntimeError("paper code not importable")
    local = paper_local(paper_fn, is_causal=is_causal, chunk=block, dtype=dtype, axis_name=AXIS)
  else:
    raise ValueError(f"unknown implementation {name!r}")
  return (jax.shard_map(local, mesh=mesh, in_specs=(SPEC,) * 3, out_specs=SPEC,
                        check_vma=name.startswith("ring-")), layout, False)


def block_for(name, local_len, block=None):
  """Block size an implementation uses at this local length (``block``: the caller's)."""
  return min(block, local_len) if block else default_block(impl_layout(name), local_len)


@dataclasses.dataclass
class Setup:
  """What every case of a run shares: the ring's mesh, dtype, head shape (batch 1), the
  paper's function (None: not importable) and the single-device memory budget (bytes)."""
  mesh: jax.sharding.Mesh
  dtype: Any
  heads: int
  head_dim: int
  paper_fn: Callable | None = None
  budget: int = 0
  batch: int = 1

  @property
  def ring(self) -> int:
    return self.mesh.shape[AXIS]

  def shape(self, length):
    return (self.batch, length, self.heads, self.head_dim)

  def impl(self, name, causal, block, mesh=None, dtype=None):
    """:func:`make_impl` on ``mesh`` in ``dtype`` (default: the run's)."""
    return make_impl(name, mesh=mesh or self.mesh, is_causal=causal, dtype=dtype or self.dtype,
                     block=block, paper_fn=self.paper_fn)

  def natural(self, name, causal, xs, mesh=None, dtype=None):
    """``[out, dq, dk, dv]`` of implementation ``name`` (its default block, on ``mesh``,
    default the run's) at natural-order ``xs``: a ring's inputs moved into its layout and
    the results moved back."""
    ring = (mesh or self.mesh).shape[AXIS]
    f, layout, one_dev = self.impl(name, causal, block_for(name, xs[0].shape[1] // ring), mesh,
                                   dtype)
    to, back = (functools.partial(g, layout=layout, ring_size=ring)
                for g in (ring_jax.to_layout, ring_jax.from_layout))
    return jax.jit(fwd_bwd(f) if one_dev else
                   lambda *a: [back(x) for x in fwd_bwd(f)(*map(to, a))])(*xs)


def memory_budget(gib):
  """Single-device bytes above which dense rows are not run: ``gib``, else 90% of the
  accelerator, else (CPU, a shared machine) min(8 GiB, 40% of the available memory)."""
  if gib:
    return int(gib * GIB)
  limit = common.device_bytes_limit()
  if limit:
    return int(0.9 * limit)
  return int(min(8 * GIB, 0.4 * (common.host_memory_available() or 16 * GIB)))


# --- Sections main and sweep: compile every case of a group, then time them round-robin -----------

def prepare_case(s, name, length, causal, block=None, timed=True, modes=MODES):
  """Compiles ``modes`` (fwd, fwd+bwd) against abstract inputs; returns ``(row, {mode:
  (compiled, args)})`` of what will be timed (with inputs drawn only then: dense rows over
  ``s.budget`` and untimed cases get memory only)."""
  block = block_for(name, length // s.ring, block)
  f, layout, one_dev = s.impl(name, causal, block)
  sharding = (jax.sharding.SingleDeviceSharding(jax.devices()[0]) if one_dev else
              NamedSharding(s.mesh, SPEC))
  x = jax.ShapeDtypeStruct(s.shape(length), s.dtype, sharding=sharding)
  row = dict(impl=name, length=length, causal=causal, layout=layout,
             block=None if one_dev else block, devices=1 if one_dev else s.ring,
             fwd_status="not run", fwdbwd_status="not run")
  todo = {}
  for mode, fn, n in (("fwd", f, 3), ("fwdbwd", fwd_bwd(f), 4)):
    if mode not in modes:
      continue
    compile_s, _, compiled = common.timed_call(lambda: jax.jit(fn).lower(*(x,) * n).compile())
    mem = common.compiled_memory(compiled)
    need = sum(mem.get(f"{k}_size_in_bytes", 0) for k in ("temp", "argument", "output"))
    row.update({f"{mode}_compile_s": round(compile_s, 2), f"{mode}_mem": mem,
                f"{mode}_times_s": []})
    if one_dev and need > s.budget:
      status = f"OOM(est {need / GIB:.1f} GiB > {s.budget / GIB:.1f} GiB budget)"
    elif not timed:
      status = "memory only (not timed at this length)"
    else:
      status, todo[mode] = "pending", (compiled, n)
    row[f"{mode}_status"] = status
  if todo:
    xs = common.normal_arrays(jax.random.key(length), [s.shape(length)] * 4, s.dtype, sharding)
    todo = {mode: (c, xs[:n]) for mode, (c, n) in todo.items()}
  return row, todo


def useful_flops(s, length, causal):
  """Matmul FLOPs attention's fwd+bwd must do (no recomputation, masked pairs excluded).

  Forward: ``QK^T`` and ``PV``, ``4 B L^2 N H``; the backward's ``dV``, ``dP``, ``dQ``,
  ``dK`` twice that (FlashAttention's recomputed ``QK^T`` is not counted). Causal: the
  ``L (L + 1) / 2`` visible pairs.
  """
  pairs = length * (length + 1) / 2 if causal else length * length
  return 3 * 4 * s.batch * pairs * s.heads * s.head_dim


def matmul_case(s, flops):
  """``(compiled, args, flops)`` of a batched ``jnp.einsum`` of about ``flops`` FLOPs, one
  ``m x m x m`` product per device of the mesh: the rate the attention's devices reach."""
  n = s.ring
  m = max(64, int(round((flops / (2 * n)) ** (1 / 3) / 32)) * 32)
  a, b = common.normal_arrays(jax.random.key(1), [(n, m, m)] * 2, s.dtype,
                              NamedSharding(s.mesh, P(AXIS, None, None)))
  f = jax.jit(lambda a, b: jnp.einsum("nij,njk->nik", a, b,
                                      preferred_element_type=jnp.float32))
  return f.lower(a, b).compile(), (a, b), 2 * n * m ** 3


def run_group(s, cases, *, length, causal, repeats, warmup=1, modes=MODES, matmul_peak=False):
  """The ``(name, block)`` cases of one (length, mask) (block None: the default): compile
  all, then time them round-robin (``common.interleaved``); ``matmul_peak``: also a
  same-size matmul, and each row's useful fwd+bwd FLOP/s as a fraction of its rate."""
  rows, todo = [], []
  for name, block in cases:
    try:
      row, t = prepare_case(s, name, length, causal, block, modes=modes)
    except Exception as e:  # noqa: BLE001
      row, t = dict(impl=name, length=length, causal=causal, devices=s.ring, block=block,
                    fwd_mem={}, fwdbwd_mem={}, fwd_times_s=[], fwdbwd_times_s=[],
                    fwd_status=f"failed: {common.error_line(e)}", fwdbwd_status="failed"), {}
    rows.append(row)
    todo += [(row, mode, c, a) for mode, (c, a) in t.items()]
  flops, peak = useful_flops(s, length, causal), None
  if matmul_peak and todo:
    c, a, peak_flops = matmul_case(s, flops)
    peak = dict(impl="matmul", flops=peak_flops, fwdbwd_times_s=[], fwdbwd_status="pending")
    todo.append((peak, "fwdbwd", c, a))

  def failed(i, e):
    row, mode = todo[i][:2]
    row[f"{mode}_status"] = f"failed: {common.error_line(e, 160)}"

  times = common.interleaved({i: (c, a) for i, (_, _, c, a) in enumerate(todo)}, repeats,
                             warmup, on_error=failed)
  for i, (row, mode, _, _) in enumerate(todo):
    if row[f"{mode}_status"] == "pending":
      wall, cpu = times[i]["wall"], times[i]["cpu"]
      row.update({f"{mode}_times_s": [round(t, 5) for t in wall],
                  f"{mode}_cpu_s": [round(t, 4) for t in cpu],
                  f"{mode}_median_s": common.median(wall),
                  f"{mode}_cpu_median_s": common.median(cpu), f"{mode}_status": "ok"})
  for row in rows + ([peak] if peak else []):
    row["repeats"], row["warmup"] = repeats, warmup
  peak_rate = (peak["flops"] / peak["fwdbwd_median_s"]
               if peak and peak["fwdbwd_status"] == "ok" else None)
  for row in rows:
    if "fwdbwd_median_s" in row:
      rate = flops / row["fwdbwd_median_s"]
      row["fwdbwd_useful_gflops"] = round(rate / 1e9, 2)
      if peak_rate:
        row["matmul_gflops"] = round(peak_rate / 1e9, 2)
        row["fwdbwd_peak_fraction"] = round(rate / peak_rate, 3)
  return rows


def sweep_blocks(name, local_len, candidates):
  """The candidate blocks implementation ``name`` can run at this local length: divisors of
  the layout's chunk (half the shard for zigzag, where a block across the two chunks
  cannot skip the masked one), plus the whole chunk when it is no larger than the largest
  candidate."""
  chunk = local_len // 2 if impl_layout(name) == "zigzag" else local_len
  whole = {chunk} if chunk <= max(candidates) else set()
  return sorted({b for b in candidates if b <= chunk and chunk % b == 0} | whole)


def sweep(s, args, names, masks, result, save):
  """Section ``sweep``: fwd+bwd time (median of ``--sweep-repeats``, every block of one
  (length, mask, layout) timed round-robin) and compiled temp memory per block size, for each
  ring variant; the default block (``ring_jax.ring.default_block``) marked. The table
  ``ring_jax.ring.BLOCK_TARGETS`` is read from these rows (docs/performance.md)."""
  rows = result["sweep"] = []  # filled row by row, saved after each group
  print(f"\n== block-size sweep, fwd+bwd (ring of {s.ring}; * = today's default) ==\n"
        f"  {'L':>6} {'mask':<6} {'layout':<11} {'block':>5} {'ms':>8} {'x best':>6} {'MiB':>6}",
        flush=True)
  for length in args.sweep_lengths:
    local = length // s.ring
    for causal in masks:
      for name in [n for n in names if n.startswith("ring-")]:
        default = default_block(impl_layout(name), local)
        group = run_group(s, [(name, b) for b in sweep_blocks(name, local, args.sweep_blocks)],
                          length=length, causal=causal, repeats=args.sweep_repeats,
                          modes=("fwdbwd",), matmul_peak=args.matmul_peak)
        best = min((r["fwdbwd_median_s"] for r in group if r["fwdbwd_status"] == "ok"),
                   default=None)
        for r in group:
          r.update(default_block=default, is_default=r["block"] == default)
          if best and r["fwdbwd_status"] == "ok":
            r["x_best"] = round(r["fwdbwd_median_s"] / best, 3)
          rows.append(r)
          print(f"  {length:>6} {'causal' if causal else 'full':<6} {name[5:]:<11} "
                f"{r['block']:>5}{'*' if r['is_default'] else ' '}{fmt_ms(r, 'fwdbwd'):>8} "
                f"{r.get('x_best', float('nan')):>6.3f} {fmt_mem(r, 'fwdbwd'):>6}", flush=True)
        save()


def main_table(s, args, names, masks, result, save):
  """Section ``main``: per length and mask, every implementation's fwd and fwd+bwd time
  (:func:`run_group`) and compiled memory, with the load average before and after."""
  print("\n== timing (median of repeats after warm-up, implementations timed round-robin) "
        "and compiled temp memory per device ==", flush=True)
  for length in args.lengths:
    for causal in masks:
      load0 = os.getloadavg()[0]
      rows = run_group(s, [(n, None) for n in names], length=length, causal=causal,
                       repeats=args.repeats, matmul_peak=args.matmul_peak)
      for row in rows:
        row["loadavg_1min"] = [round(load0, 2), round(os.getloadavg()[0], 2)]
        result["rows"].append(row)
        print(row_line(row), flush=True)
      print(f"  (t={common.elapsed():.0f}s, load average {load0:.1f} -> "
            f"{os.getloadavg()[0]:.1f})", flush=True)
      save()
  if jax.default_backend() == "cpu":
    print("\n" + CPU_NOTE)


# --- Sections check and bf16 (errors against oracles), memscan (compile only) ---------------------

def check(s, args, names, masks, result, save):
  """Section ``check``: max abs error of each implementation's output and grads against
  ``ring_jax.reference_attention`` (natural order) at the shortest length (at most 4096)."""
  length = min(min(args.lengths), 4096)
  print(f"\n== correctness vs ring_jax.reference_attention at L={length} (max abs error) ==",
        flush=True)
  xs = common.normal_arrays(jax.random.key(7), [s.shape(length)] * 4, s.dtype)
  for causal in masks:
    ref = functools.partial(ring_jax.reference_attention, is_causal=causal)
    want = [np.asarray(w, np.float32) for w in jax.jit(fwd_bwd(ref))(*xs)]
    tol = (2e-4 if s.dtype == jnp.float32 else 5e-2) * max(1.0, *(np.abs(w).max() for w in want))
    for name in names:
      c = dict(impl=name, length=length, causal=causal)
      try:
        errs = max_abs_err(s.natural(name, causal, xs), want)
        c.update(max_abs_err=errs, ok=all(e <= tol for e in errs.values()), tol=float(tol))
      except Exception as e:  # noqa: BLE001
        c.update(ok=False, error=common.error_line(e))
      result["checks"].append(c)
      print(f"  {'causal' if causal else 'full':<7} {name:<16} {'OK ' if c['ok'] else 'BAD'} " +
            (" ".join(f"{k}={v:.1e}" for k, v in c["max_abs_err"].items())
             if "max_abs_err" in c else c["error"]), flush=True)


def max_abs_err(got, want):
  """``{out, dq, dk, dv: max abs error}`` of ``got`` against ``want``, in ``want``'s dtype."""
  return {nm: float(np.max(np.abs(np.asarray(x, w.dtype) - w)))
          for nm, x, w in zip(GRADS, got, want)}


def oracle_f64(q, k, v, do, is_causal):
  """Dense attention and its VJP in float64 (``ring_jax.testing.oracle``): out, dq, dk, dv."""
  from ring_jax.testing import oracle  # noqa: PLC0415

  pos = np.arange(q.shape[1])
  r = oracle.attention(q, k, v, oracle.visibility(pos, pos, is_causal), q.shape[-1] ** -0.5,
                       np.asarray(do, np.float64))
  return [r[name] for name in GRADS]


def bf16(s, args, names, masks, result, save):
  """Section ``bf16``: relative (Frobenius) and max abs error of out, dq, dk, dv in bfloat16
  against the float64 oracle, causal, at ``--err-length`` per ring size of :data:`ERR_RINGS`
  and ring layout (and the paper's code); the first row: bfloat16's own rounding."""
  length = args.err_length
  print(f"\n== bf16 relative error (||x - x64|| / ||x64||) vs float64 oracle, causal, "
        f"L={length} ==\n  {'impl':<34} {'ring':>4}  {'out':>8}  {'dq':>8}  "
        f"{'dk':>8}  {'dv':>8}", flush=True)
  xs = common.normal_arrays(jax.random.key(3), [(1, length, s.heads, s.head_dim)] * 4,
                           jnp.bfloat16)
  want = oracle_f64(*xs, True)
  rel = lambda got: {nm: float(np.linalg.norm(np.asarray(x, np.float64) - w) /  # noqa: E731
                               np.linalg.norm(w)) for nm, x, w in zip(GRADS, got, want)}
  rows = [dict(impl="bf16 rounding of the f64 result", ring=None,
               rel_err=rel([jnp.asarray(w, jnp.bfloat16) for w in want]))]
  impls = [f"ring-{lay}" for lay in args.layouts] + (["paper"] if s.paper_fn else [])
  for ring in [r for r in ERR_RINGS if r <= len(jax.devices())]:
    mesh = common.ring_mesh(ring)
    for name in impls:
      try:
        got = s.natural(name, True, xs, mesh, jnp.bfloat16)
        rows.append(dict(impl=name, ring=ring, rel_err=rel(got),
                         max_abs_err=max_abs_err(got, want)))
      except Exception as e:  # noqa: BLE001
        rows.append(dict(impl=name, ring=ring, error=common.error_line(e)))
      print_err_row(rows[-1])
  print_err_row(rows[0])
  result["bf16_error"] = dict(length=length, causal=True, heads=s.heads, head_dim=s.head_dim,
                              rows=rows)


def memscan(s, args, names, masks, result, save):
  """Section ``memscan``: compiled fwd and fwd+bwd temp memory per device at the fixed block
  ``--memscan-block`` (compile only), per length of ``--memscan-lengths`` the block divides."""
  block = args.memscan_block
  print(f"\n== compiled temp memory per device at a fixed block of {block} (compile only) ==",
        flush=True)
  rows = result["memscan"] = []
  for causal, length, name in [(c, n, i) for c in masks for n in args.memscan_lengths
                               for i in names]:
    if name == "dense" or block not in sweep_blocks(name, length // s.ring, [block]):
      continue
    try:
      mem = prepare_case(s, name, length, causal, block, timed=False)[0]
      r = dict(impl=name, length=length, block=block, causal=causal,
               fwd_temp=mem["fwd_mem"].get("temp_size_in_bytes"),
               fwdbwd_temp=mem["fwdbwd_mem"].get("temp_size_in_bytes"))
    except Exception as e:  # noqa: BLE001
      r = dict(impl=name, length=length, block=block, error=str(e)[:200])
    rows.append(r)
    print(f"  L={length:<7} {name:<16} block={block:<5} " +
          (f"fwd {r['fwd_temp'] / MIB:8.1f} MiB  fwd+bwd {r['fwdbwd_temp'] / MIB:8.1f} MiB"
           if "error" not in r else r["error"]), flush=True)


#: The sections in the order they run (``--sections`` picks).
SECTIONS = dict(check=check, sweep=sweep, bf16=bf16, memscan=memscan, main=main_table)


# --- Output ---------------------------------------------------------------------------------------

def fmt_ms(r, mode):
  st = r.get(f"{mode}_status", "-")
  if st.startswith("ok"):
    return f"{1e3 * r[f'{mode}_median_s']:.1f}"
  if st.startswith("OOM"):
    return "OOM(est)"
  return "not run" if st.startswith("memory only") else "FAIL"


def fmt_mem(r, mode):
  m = r.get(f"{mode}_mem", {}).get("temp_size_in_bytes")
  return "-" if m is None else f"{m / MIB:.1f}"


def row_line(row):
  """One timed row as a line of text (the per-row log and ``--render``)."""
  return (f"  L={row['length']:<6} {'causal' if row['causal'] else 'full':<7} {row['impl']:<16} "
          f"fwd {fmt_ms(row, 'fwd'):>9} ms  fwd+bwd {fmt_ms(row, 'fwdbwd'):>9} ms  "
          f"temp {fmt_mem(row, 'fwd'):>8} / {fmt_mem(row, 'fwdbwd'):>8} MiB  "
          f"[{row.get('fwd_status')}; {row.get('fwdbwd_status')}]" +
          (f"  fwd+bwd {row['fwdbwd_useful_gflops']:.1f} useful GFLOP/s"
           if "fwdbwd_useful_gflops" in row else "") +
          (f" = {100 * row['fwdbwd_peak_fraction']:.1f}% of a same-size f32 matmul "
           f"({row['matmul_gflops']:.1f} GFLOP/s, same run)"
           if "fwdbwd_peak_fraction" in row else ""))


def print_err_row(r):
  if "error" in r:
    print(f"  {r['impl']:<14} ring={r['ring']}: {r['error']}", flush=True)
    return
  ring = "-" if r["ring"] is None else r["ring"]
  print(f"  {r['impl']:<34} {ring:>4}  " +
        "  ".join(f"{r['rel_err'][nm]:.2e}" for nm in GRADS), flush=True)


def render(path):
  """Re-print the rows or the sweep table of a result file (``plot_results.py`` draws its
  plots)."""
  with open(path) as fh:
    result = json.load(fh)
  print(f"{result['meta'].get('command')}  ({result['meta'].get('date')})")
  if result["rows"]:
    print("\n".join(row_line(r) for r in result["rows"]))
  if result.get("sweep"):
    from benchmarks import report  # noqa: PLC0415 - the one renderer (pure Python, no jax)
    print(report.sweep_markdown(result["sweep"]))
  return result


def main(argv=None):
  ap = common.parser(__doc__, repeats=5, lengths=[2048, 4096, 8192, 16384], ring=8, heads=8,
                     head_dim=64)
  ap.add_argument("--matmul-peak", action="store_true",
                  help="useful fwd+bwd FLOP/s as a fraction of a same-size matmul's")
  ap.add_argument("--masks", type=strs, default=["causal", "full"])
  ap.add_argument("--variants", type=strs, default=["ring", "allgather", "dense", "paper"])
  ap.add_argument("--layouts", type=strs, default=list(ring_jax.LAYOUTS))
  ap.add_argument("--sections", type=strs, default=["check", "main", "bf16"],
                  help=f"subset of {','.join(SECTIONS)}")
  ap.add_argument("--err-length", type=int, default=2048)
  ap.add_argument("--sweep-lengths", type=ints, default=[1024, 2048, 4096, 8192, 16384])
  ap.add_argument("--sweep-blocks", type=ints, default=[64, 128, 256, 512, 1024],
                  help="candidate block sizes (those dividing the layout's chunk run)")
  ap.add_argument("--sweep-repeats", type=int, default=3)
  ap.add_argument("--memscan-lengths", type=ints, default=[2048, 4096, 8192, 16384, 32768, 65536])
  ap.add_argument("--memscan-block", type=int, default=256)
  ap.add_argument("--mem-budget-gib", type=float, default=None,
                  help="single-device memory above which dense rows are not run")
  ap.add_argument("--out", default=common.RESULTS, help="result folder")
  ap.add_argument("--tag", default=None, help="output file stem (default attention_<platform>)")
  ap.add_argument("--render", default=None, help="re-print a result file's tables")
  args = ap.parse_args(argv)
  if args.render:
    return render(args.render)
  platform = jax.default_backend()
  dtype = jnp.float32 if platform == "cpu" else jnp.bfloat16
  ring = min(args.ring, len(jax.devices()))
  try:  # ringattention 0.1.2's function, else None and why not
    paper_fn = import_paper()
    paper_note = "ringattention 0.1.2 imported (jax.lib.xla_bridge alias installed)"
  except Exception as e:  # noqa: BLE001
    paper_fn = None
    paper_note = f"paper code SKIPPED: cannot import ringattention: {type(e).__name__}: {e}"
  print(paper_note, flush=True)
  s = Setup(common.ring_mesh(ring), dtype, args.heads, args.head_dim, paper_fn,
            memory_budget(args.mem_budget_gib))
  names = [n for v in args.variants if v != "paper" or paper_fn
           for n in ([f"ring-{lay}" for lay in args.layouts] if v == "ring" else [v])]
  masks = [m == "causal" for m in args.masks]
  meta = common.run_meta(argv, __file__, ring=ring, dtype=jnp.dtype(dtype).name, batch=s.batch,
                         heads=args.heads, head_dim=args.head_dim, repeats=args.repeats,
                         paper=paper_note, single_device_budget_gib=round(s.budget / GIB, 2),
                         note=CPU_NOTE if platform == "cpu" else "")
  stem = os.path.join(args.out, args.tag or f"attention_{platform}")
  result = dict(meta=meta, checks=[], rows=[])

  def save():
    result["meta"]["elapsed_s"] = common.elapsed()
    common.write_result(stem + ".json", result)

  print(f"jax {jax.__version__} on {platform} ({meta['device_kind']}), ring={ring}, "
        f"{meta['dtype']}, B={s.batch} N={args.heads} H={args.head_dim}", flush=True)
  for name in [n for n in SECTIONS if n in args.sections]:
    SECTIONS[name](s, args, names, masks, result, save)
    save()
  print(f"\nwrote {stem}.json ({common.elapsed():.0f}s)")
  return result


if __name__ == "__main__":
  main()
