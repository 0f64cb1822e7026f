"""Bytes over each mesh axis of the two-level ring vs the flat ring, from the compiled HLO;
``matrix``: the rings' compiled footprint over a fixed matrix, to compare two ring loops.

:func:`permute_traffic` counts what every collective-permute of a compiled program sends (no
timing), for the flat ring, the two-level ring in full rotation and routed (:func:`measure`);
``matrix`` measures each cell of :func:`cells` (:func:`measure_cell`), ``matrix --compare``
prints the cells whose figures differ and exits non-zero when one got worse. Commands and
flags: benchmarks/README.md, "Two link levels".
"""

from __future__ import annotations

import collections
import datetime
import itertools
import json
import math
import os
import re
import sys

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ring_jax  # noqa: E402
from benchmarks import common  # noqa: E402
from ring_jax import analysis, topology  # noqa: E402

common.fake_cpu_devices()

AXES = ("outer", "inner")


def permute_traffic(hlo: str, mesh_shape, outer: int = 0) -> list[dict]:
  """Every collective-permute of compiled HLO text, as executed per program run.

  Returns one dict per op: ``scope`` (the ``op_name`` metadata, e.g.
  ``.../two_level_fwd/send_outer/ppermute``), ``bytes`` (what one device
  sends: the operand), ``runs`` (loop trip counts included), ``pairs`` and
  ``outer_pairs`` (how many of its source->target pairs cross mesh dimension
  ``outer`` of ``mesh_shape``: the partition ids are positions in the mesh's
  device order); how often each computation runs: :func:`ring_jax.analysis.executions`.
  """
  comps = analysis.parse_module(hlo)
  runs = analysis.executions(comps)
  ops = []
  for name, insts in comps.items():
    for inst in insts:
      st = inst.source_target_pairs
      if inst.opcode not in ("collective-permute", "collective-permute-start") or not st:
        continue
      crossing = sum(np.unravel_index(a, mesh_shape)[outer]
                     != np.unravel_index(b, mesh_shape)[outer] for a, b in st)
      # -start's shape: (operand, result, ...)
      ops.append(dict(scope=inst.op_name, bytes=common.shape_bytes(inst.shape, first=True),
                      runs=runs[name], pairs=len(st), outer_pairs=int(crossing)))
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
  mesh = common.make_mesh(split, axes, devices)
  seq = axes if len(axes) == 2 else axes[0]
  attend = ring_jax.two_level_ring_attention if two_level else ring_jax.ring_attention
  kw = dict(ring_kw, axis_name=seq, is_causal=is_causal, layout=layout,
            causal_routing=causal_routing)
  # float32: XLA:CPU moves bfloat16 collectives as float32 anyway; bf16 halves the K/V bytes.
  args = [jax.ShapeDtypeStruct((1, length, n, head_dim), jnp.float32)
          for n in (heads, kv_heads, kv_heads)]
  if layout == "document":
    args.append(jax.ShapeDtypeStruct((1, length), jnp.int32))
  local = lambda q, k, v, *seg: attend(  # noqa: E731
      q, k, v, segment_ids=seg[0] if seg else None, **kw)
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


def print_table(rows):
  mib = common.MIB
  print(f"{'split':>6} {'pass':>8} {'ring':>10} {'outer xfers':>12} {'outer MiB':>10} "
        f"{'all outer MiB':>14} {'inner xfers':>12} {'inner MiB':>10}")
  for r in rows:
    print(f"{'x'.join(map(str, r['split'])):>6} {r['pass_']:>8} {r['ring']:>10} "
          f"{r['outer_transfers']:>12} {r['outer_bytes'] / mib:>10.2f} "
          f"{r['outer_total'] / mib:>14.2f} {r['inner_transfers']:>12} "
          f"{r['inner_bytes'] / mib:>10.2f}")


# --- matrix: the rings' compiled footprint over a fixed matrix ---------------------------------

RINGS = ("2", "4", "8", "2x2", "4x2")
LAYOUTS = ("contiguous", "zigzag", "striped", "document")
MASKS = ("causal", "full", "window")
PASSES = ("fwd", "fwd+bwd")
LOCAL_LEN = 128   # tokens per device
BLOCK = 32
WINDOW = (160, 0)  # causal, reaching a bit over one shard back
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 32
# (figure, better when) compared by --compare
FIGURES = (("permutes", "lower"), ("permute_bytes", "lower"), ("temp_bytes", "lower"),
           ("hlo_chars", "lower"), ("ring_in_flight", "higher"))


def cells(rings, layouts, masks, passes):
  """The matrix's cells as dicts (document: no window, the layout takes none)."""
  for ring, layout, mask, routed, pass_ in itertools.product(rings, layouts, masks,
                                                             (False, True), passes):
    if not (layout == "document" and mask == "window"):
      yield dict(ring=ring, layout=layout, mask=mask, routed=routed, pass_=pass_)


def measure_cell(cell, devices, tpu: bool) -> dict:
  """One cell compiled on its local shards (:func:`compile_ring`, on the first ``devices``):
  the collective-permutes executed per run and the bytes they move over all links together
  (:func:`permute_traffic`), ``memory_analysis()`` temp bytes, the HLO's size
  (:func:`program_chars`) and, ``tpu`` (a TPU slice's devices), the ring transfers in flight
  during block compute (:func:`ring_jax.analysis.overlap_report`)."""
  split = tuple(int(x) for x in cell["ring"].split("x"))
  compiled = compile_ring(
      split, two_level=len(split) == 2, backward=cell["pass_"] == "fwd+bwd",
      is_causal=cell["mask"] != "full", length=LOCAL_LEN * math.prod(split), heads=HEADS,
      kv_heads=KV_HEADS, head_dim=HEAD_DIM, layout=cell["layout"],
      causal_routing=cell["routed"], devices=devices, block_q=BLOCK, block_kv=BLOCK,
      hop_kernel="xla", local_window_size=WINDOW if cell["mask"] == "window" else None)
  text = compiled.as_text()
  ops = permute_traffic(text, split)
  row = dict(cell, permutes=sum(op["runs"] for op in ops),
             permute_bytes=sum(op["bytes"] * op["runs"] * op["pairs"] for op in ops),
             temp_bytes=int(compiled.memory_analysis().temp_size_in_bytes),
             hlo_chars=program_chars(text))
  if tpu:
    row["ring_in_flight"], row["ring_transfers"] = analysis.overlap_report(compiled).ring()
  return row


_METADATA = re.compile(r",? ?metadata=\{[^}]*\}")
_NUMBERING = re.compile(r"(?<=[A-Za-z_])\.\d+|\.clone|(?<=region)_\d+")


def program_chars(text: str) -> int:
  """Characters of an HLO module's computations without their debug information: from the
  first computation on (the stack-frame tables before it name source files and lines),
  without each instruction's ``metadata={...}``, and with the compiler's numbering of names
  dropped (``%fusion.123`` counts as ``%fusion``, ``region_7.clone.clone`` as ``region``: the
  same program numbered from another counter is the same size)."""
  lines = text.splitlines()
  start = next((i for i, line in enumerate(lines) if line.startswith(("%", "ENTRY"))), 0)
  return len(_NUMBERING.sub("", _METADATA.sub("", "\n".join(lines[start:]))))


def key(row) -> str:
  return (f"{row['ring']} {row['layout']}-{row['mask']}{'+routed' if row['routed'] else ''} "
          f"{row['pass_']}")


def compare(before_path, after_path) -> int:
  """Prints the cells whose figures differ; 1 when one got worse (or is missing), else 0."""
  load = lambda p: {key(r): r for r in json.load(open(p))["rows"]}  # noqa: E731
  before, after = load(before_path), load(after_path)
  counts = collections.Counter()
  for k, b in before.items():
    a = after.get(k)
    if a is None:
      print(f"{k}: missing after")
      counts["worse"] += 1
      continue
    changed = [(fig, (a[fig] > b[fig]) == (good == "lower")) for fig, good in FIGURES
               if fig in a and fig in b and a[fig] != b[fig]]
    counts["worse" if any(bad for _, bad in changed) else
           "better" if changed else "equal"] += 1
    if changed:
      print(f"{k}: " + "; ".join(f"{fig} {b[fig]} -> {a[fig]}{' WORSE' if bad else ''}"
                                 for fig, bad in changed))
  print(f"{len(before)} cells: {counts['equal']} equal, {counts['better']} better, "
        f"{counts['worse']} worse")
  return 1 if counts["worse"] else 0


def matrix(args) -> int:
  """The ``matrix`` command: every cell's figures, written after each cell (a long run
  stopped early keeps what it measured); ``--compare``: :func:`compare`."""
  if args.compare:
    return compare(*args.compare)
  devices = topology.devices(args.topology) if args.topology else jax.devices()
  header = dict(label=args.label, date=datetime.date.today().isoformat(),
                jax=jax.__version__, platform=args.topology or jax.default_backend(),
                shapes=dict(local_len=LOCAL_LEN, block=BLOCK, window=WINDOW, heads=HEADS,
                            kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype="float32"))
  rows = []
  for cell in cells(args.rings, args.layouts, args.masks, args.passes):
    r = measure_cell(cell, devices, tpu=bool(args.topology))
    rows.append(r)
    print(f"{key(r):45s} permutes {r['permutes']:4d} bytes {r['permute_bytes']:10d} "
          f"temp {r['temp_bytes']:10d} hlo {r['hlo_chars']:9d}"
          + (f" in flight {r['ring_in_flight']}/{r['ring_transfers']}" if args.topology
             else ""), flush=True)
    if args.out:
      common.write_result(args.out, dict(header, rows=rows))
  return 0


def main(argv=None):
  ap = common.parser(__doc__, out="two_level_cpu.json", length=8192)
  ap.add_argument("--non-causal", action="store_true")
  ap.add_argument("--layout", default="zigzag")
  mx = ap.add_subparsers(dest="command").add_parser(
      "matrix", help="the rings' compiled footprint over a fixed matrix")
  mx.add_argument("--out", default="", help="result file (JSON)")
  mx.add_argument("--topology", default=None, help="compile for this TPU slice (8 chips)")
  for flag, values in (("rings", RINGS), ("layouts", LAYOUTS), ("masks", MASKS),
                       ("passes", PASSES)):
    mx.add_argument(f"--{flag}", type=common.strs, default=list(values))
  mx.add_argument("--label", default="")
  mx.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
  args = ap.parse_args(argv)
  if args.command == "matrix":
    return matrix(args)
  rows = measure(length=args.length, is_causal=not args.non_causal, layout=args.layout)
  print_table(rows)
  common.write_result(args.out, dict(
      meta=common.run_meta(argv, __file__), jax=jax.__version__, heads=4, kv_heads=2,
      head_dim=64, dtype="float32", layout=args.layout, is_causal=not args.non_causal, rows=rows))
  return rows


if __name__ == "__main__":
  result = main()
  sys.exit(result if isinstance(result, int) else 0)
