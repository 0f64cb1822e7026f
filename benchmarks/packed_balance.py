r"""Causal work per device on packed rows: zigzag vs the per-document layout (pure numpy).

  PYTHONPATH=. python benchmarks/packed_balance.py            # ring 8, 128K rows, ~1 min

Per mean document length and layout, over ``--rows`` packed rows: max/mean per device of the
token pairs scored (:func:`ring_jax.documents.token_work`) and of the block pairs the ring
computes from its own block tables (:func:`ring_jax.documents.block_work`), the critical path
(each hop costs its busiest device), and the document layout's block pairs and critical path
over zigzag's. Writes ``<out>/<tag>.json`` and ``.log``; ``--dry-run``: small rows.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ring_jax  # noqa: E402
from benchmarks import common  # noqa: E402
from ring_jax import documents  # noqa: E402

LAYOUTS = ("zigzag", "document")


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


def measure(seg: np.ndarray, ring: int, block: int) -> dict:
  """Per-layout balance figures of the rows ``seg`` (natural order): max/mean token pairs,
  block pairs and critical path per device (median and max over rows), and the medians of
  the document layout's block pairs and critical path over zigzag's."""
  doc = ring_jax.document_layout(seg, ring)
  zigzag = ring_jax.layout_positions("zigzag", ring, seg.shape[1])
  perms = {"zigzag": np.broadcast_to(zigzag, seg.shape), "document": doc.permutation}
  ids = {"zigzag": seg[:, zigzag], "document": doc.segment_ids}
  out, totals, critical_paths = {}, {}, {}
  for layout in LAYOUTS:
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


def parse_args(argv=None):
  ap = common.parser(__doc__, length=131072, ring=8)
  ap.add_argument("--means", default="2048,4096,8192,16384,32768")
  ap.add_argument("--sigma", type=float, default=1.0)
  ap.add_argument("--rows", type=int, default=20)
  ap.add_argument("--block", type=int, default=256)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--dry-run", action="store_true", help="4K rows, 2 per mean")
  ap.add_argument("--out", default=common.RESULTS)
  ap.add_argument("--tag", default="packed_balance")
  args = ap.parse_args(argv)
  if args.dry_run:
    args.length, args.rows, args.means, args.block = 4096, 2, "256,1024", 32
  return args


def main(argv=None) -> dict:
  args = parse_args(argv)
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
  for mean in common.ints(args.means):
    fig = result["means"][str(mean)] = measure(
        packed_rows(rng, args.rows, args.length, mean, args.sigma), args.ring, args.block)
    ratios = [fig[layout][key + "_over_mean"] for layout, key in (
        ("zigzag", "token_max"), ("document", "token_max"), ("zigzag", "block_max"),
        ("document", "block_max"), ("document", "critical_path"))]
    lines.append(line([mean, *(f"{r['median']:.2f} / {r['max']:.2f}" for r in ratios),
                       f"{fig['document_block_pairs_over_zigzag']:.2f}",
                       f"{fig['document_critical_path_over_zigzag']:.2f}"]))
  result["seconds"] = time.perf_counter() - start
  print("\n".join(lines))
  common.write_result(os.path.join(args.out, f"{args.tag}.json"), result, log="\n".join(lines))
  return result


if __name__ == "__main__":
  main()
