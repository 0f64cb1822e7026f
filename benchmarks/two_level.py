"""Bytes over each mesh axis of the two-level ring vs the flat ring, from the compiled HLO.

For ``seq_axis=(outer, inner)`` the sequence is split over both axes, outer-major. The flat
ring (``ring_jax.ring_attention(axis_name=(outer, inner))``) sends every hop to the next ring
index, so each of its ``n - 1`` hops waits for the slow (outer) link; the two-level ring
(:mod:`ring_jax.two_level`) sends over it ``n_o - 1`` times (the backward's dK/dV ``n_o``
times), each transfer issued a whole inner ring before it is read; routed
(``causal_routing=True``) each part of a group's K/V goes only to the groups that see it.
:func:`permute_traffic` counts what each sends, from the compiled program alone (no timing);
docs/benchmarks.md, "Two link levels".

  PYTHONPATH=. python benchmarks/two_level.py   # -> results/two_level_cpu.json, a table
"""

from __future__ import annotations

import collections
import functools
import math
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ring_jax  # noqa: E402
from benchmarks import common  # noqa: E402

common.fake_cpu_devices()

AXES = ("outer", "inner")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%([\w.\-]+)\s.*\{\s*$")
_CALLEE = re.compile(r"\b(?:body|calls|to_apply|condition|true_computation|false_computation)"
                     r"=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_PERMUTE = re.compile(r"=\s*(\([^=]*?\)|\S+)\s+collective-permute(?:-start)?\(")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")
_SCOPE = re.compile(r'op_name="([^"]*)"')


def _computations(hlo: str) -> tuple[dict[str, list[str]], str]:
  """``({name: instruction lines}, entry name)`` of HLO text."""
  comps, entry, current = {}, None, None
  for line in hlo.splitlines():
    m = _COMPUTATION.match(line)
    if m:
      current = m.group(1)
      comps[current] = []
      if line.startswith("ENTRY"):
        entry = current
    elif line.strip() == "}":
      current = None
    elif current is not None:
      comps[current].append(line)
  return comps, entry


def _executions(comps, entry) -> dict[str, int]:
  """How often each computation runs per program run: a while body ``known_trip_count``
  times per run of its caller (a loop without one counts once); a conditional's branches in
  a loop body of as many trips as branches once per run of that loop each (the routed
  rings' ``lax.switch`` on the step, ``ring_jax.ring.hop_send``, as
  ``tests/ring_jax/test_routing.py`` counts them); anything else called (other conditionals'
  branches too: an upper bound) once per run of its caller."""
  runs = collections.Counter({entry: 1})
  loop_trips = {}  # while body -> its known_trip_count
  order, seen = [entry], {entry}
  while order:  # callers before callees (HLO call graphs are acyclic)
    name = order.pop(0)
    for line in comps.get(name, ()):
      trips = _TRIPS.search(line)
      callees = _CALLEE.findall(line)
      branches = []
      for b in _BRANCHES.findall(line):
        branches += re.findall(r"%([\w.\-]+)", b)
      for callee in callees + branches:
        times = int(trips.group(1)) if trips and f"body=%{callee}" in line else 1
        if trips and f"body=%{callee}" in line:
          loop_trips[callee] = times
        if callee in branches and loop_trips.get(name) == len(branches) > 1:
          runs[callee] += runs[name] // len(branches)
        else:
          runs[callee] += runs[name] * times
        if callee not in seen:
          seen.add(callee)
          order.append(callee)
  return runs


def permute_traffic(hlo: str, mesh_shape, outer: int = 0) -> list[dict]:
  """Every collective-permute of compiled HLO text, as executed per program run.

  Returns one dict per op: ``scope`` (the ``op_name`` metadata, e.g.
  ``.../two_level_fwd/send_outer/ppermute``), ``bytes`` (what one device
  sends: the operand), ``runs`` (loop trip counts included), ``pairs`` and
  ``outer_pairs`` (how many of its source->target pairs cross mesh dimension
  ``outer`` of ``mesh_shape``: the partition ids are positions in the mesh's
  device order). A computation that XLA did not give a trip count is counted once.
  """
  comps, entry = _computations(hlo)
  runs = _executions(comps, entry)
  ops = []
  for name, lines in comps.items():
    for line in lines:
      m = _PERMUTE.search(line)
      pairs = _PAIRS.search(line)
      if not m or not pairs:
        continue
      nbytes = common.shape_bytes(m.group(1), first=True)  # -start: (operand, result, ...)
      st = [tuple(map(int, p)) for p in re.findall(r"\{(\d+),(\d+)\}", pairs.group(1))]
      crossing = sum(np.unravel_index(a, mesh_shape)[outer]
                     != np.unravel_index(b, mesh_shape)[outer] for a, b in st)
      scope = _SCOPE.search(line)
      ops.append(dict(scope=scope.group(1) if scope else "", bytes=nbytes, runs=runs[name],
                      pairs=len(st), outer_pairs=int(crossing)))
  return ops


def axis_summary(ops: list[dict]) -> dict:
  """What one link of each kind carries over the program (the busiest one; every pair of
  a permute is its own link direction): ``outer_transfers`` / ``outer_bytes``, the
  executed permutes with a pair over the outer axis (each waits for a slow link) and
  their bytes; ``inner_transfers`` / ``inner_bytes`` likewise for pairs within a group.
  A flat ring's hop has both kinds of pair, so it counts in both."""
  out = dict(outer_transfers=0, outer_bytes=0, inner_transfers=0, inner_bytes=0)
  for op in ops:
    for kind, present in (("outer", op["outer_pairs"] > 0),
                          ("inner", op["outer_pairs"] < op["pairs"])):
      if present:
        out[f"{kind}_transfers"] += op["runs"]
        out[f"{kind}_bytes"] += op["bytes"] * op["runs"]
  return out


def outer_total(ops: list[dict], scope: str = "") -> int:
  """Bytes over all outer links together: each executed permute's operand bytes times its
  source->target pairs that cross the outer axis (what routing drops: a routed outer step
  sends over fewer pairs, not fewer permutes); only ops whose scope holds ``scope``."""
  return sum(op["bytes"] * op["runs"] * op["outer_pairs"] for op in ops if scope in op["scope"])


def compile_ring(split, *, two_level: bool, backward: bool, is_causal: bool, length: int,
                 heads: int = 4, kv_heads: int = 2, head_dim: int = 64, layout: str = "zigzag",
                 causal_routing: bool | None = False, devices=None, **ring_kw):
  """The compiled flat or two-level ring on its local shards (``jax.shard_map`` of
  :func:`ring_jax.ring_attention` / :func:`ring_jax.two_level_ring_attention`, inputs in the
  layout) over the first ``prod(split)`` of ``devices`` (default: JAX's); ``split`` =
  (n_outer, n_inner) names axes ``outer``, ``inner`` (the flat ring runs over both), one size
  the axis ``sequence``. ``backward``: the gradients of the output's sum of squares;
  ``layout="document"`` adds an int32 ``segment_ids`` input; ``ring_kw`` (blocks, hop kernel,
  window) and ``causal_routing`` (default here: off) go to the ring."""
  axes = AXES if len(split) == 2 else ("sequence",)
  devices = jax.devices() if devices is None else devices
  mesh = jax.sharding.Mesh(np.asarray(devices[:math.prod(split)]).reshape(split), axes)
  seq = axes if len(axes) == 2 else axes[0]
  attend = ring_jax.two_level_ring_attention if two_level else ring_jax.ring_attention
  kw = dict(ring_kw, axis_name=seq, is_causal=is_causal, layout=layout,
            causal_routing=causal_routing)
  # float32: XLA:CPU moves bfloat16 collectives as float32 anyway; bf16 halves the K/V bytes.
  args = [jax.ShapeDtypeStruct((1, length, n, head_dim), jnp.float32)
          for n in (heads, kv_heads, kv_heads)]
  if layout == "document":
    local = lambda q, k, v, seg: attend(q, k, v, segment_ids=seg, **kw)  # noqa: E731
    args.append(jax.ShapeDtypeStruct((1, length), jnp.int32))
  else:
    local = functools.partial(attend, **kw)
  fn = jax.shard_map(local, mesh=mesh, in_specs=(P(None, seq),) * len(args),
                     out_specs=P(None, seq))
  if backward:
    fwd = fn
    fn = lambda *a: jax.grad(lambda q, k, v: jnp.sum(fwd(q, k, v, *a[3:]) ** 2),  # noqa: E731
                             (0, 1, 2))(*a[:3])
  return jax.jit(fn).lower(*args).compile()


def measure(splits=((2, 4), (4, 2)), length: int = 8192, is_causal: bool = True,
            layout: str = "zigzag") -> list[dict]:
  """Per split and pass: the flat ring, the two-level ring in full rotation and routed
  (``causal_routing=True``: the outer transfers only where they are seen)."""
  rows = []
  for split in splits:
    for backward in (False, True):
      for ring, two_level, routing in (("flat", False, False), ("two-level", True, False),
                                       ("routed", True, True)):
        ops = permute_traffic(compile_ring(
            split, two_level=two_level, backward=backward, is_causal=is_causal, length=length,
            layout=layout, causal_routing=routing).as_text(), split)
        rows.append(dict(split=list(split), ring=ring, pass_="fwd+bwd" if backward else "fwd",
                         length=length, **axis_summary(ops), outer_total=outer_total(ops)))
  return rows


def print_table(rows, out=sys.stdout):
  mib = common.MIB
  print(f"{'split':>6} {'pass':>8} {'ring':>10} {'outer xfers':>12} {'outer MiB':>10} "
        f"{'all outer MiB':>14} {'inner xfers':>12} {'inner MiB':>10}", file=out)
  for r in rows:
    print(f"{'x'.join(map(str, r['split'])):>6} {r['pass_']:>8} {r['ring']:>10} "
          f"{r['outer_transfers']:>12} {r['outer_bytes'] / mib:>10.2f} "
          f"{r['outer_total'] / mib:>14.2f} {r['inner_transfers']:>12} "
          f"{r['inner_bytes'] / mib:>10.2f}", file=out)


def main(argv=None):
  ap = common.parser(__doc__, out="two_level_cpu.json", length=8192)
  ap.add_argument("--non-causal", action="store_true")
  ap.add_argument("--layout", default="zigzag")
  args = ap.parse_args(argv)
  rows = measure(length=args.length, is_causal=not args.non_causal, layout=args.layout)
  print_table(rows)
  common.write_result(args.out, dict(
      meta=common.run_meta(argv, __file__), jax=jax.__version__, heads=4, kv_heads=2,
      head_dim=64, dtype="float32", layout=args.layout, is_causal=not args.non_causal, rows=rows))
  return rows


if __name__ == "__main__":
  main()
