r"""Causal load balance in wall time: one process per device, each on its own core.

  PYTHONPATH=. python benchmarks/balance.py --processes 2 --lengths 4096,8192,16384 --repeats 5

Each device is its own process, pinned to its own core before JAX starts, XLA:CPU and
BLAS/OpenMP single-threaded, the processes one JAX system over ``jax.distributed`` with gloo
collectives, so a ring step waits for the slowest device as on accelerators (all fake
devices in one process share the cores: time shows the total work, not the critical path).
Per length: causal fwd+bwd of each of ``--impls`` (``benchmarks/attention.py``'s; a
``ring-<layout>`` with ``+full`` / ``+routed``: ``causal_routing=False`` / ``True``; the
paper's code, ``ringattention==0.1.2``, left out with a note when it does not import), timed
round-robin after a warm-up; a repetition's time is the slowest process's, the figure their
median, beside each layout's critical path from ``ring_jax.schedule`` (in full local hops).
docs/benchmarks.md, "Load balance in wall time".

Writes ``<out>/<tag>.json`` and ``.log``. ``--dry-run``: one short length, one repetition,
no warm-up (a smoke test; the numbers mean nothing).
"""

from __future__ import annotations

import argparse
import datetime
import io
import json
import os
import platform as _platform
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Imports JAX and NumPy but starts no thread: a worker still pins its core before JAX starts.
from benchmarks import common  # noqa: E402

#: One-thread XLA:CPU for each worker; one fake device per process.
WORKER_XLA_FLAGS = ("--xla_force_host_platform_device_count=1 "
                    "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")
#: Thread pools of libraries a worker might load (BLAS, OpenMP): one thread each. Whatever
#: threads remain (XLA's own pools) share the one core the process is pinned to.
ONE_THREAD_ENV = {name: "1" for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS",
                                         "OPENBLAS_NUM_THREADS")}
IMPLS = ("ring-contiguous", "ring-zigzag", "ring-striped", "paper")
#: Also accepted by --impls: each ring with its routing forced (+full: causal_routing=False,
#: +routed: True), e.g. to compare the full and the routed rotation where transfers are
#: exposed (short local lengths).
ROUTED = ("ring-contiguous+full", "ring-contiguous+routed", "ring-zigzag+full",
          "ring-zigzag+routed")


def parse_args(argv=None):
  ap = common.parser(__doc__, repeats=5, heads=8, head_dim=64)
  ap.add_argument("--processes", type=int, default=2, help="devices = processes = cores used")
  ap.add_argument("--cores", type=common.ints, default=None,
                  help="core of each process (default: the first --processes cores this "
                       "process may run on)")
  ap.add_argument("--lengths", type=common.ints, default=None,
                  help="default 4096,8192,16384 (--dry-run: 256)")
  ap.add_argument("--impls", type=common.strs, default=list(IMPLS))
  ap.add_argument("--warmup", type=int, default=1)
  ap.add_argument("--batch", type=int, default=1)
  ap.add_argument("--block", type=int, default=None,
                  help="block size of every implementation (default: the ring's default "
                       "block for its layout, as benchmarks/attention.py)")
  ap.add_argument("--dry-run", action="store_true",
                  help="one length (--lengths' first, default 256), 1 repetition, no warm-up")
  ap.add_argument("--timeout", type=float, default=3600, help="seconds for the whole run")
  ap.add_argument("--out", default=common.RESULTS)
  ap.add_argument("--tag", default="balance_cpu", help="output file stem")
  # Internal: a worker process.
  ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
  ap.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
  ap.add_argument("--workdir", default=None, help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  args.argv = sys.argv[1:] if argv is None else list(argv)
  if args.dry_run:
    args.lengths = (args.lengths or [256])[:1]
    args.repeats, args.warmup = 1, 0
  elif args.lengths is None:
    args.lengths = [4096, 8192, 16384]
  unknown = set(args.impls) - set(IMPLS + ROUTED)
  if unknown:
    ap.error(f"unknown --impls {sorted(unknown)}; known: {IMPLS + ROUTED}")
  return args


# ----------------------------------------------------------------------------
# Worker: one device, one core
# ----------------------------------------------------------------------------

def worker(args) -> None:
  core = args.cores[args.worker]
  os.sched_setaffinity(0, {core})  # Before JAX starts any thread: they all inherit it.
  import jax

  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=f"127.0.0.1:{args.port}",
                             num_processes=args.processes, process_id=args.worker)
  import jax.numpy as jnp
  import numpy as np
  from jax.experimental import multihost_utils
  from jax.sharding import NamedSharding, PartitionSpec as P

  from benchmarks import attention as bench  # after XLA_FLAGS: it keeps our device count

  n = jax.device_count()
  assert n == args.processes and jax.local_device_count() == 1, (n, jax.local_device_count())
  mesh = jax.sharding.Mesh(np.array(jax.devices()), (bench.AXIS,))
  sharding = NamedSharding(mesh, P(None, bench.AXIS, None, None))
  paper_fn, paper_note = None, None
  if "paper" in args.impls:
    try:
      paper_fn = bench.import_paper()
    except Exception as e:  # noqa: BLE001  (optional extra not installed)
      paper_note = f"paper code not importable ({type(e).__name__}: {e}); install the bench extra"
  impls = [name for name in args.impls if name != "paper" or paper_fn is not None]

  def global_array(seed, shape):
    """The same global array on every process (numpy, seeded), each holding its shard."""
    x = np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)
    return jax.make_array_from_callback(shape, sharding, lambda idx: x[idx])

  rows = []
  for length in args.lengths:
    shape = (args.batch, length, args.heads, args.head_dim)
    q, k, v, do = (global_array(length * 4 + i, shape) for i in range(4))
    cases = []
    for name in impls:
      block = bench.block_for(name, length // n, args.block)
      f, layout, _ = bench.make_impl(name, mesh=mesh, is_causal=True, dtype=jnp.float32,
                                     block=block, paper_fn=paper_fn)
      t0 = time.perf_counter()
      compiled = jax.jit(bench.fwd_bwd(f)).lower(q, k, v, do).compile()
      cases.append(dict(impl=name, layout=layout, block=block, length=length, compiled=compiled,
                        compile_s=round(time.perf_counter() - t0, 2), times_s=[], cpu_s=[],
                        temp_bytes=common.compiled_memory(compiled).get("temp_size_in_bytes")))
    # Round-robin (a slow phase of the machine hits every impl alike), all processes in step.
    times = common.interleaved(
        {c["impl"]: (c["compiled"], (q, k, v, do)) for c in cases}, args.repeats, args.warmup,
        before=lambda name, it: multihost_utils.sync_global_devices(f"{length}-{it}-{name}"))
    for case in cases:
      case["times_s"] = [round(t, 5) for t in times[case["impl"]]["wall"]]
      case["cpu_s"] = [round(t, 4) for t in times[case["impl"]]["cpu"]]
    rows.extend({k: v for k, v in case.items() if k != "compiled"} for case in cases)
  out = dict(process=args.worker, core=core, affinity=sorted(os.sched_getaffinity(0)),
             rows=rows, paper_note=paper_note)
  with open(os.path.join(args.workdir, f"worker_{args.worker}.json"), "w") as f:
    json.dump(out, f)
  jax.distributed.shutdown()


# ----------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------

def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def worker_command(args, i: int, port: int, workdir: str) -> list[str]:
  """This script with the run's own flags, as worker ``i`` on the cores chosen."""
  return [sys.executable, os.path.abspath(__file__), *args.argv, "--worker", str(i),
          "--port", str(port), "--workdir", workdir, "--cores", ",".join(map(str, args.cores))]


def launch(args) -> dict:
  """Starts one worker per device, waits for all, returns the merged result."""
  allowed = sorted(os.sched_getaffinity(0))
  if args.cores is None:
    args.cores = allowed[:args.processes]
  if len(args.cores) != args.processes or len(set(args.cores)) != args.processes:
    raise SystemExit(f"--cores={args.cores}: need {args.processes} distinct cores "
                     f"(this process may use {allowed}); lower --processes or name the cores.")
  if not set(args.cores) <= set(allowed):
    raise SystemExit(f"--cores={args.cores} are not all available here ({allowed}).")
  env = dict(os.environ, XLA_FLAGS=WORKER_XLA_FLAGS, JAX_PLATFORMS="cpu", **ONE_THREAD_ENV)
  env["PYTHONPATH"] = os.pathsep.join(p for p in (common.ROOT, env.get("PYTHONPATH")) if p)
  port = free_port()
  with tempfile.TemporaryDirectory(prefix="balance_") as workdir:
    procs = [subprocess.Popen(worker_command(args, i, port, workdir), env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(args.processes)]
    deadline = time.monotonic() + args.timeout
    outputs = []
    try:
      for p in procs:
        outputs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
    finally:
      for p in procs:  # A failed or overrunning worker: stop the ones this run started.
        if p.poll() is None:
          p.kill()
          p.wait()
    failed = [(i, p.returncode) for i, p in enumerate(procs) if p.returncode]
    if failed:
      i, rc = failed[0]
      raise SystemExit(f"worker {i} exited with status {rc}:\n{outputs[i][-4000:]}")
    workers = []
    for i in range(args.processes):
      with open(os.path.join(workdir, f"worker_{i}.json")) as f:
        workers.append(json.load(f))
  return merge(args, workers)


def merge(args, workers: list[dict]) -> dict:
  """One row per (length, impl): per repetition the slowest process's time, then the median."""
  import numpy as np

  import ring_jax
  from benchmarks.attention import ring_variant as bench_variant
  from ring_jax.ring import default_block

  rows = []
  for j, row in enumerate(workers[0]["rows"]):
    per_rep = np.max([w["rows"][j]["times_s"] for w in workers], axis=0)
    n, length = args.processes, row["length"]
    local = length // n
    b = row["block"] or default_block(row["layout"], local)
    routing = bench_variant(row["impl"])[2] if row["impl"].startswith("ring-") else False
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
    row["time_over_paper"] = (round(row["median_s"] / paper["median_s"], 3) if paper else None)
  import jax
  return dict(
      benchmark="balance", processes=args.processes, cores=args.cores,
      affinity=[w["affinity"] for w in workers], xla_flags=WORKER_XLA_FLAGS,
      lengths=args.lengths, impls=args.impls, repeats=args.repeats, warmup=args.warmup,
      batch=args.batch, heads=args.heads, head_dim=args.head_dim, dtype="float32",
      causal=True, dry_run=args.dry_run, paper_note=workers[0]["paper_note"], rows=rows,
      jax=jax.__version__, python=_platform.python_version(), machine=_platform.machine(),
      cpus=os.cpu_count(), load_avg=os.getloadavg(),
      date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))


def print_table(result, out=sys.stdout) -> None:
  print(f"causal fwd+bwd, {result['processes']} processes x 1 device, one core each "
        f"(cores {result['cores']}), B={result['batch']} heads={result['heads']} "
        f"head_dim={result['head_dim']} f32; median of {result['repeats']} (slowest process per "
        f"repetition); load average {', '.join(f'{x:.1f}' for x in result['load_avg'])}",
        file=out)
  if result["paper_note"]:
    print(f"note: {result['paper_note']}", file=out)
  hdr = (f"{'L':>6} {'impl':<16} {'block':>5} {'fwd+bwd ms':>11} {'per process ms':>18} "
         f"{'/ paper':>8} {'crit. path hops':>16} {'total hops':>11} {'temp MiB':>9}")
  print(hdr, file=out)
  print("-" * len(hdr), file=out)
  for r in result["rows"]:
    per = "/".join(f"{1e3 * t:.0f}" for t in r["per_process_median_s"])
    ratio = "-" if r["time_over_paper"] is None else f"{r['time_over_paper']:.2f}"
    temp = "-" if r["temp_bytes"] is None else f"{r['temp_bytes'] / 2 ** 20:.1f}"
    print(f"{r['length']:>6} {r['impl']:<16} {str(r['block']):>5} {1e3 * r['median_s']:>11.1f} "
          f"{per:>18} {ratio:>8} {r['critical_path_hops']:>16.3f} {r['total_hops']:>11.3f} "
          f"{temp:>9}", file=out)


def main(argv=None) -> dict | None:
  args = parse_args(argv)
  if args.worker is not None:
    worker(args)
    return None
  result = launch(args)
  table = io.StringIO()
  print_table(result, out=table)
  print(table.getvalue(), end="")
  stem = os.path.join(args.out, args.tag)
  common.write_result(stem + ".json", result, log=table.getvalue())
  print(f"wrote {stem}.json and {stem}.log", flush=True)
  return result


if __name__ == "__main__":
  main()
