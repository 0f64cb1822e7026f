r"""Host time of the data pipeline's layout step per batch: zigzag vs the document layout.

  PYTHONPATH=. python benchmarks/layout_host_time.py                # seconds, 2 CPU cores
  PYTHONPATH=. python benchmarks/layout_host_time.py --ring 8,16 --mean 4096,1024 \
      --out benchmarks/results/layout_host_time_cpu.json     # what the docs quote

Times :func:`training.data.to_layout_np` alone on a fresh packed batch (:func:`packed_batch`)
per repetition, per shape, ring and mean document length: the median and fastest of
``--reps`` calls in ms per batch and the median's tokens per second (benchmarks/README.md,
"The document layout's host cost").
"""

from __future__ import annotations

import itertools
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import common  # noqa: E402
from benchmarks.balance import packed_rows  # noqa: E402
from training import batch as batch_lib  # noqa: E402
from training import data as data_lib  # noqa: E402


def packed_batch(rng, rows: int, length: int, mean: float) -> dict[str, np.ndarray]:
  """A natural-order batch of :mod:`training.batch`'s fields over ``rows`` packed rows of
  ``length`` tokens, documents of lognormal length (``mean`` tokens, sigma 1, as
  ``benchmarks/balance.py packed`` draws them)."""
  seg = packed_rows(rng, rows, length, mean, sigma=1.0)
  tokens = rng.integers(3, 259, size=(rows, length)).astype(batch_lib.DTYPES["tokens"])
  labels, loss_mask = data_lib.next_token_targets(tokens, seg)
  return dict(tokens=tokens, positions=data_lib.segment_positions(seg), segment_ids=seg,
              labels=labels, loss_mask=loss_mask)


def main(argv=None) -> list[dict]:
  p = common.parser(__doc__, out="")
  p.add_argument("--shapes", type=common.strs, default=["1x131072", "8x16384"],
                 help="batches as ROWSxLENGTH, comma-separated")
  p.add_argument("--ring", type=common.ints, default=[8], help="ring size(s), comma-separated")
  p.add_argument("--mean", type=common.floats, default=[4096.0],
                 help="mean document length(s) in tokens, comma-separated")
  p.add_argument("--reps", type=int, default=9)
  p.add_argument("--layouts", type=common.strs, default=["zigzag", "document"])
  p.add_argument("--seed", type=int, default=0)
  args = p.parse_args(argv)
  rng = np.random.default_rng(args.seed)
  results = []
  for mean, ring, shape in itertools.product(args.mean, args.ring, args.shapes):
    rows, length = (int(x) for x in shape.split("x"))
    batches = [packed_batch(rng, rows, length, mean) for _ in range(args.reps)]
    docs = np.mean([len(np.unique(b["segment_ids"][0])) for b in batches])
    for layout in args.layouts:
      data_lib.to_layout_np(batches[0], layout, ring)  # warm-up (caches, allocator)
      seconds = [common.timed_call(data_lib.to_layout_np, b, layout, ring)[0]
                 for b in batches]
      median = common.median(seconds)
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
