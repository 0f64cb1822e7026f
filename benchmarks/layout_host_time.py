r"""Host time of the data pipeline's layout step per batch: zigzag vs the document layout.

  PYTHONPATH=. python benchmarks/layout_host_time.py                # seconds, 2 CPU cores
  PYTHONPATH=. python benchmarks/layout_host_time.py --ring 8,16 --mean 4096,1024 \
      --out benchmarks/results/layout_host_time_cpu.json     # what the docs quote

Times :func:`training.data.to_layout_np` alone (the reorder the Grain pipeline runs once per
batch: zigzag applies one fixed permutation, ``"document"`` builds each row's own from its
segment ids with :func:`ring_jax.document_layout`) on packed batches of each ``--shapes``
(rows x length; documents of lognormal length, ``--mean`` tokens, sigma 1, as
``benchmarks/packed_balance.py`` draws them), a fresh batch per repetition: per shape, ring
and mean (``--ring`` and ``--mean`` take lists) the median and fastest of ``--reps`` calls in
ms per batch and the tokens per second of the median, to compare with the tokens per second
the train step consumes (benchmarks/README.md, "The document layout's host cost").
"""

from __future__ import annotations

import os
import statistics
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import common  # noqa: E402
from benchmarks.packed_balance import packed_rows  # noqa: E402
from training import batch as batch_lib  # noqa: E402
from training import data as data_lib  # noqa: E402


def packed_batch(rng, rows: int, length: int, mean: float) -> dict[str, np.ndarray]:
  """A natural-order batch of :mod:`training.batch`'s fields over packed documents."""
  seg = packed_rows(rng, rows, length, mean, sigma=1.0)
  tokens = rng.integers(3, 259, size=(rows, length)).astype(batch_lib.DTYPES["tokens"])
  labels, loss_mask = data_lib.next_token_targets(tokens, seg)
  return dict(tokens=tokens, positions=data_lib.segment_positions(seg), segment_ids=seg,
              labels=labels, loss_mask=loss_mask)


def main(argv=None) -> list[dict]:
  p = common.parser(__doc__, out="")
  p.add_argument("--shapes", default="1x131072,8x16384",
                 help="batches as ROWSxLENGTH, comma-separated")
  p.add_argument("--ring", default="8", help="ring size(s), comma-separated")
  p.add_argument("--mean", default="4096", help="mean document length(s) in tokens, "
                 "comma-separated")
  p.add_argument("--reps", type=int, default=9)
  p.add_argument("--layouts", default="zigzag,document")
  p.add_argument("--seed", type=int, default=0)
  args = p.parse_args(argv)
  rng = np.random.default_rng(args.seed)
  results = []
  for mean in (float(m) for m in args.mean.split(",")):
    for ring in (int(r) for r in args.ring.split(",")):
      for shape in args.shapes.split(","):
        rows, length = (int(x) for x in shape.split("x"))
        batches = [packed_batch(rng, rows, length, mean) for _ in range(args.reps)]
        docs = np.mean([len(np.unique(b["segment_ids"][0])) for b in batches])
        for layout in args.layouts.split(","):
          data_lib.to_layout_np(batches[0], layout, ring)  # warm-up (caches, allocator)
          seconds = [common.timed_call(data_lib.to_layout_np, b, layout, ring)[0]
                     for b in batches]
          median = statistics.median(seconds)
          row = dict(shape=shape, layout=layout, ring=ring, mean=mean,
                     docs_per_row=round(docs, 1), median_ms=round(1e3 * median, 2),
                     min_ms=round(1e3 * min(seconds), 2),
                     tokens_per_s=round(rows * length / median))
          results.append(row)
          print(f"{shape:>10s} ring {ring} mean {mean:g} {layout:9s} "
                f"({row['docs_per_row']} docs/row): median {row['median_ms']:8.2f} ms/batch "
                f"(min {row['min_ms']:.2f}) over {args.reps}, "
                f"{row['tokens_per_s'] / 1e6:.1f}M tokens/s", flush=True)
  meta = common.run_meta(argv, __file__, devices=False, numpy=np.__version__, reps=args.reps,
                         seed=args.seed, elapsed_s=common.elapsed())
  common.save(args.out, dict(meta=meta, rows=results))
  return results


if __name__ == "__main__":
  main()
