"""Where a ring's time goes: a profile of ring attention's fwd+bwd, by kind of work and by part.

Runs ``ring_jax.ring_attention_sharded`` (forward + backward) under ``jax.profiler`` and adds
up the time of every executed HLO instruction of the trace, classified by what its compiled
HLO computes (a fusion by the ops it fuses; :func:`_kind`: :data:`KINDS`) and by its
``jax.named_scope`` (:func:`_part`: forward / backward, the hop kernel's block loops, the
online-softmax ``merge``, the transfers, the rest). On CPU the fake devices are threads
sharing the cores, so durations include waiting: read the shares, and use ``--ring 2``.

  PYTHONPATH=. python benchmarks/hop_profile.py --length 4096 --ring 2 --mask causal
"""

from __future__ import annotations

import collections
import functools
import glob
import gzip
import json
import os
import sys
import tempfile

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ring_jax  # noqa: E402
from benchmarks import common  # noqa: E402
from ring_jax import analysis  # noqa: E402

common.fake_cpu_devices()

KINDS = ("matmul", "exp", "select/compare", "layout copies", "transfer", "other")
PARTS = ("xla_hop_fwd_blocks", "xla_hop_bwd_blocks", "merge")
_CONTROL = ("while", "conditional", "call")


def parse_hlo(hlo: str) -> dict[str, tuple[str, str]]:
  """``{instruction name: (kind, named-scope path)}`` of a compiled HLO module's text (parsed
  by :func:`ring_jax.analysis.parse_module`)."""
  comps = analysis.parse_module(hlo)
  # Who calls each computation (loop bodies, branches, fusions): an instruction without a
  # named scope of its own (XLA drops it on many fusions) takes its caller's.
  caller = {}
  for comp, insts in comps.items():
    for inst in insts:
      for callee in inst.called:
        caller.setdefault(callee, (comp, inst))

  @functools.cache
  def opcodes(comp: str) -> frozenset[str]:
    """Every opcode a computation holds, through the fusions it calls."""
    return frozenset().union(*map(ops, comps.get(comp, ())))

  def ops(inst) -> set[str]:
    """An instruction's opcode and those of what it runs if a fusion (or an async op)."""
    fused = inst.called if inst.opcode in ("fusion", "async-start") else ()
    return {inst.opcode}.union(*map(opcodes, fused))

  def comp_scope(comp: str, depth: int = 0) -> str:
    """The named scope of the instruction that calls ``comp`` (or of its caller, ...)."""
    if comp not in caller or depth > 50:
      return ""
    parent, inst = caller[comp]
    return inst.op_name or comp_scope(parent, depth + 1)

  return {inst.name: (_kind(inst.opcode, ops(inst)), inst.op_name or comp_scope(comp))
          for comp, insts in comps.items() for inst in insts}


def _kind(op: str, ops: set[str]) -> str:
  """The kind of an instruction ``op`` that computes ``ops`` (its fused ops too): ``control``
  (loops, branches, calls: not counted, they only hold others), ``transfer`` (collectives),
  ``matmul`` (a ``dot``), ``exp``, ``select/compare`` (masks, the NaN-aware row maxima),
  ``layout copies`` (copies, transposes, slices), else ``other`` (elementwise, reductions)."""
  if op in _CONTROL:
    return "control"
  if any(c in o for o in ops for c in common.COLLECTIVES):
    return "transfer"
  if "dot" in ops or "convolution" in ops:
    return "matmul"
  if "exponential" in ops:
    return "exp"
  if ops & {"select", "compare"}:
    return "select/compare"
  if ops <= {"copy", "transpose", "bitcast", "dynamic-slice", "dynamic-update-slice", "slice",
             "concatenate", "parameter", "constant", "tuple", "get-tuple-element", "broadcast",
             "reshape"}:
    return "layout copies"
  return "other"


def _part(kind: str, scope: str) -> str:
  """``"<fwd|bwd>: <part>"`` of an instruction of ``kind`` in named ``scope``: the transfers
  (XLA:CPU keeps no scope on its collectives: K/V and dK/dV count together), one of
  :data:`PARTS`, else ``other`` (block tables, positions, non-finite flags, casts)."""
  direction = "bwd" if "ring_bwd" in scope or "transpose(" in scope else "fwd"
  if kind == "transfer":
    return f"{direction}: transfers"
  for part in PARTS:
    if part in scope:
      return f"{direction}: {part}"
  return f"{direction}: other"


def profile(length: int, layout: str, causal: bool, block: int | None, ring: int, heads: int,
            head_dim: int, steps: int) -> dict:
  """The ring's fwd+bwd (gradient of a sum of squares) profiled over ``steps`` calls: ms per
  step and device by kind (:data:`KINDS`) and by part (:func:`_part`), and the case."""
  mesh = common.ring_mesh(ring)
  q, k, v = common.normal_arrays(jax.random.key(0), [(1, length, heads, head_dim)] * 3,
                                 sharding=jax.sharding.NamedSharding(mesh, common.SEQ_SPEC))

  def loss(q, k, v):
    out = ring_jax.ring_attention_sharded(q, k, v, mesh=mesh, is_causal=causal, layout=layout,
                                          block_q=block, block_kv=block)
    return jnp.sum(out.astype(jnp.float32) ** 2)

  compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile()
  instructions = parse_hlo(compiled.as_text())
  jax.block_until_ready(compiled(q, k, v))
  with tempfile.TemporaryDirectory() as tmp:
    with jax.profiler.trace(tmp, create_perfetto_trace=True):
      for _ in range(steps):
        jax.block_until_ready(compiled(q, k, v))
    trace = json.load(gzip.open(glob.glob(f"{tmp}/**/*.trace.json.gz", recursive=True)[0]))
  by_kind, by_part = collections.Counter(), collections.Counter()
  for event in trace["traceEvents"]:
    found = instructions.get(event.get("name")) if event.get("ph") == "X" else None
    if found is None or found[0] == "control":
      continue
    us = event.get("dur", 0) / steps / ring  # per step, per device
    by_kind[found[0]] += us
    by_part[_part(*found)] += us
  return dict(length=length, layout=layout, causal=causal, ring=ring, heads=heads,
              head_dim=head_dim, block=block, jax=jax.__version__,
              platform=jax.default_backend(),
              by_kind_ms={k: round(by_kind[k] / 1e3, 3) for k in KINDS},
              by_part_ms={k: round(v / 1e3, 3) for k, v in sorted(by_part.items())})


def print_profile(r: dict) -> None:
  print(f"ring of {r['ring']}, L={r['length']}, {r['layout']}, "
        f"{'causal' if r['causal'] else 'full'}, block {r['block'] or 'default'}, "
        f"{r['heads']}x{r['head_dim']}, fwd+bwd; ms per step and device (jax {r['jax']}, "
        f"{r['platform']})")
  for title, table in (("by kind", r["by_kind_ms"]), ("by part", r["by_part_ms"])):
    total = sum(table.values()) or 1.0
    print(f"  {title}:")
    for name, ms in sorted(table.items(), key=lambda kv: -kv[1]):
      print(f"    {name:<28} {ms:9.2f} ms  {100 * ms / total:5.1f}%")


def main(argv=None):
  ap = common.parser(__doc__, out="", length=4096, ring=8, heads=8, head_dim=64)
  ap.add_argument("--layout", default="zigzag")
  ap.add_argument("--mask", choices=("causal", "full"), default="causal")
  ap.add_argument("--block", type=int, default=None, help="default: the ring's default block")
  ap.add_argument("--steps", type=int, default=3)
  args = ap.parse_args(argv)
  r = profile(args.length, args.layout, args.mask == "causal", args.block, args.ring,
              args.heads, args.head_dim, args.steps)
  print_profile(r)
  common.save(args.out, dict(r, meta=common.run_meta(argv, __file__)))
  return r


if __name__ == "__main__":
  main()
