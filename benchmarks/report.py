"""The figures the README and the docs quote, generated from ``benchmarks/results/``.

Every table of measured figures in a markdown file sits between two markers::

    <!-- report: NAME -->
    ... generated text, replaced wholesale ...
    <!-- /report -->

``NAME`` is a block of :data:`BLOCKS`, declared as data by :func:`table_block`: its result
files (``benchmarks/results/*.json`` / ``*.jsonl``), an intro, a table's columns (or rows), and
text after it; every ratio and percentage is computed from the raw numbers there, and a caption
line follows (date, machine and jax version as the result file records them, the command that
made it, a link to the file). A block that is not intro, table and caption registers its own
renderer with :func:`block`. Nothing in a block is typed by hand, so no quoted figure can drift
from the run that made it. A new block is one call at module level::

    table_block("my_block", "my_result_cpu.json", rows=lambda d: d["rows"], align="-r",
                intro="Ring of {ring}, {length:len} tokens:",   # over the file's top level
                columns=[("config", "`{config}`"), ("temp MiB", "{temp_bytes:mib}")])

    python benchmarks/report.py              # rewrite every block in every *.md of the repo
    python benchmarks/report.py --check      # exit 1 with a diff if a block is out of date
    python benchmarks/report.py --files README.md docs/benchmarks.md   # only these files
    python benchmarks/report.py --list       # block names and their result files
    python benchmarks/report.py --print headline   # one block's text (links from the root)

An unknown block name, an unterminated block, or a block whose result file is
missing is an error (exit 2). Pure Python: no jax, nothing compiled or timed.
Result files that do not record their date / machine / jax themselves get them
from ``results/provenance.json`` (established from their ``.log`` or the commit
that wrote them, and saying so).
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
import os
import re
import string
import sys
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
MIB = 2 ** 20
GIB = 2 ** 30
# Links in generated text are written from the repository root with this prefix and made
# relative to the file that holds the block when it is rendered.
LINK_ROOT = "@@/"
DOC = LINK_ROOT + "docs/benchmarks.md"

# Markers are whole lines (a marker quoted inside a line of prose is not one).
BLOCK_RE = re.compile(r"^<!-- report: (?P<name>[^\s>]+) -->\n(?P<body>.*?)^<!-- /report -->$",
                      re.S | re.M)
OPEN_RE = re.compile(r"^<!-- report: (?P<name>[^\s>]*) -->$", re.M)
CLOSE_RE = re.compile(r"^<!-- /report -->$", re.M)
SKIP_DIRS = {"node_modules", "__pycache__", "build", "dist"}


class ReportError(Exception):
  """A block that cannot be rendered: unknown name, missing result file, bad markers."""


BLOCKS: dict[str, tuple[Callable[[], str], tuple[str, ...]]] = {}


def block(name: str, *files: str):
  """Registers ``fn() -> markdown`` as block ``name``, made from ``files`` in results/."""
  def register(fn):
    BLOCKS[name] = (fn, files)
    return fn
  return register


# ----------------------------------------------------------------------------
# Reading result files
# ----------------------------------------------------------------------------

def _path(name: str) -> str:
  path = os.path.join(RESULTS, name)
  if not os.path.exists(path):
    raise ReportError(f"result file benchmarks/results/{name} is missing")
  return path


def load(name: str):
  """A result file: JSON, or JSON lines (a list of records)."""
  with open(_path(name)) as fh:
    if name.endswith(".jsonl"):
      return [json.loads(line) for line in fh if line.strip()]
    return json.load(fh)


def provenance(name: str) -> dict:
  with open(os.path.join(RESULTS, "provenance.json")) as fh:
    return json.load(fh).get(name, {})


def meta(name: str) -> dict:
  """Date, machine, jax and command of a result file, from the file itself where it records
  them (the ``meta`` dict of attention.py / core_report.py, the top level of balance.py),
  else from provenance.json."""
  data = load(name)
  rec = data if isinstance(data, dict) else {}
  m = dict(rec.get("meta", {})) if isinstance(rec.get("meta"), dict) else {}
  for key in ("date", "jax", "command", "machine", "cpus", "processes"):
    if key in rec and key not in m:
      m[key] = rec[key]
  out = dict(date=None, date_note="", jax=m.get("jax"), command=m.get("command"),
             machine=None)
  if m.get("date"):
    out["date"] = m["date"][:10]
  if m.get("platform") == "cpu" or m.get("machine"):
    cores = m.get("cpu_count") or m.get("cpus")
    devices = m.get("num_devices")
    parts = [f"{cores}-core CPU" if cores else "CPU"]
    if m.get("processes"):
      parts.append(f"{m['processes']} processes, one core each")
    elif devices:
      parts.append(f"{devices} fake devices")
    out["machine"] = ", ".join(parts)
  if rec.get("benchmark") == "balance" and not out["command"]:  # balance.py records its flags
    stem = os.path.splitext(name)[0]
    out["command"] = (f"PYTHONPATH=. python benchmarks/balance.py --processes {rec['processes']} "
                      f"--lengths {','.join(map(str, rec['lengths']))} --repeats {rec['repeats']} "
                      f"--impls {','.join(rec['impls'])}" +
                      ("" if stem == "balance_cpu" else f" --tag {stem}"))
  extra = provenance(name)
  if out["machine"] == "CPU" and extra.get("machine"):  # the file says no more than "cpu"
    out["machine"] = None
  for key in ("date", "date_note", "jax", "command", "machine"):
    if not out.get(key) and extra.get(key):
      out[key] = extra[key]
  return out


def link(name: str) -> str:
  return f"[`{name}`]({LINK_ROOT}benchmarks/results/{name})"


def caption(*names: str, note: str = "") -> str:
  """One line under a table: per result file its date, machine, jax, a link and the command
  that made it."""
  parts = []
  for name in names:
    cmd = meta(name)["command"]
    parts.append(f"{link(name)}: {when(name)}" + (f"; `{cmd}`" if cmd else ""))
  line = ("Source: " if len(names) == 1 else "Sources: ") + "; ".join(parts) + "."
  if note:
    line += " " + note
  return f"<sub>{line}</sub>"


def when(name: str, short: bool = False) -> str:
  """``date (how it is known), machine, jax X`` of a result file."""
  m = meta(name)
  date = m["date"] or "date not recorded"
  if m["date_note"]:
    date += " (commit date)" if short else f" ({m['date_note']})"
  return ", ".join([date, m["machine"] or "machine not recorded",
                    f"jax {m['jax']}" if m["jax"] else "jax not recorded"])


# ----------------------------------------------------------------------------
# Formatting (one style everywhere)
# ----------------------------------------------------------------------------

def mib(nbytes: float) -> str:
  return f"{nbytes / MIB:.1f}"


def gib(nbytes: float) -> str:
  return f"{nbytes / GIB:.1f}"


def x(ratio: float, digits: int = 2) -> str:
  return f"{ratio:.{digits}f}x"


def pct(frac: float) -> str:
  return f"{100 * frac:.1f}%"


def sci(v: float) -> str:
  mant, exp = f"{v:.1e}".split("e")
  return f"{mant}e{int(exp)}"


def ms(seconds: float) -> str:
  return f"{1e3 * seconds:.1f}"


def tokens(n: float) -> str:
  """3 significant figures with K / M (decimal): 9256960 -> 9.26M."""
  for unit, div in (("M", 1e6), ("K", 1e3)):
    if n >= div:
      v = n / div
      return f"{v:.{max(0, 2 - int(math.floor(math.log10(v))))}f}{unit}"
  return str(int(n))


def length(n: int) -> str:
  """A sequence length in binary units: 4096 -> 4K, 655360 -> 640K, 4718592 -> 4.5M."""
  if n >= 2 ** 20:
    return f"{n / 2 ** 20:g}M"
  if n >= 1024:
    return f"{n / 1024:g}K"
  return str(n)


def table(head: list[str], rows: list[list], align: str | None = None) -> str:
  """A markdown table; ``align`` has one letter per column, ``r`` for right-aligned."""
  align = align or "-" * len(head)
  sep = ["---:" if a == "r" else "---" for a in align]
  lines = ["| " + " | ".join(head) + " |", "|" + "|".join(sep) + "|"]
  lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
  return "\n".join(lines)


def _mesh(sizes: dict, sep: str, keep: str = "") -> str:
  """The axes of a mesh larger than 1 (and ``keep``): ``data=2 x sequence=4``."""
  return sep.join(f"{k}={v}" for k, v in sizes.items() if v != 1 or k == keep)


def _rows_by(rows, *keys) -> dict:
  """``rows`` by the tuple of their ``keys``."""
  return {tuple(r[k] for k in keys): r for r in rows}


def _blocks(rows) -> str:
  """The block sizes of ``rows``: ``256, 512``."""
  return ", ".join(map(str, sorted({r["block"] for r in rows})))


def _pairs(rows) -> list:
  """``(previous row or None, row)`` for each row."""
  rows = list(rows)
  return list(zip([None] + rows[:-1], rows))


# ----------------------------------------------------------------------------
# Blocks declared as data
# ----------------------------------------------------------------------------

class _Units(string.Formatter):
  """``str.format`` with the report's units as format specs: ``{temp_bytes:mib}``."""
  SPECS = {"mib": mib, "gib": gib, "ratio": x, "pct": pct, "sci": sci, "len": length}

  def format_field(self, value, spec: str) -> str:
    return self.SPECS[spec](value) if spec in self.SPECS else super().format_field(value, spec)


def fmt(spec: str, record) -> str:
  """``spec`` formatted over the mapping ``record``; units as in :class:`_Units`."""
  return _Units().vformat(spec, (), record)


def _text(spec, data: list) -> str:
  """A declared piece of text: ``spec(*data)``, or a format string over the first file."""
  if callable(spec):
    return spec(*data)
  return fmt(spec, data[0]) if spec else ""


def table_block(name: str, *files: str, key: str = "", rows: Callable | None = None, columns=(),
                head=(), align: str | Callable = "", intro: str | Callable = "",
                after: str | Callable = "", note: str | Callable = "") -> None:
  """Registers block ``name``: ``intro``, a table, ``after`` and the caption of ``files``
  (``note`` at its end), each left out where empty, separated by blank lines.

  ``rows(*data)`` (``data``: the contents of ``files``, or their entry ``key``) gives the
  table's records; no ``rows``, no table. With ``columns`` (``[(header, cell)]``) a record is
  one row and ``cell`` is ``cell(record)`` or a format string (:func:`fmt`) over it; without, a
  record is a list of cells under ``head``. ``intro``, ``after``, ``note``, ``align`` (one
  letter per column, ``r``: right-aligned) and ``head`` are fixed or functions of ``*data``;
  fixed text is a format string over the first file's contents."""
  def render() -> str:
    data = [load(f)[key] if key else load(f) for f in files]
    grid = ""
    if rows is not None:
      records = list(rows(*data))
      if columns:
        hd = [h for h, _ in columns]
        records = [[c(r) if callable(c) else fmt(c, r) for _, c in columns]
                   for r in records]
      else:
        hd = head(*data) if callable(head) else head
      grid = table(hd, records, _text(align, data))
    parts = [_text(intro, data), grid, _text(after, data), caption(*files, note=_text(note, data))]
    return "\n\n".join(p for p in parts if p)
  BLOCKS[name] = (render, files)


# ----------------------------------------------------------------------------
# Core figures: benchmarks/core_report.py
# ----------------------------------------------------------------------------

CORE = "core_report_cpu.json"
GRADS = ("dq", "dk", "dv")


def _worst(rows, *keys) -> float:
  return max(r[k] for r in rows for k in keys)


table_block(
    "core_accuracy", CORE, key="accuracy", rows=lambda d: d, align="-rrrr",
    intro=lambda d: (f"Worst of the {len(d)} cases: **{sci(_worst(d, 'out'))}** on outputs, "
                     f"**{sci(_worst(d, *GRADS))}** on dQ/dK/dV (max |error| / max |reference|)."),
    columns=[("case", "`{case}`"), ("out", "{out:sci}"), ("dQ", "{dq:sci}"), ("dK", "{dk:sci}"),
             ("dV", "{dv:sci}")])

table_block(
    "core_memory", CORE, key="memory", align="rrrrr",
    intro=("Ring of {ring}, {heads} heads x {head_dim}, causal {layout}, {dtype}, blocks of "
           "{block}:"),
    head=["local length", "global length", "fwd+bwd temp MiB/device", "vs previous",
          "one [L/n, L/n] f32 score matrix per head, MiB"],
    rows=lambda d: [[f"{r['local_len']:,}", f"{r['global_len']:,}", mib(r["temp_bytes"]),
                     x(r["temp_bytes"] / p["temp_bytes"]) if p else "",
                     f"{mib(r['local_len'] ** 2 * 4)} x {d['heads']} heads"]
                    for p, r in _pairs(d["rows"])])


def _work_rows(d) -> list:
  base = next(r for r in d["rows"] if r["layout"] == "contiguous")["critical_path"]
  return [[r["layout"], f"{min(w)} ... {max(w)}", f"{max(w) / (sum(w) / len(w)):.2f}",
           r["critical_path"], x(r["critical_path"] / base), sum(w)]
          for r in d["rows"] for w in [r["work_per_device"]]]


table_block(
    "core_work", CORE, key="work", rows=_work_rows, align="-rrrrr",
    intro=("Causal, ring of {ring}, {local_len} tokens per device, blocks of {block} "
           "(`ring_jax.schedule`, no timing):"),
    head=["layout", "block pairs per device (min ... max)", "max / mean", "critical path (pairs)",
          "vs contiguous", "total"])


# ----------------------------------------------------------------------------
# Against the paper's code: benchmarks/attention.py
# ----------------------------------------------------------------------------

PAPER_4K = "attention_cpu_4k.json"
MEMSCAN = "attention_cpu_memscan_scan.json"  # ring zigzag, paper and all-gather in one run
BF16 = "attention_cpu_bf16.json"
PAPER_IMPLS = {"ring-zigzag": "ring zigzag", "ring-contiguous": "ring contiguous",
               "paper": "paper"}


def _paper_rows(d) -> list:
  by = _rows_by(d["rows"], "impl", "causal")
  rows = []
  for causal, name in ((True, "causal"), (False, "non-causal")):
    paper = by[("paper", causal)]
    times = [by[(i, causal)]["fwdbwd_median_s"] / paper["fwdbwd_median_s"] for i in PAPER_IMPLS]
    rows.append([f"{name}: fwd+bwd time vs paper"] +
                [f"**{x(t)}**" if t == min(times[:2]) else x(t) for t in times] + [""])
    rows.append([f"{name}: useful GFLOP/s (fraction of the matmul's)"] +
                [f"{r['fwdbwd_useful_gflops']:.1f} "
                 f"({pct(r['fwdbwd_useful_gflops'] / r['matmul_gflops'])})"
                 for r in (by[(i, causal)] for i in PAPER_IMPLS)] +
                [f"{paper['matmul_gflops']:.1f}"])
  temp = lambda i, causal: mib(by[(i, causal)]["fwdbwd_mem"]["temp_size_in_bytes"])
  rows.append(["fwd+bwd temp MiB per device, causal / non-causal"] +
              [f"{temp(i, True)} / {temp(i, False)}" for i in PAPER_IMPLS] + [""])
  return rows


table_block(
    "paper_4k", PAPER_4K, rows=_paper_rows,
    intro=lambda d: (f"{d['meta']['dtype']}, B={d['meta']['batch']}, {d['meta']['heads']} heads "
                     f"x {d['meta']['head_dim']}, ring of {d['meta']['ring']} in one process, "
                     f"blocks of {_blocks(d['rows'])}, median of {d['meta']['repeats']}:"),
    head=lambda d: ([f"L = {length(d['rows'][0]['length'])}, fwd+bwd", *PAPER_IMPLS.values(),
                     "same-size f32 matmul"]))


def _memscan(d) -> tuple[dict, str, list]:
  """The memory scan by (impl, length), the ring's impl and the lengths."""
  by = _rows_by(d["memscan"], "impl", "length")
  return by, next(i for i, _ in by if i.startswith("ring")), sorted({n for _, n in by})


def _fixed_block_rows(d) -> list:
  by, ring, lengths = _memscan(d)
  rows = []
  for n in lengths:
    r, p = by[(ring, n)]["fwdbwd_temp"], by[("paper", n)]["fwdbwd_temp"]
    ag = by.get(("allgather", n))
    rows.append([length(n), mib(r), mib(p), f"**{x(r / p)}**",
                 mib(ag["fwdbwd_temp"]) if ag else "-"])
  return rows


def _fixed_block_head(d) -> list:
  by, ring, lengths = _memscan(d)
  return [f"L ({ring}, causal, blocks of {by[(ring, lengths[0])]['block']})", "ring MiB/device",
          "paper MiB/device", "ring / paper", "all-gather MiB/device"]


table_block("memory_fixed_block", MEMSCAN, rows=_fixed_block_rows, head=_fixed_block_head,
            align="-rrrr")

table_block(
    "memory_scan_allgather", MEMSCAN, align="-rr",
    head=["L", "all-gather fwd+bwd temp MiB/device", "vs previous"],
    rows=lambda d: [[length(n), mib(v), x(v / p[1]) if p else ""] for p, (n, v) in _pairs(
        sorted((r["length"], r["fwdbwd_temp"]) for r in d["memscan"] if r["impl"] == "allgather"))])


def _bf16_rows(e) -> list:
  rings = sorted({r["ring"] for r in e["rows"] if r["ring"]})
  by = {(r["impl"], r["ring"]): r["rel_err"] for r in e["rows"]}
  errors = lambda v: " / ".join(sci(v[k]) for k in ("out", *GRADS))
  rows = []
  for impl in dict.fromkeys(r["impl"] for r in e["rows"]):
    if (impl, None) in by:
      rows.append([impl, errors(by[(impl, None)])] + [""] * (len(rings) - 1))
    else:
      rows.append([impl] + [errors(by[(impl, n)]) if (impl, n) in by else "-" for n in rings])
  return rows


def _bf16_worst(e) -> float:
  """The worst error over the ring's layouts and sizes."""
  return _worst([r["rel_err"] for r in e["rows"] if r["impl"].startswith("ring") and r["ring"]],
                "out", *GRADS)


table_block(
    "bf16_error", BF16, key="bf16_error", rows=_bf16_rows,
    head=lambda e: ["impl"] + [f"ring {n}" for n in sorted({r["ring"] for r in e["rows"]
                                                             if r["ring"]})],
    intro=lambda e: (f"Relative Frobenius error out / dQ / dK / dV, causal, L={e['length']}, "
                     f"{e['heads']} heads x {e['head_dim']}; worst over the ring's layouts and "
                     f"sizes: **{sci(_bf16_worst(e))}**."))


# ----------------------------------------------------------------------------
# Load balance: balance.py, packed_balance.py
# ----------------------------------------------------------------------------

BALANCE = "balance_cpu.json"
PACKED = "packed_balance.json"


def _balance_rows(d) -> list:
  by = _rows_by(d["rows"], "impl", "length")
  rows = []
  for n in d["lengths"]:
    paper = by.get(("paper", n))
    ratios = [x(by[(i, n)]["median_s"] / paper["median_s"]) if paper else "-"
              for i in ("ring-contiguous", "ring-zigzag", "ring-striped")]
    zz, ct = by[("ring-zigzag", n)], by[("ring-contiguous", n)]
    rows.append([length(n), *ratios, ms(paper["median_s"]) if paper else "-",
                 f"{ct['critical_path_hops']:.2f} / {zz['critical_path_hops']:.2f}",
                 f"{mib(zz['temp_bytes'])} / {mib(paper['temp_bytes']) if paper else '-'}"])
  return rows


table_block(
    "balance", BALANCE, rows=_balance_rows, align="-rrrrrr",
    intro=lambda d: (f"Causal fwd+bwd, {d['processes']} processes (ring of {d['processes']}), "
                     f"{d['dtype']}, B={d['batch']}, {d['heads']} heads x {d['head_dim']}, "
                     f"blocks of {_blocks(d['rows'])}, median of {d['repeats']} (each "
                     "repetition: the slowest process); time over the paper's code:"),
    head=["L", "contiguous", "zigzag", "striped", "paper (ms)",
          "critical path, hops: contiguous / zigzag", "temp MiB/device: ring / paper"])


def _mm(v) -> str:
  return f"{v['median']:.2f} / {v['max']:.2f}"


table_block(
    "packed_balance", PACKED, align="-rrrrrr",
    intro=("Ring of {ring}, rows of {length:,} tokens, lognormal document lengths (sigma "
           "{sigma:g}), {rows} rows per mean, blocks of {block}; max/mean work per device, "
           "median / max over rows:"),
    rows=lambda d: sorted((dict(v, mean=int(k)) for k, v in d["means"].items()),
                          key=lambda v: v["mean"]),
    columns=[("mean document", "{mean:len}"),
             ("zigzag, blocks", lambda v: _mm(v["zigzag"]["block_max_over_mean"])),
             ("`document`, blocks", lambda v: f"**{_mm(v['document']['block_max_over_mean'])}**"),
             ("zigzag, tokens", lambda v: _mm(v["zigzag"]["token_max_over_mean"])),
             ("`document`, tokens", lambda v: _mm(v["document"]["token_max_over_mean"])),
             ("block pairs, document / zigzag", "{document_block_pairs_over_zigzag:ratio}"),
             ("critical path, document / zigzag", "{document_critical_path_over_zigzag:ratio}")])


# ----------------------------------------------------------------------------
# How long a context fits: fit.py
# ----------------------------------------------------------------------------

FIT_1 = "fit_llama_1b_long_1dev.json"
FIT_8 = "fit_llama_1b_long_8dev.json"
FIT_NOLICM = "fit_llama_1b_long_1dev_512k_nolicm.json"
FIT_PIPELINE = "fit_llama_1b_pipeline_cpu.jsonl"


def _fit_rows(*runs) -> list:
  rows = []
  for d in runs:
    mesh = _mesh(d["mesh"], ", ") or "sequence=1"
    for c in d["checked"]:
      bold = (lambda s: f"**{s}**") if c["seq_len"] == d["seq_len"] else str
      rows.append([f"{d['devices']} ({mesh})", bold(f"{c['seq_len']:,} ({length(c['seq_len'])})"),
                   gib(c["compiled_per_device_bytes"]), gib(c["offloaded_bytes"]),
                   bold(gib(c["per_device_bytes"])), "yes" if c["fits"] else "no"])
  return rows


table_block(
    "fit", FIT_1, FIT_8, rows=_fit_rows, align="-rrrr-",
    intro=lambda d, _: (f"`configs/llama_1b.py:long`, remat `{d['remat_policy']}`, batch "
                        f"{d['batch_rows']}, {d['memory_bytes'] / GIB:g} GiB per device; bold: "
                        "the longest length that fits. Per device = compiled - to host:"),
    head=["devices (mesh)", "seq_len", "compiled GiB", "to host GiB", "per device GiB", "fits"])


def _nolicm(with_, d) -> str:
  n = d["checked"][0]["seq_len"]
  with_ = next(c for c in with_["checked"] if c["seq_len"] == n)
  without = d["checked"][0].get("compiled_per_device_bytes", d["checked"][0]["per_device_bytes"])
  return (f"`configs/llama_1b.py:long`, 1 device, {length(n)} tokens, compiled per device "
          f"(offloads not subtracted): **{gib(with_['compiled_per_device_bytes'])} GiB** with "
          f"the pass, **{gib(without)} GiB** with `--xla_flags={d['xla_flags']}`.")


table_block("fit_nolicm", FIT_1, FIT_NOLICM, intro=_nolicm)

table_block(
    "fit_pipeline", FIT_PIPELINE, align="-rrrr",
    intro=lambda runs: (f"`configs/llama_1b.py`, {runs[0]['seq_len']:,} tokens x "
                        f"{runs[0]['batch_rows']} rows, remat `{runs[0]['remat_policy']}`, "
                        "compiled on fake CPU devices, per device:"),
    rows=lambda runs: sorted(runs, key=lambda d: -d["per_device_bytes"]),
    columns=[("mesh", lambda d: f"`{_mesh(d['mesh'], ' x ', keep='data')}`"),
             ("devices", "{devices}"),
             ("arguments GiB", "{checked[0][argument_bytes]:gib}"),
             ("temp GiB", "{checked[0][temp_bytes]:gib}"),
             ("per device GiB", "**{per_device_bytes:gib}**")])


# ----------------------------------------------------------------------------
# Train step, decode, data pipeline, two-level ring
# ----------------------------------------------------------------------------

TRAIN = ("train_throughput_cpu_2k.json", "train_throughput_cpu.json")
DECODE_TIME = "decode_time_cpu.jsonl"
DECODE_FIT = "decode_fit_cpu.jsonl"
PIPELINE = "data_pipeline_cpu.json"
TWO_LEVEL = "two_level_cpu.json"


def _train_row(r, d) -> list:
  if "error" in r:  # refused before running, e.g. over the host's memory
    return [f"{d['results'][0]['seq_len']:,}", r["attention"],
            f"not run: {r['error'].split(': ', 1)[-1]}", "", "", "", ""]
  return [f"{r['seq_len']:,}", r["attention"], ms(r["step_s"]), f"{r['tokens_per_s']:.0f}",
          pct(r["mfu"]), mib(r["temp_bytes_per_device"]), f"{r['loss']:.3f}"]


table_block(
    "train_throughput", *TRAIN, align="r-rrrrr",
    intro=("**Superseded run**: measured at commit `c5be18c`, when the script still had its own "
           "train step (plain AdamW, no clipping); the script now runs the shipped step and has "
           "not been re-timed. MFU against this host's measured f32 matmul rate (only ratios "
           "mean something):"),
    head=["L", "attention", "step ms", "tokens/s", "MFU (host-relative)", "temp MiB/device",
          "loss"],
    rows=lambda *runs: [_train_row(r, d) for d in runs for r in d["results"]])

table_block(
    "decode_time", DECODE_TIME, rows=lambda d: d, align="rrrr",
    columns=[("context", "{length:,}"),
             ("KV cache MiB/device", "{cache_mib_per_device:.1f}"),
             ("step temp MiB/device", "{step_temp_mib_per_device:.1f}"),
             ("decode step ms (median of 10)", "{step_ms_median:.0f}")])

table_block(
    "decode_fit", DECODE_FIT, rows=lambda d: d, align="--rrrr",
    intro=lambda d: f"Budget {d[0]['budget_gib']:g} GiB per device:",
    columns=[("model", lambda r: r["config"].removesuffix(".py")),
             ("devices (mesh)", lambda r: f"{r['devices']} ({_mesh(r['mesh'], ', ')})"),
             ("fixed per device", "{fixed_gib_per_device:.1f} GiB"),
             ("bytes/token/device", "{bytes_per_token_per_device:,.0f}"),
             ("longest f32 cache (compiled peak)",
              lambda r: f"**{tokens(r['longest_cache_tokens'])}** "
                        f"({r['peak_gib_at_longest']:.2f} GiB)"),
             ("bf16 cache (derived)", lambda r: tokens(r["longest_bf16_cache_tokens_derived"]))])

table_block(
    "data_pipeline", PIPELINE, align="rr-rrr",
    rows=lambda d: sorted(d["runs"], key=lambda r: (r["tokenizer"], r["corpus_mb"])),
    columns=[("corpus", "{corpus_mb} MiB"),
             ("files", "{files}"),
             ("tokenizer", lambda r: "byte" if r["tokenizer"] == "byte"
              else f"BPE, vocab {r['vocab_size']} (`tokenizers`)"),
             ("peak RSS MiB (before pipeline)", "{peak_rss_mib:.1f} ({rss_before_mib:.1f})"),
             ("first batch s", "{first_batch_s:.3f}"),
             ("tokens/s", "{tokens_per_s:,}")],
    after=("The consumer, `train.py` with {train_step[config]}, {train_step[steps]} steps: "
           "**{train_step[tokens_per_s]:,} tokens/s** ({train_step[step_time_s]:.2f} s/step)."))


def _two_level_rows(d) -> list:
  flat = {(tuple(r["split"]), r["pass_"]): r for r in d["rows"] if r["ring"] == "flat"}
  return [["x".join(map(str, r["split"])), r["pass_"], r["ring"], r["outer_transfers"],
           mib(r["outer_bytes"]), mib(r["outer_total"]),
           x(r["outer_total"] / flat[(tuple(r["split"]), r["pass_"])]["outer_total"]),
           r["inner_transfers"], mib(r["inner_bytes"])] for r in d["rows"]]


table_block(
    "two_level", TWO_LEVEL, rows=_two_level_rows, align="---rrrrrr",
    intro=lambda d: (f"Ring of 8, L = {d['rows'][0]['length']:,}, {d['kv_heads']} K/V heads of "
                     f"{d['head_dim']}, {d['dtype']}, {'causal ' if d['is_causal'] else ''}"
                     f"{d['layout']}; per device unless \"all\":"),
    head=["split (outer x inner)", "pass", "ring", "outer transfers", "outer MiB",
          "all outer links MiB", "all outer vs flat", "inner transfers", "inner MiB"])


# ----------------------------------------------------------------------------
# docs/performance.md: block sweep, hop profile, routing, tensor sequence parallelism
# ----------------------------------------------------------------------------

def sweep_markdown(rows) -> str:
  """A block-size sweep (``attention.py --sections sweep``) as a markdown table: per (length,
  mask, layout), each block's fwd+bwd time over the best block's and its temp MiB; ``*`` marks
  the default. The last column: the default against the best block, in time and in temp
  memory. ``attention.py --render`` prints the same table."""
  blocks = sorted({r["block"] for r in rows if r.get("block")})
  temp = lambda r: r["fwdbwd_mem"].get("temp_size_in_bytes", 0)
  cell = lambda r: (f"{r['x_best']:.2f}x, {temp(r) / MIB:.1f}" + ("*" if r.get("is_default")
                                                                    else "")) if r else ""
  groups = {}
  for r in rows:
    groups.setdefault((r["length"], r["causal"], r["layout"]), {})[r["block"]] = r
  out = []
  for (n, causal, layout), by_block in groups.items():
    timed = [by_block.get(b) if "x_best" in by_block.get(b, {}) else None for b in blocks]
    best = default = None
    for r in filter(None, timed):
      best = r if r["x_best"] == 1.0 else best
      default = r if r.get("is_default") else default
    verdict = (f"{default['x_best']:.2f}x, {temp(default) / temp(best):.2f}x"
               if best and default else "")
    out.append([f"{n // 1024}K" if n % 1024 == 0 else str(n), "causal" if causal else "full",
                layout, *map(cell, timed), verdict])
  return table(["L", "mask", "layout", *map(str, blocks),
                "default: time, temp vs the best block"], out)


SWEEP = "block_sweep_cpu.json"
SWEEP_1K, SWEEP_64_128 = "block_sweep_cpu_1k.json", "block_sweep_cpu_64_128.json"
HOP_PROFILE = ("hop_profile_cpu_causal.json", "hop_profile_cpu_full.json")
HOP_KINDS = {"matmul": "matmuls (the block products)", "exp": "exp",
             "select/compare": "select/compare (masks, the row maxima)",
             "other": "other elementwise and reductions (scale, rescale, row sums, delta)",
             "transfer": "transfers (waits included)", "layout copies": "layout copies"}

table_block("block_sweep", SWEEP, after=lambda d: sweep_markdown(d["sweep"]))
table_block("block_sweep_64_128", SWEEP_1K, SWEEP_64_128,
            after=lambda a, b: sweep_markdown(a["sweep"] + b["sweep"]))


def _hop_profile_rows(*runs) -> list:
  kind = lambda r, k: pct(r["by_kind_ms"][k] / sum(r["by_kind_ms"].values()))
  part = lambda r, k: pct(r["by_part_ms"].get(k, 0.0) / sum(r["by_part_ms"].values()))
  return ([[label] + [kind(r, k) for r in runs]
           for k, label in HOP_KINDS.items()] +
          [["by part: backward block loops / forward block loops"] +
           [f"{part(r, 'bwd: xla_hop_bwd_blocks')} / {part(r, 'fwd: xla_hop_fwd_blocks')}"
            for r in runs],
           ["by part: merge of the hops' (out, lse)"] + [part(r, "fwd: merge") for r in runs]])


table_block(
    "hop_profile", *HOP_PROFILE, rows=_hop_profile_rows, align="-rr",
    intro="Ring of {ring}, L={length}, {layout}, {heads} heads x {head_dim}, default blocks:",
    head=lambda *runs: ["share of the profiled op time"] + ["causal" if r["causal"] else
                                                            "non-causal" for r in runs])


def _routing_rows(one_proc, procs, full_impl: str, routed_impl: str) -> list:
  rows = []
  for d, label in ((one_proc, "8 devices in one process"), (procs, None)):
    if "rows" in d and "meta" in d:
      by = {(r["impl"], r["length"]): (r["fwdbwd_median_s"],
                                       r["fwdbwd_mem"]["temp_size_in_bytes"]) for r in d["rows"]}
    else:
      label = f"{d['processes']} processes, one core each"
      by = {(r["impl"], r["length"]): (r["median_s"], r["temp_bytes"]) for r in d["rows"]}
    lengths = sorted({n for i, n in by if i == full_impl and (routed_impl, n) in by})
    for j, n in enumerate(lengths):
      (tf, mf), (tr, mr) = by[(full_impl, n)], by[(routed_impl, n)]
      rows.append([label if j == 0 else "", length(n), f"{ms(tf)} ms",
                   f"{ms(tr)} ms ({x(tr / tf)})", f"{mib(mf)} / {mib(mr)}"])
  return rows


def _routing_head(layout: str) -> list:
  return ["", "L", f"{layout} full", f"{layout} routed", "fwd+bwd temp MiB/device, full / routed"]


table_block("routing_default", "routing_default_cpu.json", "balance_routing_cpu.json",
            rows=lambda a, b: _routing_rows(a, b, "ring-contiguous+full", "ring-contiguous"),
            head=_routing_head("contiguous"), align="-rrrr")
table_block("routing_zigzag", "routing_zigzag_cpu.json", "balance_routing_zigzag_cpu.json",
            rows=lambda a, b: _routing_rows(a, b, "ring-zigzag+full", "ring-zigzag+routed"),
            head=_routing_head("zigzag"), align="-rrrr")


def _tensor_sp_rows(d) -> list:
  grads = _grads(d)

  def coll(side, kind):
    c = side["collectives"][kind]
    return f"{c['count']} ({c['bytes'] / MIB:,.0f})"

  both = lambda r, kind: f"{coll(r['off'], kind)} / {coll(r['on'], kind)}"
  rows = []
  for p, r in _pairs(d["rows"]):
    off, on = r["off"]["temp_bytes"], r["on"]["temp_bytes"]
    growth = "-"
    if p:
      go, gn = off - p["off"]["temp_bytes"], on - p["on"]["temp_bytes"]
      growth = f"{go / GIB:.2f} / {gn / GIB:.2f} ({gn / go:.2f})"
    rows.append([f"{r['seq_len']:,}", f"{off / GIB:.2f}", f"{on / GIB:.2f}", f"{on / off:.2f}",
                 f"{(off - grads) / GIB:.2f} / {(on - grads) / GIB:.2f}", growth,
                 both(r, "all-reduce"), coll(r["on"], "reduce-scatter"), both(r, "all-gather"),
                 both(r, "collective-permute")])
  return rows


def _grads(d) -> float:
  """Bytes of float32 gradient buffers per device."""
  return d["num_params"] / d["mesh"]["tensor"] * 4


table_block(
    "tensor_sp", "tensor_sp_cpu.json", rows=_tensor_sp_rows, align="rrrrrrrrrr",
    intro=lambda d: (f"Float32 gradient buffers: {_grads(d) / GIB:.2f} GiB per device (in "
                     "\"temp\", the same at every length and either way); collectives: count "
                     "(MiB of results):"),
    head=["seq_len", "temp off GiB", "temp on GiB", "on/off", "temp - f32 grads off / on GiB",
          "growth off / on GiB (on/off)", "all-reduce off / on", "reduce-scatter on",
          "all-gather off / on", "collective-permute off / on"])


# ----------------------------------------------------------------------------
# docs/performance.md: memory per kernel and strategy
# ----------------------------------------------------------------------------

KERNELS_MEM = "attention_cpu_memscan_kernels.json"
KERNEL_NAMES = {"ring-zigzag:xla": "`xla`",
                "paper": "paper's code (`ringattention` 0.1.2), for scale"}
OVERLAP = "ring-zigzag+overlap:xla"


def _overlap_dkv(d) -> str:
  by, _, lengths = _memscan(d)
  m, n = d["meta"], lengths[-1]
  default, overlap, paper = (by[(i, n)]["fwdbwd_temp"] for i in
                             ("ring-zigzag:xla", OVERLAP, "paper"))
  return (f"Compiled fwd+bwd temp per device at {length(n)} tokens, ring of {m['ring']}, "
          f"{m['heads']} x {m['head_dim']} heads, {m['dtype']}, blocks of "
          f"{by[(OVERLAP, n)]['block']}, causal zigzag: **{mib(default)} MiB** by default, "
          f"**{mib(overlap)} MiB** with `overlap_dkv=True` ({x(overlap / default)}); the "
          f"paper's code: {mib(paper)} MiB.")


table_block("overlap_dkv", KERNELS_MEM, intro=_overlap_dkv)


def _kernel_rows(d) -> list:
  by, _, lengths = _memscan(d)
  return [[label] + [f"{mib(by[(impl, n)][k])} MiB" for n in lengths
                     for k in ("fwd_temp", "fwdbwd_temp")] for impl, label in KERNEL_NAMES.items()]


table_block(
    "hop_kernel_memory", KERNELS_MEM, rows=_kernel_rows,
    head=lambda d: ["kernel"] + [f"{p}, {length(n)}" for n in _memscan(d)[2]
                                 for p in ("fwd", "fwd+bwd")],
    align=lambda d: "-" + "r" * 2 * len(_memscan(d)[2]))

table_block(
    "strategy_memory", "strategy_memory_cpu.json", rows=lambda d: d["rows"], align="-rrrr",
    intro=("Compiled on CPU, {length:len} tokens over {meta[num_devices]} devices, {heads} x "
           "{head_dim} heads, {dtype}, causal {layout}, default blocks, per device:"),
    columns=[("strategy", "`{strategy}`"),
             ("fwd temp MiB", "{fwd_temp_bytes:mib}"),
             ("fwd+bwd temp MiB", "{fwdbwd_temp_bytes:mib}"),
             ("`plan()` memory MiB", "{plan_memory_bytes:mib}"),
             ("compiled / plan", lambda r: x(r["fwdbwd_temp_bytes"] / r["plan_memory_bytes"]))])


# ----------------------------------------------------------------------------
# docs/performance.md: deviceless TPU compiles (tpu_overlap.py)
# ----------------------------------------------------------------------------

TPU_NOTE = "Deviceless compiles with libtpu {libtpu}."
TPU_INTRO = ("`ring_attention_sharded` fwd+bwd compiled for {topology} (no TPU attached), "
             "ring of 4")


def _ring_kinds(row) -> str:
  return ", ".join(f"{kind.removeprefix('ring ')} {h}/{t}" for kind, (h, t) in row["kinds"].items())


def _in_flight(r) -> str:
  return f"{r['ring_in_flight']} of {r['ring_transfers']}"


def _overlap_cells(o, r) -> list:
  """A tpu_overlap row: ring transfers in flight and temp before (``o``) and after."""
  return [f"`{r['config']}`", _in_flight(o) if o else "", mib(o["temp_mib"] * MIB) if o else "",
          _in_flight(r), _ring_kinds(r), mib(r["temp_mib"] * MIB)]


def _rotation_cells(o, r) -> list:
  """A tpu_backward_rotation row: in flight, per kind and temp, before (``o``) and after."""
  return [f"`{r['config']}`"] + [c for s in (o, r) for c in (_in_flight(s), _ring_kinds(s),
                                                             mib(s["temp_mib"] * MIB))]


def _before_after(after, before, cells, skip_new: bool) -> list:
  """Per configuration of ``after`` (errors left out) its ``cells(before row or None, row)``;
  ``skip_new``: leave out those ``before`` lacks."""
  old = {r["config"]: r for r in before["rows"] if "error" not in r}
  return [cells(old.get(r["config"]), r) for r in after["rows"]
          if "error" not in r and (r["config"] in old or not skip_new)]


table_block(
    "tpu_overlap", "tpu_overlap_v5p.json", "tpu_overlap_v5p_before.json", align="-rrr-r",
    note=TPU_NOTE,
    intro=lambda a, b: (TPU_INTRO.format_map(a) + f", {length(a['length'])} tokens, "
                        f"{a['heads']} x {a['head_dim']} heads, {a['dtype']}, xla hop (splash "
                        "where named), default blocks; ring transfers with block compute in "
                        "flight / all (`ring_jax.analysis.overlap_report`, a loop body's pair "
                        f"counted once) and temp per chip; {b['label']}, with its defaults "
                        "(in-place dK/dV; causal contiguous routed):"),
    head=["configuration", "before: in flight", "before: temp MiB", "after: in flight",
          "after, per kind", "after: temp MiB"],
    rows=lambda a, b: _before_after(a, b, _overlap_cells, skip_new=False))

table_block(
    "tpu_backward_rotation", "tpu_backward_rotation_v5p.json",
    "tpu_backward_rotation_v5p_before.json", align="-r-rr-r", note=TPU_NOTE,
    intro=lambda a, b: (TPU_INTRO.format_map(a) + f" (two-level: 2 x 2), {length(a['length'])} "
                        f"tokens, {a['heads']} x {a['head_dim']} heads, {a['dtype']}, xla hop "
                        "(splash where named), the TPU defaults; ring transfers with block "
                        "compute in flight / all, per kind, and temp per chip; "
                        f"{b['label']} against {a['label']}:"),
    head=["configuration", "before: in flight", "before, per kind", "before: temp MiB",
          "after: in flight", "after, per kind", "after: temp MiB"],
    rows=lambda a, b: _before_after(a, b, _rotation_cells, skip_new=True))


def _hop_case(row) -> tuple[str, str]:
  """``(configuration without the kernel, kernel)`` of a tpu_overlap.py row (``pallas_tpu``:
  the fused TPU kernel since removed, whose rows the result files keep)."""
  parts = row["config"].split("+")
  kernel = next((p for p in parts[1:] if p in ("splash", "pallas_tpu")), "xla")
  return "+".join(p for p in parts if p != kernel), kernel


def _hop_memory_rows(d, tried) -> list:
  rows = {_hop_case(r): r for r in d["rows"]}
  tried_rows = {_hop_case(r): r for r in tried["rows"]}

  def temp(rows, case, kernel):
    r = rows.get((case, kernel))
    if r is None:
      return "", None
    if "error" in r:
      return "refused" if r["error"].startswith("ValueError") else "error", None
    return mib(r["temp_mib"] * MIB), r["temp_mib"]

  out = []
  for case in dict.fromkeys(c for c, _ in rows):
    first = rows[(case, "xla")]
    xla, xla_v = temp(rows, case, "xla")
    cells = [f"`{case}`", f"{first['heads']}:{first['kv_heads']}", xla]
    for source, kernel in ((rows, "pallas_tpu"), (rows, "splash"), (tried_rows, "splash")):
      text, v = temp(source, case, kernel)
      cells += [text, x(v / xla_v) if v and xla_v else ""]
    out.append(cells)
  return out


table_block(
    "tpu_hop_memory", "tpu_hop_memory_v5p.json", "tpu_hop_memory_v5p_tried.json",
    rows=_hop_memory_rows, align="--rrrrrrr", note=TPU_NOTE,
    intro=lambda d, tried: (TPU_INTRO.format_map(d) + f", {length(d['length'])} tokens, head "
                            f"dim {d['head_dim']}, {d['dtype']}, default blocks, the TPU "
                            "defaults (`overlap_dkv=True`, full rotation); temp MiB per chip "
                            "(`memory_analysis()`), heads query:K/V; the last pair: splash with "
                            f"the guard change of {tried['label']} (reverted):"),
    head=["configuration", "heads", "xla", "pallas_tpu (removed)", "/ xla", "splash", "/ xla",
          "splash, tried", "/ xla"])



TPU_SPLASH_NONFINITE = "tpu_splash_nonfinite_v5p.json"
TPU_SPLASH_NONFINITE_BEFORE = "tpu_splash_nonfinite_v5p_before.json"


@block("tpu_splash_nonfinite", TPU_SPLASH_NONFINITE, TPU_SPLASH_NONFINITE_BEFORE)
def tpu_splash_nonfinite() -> str:
  after, before = load(TPU_SPLASH_NONFINITE), load(TPU_SPLASH_NONFINITE_BEFORE)
  old = {_hop_case(r): r for r in before["rows"] if "error" not in r}
  rows = []
  for r in after["rows"]:
    case, kernel = _hop_case(r)
    b, xla = old.get((case, kernel)), old.get((case, "xla"))
    if "error" in r or kernel != "splash" or b is None or xla is None:
      continue
    rows.append([f"`{case}`", f"{r['heads']}:{r['kv_heads']}", mib(xla["temp_mib"] * MIB),
                 mib(b["temp_mib"] * MIB), x(b["temp_mib"] / xla["temp_mib"]),
                 f"{b['ring_in_flight']} of {b['ring_transfers']}",
                 f"{b['hlo_chars'] / 1e6:.2f}M", mib(r["temp_mib"] * MIB),
                 x(r["temp_mib"] / xla["temp_mib"]),
                 f"{r['ring_in_flight']} of {r['ring_transfers']}",
                 f"{r['hlo_chars'] / 1e6:.2f}M"])
  return (f"`ring_attention_sharded` fwd+bwd compiled for {after['topology']} (no TPU "
          f"attached), ring of 4, {length(after['length'])} tokens, head dim "
          f"{after['head_dim']}, {after['dtype']}, default blocks, the TPU defaults; temp MiB "
          f"per chip, ring transfers in flight / all and the scheduled HLO's characters; "
          f"splash {before['label']} (a `cond` to the xla hop on non-finite inputs) and "
          f"{after['label']} (no `cond` without segment ids); the xla column from the before "
          "run:\n\n" +
          table(["configuration", "heads", "xla", "splash before", "/ xla", "in flight",
                 "HLO", "splash after", "/ xla", "in flight", "HLO"], rows, "--rrrrrrrrr") +
          "\n\n" + caption(TPU_SPLASH_NONFINITE, TPU_SPLASH_NONFINITE_BEFORE,
                            note=f"Deviceless compiles with libtpu {after['libtpu']}."))

# ----------------------------------------------------------------------------
# docs/performance.md: compile time; docs/training.md: the document layout's host time
# ----------------------------------------------------------------------------

COMPILE = "compile_time_cpu.json"


def _compile_rows(d) -> list:
  case = lambda r: (f"{'causal' if r['causal'] else 'non-causal'} {r['layout']}" +
                    (" (routed)" if r["routed"] else ""))
  t = d["train_step"]
  step = (f"the tiny train step (`{t['config']}`, {_mesh(t['mesh'], ' x ')}, batch "
          f"{t['batch'][0]} x {t['batch'][1]})")
  return [[name, f"{r['hlo_lines']:,}", f"{r['hlo_instructions']:,}",
           f"{r['compile_median_s']:.2f} s"]
          for name, r in [(case(r), r) for r in d["attention"] if r["causal_routing"] is None] +
          [(step, t)]]


table_block(
    "compile_time", COMPILE, rows=_compile_rows, align="-rrr",
    intro=("fwd+bwd of `ring_attention_sharded`, ring of {meta[ring]}, {meta[length]} tokens, "
           "{meta[heads]} heads x {meta[head_dim]}, {meta[dtype]}, default blocks and routing; "
           "compile: median of {meta[repeats]} fresh compiles, persistent cache off:"),
    head=["", "compiled HLO lines", "HLO instructions", "compile"])


def _routing_compile_rows(d) -> list:
  rows = []
  for layout in ("contiguous", "zigzag"):
    full, routed = (next(r for r in d["attention"] if r["causal"] and r["layout"] == layout
                         and r["routed"] == routed) for routed in (False, True))
    for key, label in (("fwd_temp_bytes", "fwd"), ("fwdbwd_temp_bytes", "fwd+bwd")):
      rows.append([f"{layout} {label}", f"{mib(full[key])} MiB", f"{mib(routed[key])} MiB"] +
                  ([f"{full['hlo_lines']:,} / {routed['hlo_lines']:,}",
                    x(routed["compile_median_s"] / full["compile_median_s"])]
                   if label == "fwd+bwd" else ["", ""]))
  return rows


def _routing_compile_intro(m) -> str:
  return (f"Causal, ring of {m['ring']}, {m['length'] // m['ring']} tokens per device, "
          f"{m['heads']} x {m['head_dim']} heads, {m['dtype']}, default blocks; temp per device "
          f"from `memory_analysis()`; compile: median of {m['repeats']} fresh compiles each:")


table_block(
    "routing_compile", COMPILE, rows=_routing_compile_rows, align="-rrrr",
    intro=lambda d: _routing_compile_intro(d["meta"]),
    head=["causal", "full rotation temp", "routed temp", "fwd+bwd HLO lines, full / routed",
          "fwd+bwd compile, routed / full"])


def _layout_host_rows(d) -> list:
  by = {}
  for r in d["rows"]:
    by.setdefault((r["shape"], r["ring"], r["mean"]), {})[r["layout"]] = r
  return [[shape, ring, f"{mean:g}", f"{v['document']['docs_per_row']:g}",
           f"{v['zigzag']['median_ms']:.2f} ms ({tokens(v['zigzag']['tokens_per_s'])} tokens/s)",
           f"**{v['document']['median_ms']:.2f} ms** "
           f"({tokens(v['document']['tokens_per_s'])} tokens/s)"]
          for (shape, ring, mean), v in by.items()]


table_block(
    "layout_host_time", "layout_host_time_cpu.json", rows=_layout_host_rows, align="-rrrrr",
    intro="`training.data.to_layout_np` per batch, one thread, median of {meta[reps]}:",
    head=["batch (rows x length)", "ring", "mean document", "documents per row", "zigzag",
          "`document`"])


LENGTH_BUCKETS = "length_buckets_cpu.json"


def _bucket_rows(d) -> list:
  bucketed = d["results"][1]
  return [[f"{b['length']:,} x {b['rows']}", b["ring"],
           f"data {b['mesh']['data']} x sequence {b['mesh']['sequence']}",
           bucketed["steps_per_bucket"].get(str(b["length"]), 0) if "steps" in bucketed else "",
           b["ring_permutes_per_step"], f"{b['ring_permute_bytes_per_step'] / MIB:.2f}"]
          for b in bucketed["buckets"]]


def _buckets_vs_one_ring(d) -> str:
  """The table of a run with one ring against one with length buckets."""
  one, bucketed = both = d["results"]
  rows = [["compiled train-step programs"] + [r["compiled_programs"] for r in both]]
  if "steps" in one:
    last = min(10, one["steps"])
    at = sorted({1, *range(one["steps"] // 4, one["steps"] + 1, one["steps"] // 4)})
    rows += [
        ["steps"] + [r["steps"] for r in both],
        ["real tokens (token slots)"] + [f"{r['real_tokens']:,} ({r['token_slots']:,})"
                                         for r in both],
        ["padding"] + [pct(r["padding_fraction"]) for r in both],
        ["ring MiB per device, whole run"] + [mib(r["ring_permute_bytes"]) for r in both],
        ["ring bytes per real token"] + [f"{r['ring_permute_bytes'] / r['real_tokens']:.0f}"
                                         for r in both],
        [f"loss at steps {', '.join(map(str, at))}"] + [
            " / ".join(f"{r['step_rows'][i - 1]['loss']:.3f}" for i in at) for r in both],
        [f"mean loss, last {last} steps"] + [
            f"{sum(s['loss'] for s in r['step_rows'][-last:]) / last:.3f}" for r in both]]
    if "real_tokens_per_s" in one:
      ratio = bucketed["real_tokens_per_s"] / one["real_tokens_per_s"]
      rows += [["real tokens/s (all token slots/s)"] + [
                   f"{r['real_tokens_per_s']:.0f} ({r['tokens_per_s']:.0f})" for r in both],
               ["real tokens/s vs one ring", "1.00x", f"**{x(ratio)}**"]]
    else:
      rows += [["tokens/s", "not timed (`--no-timing`: the host was not quiet)", ""]]
  return table(["", "one ring", f"`length_buckets={tuple(bucketed['length_buckets'])}`"], rows,
               "-rr")


def _buckets_intro(d) -> str:
  st, corpus = d["settings"], d["corpus"]
  return (f"`benchmarks/length_buckets.py`: {corpus['documents']:,} documents "
          f"({pct(corpus['short_fraction'])} of them <= `seq_len / 8`), `seq_len` "
          f"{st['seq_len']:,}, the one ring of {st['ring']} fake CPU devices, "
          f"{st['batch'] * st['seq_len']:,} token slots per step, a "
          f"{st['model']['model.num_layers']}-layer dim-{st['model']['model.dim']} LLaMA, the "
          "same initial parameters and document stream. Per bucket, read from its compiled "
          "program (loop bodies times their trip counts), per device:")


table_block(
    "length_buckets", LENGTH_BUCKETS, intro=_buckets_intro, rows=_bucket_rows, align="-r-rrr",
    head=["bucket (tokens x rows)", "ring", "mesh", "steps", "ring permutes per step",
          "ring MiB per step"], after=_buckets_vs_one_ring)


# ----------------------------------------------------------------------------
# Conformance: benchmarks/conformance.py (the kit, ring_jax.testing)
# ----------------------------------------------------------------------------

CONFORMANCE = {"ring_jax ring": "conformance_ring.json",
               "ring_jax all_gather": "conformance_all_gather.json",
               "ring_jax ulysses": "conformance_ulysses.json",
               "ringattention 0.1.2": "conformance_ringattention-0.1.2.json",
               "ejkernel 0.0.80.3 (XLA)": "conformance_ejkernel-0.0.80.3-xla.json",
               "ejkernel, GQA as is": "conformance_ejkernel-0.0.80.3-xla-native-gqa.json",
               "tokamax 0.0.17 ring (interpret)":
                   "conformance_tokamax-0.0.17-ring-interpret.json"}
STATUSES = ("pass", "fail", "not supported")


def _verdict(row) -> str:
  if row["status"] == "not supported":
    return "n/s"
  worst = max(row["errors"].items(), key=lambda kv: kv[1]) if row["errors"] else None
  if row["status"] == "pass":
    return f"pass {sci(worst[1])}"
  if worst is None:  # raised: the exception's type
    return "fail: " + row["message"].split(":")[0]
  return f"**fail** {worst[0]} {sci(worst[1]) if worst[1] != float('inf') else 'non-finite'}"


def _conformance_matrix(*runs) -> str:
  """Per case (a row) and function (a column): its verdict."""
  by = [{r["case"]: r for r in d["rows"]} for d in runs]
  return table(["case", *CONFORMANCE],
               [[f"`{c}`", *(_verdict(b[c]) if c in b else "-" for b in by)]
                for c in (r["case"] for r in runs[0]["rows"])])


table_block(
    "conformance", *CONFORMANCE.values(), align="-rrr",
    head=["function", *STATUSES],
    rows=lambda *runs: [[name, *(sum(r["status"] == s for r in d["rows"]) for s in STATUSES)]
                        for name, d in zip(CONFORMANCE, runs)],
    after=lambda *runs: ("Per case: the worst quantity's error against the float64 oracle "
                         "(max |error| / max |oracle|; bound 1.5e-5 in float32, 7.8e-3 in "
                         "bfloat16), or why it failed; n/s: the signature takes no keyword the "
                         "case needs.\n\n" + _conformance_matrix(*runs)))


# ----------------------------------------------------------------------------
# The README's headline table
# ----------------------------------------------------------------------------

def _headline_rows() -> list[tuple[str, str, list[str], str]]:
  """Per headline figure: what it measures, the figure, its result files, its docs section."""
  acc = load(CORE)["accuracy"]
  p4 = _rows_by(load(PAPER_4K)["rows"], "impl", "causal")
  zz, pa = p4[("ring-zigzag", True)], p4[("paper", True)]
  mem, ring, _ = _memscan(load(MEMSCAN))
  lengths = [n for n in (16384, 65536) if (ring, n) in mem]  # two lengths fit a cell
  temp = lambda impl, n: mem[(impl, n)]["fwdbwd_temp"]
  bal = load(BALANCE)
  bby = _rows_by(bal["rows"], "impl", "length")
  bl = 8192 if ("ring-zigzag", 8192) in bby else bal["lengths"][-1]
  pk = load(PACKED)["means"].values()
  zz_med = [v["zigzag"]["block_max_over_mean"]["median"] for v in pk]
  f1, f8 = load(FIT_1), load(FIT_8)
  dfit = next(r for r in load(DECODE_FIT) if r["config"] == "llama_1b.py" and r["devices"] == 8)
  tl = load(TWO_LEVEL)["rows"]
  full = next(r for r in tl if r["ring"] == "two-level" and r["pass_"] == "fwd+bwd")
  routed = next(r for r in tl if r["ring"] == "routed" and r["pass_"] == "fwd+bwd"
                and r["split"] == full["split"])
  return [
      (f"Max relative error vs a float64 oracle, float32 inputs, {len(acc)} cases "
       "(layouts, masks, segments, GQA/MQA, ring sizes 1-8): outputs / dQ, dK, dV",
       f"{sci(_worst(acc, 'out'))} / {sci(_worst(acc, *GRADS))}", [CORE], "exactness"),
      (f"Causal fwd+bwd time vs the paper's code, zigzag, L={length(zz['length'])}, "
       "8 fake devices in one process",
       x(zz["fwdbwd_median_s"] / pa["fwdbwd_median_s"]), [PAPER_4K], "against-the-papers-code"),
      ("Useful FLOP/s of that causal zigzag fwd+bwd as a fraction of a same-size f32 matmul "
       f"(paper's code: {pct(pa['fwdbwd_useful_gflops'] / pa['matmul_gflops'])})",
       pct(zz["fwdbwd_useful_gflops"] / zz["matmul_gflops"]), [PAPER_4K],
       "against-the-papers-code"),
      (f"fwd+bwd memory per device, causal zigzag, blocks of 256, "
       f"{' / '.join(length(n) for n in lengths)}: ring vs the paper's code (all-gather)",
       " / ".join(f"{mib(temp(ring, n))} MiB ({x(temp(ring, n) / temp('paper', n))})"
                  for n in lengths) +
       " (all-gather " + " / ".join(mib(temp("allgather", n)) for n in lengths) + " MiB)",
       [MEMSCAN], "memory-per-device"),
      (f"Causal fwd+bwd wall time vs the paper's code, one process and core per device "
       f"(ring of {bal['processes']}), zigzag, L={length(bl)}",
       x(bby[("ring-zigzag", bl)]["median_s"] / bby[("paper", bl)]["median_s"]), [BALANCE],
       "load-balance-in-wall-time"),
      ("Packed documents, ring of 8: max/mean causal work per device, `layout=\"document\"` "
       "(worst row; zigzag's medians)",
       f"{max(v['document']['block_max_over_mean']['max'] for v in pk):.2f} "
       f"({min(zz_med):.2f}-{max(zz_med):.2f})", [PACKED], "packed-documents"),
      (f"Longest `configs/llama_1b.py:long` training context within "
       f"{f1['memory_bytes'] / GIB:g} GiB per device (compiled plan): 1 device / 8 devices",
       f"{length(f1['seq_len'])} / {length(f8['seq_len'])} tokens", [FIT_1, FIT_8],
       "how-long-a-context-fits"),
      (f"Longest llama_1b decode KV cache (f32) within {dfit['budget_gib']:g} GiB per device, "
       f"{dfit['devices']} devices", f"{tokens(dfit['longest_cache_tokens'])} tokens",
       [DECODE_FIT], "decode"),
      ("Two-level ring, causal zigzag, fwd+bwd, split "
       f"{'x'.join(map(str, full['split']))}: bytes over the outer links, routed / full rotation",
       x(routed["outer_total"] / full["outer_total"]), [TWO_LEVEL], "two-link-levels"),
  ]


@block("headline", CORE, PAPER_4K, MEMSCAN, BALANCE, PACKED, FIT_1, FIT_8, DECODE_FIT, TWO_LEVEL)
def headline() -> str:
  """The README's table: per figure its date, machine and jax, its files, its docs section."""
  rows = []
  for what, figure, files, anchor in _headline_rows():
    dated = "; ".join(dict.fromkeys(when(f, short=True) for f in files))
    src = ", ".join(f"[{f}]({LINK_ROOT}benchmarks/results/{f})" for f in files)
    rows.append([what, f"**{figure}**", dated, f"{src}; [how]({DOC}#{anchor})"])
  return (table(["measured", "figure", "date, machine, jax", "result file; command"], rows) +
          "\n\nGenerated by `python benchmarks/report.py` from the result files; every table "
          f"and its command: [docs/benchmarks.md]({DOC}).")


# ----------------------------------------------------------------------------
# Rendering into markdown files
# ----------------------------------------------------------------------------

def render_block(name: str, md_path: str) -> str:
  """Block ``name``'s text with links made relative to the directory of ``md_path``."""
  if name not in BLOCKS:
    raise ReportError(f"unknown block {name!r} (known: {', '.join(sorted(BLOCKS))})")
  text = BLOCKS[name][0]()
  rel = os.path.relpath(ROOT, os.path.dirname(os.path.abspath(md_path)))
  prefix = "" if rel == "." else rel.replace(os.sep, "/") + "/"
  return text.replace(LINK_ROOT, prefix).rstrip("\n")


def rewrite(text: str, md_path: str, cache: dict | None = None) -> tuple[str, list[str]]:
  """``text`` with every block regenerated; the names of the blocks that changed."""
  opens = [m.group("name") for m in OPEN_RE.finditer(text)]
  found = BLOCK_RE.findall(text)
  closes = len(CLOSE_RE.findall(text))
  if len(opens) != len(found) or closes != len(found):
    raise ReportError(f"{os.path.relpath(md_path, ROOT)}: unbalanced <!-- report: NAME --> / "
                      "<!-- /report --> markers")
  changed = []

  def sub(m):
    name = m.group("name")
    try:
      body = render_block(name, md_path)
    except ReportError as e:
      raise ReportError(f"{os.path.relpath(md_path, ROOT)}: block {name!r}: {e}") from None
    new = f"<!-- report: {name} -->\n{body}\n<!-- /report -->"
    if new != m.group(0):
      changed.append(name)
    return new

  return BLOCK_RE.sub(sub, text), changed


def markdown_files(root: str = ROOT) -> list[str]:
  """Every *.md in the repository (hidden directories, virtualenvs and build output skipped)."""
  out = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d not in SKIP_DIRS
                         and not d.endswith(".egg-info") and not d.startswith("venv"))
    out += [os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".md")]
  return out


def block_diff(old: str, new: str, md_path: str) -> str:
  """A unified diff per block that differs, headed by the file and the block's name."""
  old_blocks = {m.start(): m for m in BLOCK_RE.finditer(old)}
  new_blocks = list(BLOCK_RE.finditer(new))
  out = []
  for o, n in zip(old_blocks.values(), new_blocks):
    if o.group(0) != n.group(0):
      rel = os.path.relpath(md_path, ROOT)
      out.append(f"{rel}: block '{o.group('name')}' differs from its result files:")
      out += list(difflib.unified_diff(o.group("body").splitlines(), n.group("body").splitlines(),
                                       f"{rel} [{o.group('name')}]", "generated", lineterm=""))
  return "\n".join(out)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--check", action="store_true",
                  help="change nothing; exit 1 with a diff if any block is out of date")
  ap.add_argument("--files", nargs="+", default=None,
                  help="markdown files to process (default: every *.md in the repository)")
  ap.add_argument("--list", action="store_true", help="print the blocks and their result files")
  ap.add_argument("--print", dest="print_block", default=None, metavar="NAME",
                  help="print one block (links relative to the repository root)")
  args = ap.parse_args(argv)
  try:
    if args.list:
      for name, (_, files) in sorted(BLOCKS.items()):
        print(f"{name}: {', '.join(files)}")
      return 0
    if args.print_block:
      print(render_block(args.print_block, os.path.join(ROOT, "README.md")))
      return 0
    stale, blocks = [], 0
    for path in args.files or markdown_files():
      with open(path) as fh:
        old = fh.read()
      if "<!-- report:" not in old and "<!-- /report" not in old:
        continue
      new, changed = rewrite(old, path)
      blocks += len(BLOCK_RE.findall(new))
      if not changed:
        continue
      if args.check:
        stale.append(block_diff(old, new, path))
      else:
        with open(path, "w") as fh:
          fh.write(new)
        print(f"{os.path.relpath(path, ROOT)}: rewrote {', '.join(changed)}")
  except ReportError as e:
    print(f"report.py: error: {e}", file=sys.stderr)
    return 2
  if stale:
    print("\n\n".join(stale))
    print("\nOut of date: run `python benchmarks/report.py` to regenerate.", file=sys.stderr)
    return 1
  if args.check:
    print(f"{blocks} blocks up to date")
  return 0


if __name__ == "__main__":
  sys.exit(main())
