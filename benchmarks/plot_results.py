"""The README's plots, drawn from committed result files (nothing is measured here).

  python benchmarks/plot_results.py      # -> benchmarks/results/plot_{memory,packed_balance}.png

* ``plot_memory.png``: fwd+bwd compiled temp memory per device against the sequence length,
  ring (zigzag) vs the paper's code vs all-gather context parallelism, fixed blocks of 256
  (``results/attention_cpu_memscan_scan.json``, from ``benchmarks/attention.py --sections
  memscan``).
* ``plot_packed_balance.png``: causal work of the busiest device over the mean on packed rows,
  zigzag vs ``layout="document"``, against the mean document length
  (``results/packed_balance.json``, from ``benchmarks/packed_balance.py``).

Each title names its result file and the run's date, so a plot cannot outlive its data
unnoticed; re-run this script after committing a new result file.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
MEMSCAN = "attention_cpu_memscan_scan.json"
PACKED = "packed_balance.json"
MIB = 2**20


def _load(name):
  with open(os.path.join(RESULTS, name)) as f:
    return json.load(f)


def memory_series(scan: dict) -> dict[str, list[tuple[int, float]]]:
  """``{impl: [(length, fwd+bwd temp MiB), ...]}`` sorted by length, causal rows only."""
  series: dict[str, list[tuple[int, float]]] = {}
  for row in scan["memscan"]:
    if row["causal"]:
      series.setdefault(row["impl"], []).append((row["length"], row["fwdbwd_temp"] / MIB))
  return {k: sorted(v) for k, v in series.items()}


def balance_series(packed: dict) -> dict[str, list[tuple[int, float, float]]]:
  """``{layout: [(mean document length, median, max of block max/mean), ...]}``."""
  series: dict[str, list[tuple[int, float, float]]] = {}
  for mean, layouts in sorted(packed["means"].items(), key=lambda kv: int(kv[0])):
    for layout, stats in layouts.items():
      if not isinstance(stats, dict):  # the file's cross-layout ratios
        continue
      b = stats["block_max_over_mean"]
      series.setdefault(layout, []).append((int(mean), b["median"], b["max"]))
  return series


def _save(fig, ax, path):
  """The plots' common finish: grid, legend, a tight PNG."""
  ax.grid(True, which="both", alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  print("wrote", path)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out-dir", default=RESULTS)
  args = p.parse_args(argv)
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  scan = _load(MEMSCAN)
  meta = scan["meta"]
  fig, ax = plt.subplots(figsize=(6.4, 4.0))
  labels = {"ring-zigzag": "ring_jax (zigzag)", "paper": "paper's ringattention 0.1.2",
            "allgather": "all-gather context parallelism"}
  for impl, pts in memory_series(scan).items():
    ax.plot([x for x, _ in pts], [y for _, y in pts], "o-", label=labels.get(impl, impl))
  ax.set_xscale("log", base=2)
  ax.set_yscale("log", base=2)
  ax.set_xlabel("sequence length (ring of %d)" % meta["ring"])
  ax.set_ylabel("fwd+bwd temp per device (MiB)")
  blocks = sorted({row["block"] for row in scan["memscan"]})
  ax.set_title("causal attention, %d heads x %d, %s, blocks of %s\n%s, %s, jax %s" % (
      meta["heads"], meta["head_dim"], meta["dtype"], "/".join(map(str, blocks)), MEMSCAN,
      meta["date"][:10], meta["jax"]), fontsize=9)
  _save(fig, ax, os.path.join(args.out_dir, "plot_memory.png"))

  packed = _load(PACKED)
  fig, ax = plt.subplots(figsize=(6.4, 4.0))
  for i, (layout, pts) in enumerate(balance_series(packed).items()):
    xs, color = [m for m, _, _ in pts], f"C{i}"
    ax.plot(xs, [med for _, med, _ in pts], "o-", color=color,
            label=f'layout="{layout}", median row')
    ax.plot(xs, [mx for _, _, mx in pts], "x--", color=color,
            label=f'layout="{layout}", worst row')
  ax.axhline(1.0, color="gray", lw=0.8)
  ax.set_xscale("log", base=2)
  ax.set_xlabel("mean document length (tokens)")
  ax.set_ylabel("busiest device / mean (causal block pairs)")
  ax.set_title("packed rows of %d tokens, ring of %d, blocks of %d\n%s" % (
      packed["length"], packed["ring"], packed["block"], PACKED), fontsize=9)
  _save(fig, ax, os.path.join(args.out_dir, "plot_packed_balance.png"))


if __name__ == "__main__":
  sys.exit(main())
