"""Compile time and program size of the ring's fwd+bwd and of the tiny train step (CPU);
``strategy``: compiled memory per device of each sequence-parallel strategy, beside
``ring_jax.plan``'s.

  PYTHONPATH=. python benchmarks/compile_time.py      # -> benchmarks/results/compile_time_cpu.json
  PYTHONPATH=. python benchmarks/compile_time.py --dry-run --out /tmp/compile_time.json
  PYTHONPATH=. python benchmarks/compile_time.py strategy   # -> results/strategy_memory_cpu.json

Per case of :data:`CASES` (``ring_jax.ring_attention_sharded`` fwd+bwd, float32, default
blocks), then for ``configs/tiny.py``'s train step (``benchmarks/fit.py``'s ``Planner``): the
compiled module's size, the median of ``--repeats`` fresh compiles and the compiled temp
memory per device (benchmarks/README.md, "Compile time and strategy memory"). Compile only.
"""

from __future__ import annotations

import functools
import os
import re
import sys

import jax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ring_jax  # noqa: E402
from benchmarks import common  # noqa: E402
from benchmarks.common import MIB  # noqa: E402
from ring_jax.routing import check_routing  # noqa: E402

common.fake_cpu_devices()

#: (causal, layout, causal_routing; None: the library's default): causal zigzag and contiguous
#: at the default routing and flipped, then non-causal.
CASES = ((True, "zigzag", None), (True, "zigzag", True), (True, "contiguous", None),
         (True, "contiguous", False), (False, "zigzag", None), (False, "contiguous", None))
INSTRUCTION = re.compile(r"^\s+(ROOT )?%?[\w.\-]+ = ")


def timed_compiles(lower, repeats: int) -> tuple:
  """``(compiled, figures)``: ``lower()`` (tracing and lowering afresh) compiled ``repeats``
  times; the figures: the last compiled module's text in lines and HLO instructions, and
  the seconds of each compile and their median."""
  times = []
  for _ in range(repeats):
    jax.clear_caches()  # no in-memory executable to reuse either
    wall, _, compiled = common.timed_call(lower().compile)
    times.append(wall)
  lines = compiled.as_text().splitlines()
  return compiled, dict(hlo_lines=len(lines),
                        hlo_instructions=sum(1 for line in lines if INSTRUCTION.match(line)),
                        compile_s=[round(t, 3) for t in times],
                        compile_median_s=round(common.median(times), 3))


def attention_case(mesh, causal, layout, routing, args):
  x = common.abstract_qkv(mesh, (1, args.length, args.heads, args.head_dim))
  attn = functools.partial(ring_jax.ring_attention_sharded, mesh=mesh, is_causal=causal,
                           layout=layout, causal_routing=routing)
  # fwd_bwd makes a new function per call: traced and lowered afresh
  compiled, figures = timed_compiles(
      lambda: jax.jit(common.fwd_bwd(attn)).lower(x, x, x, x), args.repeats)
  return dict(causal=causal, layout=layout, causal_routing=routing,
              routed=check_routing(routing, layout, causal), **figures,
              fwd_temp_bytes=common.temp_bytes(attn, x, x, x),
              fwdbwd_temp_bytes=common.compiled_memory(compiled)["temp_size_in_bytes"])


def train_step_case(args):
  from benchmarks import fit
  from configs import tiny

  config = tiny.get_config()
  sizes = fit.resolve_mesh(config, len(jax.devices()), None)
  planner = fit.Planner(config, sizes, limit_bytes=2 ** 40)
  shape = (config.batch_size, config.data.seq_len)
  compiled, figures = timed_compiles(lambda: planner.step.lower(shape), args.repeats)
  return dict(config="configs/tiny.py", mesh=sizes, batch=list(shape),
              attention=planner.model_cfg.attention, layout=planner.model_cfg.layout, **figures,
              temp_bytes=common.compiled_memory(compiled)["temp_size_in_bytes"])


def strategy_memory(args, argv) -> dict:
  """The ``strategy`` command: per strategy, the compiled temp memory per device of
  ``ring_jax.attention_sharded`` forward and fwd+bwd (causal, float32, default blocks) and the
  memory ``ring_jax.plan`` counts for the same call (``Estimate.memory_bytes``)."""
  mesh = common.ring_mesh(args.ring)
  x = common.abstract_qkv(mesh, (1, args.length, args.heads, args.head_dim))
  plan = ring_jax.plan(batch=1, seq_len=args.length, heads=args.heads, kv_heads=args.heads,
                       head_dim=args.head_dim, dtype="float32", is_causal=True,
                       layout=args.layout, sequence=args.ring, device="cpu")
  rows = []
  for strategy in ("ring", "ulysses", "all_gather"):
    f = functools.partial(ring_jax.attention_sharded, mesh=mesh, strategy=strategy,
                          seq_axis="sequence", batch_axis=None, is_causal=True,
                          layout=args.layout)
    r = dict(strategy=strategy, fwd_temp_bytes=common.temp_bytes(f, x, x, x),
             fwdbwd_temp_bytes=common.temp_bytes(common.fwd_bwd(f), x, x, x, x),
             plan_memory_bytes=int(plan.estimate(strategy).memory_bytes))
    rows.append(r)
    print(f"{strategy:10s} temp fwd {r['fwd_temp_bytes'] / MIB:7.1f} MiB, fwd+bwd "
          f"{r['fwdbwd_temp_bytes'] / MIB:7.1f} MiB; plan() counts "
          f"{r['plan_memory_bytes'] / MIB:7.1f} MiB", flush=True)
  return common.save(args.out, dict(
      meta=common.run_meta(argv, __file__, elapsed_s=common.elapsed()), length=args.length,
      heads=args.heads, head_dim=args.head_dim, dtype="float32", layout=args.layout,
      is_causal=True, rows=rows))


def main(argv=None) -> dict:
  ap = common.parser(__doc__, out="compile_time_cpu.json", length=4096, repeats=3, ring=8,
                     heads=8, head_dim=64)
  ap.add_argument("--dry-run", action="store_true",
                  help="smoke test: 256 tokens, one compile each, two cases, no train step")
  sub = ap.add_subparsers(dest="command")
  st = sub.add_parser("strategy", help="compiled memory per strategy beside ring_jax.plan's")
  st.add_argument("--out", default=os.path.join(common.RESULTS, "strategy_memory_cpu.json"),
                  help="result file (JSON)")
  st.add_argument("--length", type=int, default=16384, help="global sequence length")
  st.add_argument("--layout", default="zigzag")
  args = ap.parse_args(argv)
  if args.command == "strategy":
    return strategy_memory(args, argv)
  cases = CASES
  if args.dry_run:
    args.length, args.repeats = 256, 1
    cases = (CASES[0], CASES[-1])
  mesh = common.ring_mesh(args.ring)
  result = dict(meta=common.run_meta(
      argv, __file__, dry_run=args.dry_run, ring=args.ring, length=args.length,
      heads=args.heads, head_dim=args.head_dim, dtype="float32", repeats=args.repeats,
      persistent_cache=False), attention=[])
  with common.without_persistent_cache():
    for causal, layout, routing in cases:
      r = attention_case(mesh, causal, layout, routing, args)
      result["attention"].append(r)
      print(f"{'causal' if causal else 'full':6s} {layout:10s} routed={r['routed']!s:5s} "
            f"HLO {r['hlo_lines']:6,} lines {r['hlo_instructions']:6,} instructions  compile "
            f"{r['compile_median_s']:.2f} s {r['compile_s']}  temp fwd "
            f"{r['fwd_temp_bytes'] / MIB:.1f} / fwd+bwd {r['fwdbwd_temp_bytes'] / MIB:.1f} "
            "MiB", flush=True)
    if not args.dry_run:
      r = result["train_step"] = train_step_case(args)
      print(f"train step {r['config']} {r['mesh']} batch {r['batch']}: HLO {r['hlo_lines']:,} "
            f"lines {r['hlo_instructions']:,} instructions  compile {r['compile_median_s']:.2f} "
            f"s {r['compile_s']}", flush=True)
  result["meta"]["elapsed_s"] = common.elapsed()
  return common.save(args.out, result)


if __name__ == "__main__":
  main()
