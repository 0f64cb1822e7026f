"""Side-by-side attention benchmark: ring_jax vs all-gather CP vs dense vs the paper's code.

One run measures, for each sequence length / mask / implementation, the
forward and forward+backward wall time (median of ``--repeats`` after a
warm-up) and the per-device compiled temporary memory
(``jax.jit(f).lower(...).compile().memory_analysis().temp_size_in_bytes``):

  ring-<layout>  ``ring_jax.ring_attention`` on a mesh with ``sequence=--ring``
  allgather      ``ring_jax.all_gather_attention`` (the library's strategy): all-gather
                 K/V, local blockwise attention (MaxText / TransformerEngine default CP)
  paper          PyPI ``ringattention==0.1.2`` (Liu et al.), ``ringattention_jax``
                 under ``jax.shard_map(check_vma=False)`` (contiguous layout only)
  dense          ``jax.nn.dot_product_attention`` on ONE device (full sequence);
                 rows whose compiled memory exceeds ``--mem-budget-gib`` are marked
                 ``OOM(est)`` from ``memory_analysis`` and not run.

Every implementation's output and gradients are checked against
``ring_jax.reference_attention`` in the same run (``--check-length``). Extra
sections: bf16 error vs a float64 oracle for ring sizes 1/2/4/8, a fixed-block memory scan
and a block-size sweep (causal work per device: ``core_report.py``).
Results: a line per case, ``<out>/attention_<platform>.json`` and PNG plots.

CPU (8 fake devices, f32):
  PYTHONPATH=. python benchmarks/attention.py --lengths 2048,4096,8192,16384 --repeats 5
Quick:
  PYTHONPATH=. python benchmarks/attention.py --lengths 2048 --repeats 2 --variants ring,paper
On GPU/TPU the same command uses the real devices and bfloat16.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ring_jax  # noqa: E402
from ring_jax.ring import default_block  # noqa: E402
from benchmarks import common  # noqa: E402
from benchmarks.common import GIB, MIB, fwd_bwd, ints, strs  # noqa: E402

common.fake_cpu_devices()

AXIS = "sequence"

CPU_NOTE = (
    "CPU caveat: the fake devices are threads sharing this machine's cores, so wall time "
    "measures the TOTAL work of all devices, not the busiest device. Causal load balancing "
    "(zigzag/striped vs contiguous) changes the per-device critical path ("
    "benchmarks/core_report.py), which only shows up in time on real accelerators; on CPU all layouts do about "
    "the same total work. Likewise ppermute/all-gather are memcpys here, so communication "
    "overlap is not measured.")


# ----------------------------------------------------------------------------
# The paper's implementation
# ----------------------------------------------------------------------------

# The conformance kit's adapter of ringattention 0.1.2 (one import, one call).
from benchmarks.conformance_peers import import_ringattention as import_paper  # noqa: E402,F401
from benchmarks.conformance_peers import paper_local  # noqa: E402


# ----------------------------------------------------------------------------
# Implementations as functions of global [B, L, N, H] arrays (inputs in layout order)
# ----------------------------------------------------------------------------

#: ``ring-<layout>+<suffix>``: the ring's ``causal_routing`` (no suffix: the library's
#: default, routed for causal contiguous only, ``ring_jax.routing.check_routing``).
ROUTING_SUFFIXES = {"routed": True, "full": False}
#: ``ring-<layout>+overlap``: ``overlap_dkv=True`` (combines with a routing suffix).
OVERLAP_SUFFIX = "overlap"


def ring_variant(name):
  """``"ring-<layout>[+routed|+full][+overlap][:<hop kernel>]"`` -> ``(layout, hop kernel name,
  causal_routing)`` (kernel default ``"auto"``; e.g. ``ring-zigzag:splash``, which runs
  in interpret mode on CPU; ``+routed`` / ``+full``: ``causal_routing=True`` / ``False``,
  no suffix: ``None``, the default)."""
  layout, _, kernel = name[len("ring-"):].partition(":")
  layout, *suffixes = layout.split("+")
  routing = None
  for suffix in suffixes:
    if suffix == OVERLAP_SUFFIX:
      continue
    if suffix not in ROUTING_SUFFIXES:
      raise ValueError(f"{name!r}: the suffix after '+' must be one of "
                       f"{sorted(ROUTING_SUFFIXES) + [OVERLAP_SUFFIX]}.")
    routing = ROUTING_SUFFIXES[suffix]
  return layout, kernel or "auto", routing


def ring_overlap(name):
  """Whether a ``ring-...`` variant names ``+overlap``: ``overlap_dkv=True`` (the backward's
  dK/dV into fresh buffers while the accumulator travels), e.g. ``ring-zigzag+overlap``."""
  return OVERLAP_SUFFIX in name[len("ring-"):].partition(":")[0].split("+")[1:]


def make_impl(name, *, mesh, is_causal, dtype, block, paper_fn=None):
  """Returns ``(f(q, k, v) -> out, layout, on_one_device)`` or raises."""
  spec = P(None, AXIS, None, None)
  if name.startswith("ring-"):
    layout, kernel, routing = ring_variant(name)
    local = functools.partial(ring_jax.ring_attention, axis_name=AXIS, is_causal=is_causal,
                              layout=layout, block_q=block, block_kv=block, hop_kernel=kernel,
                              causal_routing=routing, overlap_dkv=ring_overlap(name))
    return jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec), layout, False
  if name.startswith("allgather"):
    layout = name.split("-", 1)[1] if "-" in name else "contiguous"
    local = functools.partial(ring_jax.all_gather_attention, axis_name=AXIS, is_causal=is_causal,
                              layout=layout, block_q=block, block_kv=block)
    return (jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec,
                          check_vma=False), layout, False)
  if name == "paper":
    if paper_fn is None:
      raise RuntimeError("paper code not importable")
    return (jax.shard_map(paper_local(paper_fn, is_causal=is_causal, chunk=block, dtype=dtype,
                                      axis_name=AXIS), mesh=mesh,
                          in_specs=(spec,) * 3, out_specs=spec, check_vma=False),
            "contiguous", False)
  if name == "dense":
    return (lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=is_causal),
            "contiguous", True)
  if name == "reference":
    return (lambda q, k, v: ring_jax.reference_attention(q, k, v, is_causal=is_causal),
            "contiguous", True)
  raise ValueError(f"unknown implementation {name!r}")


def block_for(name, local_len, args_block):
  """Block size an implementation uses at this local length."""
  if args_block:
    return min(args_block, local_len)
  layout = ring_variant(name)[0] if name.startswith("ring-") else "contiguous"
  if name.startswith("allgather-"):
    layout = name.split("-", 1)[1]
  return default_block(layout, local_len)


def inputs(key, shape, dtype, sharding=None):
  """q, k, v, do: standard normal (drawn in float32) ``shape`` arrays in ``dtype``, placed
  with ``sharding``, else uncommitted (usable on one device or the mesh)."""
  xs = [jax.random.normal(k_, shape, jnp.float32).astype(dtype)
        for k_ in jax.random.split(key, 4)]
  return xs if sharding is None else [jax.device_put(x, sharding) for x in xs]


def natural_fwd_bwd(f, layout, ring):
  """Jitted ``(q, k, v, do) -> [out, dq, dk, dv]`` of ``f`` in natural order: the inputs
  moved into ``layout`` over a ring of ``ring`` devices, the results moved back."""
  to = lambda x: ring_jax.to_layout(x, layout, ring)  # noqa: E731
  back = lambda x: ring_jax.from_layout(x, layout, ring)  # noqa: E731
  return jax.jit(lambda *a: [back(x) for x in fwd_bwd(f)(*map(to, a))])


def device_mem_budget(args):
  if args.mem_budget_gib:
    return int(args.mem_budget_gib * GIB)
  limit = common.device_bytes_limit()
  if limit:
    return int(0.9 * limit)
  avail = common.host_memory_available() or 16 * GIB
  return int(min(8 * GIB, 0.4 * avail))  # CPU: shared machine, stay well clear


# ----------------------------------------------------------------------------
# Main table
# ----------------------------------------------------------------------------

def prepare_case(name, *, mesh, length, is_causal, args, dtype, paper_fn, budget, timed_run,
                 modes=("fwd", "fwdbwd")):
  """Compiles ``modes`` (fwd, fwd+bwd); returns ``(row, {mode: (compiled, args)})`` of what will
  be timed."""
  ring = mesh.shape[AXIS]
  local_len = length // ring
  block = block_for(name, local_len, args.block)
  f, layout, one_dev = make_impl(name, mesh=mesh, is_causal=is_causal, dtype=dtype,
                                 block=block, paper_fn=paper_fn)
  sharding = (jax.sharding.SingleDeviceSharding(jax.devices()[0]) if one_dev else
              NamedSharding(mesh, P(None, AXIS, None, None)))
  q, k, v, do = inputs(jax.random.key(length), (args.batch, length, args.heads, args.head_dim),
                       dtype, sharding)
  row = dict(impl=name, length=length, causal=is_causal, layout=layout,
             block=None if one_dev else block, devices=1 if one_dev else ring)
  todo = {}
  for mode, fn, a in (("fwd", f, (q, k, v)), ("fwdbwd", fwd_bwd(f), (q, k, v, do))):
    if mode not in modes:
      continue
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(*a).compile()
    row[f"{mode}_compile_s"] = round(time.perf_counter() - t0, 2)
    mem = common.compiled_memory(compiled)
    row[f"{mode}_mem"] = mem
    row[f"{mode}_times_s"] = []
    need = mem.get("temp_size_in_bytes", 0) + mem.get("argument_size_in_bytes", 0) + \
        mem.get("output_size_in_bytes", 0)
    if one_dev and need > budget:
      row[f"{mode}_status"] = f"OOM(est {need / GIB:.1f} GiB > {budget / GIB:.1f} GiB budget)"
    elif not timed_run:
      row[f"{mode}_status"] = "memory only (not timed at this length)"
    else:
      row[f"{mode}_status"] = "pending"
      todo[mode] = (compiled, a)
  return row, todo


def useful_flops(length, is_causal, args, mode):
  """Matmul FLOPs attention must do (no recomputation, masked pairs excluded).

  Forward: ``QK^T`` and ``PV``, ``4 B L^2 N H``; the backward's ``dV``, ``dP``, ``dQ``,
  ``dK`` twice that (FlashAttention's recomputed ``QK^T`` is not counted). Causal: the
  ``L (L + 1) / 2`` visible pairs.
  """
  pairs = length * (length + 1) / 2 if is_causal else length * length
  fwd = 4 * args.batch * pairs * args.heads * args.head_dim
  return fwd if mode == "fwd" else 3 * fwd


def matmul_case(mesh, flops, dtype):
  """The same machine's matmul rate, as a contender of the group: a plain batched
  ``jnp.einsum`` of about ``flops`` FLOPs, one ``m x m x m`` product per device of the
  mesh (so it runs on the devices, threads and cores the attention runs on).
  Returns ``(compiled, args, flops)``."""
  n = mesh.shape[AXIS]
  m = max(64, int(round((flops / (2 * n)) ** (1 / 3) / 32)) * 32)
  sh = NamedSharding(mesh, P(AXIS, None, None))
  a, b = (jax.device_put(jax.random.normal(jax.random.key(i), (n, m, m), jnp.float32)
                         .astype(dtype), sh) for i in (1, 2))
  f = jax.jit(lambda a, b: jnp.einsum("nij,njk->nik", a, b,
                                      preferred_element_type=jnp.float32))
  return f.lower(a, b).compile(), (a, b), 2 * n * m ** 3


def run_group(names, *, mesh, length, is_causal, args, dtype, paper_fn, budget, repeats,
              warmup, timed_names, blocks=(None,), modes=("fwd", "fwdbwd")):
  """All implementations of one (length, mask): compile all, then time them round-robin.

  Round-robin (rep 1 of every implementation, then rep 2, ...) spreads slow phases of a
  shared machine over all implementations instead of penalising whichever ran then.
  ``blocks``: each implementation once per block size (None: ``args.block``), the block
  sweep's contenders.
  """
  rows, todo = [], []
  for name, block in [(n, b) for n in names for b in blocks]:
    case_args = args if block is None else argparse.Namespace(**{**vars(args), "block": block})
    try:
      row, t = prepare_case(name, mesh=mesh, length=length, is_causal=is_causal,
                            args=case_args, dtype=dtype, paper_fn=paper_fn, budget=budget,
                            timed_run=name in timed_names, modes=modes)
    except Exception as e:  # noqa: BLE001
      row, t = dict(impl=name, length=length, causal=is_causal, devices=mesh.shape[AXIS],
                    block=block, fwd_mem={}, fwdbwd_mem={}, fwd_times_s=[], fwdbwd_times_s=[],
                    fwd_status=f"failed: {common.error_line(e)}",
                    fwdbwd_status="failed"), {}
    for mode in ("fwd", "fwdbwd"):
      row.setdefault(f"{mode}_status", "not run")
    rows.append(row)
    for mode, (c, a) in t.items():
      todo.append((row, mode, c, a))
  peak = None
  if getattr(args, "matmul_peak", False) and todo:
    c, a, flops = matmul_case(mesh, useful_flops(length, is_causal, args, "fwdbwd"), dtype)
    peak = dict(impl="matmul", flops=flops, fwdbwd_times_s=[], fwdbwd_status="pending")
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
                  f"{mode}_median_s": float(np.median(wall)),
                  f"{mode}_cpu_median_s": float(np.median(cpu)), f"{mode}_status": "ok"})
  for row in rows + ([peak] if peak else []):
    row["repeats"], row["warmup"] = repeats, warmup
  peak_rate = (peak["flops"] / peak["fwdbwd_median_s"]
               if peak and peak.get("fwdbwd_status") == "ok" else None)
  for row in rows:
    if "fwdbwd_median_s" in row:
      rate = useful_flops(length, is_causal, args, "fwdbwd") / row["fwdbwd_median_s"]
      row["fwdbwd_useful_gflops"] = round(rate / 1e9, 2)
      if peak_rate:
        row["matmul_gflops"] = round(peak_rate / 1e9, 2)
        row["fwdbwd_peak_fraction"] = round(rate / peak_rate, 3)
  return rows


def check_case(name, *, mesh, length, is_causal, args, dtype, paper_fn):
  """Max abs error of output and grads against ring_jax.reference_attention (natural order)."""
  ring = mesh.shape[AXIS]
  block = block_for(name, length // ring, args.block)
  f, layout, one_dev = make_impl(name, mesh=mesh, is_causal=is_causal, dtype=dtype,
                                 block=block, paper_fn=paper_fn)
  q, k, v, do = inputs(jax.random.key(7), (args.batch, length, args.heads, args.head_dim), dtype)
  ref = lambda q, k, v: ring_jax.reference_attention(q, k, v, is_causal=is_causal)
  want = jax.jit(fwd_bwd(ref))(q, k, v, do)
  got = (jax.jit(fwd_bwd(f)) if one_dev else natural_fwd_bwd(f, layout, ring))(q, k, v, do)
  errs = {}
  for nm, x, y in zip(("out", "dq", "dk", "dv"), got, want):
    x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
    errs[nm] = float(np.max(np.abs(x - y)))
  scale_ = max(float(np.max(np.abs(np.asarray(w, np.float32)))) for w in want)
  tol = (2e-4 if dtype == jnp.float32 else 5e-2) * max(1.0, scale_)
  return dict(impl=name, length=length, causal=is_causal, max_abs_err=errs,
              ok=bool(all(e <= tol for e in errs.values())), tol=tol)


# ----------------------------------------------------------------------------
# bf16 error vs float64 oracle for ring sizes 1/2/4/8
# ----------------------------------------------------------------------------

def oracle_f64(q, k, v, do, is_causal):
  """Dense attention and its VJP in float64 (``ring_jax.testing.oracle``): out, dq, dk, dv."""
  from ring_jax.testing import oracle  # noqa: PLC0415

  pos = np.arange(q.shape[1])
  r = oracle.attention(q, k, v, oracle.visibility(pos, pos, is_causal), q.shape[-1] ** -0.5,
                       np.asarray(do, np.float64))
  return [r[name] for name in ("out", "dq", "dk", "dv")]


def bf16_error_table(args, paper_fn):
  length, is_causal = args.err_length, True
  xs = inputs(jax.random.key(3), (1, length, args.heads, args.head_dim), jnp.bfloat16)
  want = oracle_f64(*xs, is_causal)
  floor = {nm: float(np.linalg.norm(np.asarray(jnp.asarray(w, jnp.bfloat16), np.float64) - w) /
                     np.linalg.norm(w)) for nm, w in zip(("out", "dq", "dk", "dv"), want)}
  rows = [dict(impl="bf16 rounding of the f64 result", ring=None, rel_err=floor)]
  impls = [f"ring-{lay}" for lay in args.layouts] + (["paper"] if paper_fn else [])
  for ring in args.err_rings:
    if ring > len(jax.devices()):
      continue
    mesh = common.make_mesh((ring,), (AXIS,))
    for name in impls:
      try:
        block = block_for(name, length // ring, args.block)
        f, layout, _ = make_impl(name, mesh=mesh, is_causal=is_causal, dtype=jnp.bfloat16,
                                 block=block, paper_fn=paper_fn)
        got = natural_fwd_bwd(f, layout, ring)(*xs)
        rel = {nm: float(np.linalg.norm(np.asarray(x, np.float64) - w) / np.linalg.norm(w))
               for nm, x, w in zip(("out", "dq", "dk", "dv"), got, want)}
        mx = {nm: float(np.max(np.abs(np.asarray(x, np.float64) - w)))
              for nm, x, w in zip(("out", "dq", "dk", "dv"), got, want)}
        rows.append(dict(impl=name, ring=ring, rel_err=rel, max_abs_err=mx))
      except Exception as e:  # noqa: BLE001
        rows.append(dict(impl=name, ring=ring, error=common.error_line(e)))
      print_err_row(rows[-1], flush=True)
  return dict(length=length, causal=is_causal, heads=args.heads, head_dim=args.head_dim,
              rows=rows)


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


def print_err_row(r, flush=False):
  if "error" in r:
    print(f"  {r['impl']:<14} ring={r['ring']}: {r['error']}", flush=flush)
    return
  e = r["rel_err"]
  ring = "-" if r["ring"] is None else r["ring"]
  print(f"  {r['impl']:<34} {ring:>4}  " +
        "  ".join(f"{e[nm]:.2e}" for nm in ("out", "dq", "dk", "dv")), flush=flush)


# ----------------------------------------------------------------------------
# Block-size sweep
# ----------------------------------------------------------------------------

def sweep_blocks(name, local_len, candidates):
  """The candidate blocks the ring variant ``name`` can run at this local length: divisors of
  the layout's chunk (half the shard for zigzag, where a block across the two chunks
  cannot skip the masked one), plus the whole chunk when it is no larger than the largest
  candidate."""
  layout = ring_variant(name)[0]
  chunk = local_len // 2 if layout == "zigzag" else local_len
  whole = {chunk} if chunk <= max(candidates) else set()
  return sorted({b for b in candidates if b <= chunk and chunk % b == 0} | whole)


def sweep(names, *, mesh, masks, args, dtype, budget, save, rows):
  """fwd+bwd time (median of ``--sweep-repeats``, every block of one (length, mask,
  layout) timed round-robin) and compiled temp memory per block size, for each ring
  variant; the default block (``ring_jax.ring.default_block``) marked. The table
  ``ring_jax.ring.BLOCK_TARGETS`` is read from these rows (docs/performance.md). Appends
  to ``rows`` and returns it."""
  ring = mesh.shape[AXIS]
  print(f"\n== block-size sweep, fwd+bwd (ring of {ring}; * = today's default) ==", flush=True)
  print(f"  {'L':>6} {'mask':<6} {'layout':<11} " + "  ".join(
      f"{'block':>5} {'ms':>8} {'x best':>6} {'MiB':>6}" for _ in range(1)))
  for length in args.sweep_lengths:
    local = length // ring
    for causal in masks:
      for name in [n for n in names if n.startswith("ring-")]:
        blocks = sweep_blocks(name, local, args.sweep_blocks)
        default = default_block(ring_variant(name)[0], local)
        group = run_group([name], mesh=mesh, length=length, is_causal=causal, args=args,
                          dtype=dtype, paper_fn=None, budget=budget,
                          repeats=args.sweep_repeats, warmup=1, timed_names={name},
                          blocks=blocks, modes=("fwdbwd",))
        ok = [r for r in group if r.get("fwdbwd_status") == "ok"]
        best = min((r["fwdbwd_median_s"] for r in ok), default=None)
        for r in group:
          r.update(default_block=default, is_default=r["block"] == default)
          if best and r.get("fwdbwd_status") == "ok":
            r["x_best"] = round(r["fwdbwd_median_s"] / best, 3)
          rows.append(r)
          mark = "*" if r["is_default"] else " "
          print(f"  {length:>6} {'causal' if causal else 'full':<6} {name[5:]:<11} "
                f"{r['block']:>5}{mark}{fmt_ms(r, 'fwdbwd'):>8} "
                f"{r.get('x_best', float('nan')):>6.3f} {fmt_mem(r, 'fwdbwd'):>6}", flush=True)
        save()
  return rows


def sweep_markdown(rows) -> str:
  """The sweep as a markdown table (one renderer: ``benchmarks/report.py``, which the docs'
  generated tables use too)."""
  from benchmarks import report  # noqa: PLC0415 - pure Python, no jax
  return report.sweep_markdown(rows)


def memory_scan(names, mesh, lengths, block, is_causal, dtype, args, paper_fn):
  """Compiled fwd+bwd temp memory per device at a FIXED block size (compile only, no run).

  The main table uses each implementation's default block, which grows with L
  up to 512; with a fixed block the remaining growth is the part linear in L.
  """
  rows = []
  for length in lengths:
    sh = NamedSharding(mesh, P(None, AXIS, None, None))
    x = jax.ShapeDtypeStruct((args.batch, length, args.heads, args.head_dim), dtype, sharding=sh)
    for name in names:
      if name in ("dense", "reference"):
        continue
      t = length // mesh.shape[AXIS]
      if t % block or (name.startswith("ring-zigzag") and (t // 2) % block):
        continue
      try:
        f, _, _ = make_impl(name, mesh=mesh, is_causal=is_causal, dtype=dtype, block=block,
                            paper_fn=paper_fn)
        m = {mode: common.compiled_memory(jax.jit(fn).lower(*a).compile()).get(
                 "temp_size_in_bytes")
             for mode, fn, a in (("fwd", f, (x, x, x)), ("fwdbwd", fwd_bwd(f), (x, x, x, x)))}
        rows.append(dict(impl=name, length=length, block=block, causal=is_causal,
                         fwd_temp=m["fwd"], fwdbwd_temp=m["fwdbwd"]))
      except Exception as e:  # noqa: BLE001
        rows.append(dict(impl=name, length=length, block=block, error=str(e)[:200]))
      r = rows[-1]
      print(f"  L={length:<7} {name:<16} block={block:<5} " +
            (f"fwd {r['fwd_temp'] / MIB:8.1f} MiB  fwd+bwd {r['fwdbwd_temp'] / MIB:8.1f} MiB"
             if "error" not in r else r["error"]), flush=True)
  return rows


# ----------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------

def fmt_ms(r, mode):
  if r.get(f"{mode}_status", "").startswith("ok"):
    return f"{1e3 * r[f'{mode}_median_s']:.1f}"
  st = r.get(f"{mode}_status", "-")
  if st.startswith("OOM"):
    return "OOM(est)"
  return "not run" if st.startswith("memory only") else "FAIL"


def fmt_mem(r, mode):
  m = r.get(f"{mode}_mem", {}).get("temp_size_in_bytes")
  return "-" if m is None else f"{m / MIB:.1f}"


def plot(result, path_prefix):
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except Exception as e:  # noqa: BLE001
    print(f"(no plots: matplotlib unavailable: {e})")
    return []
  rows = result["rows"]
  paths = []
  for causal in sorted({r["causal"] for r in rows}):
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for impl in sorted({r["impl"] for r in rows}):
      rs = sorted((r for r in rows if r["impl"] == impl and r["causal"] == causal),
                  key=lambda r: r["length"])
      for ax, key in ((axes[0], "fwd_median_s"), (axes[1], "fwdbwd_median_s")):
        pts = [(r["length"], r[key] * 1e3) for r in rs if key in r]
        if pts:
          ax.plot(*zip(*pts), marker="o", label=impl)
      pts = [(r["length"], r["fwdbwd_mem"]["temp_size_in_bytes"] / MIB) for r in rs
             if "temp_size_in_bytes" in r.get("fwdbwd_mem", {})]
      if pts:
        style = "--" if impl in ("dense", "reference") else "-"
        axes[2].plot(*zip(*pts), style, marker="o", label=impl)
    titles = ("forward time (ms)", "forward+backward time (ms)",
              "fwd+bwd compiled temp memory per device (MiB)")
    for ax, title in zip(axes, titles):
      ax.set_xscale("log", base=2)
      ax.set_yscale("log")
      ax.set_xlabel("sequence length")
      ax.set_title(title, fontsize=10)
      ax.grid(True, which="both", alpha=0.3)
    axes[2].legend(fontsize=8)
    m = result["meta"]
    fig.suptitle(f"{'causal' if causal else 'non-causal'} attention, {m['platform']} "
                 f"{m['dtype']}, B={m['batch']} N={m['heads']} H={m['head_dim']}, "
                 f"ring={m['ring']} (dense: 1 device; OOM rows have memory but no time)",
                 fontsize=10)
    fig.tight_layout()
    p = f"{path_prefix}_{'causal' if causal else 'full'}.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)
  return paths


# ----------------------------------------------------------------------------

def parse_args(argv=None):
  ap = common.parser(__doc__, repeats=5, lengths=[2048, 4096, 8192, 16384], dtype="auto",
                     ring=8, heads=8, head_dim=64)
  ap.add_argument("--large-repeats", type=int, default=None,
                  help="repeats for lengths >= --large-from (default: --repeats)")
  ap.add_argument("--large-from", type=int, default=16384)
  ap.add_argument("--repeats-at", default={},
                  type=lambda s: {int(a): int(b) for a, b in (x.split(":") for x in s.split(","))},
                  help="per-length repeats overriding the above, e.g. 8192:2,16384:1")
  ap.add_argument("--large-warmup", type=int, default=1,
                  help="warm-up runs for lengths >= --large-from (AOT-compiled already)")
  ap.add_argument("--large-variants", type=strs, default=None,
                  help="implementations timed at lengths >= --large-from (e.g. "
                       "ring-zigzag,allgather,paper; 'ring' = all layouts); the others get "
                       "compiled memory only. Default: all")
  ap.add_argument("--matmul-peak", action="store_true",
                  help="time a plain batched matmul of the same FLOPs in every group (interleaved) "
                       "and report useful fwd+bwd FLOP/s as a fraction of it")
  ap.add_argument("--batch", type=int, default=1)
  ap.add_argument("--masks", type=strs, default=["causal", "full"])
  ap.add_argument("--variants", type=strs, default=["ring", "allgather", "dense", "paper"])
  ap.add_argument("--layouts", type=strs, default=list(ring_jax.LAYOUTS))
  ap.add_argument("--block", type=int, default=None,
                  help="block_q = block_kv for ring/all-gather and the paper's chunk size "
                       "(default: ring_jax's default block per layout)")
  ap.add_argument("--sections", type=strs, default=["check", "main", "bf16"],
                  help="subset of check,main,bf16,memscan,sweep")
  ap.add_argument("--check-length", type=int, default=None,
                  help="length for correctness checks (default: min(lengths), at most 4096)")
  ap.add_argument("--err-length", type=int, default=2048)
  ap.add_argument("--err-rings", type=ints, default=[1, 2, 4, 8])
  ap.add_argument("--sweep-lengths", type=ints, default=[1024, 2048, 4096, 8192, 16384],
                  help="section sweep: sequence lengths")
  ap.add_argument("--sweep-blocks", type=ints, default=[64, 128, 256, 512, 1024],
                  help="section sweep: candidate block sizes (those dividing the layout's "
                       "chunk run, and the whole shard)")
  ap.add_argument("--sweep-repeats", type=int, default=3)
  ap.add_argument("--memscan-lengths", type=ints, default=[2048, 4096, 8192, 16384, 32768, 65536])
  ap.add_argument("--memscan-block", type=int, default=256)
  ap.add_argument("--mem-budget-gib", type=float, default=None,
                  help="single-device memory above which dense rows are marked OOM(est) "
                       "instead of run (default: 90%% of the accelerator; on CPU "
                       "min(8, 0.4 x available) GiB)")
  ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                "results"))
  ap.add_argument("--tag", default=None, help="output file stem (default attention_<platform>)")
  ap.add_argument("--render", default=None,
                  help="re-print the rows and redraw the plots of an existing JSON")
  return ap.parse_args(argv)


def render(path):
  with open(path) as fh:
    result = json.load(fh)
  print(f"{result['meta'].get('command')}  ({result['meta'].get('date')})")
  if result["rows"]:
    print("\n".join(row_line(r) for r in result["rows"]))
    plot(result, os.path.splitext(path)[0])
  if result.get("sweep"):
    print(sweep_markdown(result["sweep"]))
  return result


def main(argv=None):
  args = parse_args(argv)
  if args.render:
    return render(args.render)
  t_start = time.perf_counter()
  platform = jax.default_backend()
  if args.dtype == "auto":
    dtype = jnp.float32 if platform == "cpu" else jnp.bfloat16
  else:
    dtype = jnp.dtype(args.dtype).type
  ring = min(args.ring, len(jax.devices()))
  mesh = common.make_mesh((ring,), (AXIS,))
  try:
    paper_fn = import_paper()
    paper_note = "ringattention 0.1.2 imported (jax.lib.xla_bridge alias installed)"
  except Exception as e:  # noqa: BLE001
    paper_fn = None
    paper_note = f"paper code SKIPPED: cannot import ringattention: {type(e).__name__}: {e}"
  print(paper_note, flush=True)
  names = []
  for v in args.variants:
    if v == "ring":
      names += [f"ring-{lay}" for lay in args.layouts]
    elif v == "paper" and paper_fn is None:
      continue
    else:
      names.append(v)
  budget = device_mem_budget(args)
  masks = [m == "causal" for m in args.masks]
  meta = common.run_meta(argv, __file__, ring=ring, dtype=jnp.dtype(dtype).name,
              batch=args.batch, heads=args.heads, head_dim=args.head_dim,
              repeats=args.repeats, large_repeats=args.large_repeats,
              large_from=args.large_from, block=args.block, paper=paper_note,
              single_device_budget_gib=round(budget / GIB, 2), note=CPU_NOTE if platform == "cpu" else "")
  os.makedirs(args.out, exist_ok=True)
  stem = os.path.join(args.out, args.tag or f"attention_{platform}")
  result = dict(meta=meta, checks=[], rows=[])

  def save():
    result["meta"]["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    common.write_result(stem + ".json", result)

  print(f"jax {jax.__version__} on {platform} ({meta['device_kind']}), ring={ring}, "
        f"{meta['dtype']}, B={args.batch} N={args.heads} H={args.head_dim}", flush=True)

  if "check" in args.sections:
    cl = args.check_length or min(min(args.lengths), 4096)
    print(f"\n== correctness vs ring_jax.reference_attention at L={cl} (max abs error) ==",
          flush=True)
    for causal in masks:
      for name in names:
        try:
          c = check_case(name, mesh=mesh, length=cl, is_causal=causal, args=args, dtype=dtype,
                         paper_fn=paper_fn)
        except Exception as e:  # noqa: BLE001
          c = dict(impl=name, length=cl, causal=causal, ok=False, error=common.error_line(e))
        result["checks"].append(c)
        errs = c.get("max_abs_err")
        print(f"  {'causal' if causal else 'full':<7} {name:<16} "
              f"{'OK ' if c['ok'] else 'BAD'} " +
              (" ".join(f"{k}={v:.1e}" for k, v in errs.items()) if errs else c.get("error", "")),
              flush=True)
    save()

  if "sweep" in args.sections:
    result["sweep"] = []  # filled row by row, saved after each group
    sweep(names, mesh=mesh, masks=masks, args=args, dtype=dtype, budget=budget, save=save,
          rows=result["sweep"])
    save()

  if "bf16" in args.sections:
    print(f"\n== bf16 relative error (||x - x64|| / ||x64||) vs float64 oracle, causal, "
          f"L={args.err_length} ==", flush=True)
    print(f"  {'impl':<34} {'ring':>4}  {'out':>8}  {'dq':>8}  {'dk':>8}  {'dv':>8}")
    result["bf16_error"] = bf16_error_table(args, paper_fn)
    print_err_row(result["bf16_error"]["rows"][0])
    save()

  if "memscan" in args.sections:
    print(f"\n== compiled temp memory per device at a fixed block of {args.memscan_block} "
          f"(compile only) ==", flush=True)
    result["memscan"] = []
    for causal in masks:
      result["memscan"] += memory_scan(names, mesh, args.memscan_lengths, args.memscan_block,
                                       causal, dtype, args, paper_fn)
    save()

  if "main" in args.sections:
    print("\n== timing (median of repeats after warm-up, implementations timed round-robin) "
          "and compiled temp memory per device ==", flush=True)
    for length in args.lengths:
      large = args.large_from is not None and length >= args.large_from
      reps = args.large_repeats if large and args.large_repeats is not None else args.repeats
      reps = args.repeats_at.get(length, reps)
      warm = args.large_warmup if large else 1
      timed_names = set(names)
      if large and args.large_variants:
        timed_names = {n for n in names if n in args.large_variants or
                       (n.startswith("ring-") and "ring" in args.large_variants)}
      for causal in masks:
        load0 = os.getloadavg()[0]
        rows = run_group(names, mesh=mesh, length=length, is_causal=causal, args=args,
                         dtype=dtype, paper_fn=paper_fn, budget=budget, repeats=reps,
                         warmup=warm, timed_names=timed_names)
        for row in rows:
          row["loadavg_1min"] = [round(load0, 2), round(os.getloadavg()[0], 2)]
          result["rows"].append(row)
          print(row_line(row), flush=True)
        print(f"  (t={time.perf_counter() - t_start:.0f}s, load average {load0:.1f} -> "
              f"{os.getloadavg()[0]:.1f})", flush=True)
        save()

  if result["rows"]:
    if platform == "cpu":
      print("\n" + CPU_NOTE)
    reduced = sorted({(r["length"], r.get("repeats"), r.get("warmup")) for r in result["rows"]
                      if r.get("repeats") != args.repeats or r.get("warmup") != 1})
    if reduced:
      print("Note: reduced repeats to keep the CPU run short: " + ", ".join(
          f"L={L}: {n} timed run(s) after {w} warm-up" for L, n, w in reduced) +
            (f"; at L >= {args.large_from} only {','.join(args.large_variants)} are timed "
             f"(the rest: compiled memory only)" if args.large_variants else ""))
    result["plots"] = [os.path.relpath(p, args.out) for p in plot(result, stem)]
  save()
  print(f"\nwrote {stem}.json ({time.perf_counter() - t_start:.0f}s)")
  return result


if __name__ == "__main__":
  main()
