r"""Causal work per device on packed rows: zigzag vs the per-document layout (pure numpy).

  PYTHONPATH=. python benchmarks/packed_balance.py            # ring 8, 128K rows, ~1 min

Rows of ``--length`` tokens are packed from documents of lognormal length (sigma 1, mean
2K..32K: ``mu = log(mean) - sigma^2 / 2``, the last one cut at the row's end), ``--rows``
per mean. Per row and layout: the (query, key) pairs each device scores
(:func:`ring_jax.documents.token_work`) and the block pairs the ring computes per device and
hop from its own block tables (:func:`ring_jax.documents.block_work`, blocks of
``--block``), summed per device, with the critical path (each hop costs its busiest device).
Reported per mean: median and max over rows of max/mean work per device, the critical path
over the mean device's work, and (medians) the document layout's total block pairs and
critical path over zigzag's (its finer pieces compute more partly masked pairs in all; the
critical path is what it buys back).
Writes ``<out>/packed_balance.json`` and ``.log``. ``--dry-run``: small rows.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import ring_jax  # noqa: E402
from benchmarks import common  # noqa: E402
from ring_jax import documents  # noqa: E402

LAYOUTS = ("zigzag", "document")


def packed_rows(rng, rows: int, length: int, mean: float, sigma: float) -> np.ndarray:
  """int32 ``[rows, length]`` segment ids 1, 2, ... of lognormal-length documents."""
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
  """Per-layout balance figures of the rows ``seg`` (natural order)."""
  doc = ring_jax.document_layout(seg, ring)
  zigzag = ring_jax.layout_positions("zigzag", ring, seg.shape[1])
  perms = {"zigzag": np.broadcast_to(zigzag, seg.shape), "document": doc.permutation}
  ids = {"zigzag": seg[:, zigzag], "document": doc.segment_ids}
  out, totals, critical_paths = {}, {}, {}
  for layout in LAYOUTS:
    tokens = documents.token_work(seg, perms[layout], ring)
    blocks = documents.block_work(ids[layout], layout, ring, block, block)
    per_device = blocks.sum(-1)
    ratio_t = tokens.max(1) / tokens.mean(1)
    ratio_b = per_device.max(1) / per_device.mean(1)
    critical = blocks.max(1).sum(-1) / per_device.mean(1)
    totals[layout] = per_device.sum(1)
    critical_paths[layout] = blocks.max(1).sum(-1)
    out[layout] = {
        "token_max_over_mean": {"median": float(np.median(ratio_t)), "max": float(ratio_t.max())},
        "block_max_over_mean": {"median": float(np.median(ratio_b)), "max": float(ratio_b.max())},
        "critical_path_over_mean": {"median": float(np.median(critical)),
                                    "max": float(critical.max())},
    }
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
  lines = [f"ring {args.ring}, {args.length}-token rows, lognormal sigma {args.sigma}, "
           f"{args.rows} rows per mean, blocks of {args.block}; max/mean work per device "
           "(median / max over rows)",
           f"{'mean':>6} | {'zigzag tokens':>14} | {'document tokens':>15} | "
           f"{'zigzag blocks':>14} | {'document blocks':>15} | {'doc crit. path':>14} | "
           f"{'doc/zz pairs':>12} | {'doc/zz crit.':>12}"]
  for mean in [int(m) for m in args.means.split(",")]:
    fig = measure(packed_rows(rng, args.rows, args.length, mean, args.sigma), args.ring,
                  args.block)
    result["means"][str(mean)] = fig
    f = lambda layout, key: (f"{fig[layout][key]['median']:.2f} / "  # noqa: E731
                             f"{fig[layout][key]['max']:.2f}")
    lines.append(f"{mean:>6} | {f('zigzag', 'token_max_over_mean'):>14} | "
                 f"{f('document', 'token_max_over_mean'):>15} | "
                 f"{f('zigzag', 'block_max_over_mean'):>14} | "
                 f"{f('document', 'block_max_over_mean'):>15} | "
                 f"{f('document', 'critical_path_over_mean'):>14} | "
                 f"{fig['document_block_pairs_over_zigzag']:>12.2f} | "
                 f"{fig['document_critical_path_over_zigzag']:>12.2f}")
  result["seconds"] = time.perf_counter() - start
  print("\n".join(lines))
  common.write_result(os.path.join(args.out, f"{args.tag}.json"), result, log="\n".join(lines))
  return result


if __name__ == "__main__":
  main()
