"""The rings' compiled footprint over a fixed matrix, to compare two versions of the ring loop.

Each cell of the matrix (:func:`cells`: rings of 2, 4, 8 and two-level 2x2, 4x2 x layouts x
causal, full, windowed x routing on, off x fwd, fwd+bwd) is compiled on its local shards
(:func:`benchmarks.two_level.compile_ring`); recorded: the collective-permutes executed per
run and the bytes they move over all links together
(:func:`benchmarks.two_level.permute_traffic`), ``memory_analysis()`` temp bytes, the HLO's
size (:func:`program_chars`) and, compiled for a TPU slice (``--topology``, no TPU attached),
the ring transfers in flight during block compute (:func:`ring_jax.analysis.overlap_report`).
Nothing runs. docs/performance.md, "One ring loop: the compiled program before and after".

    PYTHONPATH=. python benchmarks/ring_loop_matrix.py --label before --out /tmp/before.json
    ALLOW_MULTIPLE_LIBTPU_LOAD=1 PYTHONPATH=. python benchmarks/ring_loop_matrix.py \\
        --topology v5p:2x2x2 --passes fwd+bwd --out /tmp/before_tpu.json
    PYTHONPATH=. python benchmarks/ring_loop_matrix.py --compare /tmp/before.json /tmp/after.json

``--compare`` prints one line per cell whose figures differ and exits non-zero when any
figure got worse (more permutes, bytes, temp or HLO, fewer transfers in flight).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import re
import sys

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import common, two_level  # noqa: E402  (two_level: 8 fake CPU devices)
from ring_jax import topology  # noqa: E402

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
  for ring in rings:
    for layout in layouts:
      for mask in masks:
        if layout == "document" and mask == "window":
          continue
        for routed in (False, True):
          for pass_ in passes:
            yield dict(ring=ring, layout=layout, mask=mask, routed=routed, pass_=pass_)


def measure(cell, devices, tpu: bool) -> dict:
  """One cell's figures, compiled on the first devices of ``devices`` (``tpu``: a TPU
  slice's, whose schedule also gives the ring transfers in flight)."""
  split = tuple(int(x) for x in cell["ring"].split("x"))
  compiled = two_level.compile_ring(
      split, two_level=len(split) == 2, backward=cell["pass_"] == "fwd+bwd",
      is_causal=cell["mask"] != "full", length=LOCAL_LEN * math.prod(split), heads=HEADS,
      kv_heads=KV_HEADS, head_dim=HEAD_DIM, layout=cell["layout"],
      causal_routing=cell["routed"], devices=devices, block_q=BLOCK, block_kv=BLOCK,
      hop_kernel="xla", local_window_size=WINDOW if cell["mask"] == "window" else None)
  text = compiled.as_text()
  ops = two_level.permute_traffic(text, split)
  row = dict(cell, permutes=sum(op["runs"] for op in ops),
             permute_bytes=sum(op["bytes"] * op["runs"] * op["pairs"] for op in ops),
             temp_bytes=int(compiled.memory_analysis().temp_size_in_bytes),
             hlo_chars=program_chars(text))
  if tpu:
    from ring_jax import analysis
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
  start = next((i for i, line in enumerate(lines)
                if line.startswith(("%", "ENTRY"))), 0)
  return len(_NUMBERING.sub("", _METADATA.sub("", "\n".join(lines[start:]))))


def key(row) -> str:
  return (f"{row['ring']} {row['layout']}-{row['mask']}{'+routed' if row['routed'] else ''} "
          f"{row['pass_']}")


def compare(before_path, after_path) -> int:
  """Prints the cells whose figures differ; 1 when one got worse, else 0."""
  load = lambda p: {key(r): r for r in json.load(open(p))["rows"]}  # noqa: E731
  before, after = load(before_path), load(after_path)
  worse = better = same = 0
  for k, b in before.items():
    a = after.get(k)
    if a is None:
      print(f"{k}: missing after")
      worse += 1
      continue
    notes, cell_worse, cell_better = [], False, False
    for fig, good in FIGURES:
      if fig not in b or fig not in a or a[fig] == b[fig]:
        continue
      up = a[fig] > b[fig]
      bad = up if good == "lower" else not up
      cell_worse |= bad
      cell_better |= not bad
      notes.append(f"{fig} {b[fig]} -> {a[fig]}{' WORSE' if bad else ''}")
    worse += cell_worse
    better += cell_better and not cell_worse
    same += not notes
    if notes:
      print(f"{k}: " + "; ".join(notes))
  print(f"{len(before)} cells: {same} equal, {better} better, {worse} worse")
  return 1 if worse else 0


def main(argv=None):
  p = common.parser(__doc__, out="")
  p.add_argument("--topology", default=None, help="compile for this TPU slice (8 chips)")
  p.add_argument("--rings", default=",".join(RINGS))
  p.add_argument("--layouts", default=",".join(LAYOUTS))
  p.add_argument("--masks", default=",".join(MASKS))
  p.add_argument("--passes", default=",".join(PASSES))
  p.add_argument("--label", default="")
  p.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
  args = p.parse_args(argv)
  if args.compare:
    return compare(*args.compare)
  devices = topology.devices(args.topology) if args.topology else jax.devices()
  header = dict(label=args.label, date=datetime.date.today().isoformat(),
                jax=jax.__version__, platform=args.topology or jax.default_backend(),
                shapes=dict(local_len=LOCAL_LEN, block=BLOCK, window=WINDOW, heads=HEADS,
                            kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype="float32"))
  rows = []
  for cell in cells(args.rings.split(","), args.layouts.split(","), args.masks.split(","),
                    args.passes.split(",")):
    row = measure(cell, devices, tpu=bool(args.topology))
    rows.append(row)
    print(f"{key(row):45s} permutes {row['permutes']:4d} bytes {row['permute_bytes']:10d} "
          f"temp {row['temp_bytes']:10d} hlo {row['hlo_chars']:9d}"
          + (f" in flight {row['ring_in_flight']}/{row['ring_transfers']}"
             if args.topology else ""), flush=True)
    if args.out:  # after every cell: a long run stopped early keeps what it measured
      common.write_result(args.out, dict(header, rows=rows))
  return 0


if __name__ == "__main__":
  sys.exit(main())
