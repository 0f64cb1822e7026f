"""What attention sinks and the logit soft-cap cost the xla hop: ring fwd+bwd, interleaved.

``ring_attention_sharded(hop_kernel="xla")`` causal fwd+bwd (the gradients of q, k, v, sinks)
on a ring of ``--ring`` fake CPU devices, inputs in the layout's order, in the four
:data:`CONFIGS` per head dim of ``--head-dim``, compiled once each and then timed
round-robin (``common.interleaved``), ``--repeats`` rounds. Per row: the best and median
process CPU and wall seconds and their ratio to ``plain`` at its head dim, against the
issue's bound ``--bound``. Run it on a quiet machine: the figures are times.

    python benchmarks/sinks_softcap_cost.py --head-dim 64,128,256   # 4K tokens, ring of 8
    python benchmarks/sinks_softcap_cost.py --length 512 --repeats 2 --out ''   # a smoke run
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ring_jax  # noqa: E402
from benchmarks import common  # noqa: E402

#: ``+sinks``: one logit per query head, applied once to the ring's result; ``+softcap``:
#: ``c * tanh(s / c)`` on every score.
CONFIGS = ("plain", "+sinks", "+softcap", "+both")


def time_configs(args, mesh, q, k, v, do, sinks) -> list[dict]:
  """The four configurations at ``q``'s head dim, interleaved: their rows."""
  def step(config):
    def loss(q, k, v, z):
      out = ring_jax.ring_attention_sharded(
          q, k, v, mesh=mesh, is_causal=True, layout=args.layout,
          inputs_in_layout=True, hop_kernel="xla",
          sinks=z if config in ("+sinks", "+both") else None,
          logits_soft_cap=args.soft_cap if config in ("+softcap", "+both") else None)
      return jnp.sum(out * do)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))

  fns = {c: step(c) for c in CONFIGS}
  for c, f in fns.items():  # compile + warm up; every configuration must give finite grads
    if not all(bool(jnp.isfinite(g).all()) for g in jax.block_until_ready(f(q, k, v, sinks))):
      raise SystemExit(f"{c}: non-finite gradients")
  times = common.interleaved({c: (f, (q, k, v, sinks)) for c, f in fns.items()}, args.repeats,
                             warmup=0)
  plain, rows, h = times["plain"], [], q.shape[-1]
  for c in CONFIGS:
    cpu, wall = times[c]["cpu"], times[c]["wall"]
    row = dict(config=c, head_dim=h, best_cpu_s=min(cpu), median_cpu_s=common.median(cpu),
               best_wall_s=min(wall), median_wall_s=common.median(wall), cpu_s=cpu, wall_s=wall,
               ratio_cpu=min(cpu) / min(plain["cpu"]), ratio_wall=min(wall) / min(plain["wall"]))
    row["within_bound"] = row["ratio_cpu"] <= args.bound
    rows.append(row)
    print(f"head dim {h:3d} {c:9s} best cpu {row['best_cpu_s']:.3f}s (x{row['ratio_cpu']:.3f})  "
          f"best wall {row['best_wall_s']:.3f}s (x{row['ratio_wall']:.3f})  "
          f"{'within' if row['within_bound'] else 'OVER'} {args.bound}", flush=True)
  return rows


def main(argv=None):
  p = common.parser(__doc__, out="sinks_softcap_cost.json", repeats=7, length=4096, ring=8,
                    heads=8)
  p.add_argument("--kv-heads", type=int, default=8)
  p.add_argument("--head-dim", type=common.ints, default=[64],
                 help="comma-separated head dims (each its own interleaved set of four)")
  p.add_argument("--layout", default="zigzag")
  p.add_argument("--soft-cap", type=float, default=50.0, help="logits_soft_cap of +softcap")
  p.add_argument("--bound", type=float, default=1.10, help="the issue's bound on each ratio")
  args = p.parse_args(argv)
  if "JAX_PLATFORMS" not in os.environ:  # fake CPU devices, also on an accelerator host
    jax.config.update("jax_platforms", "cpu")
  common.fake_cpu_devices(args.ring)
  if jax.device_count() < args.ring:
    raise SystemExit(f"needs {args.ring} devices, have {jax.device_count()} (XLA_FLAGS set "
                     "before jax was imported?)")
  mesh = common.ring_mesh(args.ring)
  length, n, kh = args.length, args.heads, args.kv_heads
  sinks = common.normal_arrays(jax.random.key(1), [(n,)])[0] * 3.0
  rows = []
  for h in args.head_dim:
    q, k, v, do = common.normal_arrays(jax.random.key(h), [(1, length, n, h)] + [
        (1, length, kh, h)] * 2 + [(1, length, n, h)])
    rows += time_configs(args, mesh, q, k, v, do, sinks)
  return common.save(args.out, dict(
      common.run_meta(argv, __file__),
      about="ring_attention_sharded(hop_kernel='xla') fwd+bwd with sinks / soft-cap vs "
            "without, interleaved in one process; ratios to 'plain' of the best process CPU "
            "(and wall) seconds at the same head dim",
      length=length, ring=args.ring, heads=n, kv_heads=kh, head_dims=args.head_dim,
      dtype="float32", layout=args.layout, is_causal=True, soft_cap=args.soft_cap,
      repeats=args.repeats, bound=args.bound, rows=rows))


if __name__ == "__main__":
  main()
