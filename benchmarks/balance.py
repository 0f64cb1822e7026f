r"""Causal load balance: in wall time, one process per device, each pinned to its own core;
``packed``: the work per device on packed rows, zigzag vs the document layout (pure numpy).

  PYTHONPATH=. python benchmarks/balance.py --processes 2 --lengths 4096,8192,16384 --repeats 5
  PYTHONPATH=. python benchmarks/balance.py packed   # ring 8, 128K rows, ~1 min

Per length: causal fwd+bwd of each of ``--impls`` (``benchmarks/attention.py``'s; the paper's
code left out with a note when it does not import), timed round-robin after a warm-up; a
repetition's time is the slowest process's, the figure their median, beside each layout's
critical path from ``ring_jax.schedule`` (in full local hops). ``packed``: per mean document
length, :func:`measure_packed`. Both write ``<out>/<tag>.json`` and ``.log``; ``--dry-run``: one
short length, one repetition, no warm-up (``packed``: small rows). How the processes are set
up: benchmarks/README.md, "Load balance in wall time".
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import sys
import time
from concurrent import futures

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Imports JAX and NumPy but starts no thread: a worker still pins its core before JAX starts.
from benchmarks import common  # noqa: E402

#: One-thread XLA:CPU for each worker; one fake device per process.
WORKER_XLA_FLAGS = ("--xla_force_host_platform_device_count=1 "
                    "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")
#: BLAS / OpenMP pools at one thread; XLA's own share the one core the process is pinned to.
ONE_THREAD_ENV = dict.fromkeys(("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"), "1")
IMPLS = ("ring-contiguous", "ring-zigzag", "ring-striped", "paper")
#: Also accepted by --impls: a ring with its routing forced (+full: causal_routing=False,
#: +routed: True).
ROUTED = tuple(f"ring-{lay}+{r}" for lay in ("contiguous", "zigzag") for r in ("full", "routed"))


def parse_args(argv=None):
  ap = common.parser(__doc__, repeats=5, heads=8, head_dim=64)
  ap.add_argument("--processes", type=int, default=2, help="devices = processes = cores used")
  ap.add_argument("--cores", type=common.ints, default=None,
                  help="core of each process (default: the first --processes this may use)")
  ap.add_argument("--lengths", type=common.ints, default=None,
                  help="default 4096,8192,16384 (--dry-run: 256)")
  ap.add_argument("--impls", type=common.strs, default=list(IMPLS))
  ap.add_argument("--timeout", type=float, default=3600, help="seconds for the whole run")
  ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)  # internal
  ap.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
  pk = ap.add_subparsers(dest="command").add_parser(
      "packed", help="causal work per device on packed rows (pure numpy)")
  pk.add_argument("--length", type=int, default=131072, help="tokens per row")
  pk.add_argument("--ring", type=int, default=8, help="devices on the sequence axis")
  pk.add_argument("--means", type=common.ints, default=[2048, 4096, 8192, 16384, 32768],
                  help="mean document lengths")
  pk.add_argument("--sigma", type=float, default=1.0, help="of the log document lengths")
  pk.add_argument("--rows", type=int, default=20, help="rows per mean")
  pk.add_argument("--seed", type=int, default=0)
  for p, block, dry, tag in (
      (ap, "block size of every implementation (default: the ring's for its layout)",
       "one length (--lengths' first, default 256), 1 repetition, no warm-up", "balance_cpu"),
      (pk, "block size", "4K rows, 2 per mean", "packed_balance")):
    p.add_argument("--block", type=int, default=None if p is ap else 256, help=block)
    p.add_argument("--dry-run", action="store_true", help=dry)
    p.add_argument("--out", default=common.RESULTS)
    p.add_argument("--tag", default=tag, help="output file stem")
  args = ap.parse_args(argv)
  if args.command == "packed":
    if args.dry_run:
      args.length, args.rows, args.means, args.block = 4096, 2, [256, 1024], 32
    return args
  args.argv = sys.argv[1:] if argv is None else list(argv)
  args.warmup, args.batch = (0 if args.dry_run else 1), 1
  if args.dry_run:
    args.lengths, args.repeats = (args.lengths or [256])[:1], 1
  args.lengths = args.lengths or [4096, 8192, 16384]
  unknown = set(args.impls) - set(IMPLS + ROUTED)
  if unknown:
    ap.error(f"unknown --impls {sorted(unknown)}; known: {IMPLS + ROUTED}")
  return args


def worker(args) -> dict:
  """One device on one core: every length's cases compiled, then timed in step with the
  other processes; returns its rows (times per repetition) as JSON-ready data."""
  core = args.cores[args.worker]
  os.sched_setaffinity(0, {core})  # Before JAX starts any thread: they all inherit it.
  import jax

  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=f"127.0.0.1:{args.port}",
                             num_processes=args.processes, process_id=args.worker)
  import jax.numpy as jnp
  from jax.experimental import multihost_utils

  from benchmarks import attention as bench  # after XLA_FLAGS: it keeps our device count

  n = jax.device_count()
  assert n == args.processes and jax.local_device_count() == 1, (n, jax.local_device_count())
  mesh = common.ring_mesh(n)
  sharding = jax.NamedSharding(mesh, bench.SPEC)
  paper_fn, paper_note = None, None
  if "paper" in args.impls:
    try:
      paper_fn = bench.import_paper()
    except Exception as e:  # noqa: BLE001  (optional extra not installed)
      paper_note = f"paper code not importable ({type(e).__name__}: {e}); install the bench extra"
  impls = [name for name in args.impls if name != "paper" or paper_fn is not None]
  rows = []
  for length in args.lengths:
    shape = (args.batch, length, args.heads, args.head_dim)
    # The same global arrays on every process (numpy, seeded), each holding its shard.
    arrays = [np.random.default_rng(length * 4 + i).standard_normal(shape, dtype=np.float32)
              for i in range(4)]
    qkvdo = [jax.make_array_from_callback(shape, sharding, lambda idx, x=x: x[idx])
             for x in arrays]
    cases, compiled = [], {}
    for name in impls:
      block = bench.block_for(name, length // n, args.block)
      f, layout, _ = bench.make_impl(name, mesh=mesh, is_causal=True, dtype=jnp.float32,
                                     block=block, paper_fn=paper_fn)
      compile_s, _, compiled[name] = common.timed_call(
          lambda: jax.jit(bench.fwd_bwd(f)).lower(*qkvdo).compile())
      cases.append(dict(impl=name, layout=layout, block=block, length=length,
                        compile_s=round(compile_s, 2), temp_bytes=common.compiled_memory(
                            compiled[name]).get("temp_size_in_bytes")))
    # Round-robin (a slow phase of the machine hits every impl alike), all processes in step.
    times = common.interleaved(
        {name: (exe, qkvdo) for name, exe in compiled.items()}, args.repeats, args.warmup,
        before=lambda name, it: multihost_utils.sync_global_devices(f"{length}-{it}-{name}"))
    rows.extend(dict(case, times_s=[round(t, 5) for t in times[case["impl"]]["wall"]],
                     cpu_s=[round(t, 4) for t in times[case["impl"]]["cpu"]]) for case in cases)
  jax.distributed.shutdown()
  return dict(process=args.worker, core=core, affinity=sorted(os.sched_getaffinity(0)),
              rows=rows, paper_note=paper_note)


def launch(args) -> dict:
  """Starts one worker per device (:func:`common.run_python`, all at once, each with one-thread
  XLA, BLAS and OpenMP), waits for all, returns the merged result."""
  allowed = sorted(os.sched_getaffinity(0))
  args.cores = args.cores or allowed[:args.processes]
  if len(args.cores) != args.processes or len(set(args.cores)) != args.processes:
    raise SystemExit(f"--cores={args.cores}: need {args.processes} distinct cores "
                     f"(this process may use {allowed}); lower --processes or name the cores.")
  if not set(args.cores) <= set(allowed):
    raise SystemExit(f"--cores={args.cores} are not all available here ({allowed}).")
  with socket.socket() as s:  # a free port for the coordinator
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  flags = [os.path.abspath(__file__), *args.argv, "--port", str(port),
           "--cores", ",".join(map(str, args.cores)), "--worker"]
  env = dict(XLA_FLAGS=WORKER_XLA_FLAGS, JAX_PLATFORMS="cpu", **ONE_THREAD_ENV)
  with futures.ThreadPoolExecutor(args.processes) as pool:
    outputs = list(pool.map(lambda i: common.run_python([*flags, str(i)], args.timeout, env),
                            range(args.processes)))
  return merge(args, [json.loads(out.strip().splitlines()[-1]) for out in outputs])


def merge(args, workers: list[dict]) -> dict:
  """One row per (length, impl): per repetition the slowest process's time, then the median."""
  import ring_jax
  from benchmarks.attention import ring_variant

  rows = []
  for j, row in enumerate(workers[0]["rows"]):
    per_rep = np.max([w["rows"][j]["times_s"] for w in workers], axis=0)
    n, length = args.processes, row["length"]
    local, b = length // n, row["block"]
    routing = ring_variant(row["impl"])[2] if row["impl"].startswith("ring-") else False
    sched = ring_jax.schedule(row["layout"], n, local, b, b, True, causal_routing=routing)
    unit = (local * local) / (b * b)  # block pairs of one full local hop
    rows.append(dict(
        impl=row["impl"], layout=row["layout"], length=length, block=row["block"],
        times_s=[float(t) for t in per_rep], median_s=float(np.median(per_rep)),
        per_process_median_s=[float(np.median(w["rows"][j]["times_s"])) for w in workers],
        per_process_cpu_s=[float(np.median(w["rows"][j]["cpu_s"])) for w in workers],
        temp_bytes=row["temp_bytes"], compile_s=row["compile_s"],
        critical_path_hops=round(sched.critical_path() / unit, 3),
        total_hops=round(float(sched.work_per_device().sum()) / unit, 3)))
  for row in rows:
    paper = next((r for r in rows if r["impl"] == "paper" and r["length"] == row["length"]), None)
    row["time_over_paper"] = round(row["median_s"] / paper["median_s"], 3) if paper else None
  import jax
  return dict(
      benchmark="balance", processes=args.processes, cores=args.cores,
      affinity=[w["affinity"] for w in workers], xla_flags=WORKER_XLA_FLAGS,
      lengths=args.lengths, impls=args.impls, repeats=args.repeats, warmup=args.warmup,
      batch=args.batch, heads=args.heads, head_dim=args.head_dim, dtype="float32",
      causal=True, dry_run=args.dry_run, paper_note=workers[0]["paper_note"], rows=rows,
      jax=jax.__version__, python=platform.python_version(), machine=platform.machine(),
      cpus=os.cpu_count(), load_avg=os.getloadavg(),
      date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))


def table(result) -> str:
  """The printed table (and ``.log``) of a merged result."""
  lines = [f"causal fwd+bwd, {result['processes']} processes x 1 device, one core each "
           f"(cores {result['cores']}), B={result['batch']} heads={result['heads']} "
           f"head_dim={result['head_dim']} f32; median of {result['repeats']} (slowest process "
           f"per repetition); load average {', '.join(f'{x:.1f}' for x in result['load_avg'])}"]
  if result["paper_note"]:
    lines.append(f"note: {result['paper_note']}")
  head = (f"{'L':>6} {'impl':<16} {'block':>5} {'fwd+bwd ms':>11} {'per process ms':>18} "
          f"{'/ paper':>8} {'crit. path hops':>16} {'total hops':>11} {'temp MiB':>9}")
  lines += [head, "-" * len(head)]
  for r in result["rows"]:
    per = "/".join(f"{1e3 * t:.0f}" for t in r["per_process_median_s"])
    ratio = "-" if r["time_over_paper"] is None else f"{r['time_over_paper']:.2f}"
    temp = "-" if r["temp_bytes"] is None else f"{r['temp_bytes'] / 2 ** 20:.1f}"
    lines.append(f"{r['length']:>6} {r['impl']:<16} {str(r['block']):>5} "
                 f"{1e3 * r['median_s']:>11.1f} {per:>18} {ratio:>8} "
                 f"{r['critical_path_hops']:>16.3f} {r['total_hops']:>11.3f} {temp:>9}")
  return "\n".join(lines) + "\n"


# --- packed: causal work per device on packed rows (pure numpy) -----------------------------

PACKED_LAYOUTS = ("zigzag", "document")


def packed_rows(rng, rows: int, length: int, mean: float, sigma: float) -> np.ndarray:
  """int32 ``[rows, length]`` segment ids 1, 2, ... of documents of lognormal length (``mu =
  log(mean) - sigma^2 / 2``, so ``mean`` is their mean), the last one cut at the row's end."""
  seg = np.zeros((rows, length), np.int32)
  mu = np.log(mean) - sigma ** 2 / 2
  for r in range(rows):
    pos, doc = 0, 1
    while pos < length:
      size = max(1, int(rng.lognormal(mu, sigma)))
      seg[r, pos:pos + size] = doc
      pos, doc = pos + size, doc + 1
  return seg


def measure_packed(seg: np.ndarray, ring: int, block: int) -> dict:
  """Per-layout balance figures of the rows ``seg`` (natural order): max/mean token pairs
  (:func:`ring_jax.documents.token_work`), block pairs the ring computes from its own block
  tables (:func:`ring_jax.documents.block_work`) and critical path (each hop costs its
  busiest device) per device, median and max over rows; and the medians of the document
  layout's block pairs and critical path over zigzag's."""
  import ring_jax
  from ring_jax import documents

  doc = ring_jax.document_layout(seg, ring)
  zigzag = ring_jax.layout_positions("zigzag", ring, seg.shape[1])
  perms = {"zigzag": np.broadcast_to(zigzag, seg.shape), "document": doc.permutation}
  ids = {"zigzag": seg[:, zigzag], "document": doc.segment_ids}
  out, totals, critical_paths = {}, {}, {}
  for layout in PACKED_LAYOUTS:
    tokens = documents.token_work(seg, perms[layout], ring)
    blocks = documents.block_work(ids[layout], layout, ring, block, block)
    per_device = blocks.sum(-1)
    totals[layout], critical_paths[layout] = per_device.sum(1), blocks.max(1).sum(-1)
    ratios = {"token_max_over_mean": tokens.max(1) / tokens.mean(1),
              "block_max_over_mean": per_device.max(1) / per_device.mean(1),
              "critical_path_over_mean": critical_paths[layout] / per_device.mean(1)}
    out[layout] = {k: {"median": float(np.median(v)), "max": float(v.max())}
                   for k, v in ratios.items()}
  out["document_block_pairs_over_zigzag"] = float(np.median(totals["document"] / totals["zigzag"]))
  out["document_critical_path_over_zigzag"] = float(
      np.median(critical_paths["document"] / critical_paths["zigzag"]))
  return out


def packed(args, argv) -> tuple[dict, str]:
  """The ``packed`` command: ``(result, its table)``, :func:`measure_packed` per mean of
  ``--means`` over ``--rows`` rows of :func:`packed_rows`."""
  rng = np.random.default_rng(args.seed)
  start = time.perf_counter()
  result = {"meta": common.run_meta(argv, __file__, devices=False), "ring": args.ring,
            "length": args.length, "sigma": args.sigma, "rows": args.rows, "block": args.block,
            "seed": args.seed, "means": {}}
  def line(cells):  # the table's columns, right-aligned
    return " | ".join(f"{c:>{w}}" for c, w in zip(cells, (6, 14, 15, 14, 15, 14, 12, 12)))
  lines = [f"ring {args.ring}, {args.length}-token rows, lognormal sigma {args.sigma}, "
           f"{args.rows} rows per mean, blocks of {args.block}; max/mean work per device "
           "(median / max over rows)",
           line(["mean", "zigzag tokens", "document tokens", "zigzag blocks", "document blocks",
                 "doc crit. path", "doc/zz pairs", "doc/zz crit."])]
  for mean in args.means:
    fig = result["means"][str(mean)] = measure_packed(
        packed_rows(rng, args.rows, args.length, mean, args.sigma), args.ring, args.block)
    ratios = [fig[layout][key + "_over_mean"] for layout, key in (
        ("zigzag", "token_max"), ("document", "token_max"), ("zigzag", "block_max"),
        ("document", "block_max"), ("document", "critical_path"))]
    lines.append(line([mean, *(f"{r['median']:.2f} / {r['max']:.2f}" for r in ratios),
                       f"{fig['document_block_pairs_over_zigzag']:.2f}",
                       f"{fig['document_critical_path_over_zigzag']:.2f}"]))
  result["seconds"] = time.perf_counter() - start
  return result, "\n".join(lines) + "\n"


def main(argv=None) -> dict | None:
  args = parse_args(argv)
  if args.worker is not None:
    print(json.dumps(worker(args)), flush=True)
    return None
  if args.command == "packed":
    result, text = packed(args, argv)
  else:
    result = launch(args)
    text = table(result)
  print(text, end="")
  stem = os.path.join(args.out, args.tag)
  common.write_result(stem + ".json", result, log=text)
  print(f"wrote {stem}.json and {stem}.log", flush=True)
  return result


if __name__ == "__main__":
  main()
