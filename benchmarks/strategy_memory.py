"""Compiled memory per device of each sequence-parallel strategy, beside ``ring_jax.plan``'s.

  PYTHONPATH=. python benchmarks/strategy_memory.py   # -> results/strategy_memory_cpu.json

Per strategy, the compiled temp memory per device (``memory_analysis()``) of
``ring_jax.attention_sharded`` forward and fwd+bwd (causal, float32, default blocks) and the
memory ``ring_jax.plan`` counts for the same call (``Estimate.memory_bytes``). Compile only.
"""

from __future__ import annotations

import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ring_jax  # noqa: E402
from benchmarks import common  # noqa: E402

common.fake_cpu_devices()


def main(argv=None) -> dict:
  ap = common.parser(__doc__, out="strategy_memory_cpu.json", length=16384, heads=8,
                     head_dim=64)
  ap.add_argument("--devices", type=int, default=8)
  ap.add_argument("--layout", default="zigzag")
  args = ap.parse_args(argv)
  mesh = common.ring_mesh(args.devices)
  x = common.abstract_qkv(mesh, (1, args.length, args.heads, args.head_dim))
  plan = ring_jax.plan(batch=1, seq_len=args.length, heads=args.heads, kv_heads=args.heads,
                       head_dim=args.head_dim, dtype="float32", is_causal=True,
                       layout=args.layout, sequence=args.devices, device="cpu")
  rows = []
  for strategy in ("ring", "ulysses", "all_gather"):
    f = functools.partial(ring_jax.attention_sharded, mesh=mesh, strategy=strategy,
                          seq_axis="sequence", batch_axis=None, is_causal=True,
                          layout=args.layout)
    r = dict(strategy=strategy, fwd_temp_bytes=common.temp_bytes(f, x, x, x),
             fwdbwd_temp_bytes=common.temp_bytes(common.fwd_bwd(f), x, x, x, x),
             plan_memory_bytes=int(plan.estimate(strategy).memory_bytes))
    rows.append(r)
    print(f"{strategy:10s} temp fwd {r['fwd_temp_bytes'] / 2**20:7.1f} MiB, fwd+bwd "
          f"{r['fwdbwd_temp_bytes'] / 2**20:7.1f} MiB; plan() counts "
          f"{r['plan_memory_bytes'] / 2**20:7.1f} MiB", flush=True)
  return common.save(args.out, dict(
      meta=common.run_meta(argv, __file__, elapsed_s=common.elapsed()), length=args.length,
      heads=args.heads, head_dim=args.head_dim, dtype="float32", layout=args.layout,
      is_causal=True, rows=rows))


if __name__ == "__main__":
  main()
