"""The docs' plots, drawn from committed result files (nothing is measured here).

  python benchmarks/plot_results.py      # -> benchmarks/results/*.png: the three below
  python benchmarks/plot_results.py --attention FILE.json   # only FILE's plots, in --out-dir

* ``plot_memory.png``: fwd+bwd compiled temp memory per device against the length, ring
  (zigzag) vs the paper's code vs all-gather, fixed blocks (:data:`MEMSCAN`, from
  ``attention.py --sections memscan``).
* ``plot_packed_balance.png``: the busiest device's causal work over the mean on packed rows,
  zigzag vs ``layout="document"``, against the mean document length (:data:`PACKED`, from
  ``balance.py packed``).
* ``attention_cpu_4k_{causal,full}.png`` (docs/benchmarks.md): per mask, fwd time, fwd+bwd
  time and temp memory against the length, per implementation (:data:`ATTENTION`, from
  ``attention.py``; ``--attention``: of another of its result files).

Each title names its result file and the run's date; re-run this after committing a new one.
"""

from __future__ import annotations

import argparse
import json
import os

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
MEMSCAN = "attention_cpu_memscan_scan.json"
PACKED = "packed_balance.json"
ATTENTION = "attention_cpu_4k.json"
MIB = 2**20


def _load(path: str) -> dict:
  """A result file (a path, or a name in ``RESULTS``)."""
  with open(os.path.join(RESULTS, path)) as f:
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


def _save(fig, axes, path, xlabel, ylabel=None, ybase=None):
  """The plots' common finish: each of ``axes`` with a log2 x axis, a y axis in log base
  ``ybase`` (None: linear) and a grid; the last one's legend; a tight PNG at ``path``."""
  for a in axes:
    a.set_xscale("log", base=2)
    if ybase:
      a.set_yscale("log", base=ybase)
    a.set_xlabel(xlabel)
    if ylabel:
      a.set_ylabel(ylabel)
    a.grid(True, which="both", alpha=0.3)
  axes[-1].legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  print("wrote", path)


def attention_plots(path: str, out_dir: str) -> list[str]:
  """Per mask of an ``attention.py`` result file, a PNG in ``out_dir`` of fwd time, fwd+bwd
  time and fwd+bwd temp memory against the length, a line per implementation; returns their
  paths."""
  import matplotlib.pyplot as plt

  result = _load(path)
  rows, m, paths = result["rows"], result["meta"], []
  for causal in sorted({r["causal"] for r in rows}):
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for impl in sorted({r["impl"] for r in rows}):
      rs = sorted((r for r in rows if r["impl"] == impl and r["causal"] == causal),
                  key=lambda r: r["length"])
      for ax, key in ((axes[0], "fwd_median_s"), (axes[1], "fwdbwd_median_s")):
        pts = [(r["length"], r[key] * 1e3) for r in rs if key in r]
        if pts:
          ax.plot(*zip(*pts), marker="o", label=impl)
      pts = [(r["length"], r["fwdbwd_mem"]["temp_size_in_bytes"] / MIB) for r in rs
             if "temp_size_in_bytes" in r.get("fwdbwd_mem", {})]
      if pts:
        axes[2].plot(*zip(*pts), "--" if impl in ("dense", "reference") else "-", marker="o",
                     label=impl)
    titles = ("forward time (ms)", "forward+backward time (ms)",
              "fwd+bwd compiled temp memory per device (MiB)")
    for ax, title in zip(axes, titles):
      ax.set_title(title, fontsize=10)
    fig.suptitle(f"{'causal' if causal else 'non-causal'} attention, {m['platform']} "
                 f"{m['dtype']}, B={m['batch']} N={m['heads']} H={m['head_dim']}, "
                 f"ring={m['ring']} (dense: 1 device; OOM rows have memory but no time); "
                 f"{os.path.basename(path)}, {m['date'][:10]}", fontsize=10)
    stem = os.path.splitext(os.path.basename(path))[0]
    paths.append(os.path.join(out_dir, f"{stem}_{'causal' if causal else 'full'}.png"))
    _save(fig, axes, paths[-1], "sequence length", ybase=10)
  return paths


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out-dir", default=RESULTS)
  p.add_argument("--attention", default=None,
                 help="only the plots of this attention.py result file")
  args = p.parse_args(argv)
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  if args.attention:
    attention_plots(args.attention, args.out_dir)
    return
  attention_plots(os.path.join(RESULTS, ATTENTION), args.out_dir)
  scan = _load(MEMSCAN)
  meta = scan["meta"]
  fig, ax = plt.subplots(figsize=(6.4, 4.0))
  labels = {"ring-zigzag": "ring_jax (zigzag)", "paper": "paper's ringattention 0.1.2",
            "allgather": "all-gather context parallelism"}
  for impl, pts in memory_series(scan).items():
    ax.plot([x for x, _ in pts], [y for _, y in pts], "o-", label=labels.get(impl, impl))
  blocks = sorted({row["block"] for row in scan["memscan"]})
  ax.set_title("causal attention, %d heads x %d, %s, blocks of %s\n%s, %s, jax %s" % (
      meta["heads"], meta["head_dim"], meta["dtype"], "/".join(map(str, blocks)), MEMSCAN,
      meta["date"][:10], meta["jax"]), fontsize=9)
  _save(fig, [ax], os.path.join(args.out_dir, "plot_memory.png"),
        "sequence length (ring of %d)" % meta["ring"], "fwd+bwd temp per device (MiB)", ybase=2)

  packed = _load(PACKED)
  fig, ax = plt.subplots(figsize=(6.4, 4.0))
  for i, (layout, pts) in enumerate(balance_series(packed).items()):
    xs, color = [m for m, _, _ in pts], f"C{i}"
    ax.plot(xs, [med for _, med, _ in pts], "o-", color=color,
            label=f'layout="{layout}", median row')
    ax.plot(xs, [mx for _, _, mx in pts], "x--", color=color,
            label=f'layout="{layout}", worst row')
  ax.axhline(1.0, color="gray", lw=0.8)
  ax.set_title("packed rows of %d tokens, ring of %d, blocks of %d\n%s" % (
      packed["length"], packed["ring"], packed["block"], PACKED), fontsize=9)
  _save(fig, [ax], os.path.join(args.out_dir, "plot_packed_balance.png"),
        "mean document length (tokens)", "busiest device / mean (causal block pairs)")


if __name__ == "__main__":
  main()
