"""The figures the README and the docs quote, generated from ``benchmarks/results/``.

Every table of measured figures in a markdown file sits between two whole-line markers,
``<!-- report: NAME -->`` and ``<!-- /report -->``, and is replaced wholesale by block ``NAME`` of
:data:`BLOCKS` (declared by :func:`table_block`): figures computed from the raw numbers of its
result files, then a caption giving per file its date, machine, jax, a link and the command that
made it (from ``results/provenance.json`` where the file records none). The commands: ``--help``
and benchmarks/README.md. An unknown block, an unterminated block or a missing result file is an
error (exit 2). Pure Python: no jax, nothing compiled or timed.
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
# Markers are whole lines (a marker quoted inside a line of prose is not one).
BLOCK_RE = re.compile(r"^<!-- report: (?P<name>[^\s>]+) -->\n(?P<body>.*?)^<!-- /report -->$",
                      re.S | re.M)
MARKER_RE = re.compile(r"^<!-- (report: [^\s>]*|/report) -->$", re.M)
# Block name -> (a function that renders it, its result files).
BLOCKS: dict[str, tuple[Callable[[], str], tuple[str, ...]]] = {}


class ReportError(Exception):
  """A block that cannot be rendered: unknown name, missing result file, bad markers."""


# --- Result files and their provenance -------------------------------------------------------

def load(name: str):
  """A result file: JSON, or JSON lines (a list of records)."""
  path = os.path.join(RESULTS, name)
  if not os.path.exists(path):
    raise ReportError(f"result file benchmarks/results/{name} is missing")
  with open(path) as fh:
    if name.endswith(".jsonl"):
      return [json.loads(line) for line in fh if line.strip()]
    return json.load(fh)


def meta(name: str) -> dict:
  """Date, date_note, machine, jax and command of a result file: what the file records (its
  ``meta`` dict over its top level; balance.py's flags), the rest from provenance.json."""
  rec = load(name)
  rec = rec if isinstance(rec, dict) else {}
  m = dict(rec, **rec.get("meta", {}))
  out = dict(date=m["date"][:10] if m.get("date") else None, date_note="", jax=m.get("jax"),
             command=m.get("command"), machine=None)
  if m.get("platform") == "cpu" or m.get("machine"):
    cores = m.get("cpu_count") or m.get("cpus")
    parts = [f"{cores}-core CPU" if cores else "CPU"]
    if m.get("processes"):
      parts.append(f"{m['processes']} processes, one core each")
    elif m.get("num_devices"):
      parts.append(f"{m['num_devices']} fake devices")
    out["machine"] = ", ".join(parts)
  if rec.get("benchmark") == "balance" and not out["command"]:
    stem = os.path.splitext(name)[0]
    out["command"] = (f"PYTHONPATH=. python benchmarks/balance.py --processes {rec['processes']} "
                      f"--lengths {','.join(map(str, rec['lengths']))} --repeats {rec['repeats']} "
                      f"--impls {','.join(rec['impls'])}" +
                      ("" if stem == "balance_cpu" else f" --tag {stem}"))
  with open(os.path.join(RESULTS, "provenance.json")) as fh:
    extra = json.load(fh).get(name, {})
  if out["machine"] == "CPU" and extra.get("machine"):  # the file says no more than "cpu"
    out["machine"] = None
  return {key: value or extra.get(key) for key, value in out.items()}


def when(name: str, short: bool = False) -> str:
  """``date (how it is known), machine, jax X`` of a result file."""
  m = meta(name)
  date = m["date"] or "date not recorded"
  if m["date_note"]:
    date += " (commit date)" if short else f" ({m['date_note']})"
  return ", ".join([date, m["machine"] or "machine not recorded",
                    f"jax {m['jax']}" if m["jax"] else "jax not recorded"])


def caption(*names: str, note: str = "") -> str:
  """The line under a table: per result file a link, :func:`when` and its command; ``note``."""
  parts = [f"[`{n}`]({LINK_ROOT}benchmarks/results/{n}): {when(n)}" +
           (f"; `{cmd}`" if (cmd := meta(n)["command"]) else "") for n in names]
  line = ("Source: " if len(names) == 1 else "Sources: ") + "; ".join(parts) + "."
  return f"<sub>{line} {note}</sub>" if note else f"<sub>{line}</sub>"


# --- Formatting: one unit per kind of number, each also a format spec of fmt() ---------------

def sci(v: float) -> str:
  """``v`` in scientific notation with one decimal: 5.3e-7."""
  mant, exp = f"{v:.1e}".split("e")
  return f"{mant}e{int(exp)}"


def tokens(n: float) -> str:
  """3 significant figures with K / M (decimal): 9256960 -> 9.26M."""
  for unit, div in (("M", 1e6), ("K", 1e3)):
    if n >= div:
      v = n / div
      return f"{v:.{max(0, 2 - int(math.floor(math.log10(v))))}f}{unit}"
  return str(int(n))


def length(n: int) -> str:
  """A sequence length in binary units: 4096 -> 4K, 655360 -> 640K, 4718592 -> 4.5M."""
  for unit, div in (("M", 2 ** 20), ("K", 1024)):
    if n >= div:
      return f"{n / div:g}{unit}"
  return str(n)


# Format spec of fmt() -> the text of one kind of number.
UNITS: dict[str, Callable] = {
    "mib": lambda nbytes: f"{nbytes / MIB:.1f}",
    "gib": lambda nbytes: f"{nbytes / GIB:.1f}",
    "ratio": lambda ratio: f"{ratio:.2f}x",
    "pct": lambda frac: f"{100 * frac:.1f}%",
    "ms": lambda seconds: f"{1e3 * seconds:.1f}",
    "medmax": lambda stats: f"{stats['median']:.2f} / {stats['max']:.2f}",
    "sci": sci, "len": length, "tokens": tokens,
    "blocks": lambda rows: ", ".join(map(str, sorted({r["block"] for r in rows})))}  # 256, 512
mib, gib, x, pct, ms = (UNITS[k] for k in ("mib", "gib", "ratio", "pct", "ms"))


def table(head: list[str], rows: list[list], align: str | None = None) -> str:
  """A markdown table; ``align`` has one letter per column, ``r`` for right-aligned."""
  sep = ["---:" if a == "r" else "---" for a in align or "-" * len(head)]
  lines = ["| " + " | ".join(head) + " |", "|" + "|".join(sep) + "|"]
  return "\n".join(lines + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows])


def _mesh(sizes: dict, sep: str, keep: str = "") -> str:
  """The axes of a mesh larger than 1 (and ``keep``): ``data=2 x sequence=4``."""
  return sep.join(f"{k}={v}" for k, v in sizes.items() if v != 1 or k == keep)


def _rows_by(rows, *keys) -> dict:
  return {tuple(r[k] for k in keys): r for r in rows}


class _Units(string.Formatter):
  """``str.format`` with :data:`UNITS` as format specs: ``{temp_bytes:mib}``."""
  def format_field(self, value, spec: str) -> str:
    return UNITS[spec](value) if spec in UNITS else super().format_field(value, spec)


def fmt(spec: str, record) -> str:
  """``spec`` formatted over the mapping ``record``; units as in :class:`_Units`."""
  return _Units().vformat(spec, (), record)


def cell(spec, record) -> str:
  """``spec(record)``, or the format string ``spec`` over ``record``."""
  return spec(record) if callable(spec) else fmt(spec, record)


# --- Blocks declared as data -----------------------------------------------------------------

def table_block(name: str, *files: str, key: str = "", rows: Callable | None = None, columns=(),
                head=(), align: str | Callable = "", intro: str | Callable = "",
                after: str | Callable = "", note: str | Callable = "",
                cite: bool = True) -> None:
  """Registers block ``name``: ``intro``, a table, ``after`` and the caption of ``files``
  (``note`` at its end; none if not ``cite``), each left out where empty.

  ``rows(*data)`` (``data``: the contents of ``files``, or their entry ``key``) gives the
  table's records (no ``rows``, no table). With ``columns`` (``[(header, cell)]``) a record is
  one row, its cells :func:`cell`; without, a record is a list of cells under ``head``. The
  other arguments are fixed or functions of ``*data``; fixed text is a format string over the
  first file's data."""
  text = lambda spec, data: spec(*data) if callable(spec) else fmt(spec, data[0]) if spec else ""

  def render() -> str:
    data = [load(f)[key] if key else load(f) for f in files]
    grid = ""
    if rows is not None:
      records, hd = list(rows(*data)), head(*data) if callable(head) else head
      if columns:
        records, hd = [[cell(c, r) for _, c in columns] for r in records], [h for h, _ in columns]
      grid = table(hd, records, text(align, data))
    parts = [text(intro, data), grid, text(after, data),
             caption(*files, note=text(note, data)) if cite else ""]
    return "\n\n".join(p for p in parts if p)
  BLOCKS[name] = (render, files)


def block(name: str, *files: str, **spec):
  """Decorator: the function is the ``rows`` of ``table_block(name, *files, **spec)``."""
  def register(rows: Callable) -> Callable:
    table_block(name, *files, rows=rows, **spec)
    return rows
  return register


# --- Core figures: benchmarks/core_report.py ---------------------------------------------------

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
                    for p, r in zip([None, *d["rows"]], d["rows"])])


@block(
    "core_work", CORE, key="work", align="-rrrrr",
    intro=("Causal, ring of {ring}, {local_len} tokens per device, blocks of {block} "
           "(`ring_jax.schedule`, no timing):"),
    head=["layout", "block pairs per device (min ... max)", "max / mean", "critical path (pairs)",
          "vs contiguous", "total"])
def _work_rows(d) -> list:
  base = next(r for r in d["rows"] if r["layout"] == "contiguous")["critical_path"]
  return [[r["layout"], f"{min(w)} ... {max(w)}", f"{max(w) / (sum(w) / len(w)):.2f}",
           r["critical_path"], x(r["critical_path"] / base), sum(w)]
          for r in d["rows"] for w in [r["work_per_device"]]]


# --- Against the paper's code: benchmarks/attention.py -----------------------------------------

PAPER_4K = "attention_cpu_4k.json"
MEMSCAN = "attention_cpu_memscan_scan.json"  # ring zigzag, paper and all-gather in one run
PAPER_IMPLS = {"ring-zigzag": "ring zigzag", "ring-contiguous": "ring contiguous",
               "paper": "paper"}


@block(
    "paper_4k", PAPER_4K,
    intro=("{meta[dtype]}, B={meta[batch]}, {meta[heads]} heads x {meta[head_dim]}, ring of "
           "{meta[ring]} in one process, blocks of {rows:blocks}, median of {meta[repeats]}:"),
    head=lambda d: [f"L = {length(d['rows'][0]['length'])}, fwd+bwd", *PAPER_IMPLS.values(),
                    "same-size f32 matmul"])
def _paper_rows(d) -> list:
  by = _rows_by(d["rows"], "impl", "causal")
  rows = []
  for causal, name in ((True, "causal"), (False, "non-causal")):
    runs = [by[(i, causal)] for i in PAPER_IMPLS]  # the paper's last
    times = [r["fwdbwd_median_s"] / runs[-1]["fwdbwd_median_s"] for r in runs]
    rows.append([f"{name}: fwd+bwd time vs paper"] +
                [f"**{x(t)}**" if t == min(times[:2]) else x(t) for t in times] + [""])
    rows.append([f"{name}: useful GFLOP/s (fraction of the matmul's)"] +
                [f"{r['fwdbwd_useful_gflops']:.1f} "
                 f"({pct(r['fwdbwd_useful_gflops'] / r['matmul_gflops'])})" for r in runs] +
                [f"{runs[-1]['matmul_gflops']:.1f}"])
  temp = lambda i, causal: mib(by[(i, causal)]["fwdbwd_mem"]["temp_size_in_bytes"])
  rows.append(["fwd+bwd temp MiB per device, causal / non-causal"] +
              [f"{temp(i, True)} / {temp(i, False)}" for i in PAPER_IMPLS] + [""])
  return rows


def _memscan(d) -> tuple[dict, str, list]:
  """Compiled fwd+bwd temp bytes by (impl, length), the ring's impl, the lengths."""
  temp = {(r["impl"], r["length"]): r["fwdbwd_temp"] for r in d["memscan"]}
  return temp, next(i for i, _ in temp if i.startswith("ring")), sorted({n for _, n in temp})


@block(
    "memory_fixed_block", MEMSCAN, align="-rrrr",
    head=lambda d: [f"L ({_memscan(d)[1]}, causal, blocks of {UNITS['blocks'](d['memscan'])})",
                    "ring MiB/device", "paper MiB/device", "ring / paper",
                    "all-gather MiB/device"])
def _fixed_block_rows(d) -> list:
  temp, ring, lengths = _memscan(d)
  return [[length(n), mib(temp[ring, n]), mib(temp["paper", n]),
           f"**{x(temp[ring, n] / temp['paper', n])}**",
           mib(temp["allgather", n]) if ("allgather", n) in temp else "-"] for n in lengths]


@block(
    "bf16_error", "attention_cpu_bf16.json", key="bf16_error",
    head=lambda e: ["impl"] + [f"ring {n}" for n in sorted({r["ring"] for r in e["rows"]
                                                            if r["ring"]})],
    intro=lambda e: (f"Relative Frobenius error out / dQ / dK / dV, causal, L={e['length']}, "
                     f"{e['heads']} heads x {e['head_dim']}; worst over the ring's layouts and "
                     "sizes: **" + sci(_worst([r["rel_err"] for r in e["rows"] if r["ring"] and
                                               r["impl"].startswith("ring")], "out", *GRADS)) +
                     "**."))
def _bf16_rows(e) -> list:
  by = {(r["impl"], r["ring"]): r["rel_err"] for r in e["rows"]}
  rings = sorted({n for _, n in by if n})
  errors = lambda v: " / ".join(sci(v[k]) for k in ("out", *GRADS))
  return [[impl] + ([errors(by[(impl, None)])] + [""] * (len(rings) - 1) if (impl, None) in by
                    else [errors(by[(impl, n)]) if (impl, n) in by else "-" for n in rings])
          for impl in dict.fromkeys(r["impl"] for r in e["rows"])]


# --- Load balance: balance.py, balance.py packed -----------------------------------------------

BALANCE = "balance_cpu.json"
PACKED = "packed_balance.json"


@block(
    "balance", BALANCE, align="-rrrrrr",
    intro=("Causal fwd+bwd, {processes} processes (ring of {processes}), {dtype}, B={batch}, "
           "{heads} heads x {head_dim}, blocks of {rows:blocks}, median of {repeats} (each "
           "repetition: the slowest process); time over the paper's code:"),
    head=["L", "contiguous", "zigzag", "striped", "paper (ms)",
          "critical path, hops: contiguous / zigzag", "temp MiB/device: ring / paper"])
def _balance_rows(d) -> list:
  by = _rows_by(d["rows"], "impl", "length")
  rows = []
  for n in d["lengths"]:
    paper, zz, ct = by.get(("paper", n)), by[("ring-zigzag", n)], by[("ring-contiguous", n)]
    rows.append([length(n)] + [x(by[(i, n)]["median_s"] / paper["median_s"]) if paper else "-"
                               for i in ("ring-contiguous", "ring-zigzag", "ring-striped")] +
                [ms(paper["median_s"]) if paper else "-",
                 f"{ct['critical_path_hops']:.2f} / {zz['critical_path_hops']:.2f}",
                 f"{mib(zz['temp_bytes'])} / {mib(paper['temp_bytes']) if paper else '-'}"])
  return rows


table_block(
    "packed_balance", PACKED, align="-rrrrrr",
    intro=("Ring of {ring}, rows of {length:,} tokens, lognormal document lengths (sigma "
           "{sigma:g}), {rows} rows per mean, blocks of {block}; max/mean work per device, "
           "median / max over rows:"),
    rows=lambda d: sorted((dict(v, mean=int(k)) for k, v in d["means"].items()),
                          key=lambda v: v["mean"]),
    columns=[("mean document", "{mean:len}"),
             ("zigzag, blocks", "{zigzag[block_max_over_mean]:medmax}"),
             ("`document`, blocks", "**{document[block_max_over_mean]:medmax}**"),
             ("zigzag, tokens", "{zigzag[token_max_over_mean]:medmax}"),
             ("`document`, tokens", "{document[token_max_over_mean]:medmax}"),
             ("block pairs, document / zigzag", "{document_block_pairs_over_zigzag:ratio}"),
             ("critical path, document / zigzag", "{document_critical_path_over_zigzag:ratio}")])


# --- How long a context fits: fit.py -----------------------------------------------------------

FIT_1 = "fit_llama_1b_long_1dev.json"
FIT_8 = "fit_llama_1b_long_8dev.json"


@block(
    "fit", FIT_1, FIT_8, align="-rrrr-",
    intro=lambda d, _: (f"`configs/llama_1b.py:long`, remat `{d['remat_policy']}`, batch "
                        f"{d['batch_rows']}, {d['memory_bytes'] / GIB:g} GiB per device; bold: "
                        "the longest length that fits. Per device = compiled - to host:"),
    head=["devices (mesh)", "seq_len", "compiled GiB", "to host GiB", "per device GiB", "fits"])
def _fit_rows(*runs) -> list:
  bold = lambda s, on: f"**{s}**" if on else s
  return [[f"{d['devices']} ({_mesh(d['mesh'], ', ') or 'sequence=1'})",
           bold(f"{c['seq_len']:,} ({length(c['seq_len'])})", c["seq_len"] == d["seq_len"]),
           gib(c["compiled_per_device_bytes"]), gib(c["offloaded_bytes"]),
           bold(gib(c["per_device_bytes"]), c["seq_len"] == d["seq_len"]),
           "yes" if c["fits"] else "no"] for d in runs for c in d["checked"]]


def _nolicm(with_, d) -> str:
  n = d["checked"][0]["seq_len"]
  with_ = next(c for c in with_["checked"] if c["seq_len"] == n)
  without = d["checked"][0].get("compiled_per_device_bytes", d["checked"][0]["per_device_bytes"])
  return (f"`configs/llama_1b.py:long`, 1 device, {length(n)} tokens, compiled per device "
          f"(offloads not subtracted): **{gib(with_['compiled_per_device_bytes'])} GiB** with "
          f"the pass, **{gib(without)} GiB** with `--xla_flags={d['xla_flags']}`.")


table_block("fit_nolicm", FIT_1, "fit_llama_1b_long_1dev_512k_nolicm.json", intro=_nolicm)

table_block(
    "fit_pipeline", "fit_llama_1b_pipeline_cpu.jsonl", align="-rrrr",
    intro=lambda runs: (f"`configs/llama_1b.py`, {runs[0]['seq_len']:,} tokens x "
                        f"{runs[0]['batch_rows']} rows, remat `{runs[0]['remat_policy']}`, "
                        "compiled on fake CPU devices, per device:"),
    rows=lambda runs: sorted(runs, key=lambda d: -d["per_device_bytes"]),
    columns=[("mesh", lambda d: f"`{_mesh(d['mesh'], ' x ', keep='data')}`"),
             ("devices", "{devices}"),
             ("arguments GiB", "{checked[0][argument_bytes]:gib}"),
             ("temp GiB", "{checked[0][temp_bytes]:gib}"),
             ("per device GiB", "**{per_device_bytes:gib}**")])


# --- Train step, decode, data pipeline, two-level ring -----------------------------------------

DECODE_FIT = "decode_fit_cpu.jsonl"
TWO_LEVEL = "two_level_cpu.json"


def _train_row(r, d) -> list:
  if "error" in r:  # refused before running, e.g. over the host's memory
    return [f"{d['results'][0]['seq_len']:,}", r["attention"],
            f"not run: {r['error'].split(': ', 1)[-1]}", "", "", "", ""]
  return [f"{r['seq_len']:,}", r["attention"], ms(r["step_s"]), f"{r['tokens_per_s']:.0f}",
          pct(r["mfu"]), mib(r["temp_bytes_per_device"]), f"{r['loss']:.3f}"]


table_block(
    "train_throughput", "train_throughput_cpu_2k.json", "train_throughput_cpu.json",
    align="r-rrrrr",
    head=["L", "attention", "step ms", "tokens/s", "MFU (host-relative)", "temp MiB/device",
          "loss"],
    rows=lambda *runs: [_train_row(r, d) for d in runs for r in d["results"]])

table_block(
    "decode_time", "decode_time_cpu.jsonl", rows=lambda d: d, align="rrrr",
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
    "data_pipeline", "data_pipeline_cpu.json", align="rr-rrr",
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


@block(
    "two_level", TWO_LEVEL, align="---rrrrrr",
    intro=lambda d: (f"Ring of 8, L = {d['rows'][0]['length']:,}, {d['kv_heads']} K/V heads of "
                     f"{d['head_dim']}, {d['dtype']}, {'causal ' if d['is_causal'] else ''}"
                     f"{d['layout']}; per device unless \"all\":"),
    columns=[("split (outer x inner)", lambda r: "x".join(map(str, r["split"]))),
             ("pass", "{pass_}"), ("ring", "{ring}"), ("outer transfers", "{outer_transfers}"),
             ("outer MiB", "{outer_bytes:mib}"), ("all outer links MiB", "{outer_total:mib}"),
             ("all outer vs flat", "{vs_flat:ratio}"), ("inner transfers", "{inner_transfers}"),
             ("inner MiB", "{inner_bytes:mib}")])
def _vs_flat(d) -> list:
  """Per row of two_level.py, its bytes over all outer links over the flat ring's."""
  flat = {(tuple(r["split"]), r["pass_"]): r["outer_total"] for r in d["rows"]
          if r["ring"] == "flat"}
  return [dict(r, vs_flat=r["outer_total"] / flat[(tuple(r["split"]), r["pass_"])])
          for r in d["rows"]]


# --- docs/performance.md: block sweep, hop profile, routing, tensor sequence parallelism -------

def sweep_markdown(rows) -> str:
  """A block-size sweep (``attention.py --sections sweep``) as a markdown table: per (length,
  mask, layout), each block's fwd+bwd time over the best block's and its temp MiB (``*``: the
  default), then the default's time and temp over the best block's."""
  sizes = sorted({r["block"] for r in rows if r.get("block")})
  temp = lambda r: r["fwdbwd_mem"].get("temp_size_in_bytes", 0)
  cell = lambda r: (f"{r['x_best']:.2f}x, {temp(r) / MIB:.1f}" + ("*" if r.get("is_default")
                                                                    else "")) if r else ""
  groups = {}
  for r in rows:
    groups.setdefault((r["length"], r["causal"], r["layout"]), {})[r["block"]] = r
  out = []
  for (n, causal, layout), by_block in groups.items():
    timed = [by_block.get(b) if "x_best" in by_block.get(b, {}) else None for b in sizes]
    best = next((r for r in timed if r and r["x_best"] == 1.0), None)
    default = next((r for r in timed if r and r.get("is_default")), None)
    verdict = (f"{default['x_best']:.2f}x, {temp(default) / temp(best):.2f}x"
               if best and default else "")
    out.append([f"{n // 1024}K" if n % 1024 == 0 else str(n), "causal" if causal else "full",
                layout, *map(cell, timed), verdict])
  return table(["L", "mask", "layout", *map(str, sizes),
                "default: time, temp vs the best block"], out)


table_block("block_sweep", "block_sweep_cpu.json", after=lambda d: sweep_markdown(d["sweep"]))
table_block("block_sweep_64_128", "block_sweep_cpu_1k.json", "block_sweep_cpu_64_128.json",
            after=lambda a, b: sweep_markdown(a["sweep"] + b["sweep"]))

HOP_KINDS = {"matmul": "matmuls (the block products)", "exp": "exp",
             "select/compare": "select/compare (masks, the row maxima)",
             "other": "other elementwise and reductions (scale, rescale, row sums, delta)",
             "transfer": "transfers (waits included)", "layout copies": "layout copies"}


@block(
    "hop_profile", "hop_profile_cpu_causal.json", "hop_profile_cpu_full.json", align="-rr",
    intro="Ring of {ring}, L={length}, {layout}, {heads} heads x {head_dim}, default blocks:",
    head=lambda *runs: ["share of the profiled op time"] + ["causal" if r["causal"] else
                                                            "non-causal" for r in runs])
def _hop_profile_rows(*runs) -> list:
  kind = lambda r, k: pct(r["by_kind_ms"][k] / sum(r["by_kind_ms"].values()))
  part = lambda r, k: pct(r["by_part_ms"].get(k, 0.0) / sum(r["by_part_ms"].values()))
  return ([[label] + [kind(r, k) for r in runs] for k, label in HOP_KINDS.items()] +
          [["by part: backward block loops / forward block loops"] +
           [f"{part(r, 'bwd: xla_hop_bwd_blocks')} / {part(r, 'fwd: xla_hop_fwd_blocks')}"
            for r in runs],
           ["by part: merge of the hops' (out, lse)"] + [part(r, "fwd: merge") for r in runs]])


def _routing_rows(one_proc, procs, full: str, routed: str) -> list:
  """Per run (attention.py's, 8 devices in one process; balance.py's, a process per device)
  and length: fwd+bwd time and temp of the full rotation, then of the routed one."""
  rows = []
  for label, by in (
      ("8 devices in one process", {(r["impl"], r["length"]): (
          r["fwdbwd_median_s"], r["fwdbwd_mem"]["temp_size_in_bytes"]) for r in one_proc["rows"]}),
      (f"{procs['processes']} processes, one core each",
       {(r["impl"], r["length"]): (r["median_s"], r["temp_bytes"]) for r in procs["rows"]})):
    for j, n in enumerate(sorted(n for i, n in by if i == full and (routed, n) in by)):
      (tf, mf), (tr, mr) = by[(full, n)], by[(routed, n)]
      rows.append([label if j == 0 else "", length(n), f"{ms(tf)} ms",
                   f"{ms(tr)} ms ({x(tr / tf)})", f"{mib(mf)} / {mib(mr)}"])
  return rows


table_block("routing_default", "routing_default_cpu.json", "balance_routing_cpu.json",
            rows=lambda a, b: _routing_rows(a, b, "ring-contiguous+full", "ring-contiguous"),
            head=["", "L", "contiguous full", "contiguous routed",
                  "fwd+bwd temp MiB/device, full / routed"], align="-rrrr")
table_block("routing_zigzag", "routing_zigzag_cpu.json", "balance_routing_zigzag_cpu.json",
            rows=lambda a, b: _routing_rows(a, b, "ring-zigzag+full", "ring-zigzag+routed"),
            head=["", "L", "zigzag full", "zigzag routed",
                  "fwd+bwd temp MiB/device, full / routed"], align="-rrrr")


def _grads(d) -> float:
  """Bytes of float32 gradient buffers per device."""
  return d["num_params"] / d["mesh"]["tensor"] * 4


@block(
    "tensor_sp", "tensor_sp_cpu.json", align="rrrrrrrrrr",
    intro=lambda d: (f"Float32 gradient buffers: {_grads(d) / GIB:.2f} GiB per device (in "
                     "\"temp\", the same at every length and either way); collectives: count "
                     "(MiB of results):"),
    head=["seq_len", "temp off GiB", "temp on GiB", "on/off", "temp - f32 grads off / on GiB",
          "growth off / on GiB (on/off)", "all-reduce off / on", "reduce-scatter on",
          "all-gather off / on", "collective-permute off / on"])
def _tensor_sp_rows(d) -> list:
  coll = lambda side, kind: (f"{side['collectives'][kind]['count']} "
                             f"({side['collectives'][kind]['bytes'] / MIB:,.0f})")
  both = lambda r, kind: f"{coll(r['off'], kind)} / {coll(r['on'], kind)}"
  rows = []
  for p, r in zip([None, *d["rows"]], d["rows"]):
    off, on = r["off"]["temp_bytes"], r["on"]["temp_bytes"]
    go, gn = (off - p["off"]["temp_bytes"], on - p["on"]["temp_bytes"]) if p else (0, 0)
    growth = f"{go / GIB:.2f} / {gn / GIB:.2f} ({gn / go:.2f})" if p else "-"
    rows.append([f"{r['seq_len']:,}", f"{off / GIB:.2f}", f"{on / GIB:.2f}", f"{on / off:.2f}",
                 f"{(off - _grads(d)) / GIB:.2f} / {(on - _grads(d)) / GIB:.2f}", growth,
                 both(r, "all-reduce"), coll(r["on"], "reduce-scatter"), both(r, "all-gather"),
                 both(r, "collective-permute")])
  return rows


# --- docs/performance.md: memory per kernel and strategy ---------------------------------------

KERNELS_MEM = "attention_cpu_memscan_kernels.json"
KERNEL_NAMES = {"ring-zigzag:xla": "`xla`",
                "paper": "paper's code (`ringattention` 0.1.2), for scale"}


def _overlap_dkv(d) -> str:
  n, m = _memscan(d)[2][-1], d["meta"]
  by = _rows_by(d["memscan"], "impl", "length")
  default, overlap, paper = (by[(i, n)]["fwdbwd_temp"] for i in
                             ("ring-zigzag:xla", "ring-zigzag+overlap:xla", "paper"))
  return (f"Compiled fwd+bwd temp per device at {length(n)} tokens, ring of {m['ring']}, "
          f"{m['heads']} x {m['head_dim']} heads, {m['dtype']}, blocks of "
          f"{by[('ring-zigzag+overlap:xla', n)]['block']}, causal zigzag: **{mib(default)} MiB** "
          f"by default, **{mib(overlap)} MiB** with `overlap_dkv=True` ({x(overlap / default)}); "
          f"the paper's code: {mib(paper)} MiB.")


table_block("overlap_dkv", KERNELS_MEM, intro=_overlap_dkv)


@block(
    "hop_kernel_memory", KERNELS_MEM,
    head=lambda d: ["kernel"] + [f"{p}, {length(n)}" for n in _memscan(d)[2]
                                 for p in ("fwd", "fwd+bwd")],
    align=lambda d: "-" + "r" * 2 * len(_memscan(d)[2]))
def _kernel_rows(d) -> list:
  by = _rows_by(d["memscan"], "impl", "length")
  return [[label] + [f"{mib(by[(impl, n)][k])} MiB" for n in _memscan(d)[2]
                     for k in ("fwd_temp", "fwdbwd_temp")] for impl, label in KERNEL_NAMES.items()]


table_block(
    "strategy_memory", "strategy_memory_cpu.json", rows=lambda d: d["rows"], align="-rrrr",
    intro=("Compiled on CPU, {length:len} tokens over {meta[num_devices]} devices, {heads} x "
           "{head_dim} heads, {dtype}, causal {layout}, default blocks, per device:"),
    columns=[("strategy", "`{strategy}`"),
             ("fwd temp MiB", "{fwd_temp_bytes:mib}"),
             ("fwd+bwd temp MiB", "{fwdbwd_temp_bytes:mib}"),
             ("`plan()` memory MiB", "{plan_memory_bytes:mib}"),
             ("compiled / plan", lambda r: x(r["fwdbwd_temp_bytes"] / r["plan_memory_bytes"]))])


# --- docs/performance.md: deviceless TPU compiles (tpu_overlap.py) -----------------------------

TPU_NOTE = "Deviceless compiles with libtpu {libtpu}."
TPU_INTRO = ("`ring_attention_sharded` fwd+bwd compiled for {topology} (no TPU attached), "
             "ring of 4")
IN_FLIGHT = "{ring_in_flight} of {ring_transfers}"  # ring transfers with compute in flight / all
TEMP = "{temp_mib:.1f}"


def _compiled(d) -> list:
  """The rows of a tpu_overlap.py run that compiled (a refused configuration records an error)."""
  return [r for r in d["rows"] if "error" not in r]


def _hop_case(row) -> tuple[str, str]:
  """``(configuration without the kernel, kernel)`` of a tpu_overlap.py row (``pallas_tpu``:
  the fused TPU kernel since removed, whose rows the result files keep)."""
  parts = row["config"].split("+")
  kernel = next((p for p in parts[1:] if p in ("splash", "pallas_tpu")), "xla")
  return "+".join(p for p in parts if p != kernel), kernel


# Per configuration that compiled: its ring transfers in flight, per kind, and temp per chip.
TPU_OVERLAP = dict(
    rows=_compiled, align="-r-r", note=TPU_NOTE,
    intro=(TPU_INTRO + " (two-level: 2 x 2), {length:len} tokens, {heads} x {head_dim} heads, "
           "{dtype}, xla hop (splash where named), default blocks, the TPU defaults; ring "
           "transfers with block compute in flight / all (`ring_jax.analysis.overlap_report`, a "
           "loop body's pair counted once), per kind, and temp per chip:"),
    columns=[("configuration", "`{config}`"), ("in flight", IN_FLIGHT),
             ("per kind", lambda r: ", ".join(f"{kind.removeprefix('ring ')} {h}/{t}"
                                              for kind, (h, t) in r["kinds"].items())),
             ("temp MiB", TEMP)])
table_block("tpu_overlap", "tpu_overlap_v5p.json", **TPU_OVERLAP)
table_block("tpu_backward_rotation", "tpu_backward_rotation_v5p.json", **TPU_OVERLAP)


@block(
    "tpu_hop_memory", "tpu_hop_memory_v5p.json", align="--rrrrr", note=TPU_NOTE,
    intro=(TPU_INTRO + ", {length:len} tokens, head dim {head_dim}, {dtype}, default blocks, the "
           "TPU defaults (`overlap_dkv=True`, full rotation); temp MiB per chip "
           "(`memory_analysis()`), heads query:K/V:"),
    head=["configuration", "heads", "xla", "pallas_tpu (removed)", "/ xla", "splash", "/ xla"])
def _hop_memory_rows(d) -> list:
  """Per configuration: its heads, the xla hop's temp, then per other kernel its temp and the
  ratio to the xla hop's."""
  run = {_hop_case(r): r for r in d["rows"]}
  mib_of = lambda r: r["temp_mib"] if r and "error" not in r else None
  temp = lambda r: ("" if r is None else fmt(TEMP, r) if "error" not in r else
                    "refused" if r["error"].startswith("ValueError") else "error")
  ratio = lambda r, xla: x(mib_of(r) / mib_of(xla)) if mib_of(r) and mib_of(xla) else ""
  out = []
  for case in dict.fromkeys(c for c, _ in run):
    xla, others = run[(case, "xla")], [run.get((case, k)) for k in ("pallas_tpu", "splash")]
    out.append([f"`{case}`", f"{xla['heads']}:{xla['kv_heads']}", temp(xla),
                *(c for r in others for c in (temp(r), ratio(r, xla)))])
  return out


table_block(
    "tpu_splash_nonfinite", "tpu_splash_nonfinite_v5p.json", rows=_compiled, align="--rrr",
    note=TPU_NOTE,
    intro=(TPU_INTRO + ", {length:len} tokens, head dim {head_dim}, {dtype}, default blocks, the "
           "TPU defaults; the splash hop: temp MiB per chip, ring transfers in flight / all and "
           "the scheduled HLO's characters:"),
    columns=[("configuration", lambda r: f"`{_hop_case(r)[0]}`"),
             ("heads", "{heads}:{kv_heads}"), ("splash temp MiB", TEMP), ("in flight", IN_FLIGHT),
             ("HLO", lambda r: f"{r['hlo_chars'] / 1e6:.2f}M")])


# --- docs/performance.md: compile time; docs/training.md: the document layout's host time ------

COMPILE = "compile_time_cpu.json"


@block(
    "compile_time", COMPILE, align="-rrr",
    intro=("fwd+bwd of `ring_attention_sharded`, ring of {meta[ring]}, {meta[length]} tokens, "
           "{meta[heads]} heads x {meta[head_dim]}, {meta[dtype]}, default blocks and routing; "
           "compile: median of {meta[repeats]} fresh compiles, persistent cache off:"),
    columns=[("", "{name}"), ("compiled HLO lines", "{hlo_lines:,}"),
             ("HLO instructions", "{hlo_instructions:,}"), ("compile", "{compile_median_s:.2f} s")])
def _compile_rows(d) -> list:
  t = d["train_step"]
  return [dict(r, name=f"{'causal' if r['causal'] else 'non-causal'} {r['layout']}" +
               (" (routed)" if r["routed"] else ""))
          for r in d["attention"] if r["causal_routing"] is None] + [
              dict(t, name=f"the tiny train step (`{t['config']}`, {_mesh(t['mesh'], ' x ')}, "
                   f"batch {t['batch'][0]} x {t['batch'][1]})")]


@block(
    "routing_compile", COMPILE, align="-rrrr",
    intro=lambda d: fmt("Causal, ring of {ring}, {local} tokens per device, {heads} x {head_dim} "
                        "heads, {dtype}, default blocks; temp per device from "
                        "`memory_analysis()`; compile: median of {repeats} fresh compiles each:",
                        dict(d["meta"], local=d["meta"]["length"] // d["meta"]["ring"])),
    head=["causal", "full rotation temp", "routed temp", "fwd+bwd HLO lines, full / routed",
          "fwd+bwd compile, routed / full"])
def _routing_compile_rows(d) -> list:
  rows = []
  for layout in ("contiguous", "zigzag"):
    full, routed = both = [next(r for r in d["attention"] if r["causal"] and r["layout"] == layout
                                and r["routed"] == routed) for routed in (False, True)]
    rows += [[f"{layout} fwd", *(f"{mib(r['fwd_temp_bytes'])} MiB" for r in both), "", ""],
             [f"{layout} fwd+bwd", *(f"{mib(r['fwdbwd_temp_bytes'])} MiB" for r in both),
              f"{full['hlo_lines']:,} / {routed['hlo_lines']:,}",
              x(routed["compile_median_s"] / full["compile_median_s"])]]
  return rows


@block(
    "layout_host_time", "layout_host_time_cpu.json", align="-rrrrr",
    intro="`training.data.to_layout_np` per batch, one thread, median of {meta[reps]}:",
    head=["batch (rows x length)", "ring", "mean document", "documents per row", "zigzag",
          "`document`"])
def _layout_host_rows(d) -> list:
  by = {}
  for r in d["rows"]:
    by.setdefault((r["shape"], r["ring"], r["mean"]), {})[r["layout"]] = r
  return [[shape, ring, f"{mean:g}", f"{v['document']['docs_per_row']:g}",
           f"{v['zigzag']['median_ms']:.2f} ms ({tokens(v['zigzag']['tokens_per_s'])} tokens/s)",
           f"**{v['document']['median_ms']:.2f} ms** "
           f"({tokens(v['document']['tokens_per_s'])} tokens/s)"]
          for (shape, ring, mean), v in by.items()]


def _buckets_vs_one_ring(d) -> str:
  """The table of a run with one ring against one with length buckets."""
  one, bucketed = both = d["results"]
  rows = [("compiled train-step programs", "{compiled_programs}")]
  if "steps" in one:
    n, last = one["steps"], min(10, one["steps"])
    at = sorted({1, *range(n // 4, n + 1, n // 4)})
    rows += [
        ("steps", "{steps}"), ("real tokens (token slots)", "{real_tokens:,} ({token_slots:,})"),
        ("padding", "{padding_fraction:pct}"),
        ("ring MiB per device, whole run", "{ring_permute_bytes:mib}"),
        ("ring bytes per real token",
         lambda r: f"{r['ring_permute_bytes'] / r['real_tokens']:.0f}"),
        (f"loss at steps {', '.join(map(str, at))}",
         lambda r: " / ".join(f"{r['step_rows'][i - 1]['loss']:.3f}" for i in at)),
        (f"mean loss, last {last} steps",
         lambda r: f"{sum(s['loss'] for s in r['step_rows'][-last:]) / last:.3f}")]
    rows += ([("real tokens/s (all token slots/s)", "{real_tokens_per_s:.0f} ({tokens_per_s:.0f})"),
              ("real tokens/s vs one ring", lambda r: "1.00x" if r is one else
               f"**{x(r['real_tokens_per_s'] / one['real_tokens_per_s'])}**")]
             if "real_tokens_per_s" in one else
             [("tokens/s", lambda r: "" if r is bucketed else
               "not timed (`--no-timing`: the host was not quiet)")])
  return table(["", "one ring", f"`length_buckets={tuple(bucketed['length_buckets'])}`"],
               [[label, *(cell(c, r) for r in both)] for label, c in rows], "-rr")


@block(
    "length_buckets", "length_buckets_cpu.json", align="-r-rrr",
    intro=lambda d: fmt(
        "`benchmarks/length_buckets.py`: {corpus[documents]:,} documents "
        "({corpus[short_fraction]:pct} of them <= `seq_len / 8`), `seq_len` {settings[seq_len]:,}, "
        "the one ring of {settings[ring]} fake CPU devices, {slots:,} token slots per step, a "
        "{settings[model][model.num_layers]}-layer dim-{settings[model][model.dim]} LLaMA, the "
        "same initial parameters and document stream. Per bucket, read from its compiled program "
        "(loop bodies times their trip counts), per device:",
        dict(d, slots=d["settings"]["batch"] * d["settings"]["seq_len"])),
    head=["bucket (tokens x rows)", "ring", "mesh", "steps", "ring permutes per step",
          "ring MiB per step"], after=_buckets_vs_one_ring)
def _bucket_rows(d) -> list:
  bucketed = d["results"][1]
  return [[f"{b['length']:,} x {b['rows']}", b["ring"],
           f"data {b['mesh']['data']} x sequence {b['mesh']['sequence']}",
           bucketed["steps_per_bucket"].get(str(b["length"]), 0) if "steps" in bucketed else "",
           b["ring_permutes_per_step"], f"{b['ring_permute_bytes_per_step'] / MIB:.2f}"]
          for b in bucketed["buckets"]]


# --- Conformance: benchmarks/conformance.py (the kit, ring_jax.testing) ------------------------

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
    after=_conformance_matrix)


# --- The README's headline table ---------------------------------------------------------------

@block("headline", CORE, PAPER_4K, MEMSCAN, BALANCE, PACKED, FIT_1, FIT_8, DECODE_FIT, TWO_LEVEL,
       cite=False,
       head=["measured", "figure", "date, machine, jax", "result file; command"])
def _headline_rows(core, paper, memscan, bal, packed, fit_1, fit_8, decode_fit, two_level):
  """Per headline figure: what it measures, the figure, the date, machine and jax of its result
  files, links to them and to its section of the docs."""
  p4 = _rows_by(paper["rows"], "impl", "causal")
  zz, pa = p4[("ring-zigzag", True)], p4[("paper", True)]
  temp, ring, _ = _memscan(memscan)
  lengths = [n for n in (16384, 65536) if (ring, n) in temp]  # two lengths fit a cell
  bby = _rows_by(bal["rows"], "impl", "length")
  bl = 8192 if ("ring-zigzag", 8192) in bby else bal["lengths"][-1]
  pk = packed["means"].values()
  zz_med = [v["zigzag"]["block_max_over_mean"]["median"] for v in pk]
  dfit = next(r for r in decode_fit if r["config"] == "llama_1b.py" and r["devices"] == 8)
  pairs = [r for r in two_level["rows"] if r["pass_"] == "fwd+bwd"]
  full = next(r for r in pairs if r["ring"] == "two-level")
  routed = next(r for r in pairs if r["ring"] == "routed" and r["split"] == full["split"])
  figures = [
      (f"Max relative error vs a float64 oracle, float32 inputs, {len(core['accuracy'])} cases "
       "(layouts, masks, segments, GQA/MQA, ring sizes 1-8): outputs / dQ, dK, dV",
       f"{sci(_worst(core['accuracy'], 'out'))} / {sci(_worst(core['accuracy'], *GRADS))}",
       [CORE], "exactness"),
      (f"Causal fwd+bwd time vs the paper's code, zigzag, L={length(zz['length'])}, "
       "8 fake devices in one process",
       x(zz["fwdbwd_median_s"] / pa["fwdbwd_median_s"]), [PAPER_4K], "against-the-papers-code"),
      ("Useful FLOP/s of that causal zigzag fwd+bwd as a fraction of a same-size f32 matmul "
       f"(paper's code: {pct(pa['fwdbwd_useful_gflops'] / pa['matmul_gflops'])})",
       pct(zz["fwdbwd_useful_gflops"] / zz["matmul_gflops"]), [PAPER_4K],
       "against-the-papers-code"),
      (f"fwd+bwd memory per device, causal zigzag, blocks of 256, "
       f"{' / '.join(length(n) for n in lengths)}: ring vs the paper's code (all-gather)",
       " / ".join(f"{mib(temp[ring, n])} MiB ({x(temp[ring, n] / temp['paper', n])})"
                  for n in lengths) +
       " (all-gather " + " / ".join(mib(temp["allgather", n]) for n in lengths) + " MiB)",
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
       f"{fit_1['memory_bytes'] / GIB:g} GiB per device (compiled plan): 1 device / 8 devices",
       f"{length(fit_1['seq_len'])} / {length(fit_8['seq_len'])} tokens", [FIT_1, FIT_8],
       "how-long-a-context-fits"),
      (f"Longest llama_1b decode KV cache (f32) within {dfit['budget_gib']:g} GiB per device, "
       f"{dfit['devices']} devices", f"{tokens(dfit['longest_cache_tokens'])} tokens",
       [DECODE_FIT], "decode"),
      ("Two-level ring, causal zigzag, fwd+bwd, split "
       f"{'x'.join(map(str, full['split']))}: bytes over the outer links, routed / full rotation",
       x(routed["outer_total"] / full["outer_total"]), [TWO_LEVEL], "two-link-levels"),
  ]
  return [[what, f"**{figure}**", "; ".join(dict.fromkeys(when(f, short=True) for f in files)),
           ", ".join(f"[{f}]({LINK_ROOT}benchmarks/results/{f})" for f in files) +
           f"; [how]({LINK_ROOT}docs/benchmarks.md#{anchor})"]
          for what, figure, files, anchor in figures]


# --- Rendering into markdown files -------------------------------------------------------------

def render_block(name: str, md_path: str) -> str:
  """Block ``name``'s text with links made relative to the directory of ``md_path``."""
  if name not in BLOCKS:
    raise ReportError(f"unknown block {name!r} (known: {', '.join(sorted(BLOCKS))})")
  rel = os.path.relpath(ROOT, os.path.dirname(os.path.abspath(md_path)))
  prefix = "" if rel == "." else rel.replace(os.sep, "/") + "/"
  return BLOCKS[name][0]().replace(LINK_ROOT, prefix).rstrip("\n")


def rewrite(text: str, md_path: str) -> tuple[str, list[tuple[str, str]]]:
  """``text`` with every block regenerated; per block that changed, its name and a unified diff
  of its old text to the generated."""
  rel = os.path.relpath(md_path, ROOT)
  if len(MARKER_RE.findall(text)) != 2 * len(BLOCK_RE.findall(text)):
    raise ReportError(f"{rel}: unbalanced <!-- report: NAME --> / <!-- /report --> markers")
  changed = []

  def sub(m):
    try:
      body = render_block(m["name"], md_path) + "\n"
    except ReportError as e:
      raise ReportError(f"{rel}: block {m['name']!r}: {e}") from None
    if body != m["body"]:
      diff = difflib.unified_diff(m["body"].splitlines(), body.splitlines(),
                                  f"{rel} [{m['name']}]", "generated", lineterm="")
      changed.append((m["name"], "\n".join(
          [f"{rel}: block '{m['name']}' differs from its result files:", *diff])))
    return f"<!-- report: {m['name']} -->\n{body}<!-- /report -->"

  return BLOCK_RE.sub(sub, text), changed


def markdown_files(root: str = ROOT) -> list[str]:
  """Every *.md in the repository (hidden directories, virtualenvs and build output skipped)."""
  out = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if not d.startswith((".", "venv"))
                         and not d.endswith(".egg-info")
                         and d not in ("node_modules", "__pycache__", "build", "dist"))
    out += [os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".md")]
  return out


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
  if args.list:
    print("\n".join(f"{name}: {', '.join(files)}" for name, (_, files) in sorted(BLOCKS.items())))
    return 0
  stale, blocks = [], 0
  try:
    if args.print_block:
      print(render_block(args.print_block, os.path.join(ROOT, "README.md")))
      return 0
    for path in args.files or markdown_files():
      with open(path) as fh:
        new, changed = rewrite(fh.read(), path)
      blocks += len(BLOCK_RE.findall(new))
      rel = os.path.relpath(path, ROOT)
      if changed and args.check:
        stale.append("\n".join(diff for _, diff in changed))
      elif changed:
        with open(path, "w") as fh:
          fh.write(new)
        print(f"{rel}: rewrote {', '.join(name for name, _ in changed)}")
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
