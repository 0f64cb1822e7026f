"""benchmarks/report.py: every quoted figure equals what its result file gives (pure JSON and
strings: no jax, nothing compiled)."""

import json
import os
import re
import shutil

import pytest

from benchmarks import report

ROOT = report.ROOT


def test_check_passes_on_the_repository(capsys):
  """Every block in every *.md with blocks (README.md and docs/ included) is up to date."""
  assert report.main(["--check"]) == 0, capsys.readouterr().out


def test_every_block_renders_and_names_its_result_files():
  for name, (_, files) in report.BLOCKS.items():
    assert files, name
    text = report.render_block(name, os.path.join(ROOT, "README.md"))
    assert text and report.LINK_ROOT not in text, name
    for f in files:
      assert os.path.exists(os.path.join(report.RESULTS, f)), (name, f)


def test_docs_quote_the_blocks():
  """docs/benchmarks.md holds every block but none other than the registry's."""
  with open(os.path.join(ROOT, "docs", "benchmarks.md")) as fh:
    names = {m.group("name") for m in report.BLOCK_RE.finditer(fh.read())}
  assert names <= set(report.BLOCKS)
  assert "headline" in names and "paper_4k" in names


def _write(tmp_path, text, name="page.md"):
  path = tmp_path / name
  path.write_text(text)
  return str(path)


def test_a_file_without_blocks_passes(tmp_path):
  path = _write(tmp_path, "# Nothing generated here\n\nA `<!-- report: x -->` in prose.\n")
  assert report.main(["--check", "--files", path]) == 0


def test_unknown_block_fails(tmp_path, capsys):
  path = _write(tmp_path, "<!-- report: no_such_block -->\n<!-- /report -->\n")
  assert report.main(["--check", "--files", path]) == 2
  assert "no_such_block" in capsys.readouterr().err


def test_unterminated_block_fails(tmp_path):
  path = _write(tmp_path, "<!-- report: paper_4k -->\ntext\n")
  assert report.main(["--check", "--files", path]) == 2


def test_missing_result_file_fails(tmp_path, monkeypatch, capsys):
  results = tmp_path / "results"
  shutil.copytree(report.RESULTS, results)
  os.remove(results / "balance_cpu.json")
  monkeypatch.setattr(report, "RESULTS", str(results))
  path = _write(tmp_path, "<!-- report: balance -->\n<!-- /report -->\n")
  assert report.main(["--check", "--files", path]) == 2
  assert "balance_cpu.json" in capsys.readouterr().err


def test_edited_number_is_caught_and_rewritten(tmp_path, capsys):
  docs = tmp_path / "docs"
  docs.mkdir()
  path = _write(docs, "intro\n\n<!-- report: paper_4k -->\n<!-- /report -->\n\nend\n")
  assert report.main(["--files", path]) == 0  # render
  assert report.main(["--check", "--files", path]) == 0
  text = open(path).read()
  assert "**0.78x**" in text and "intro\n\n" in text and text.endswith("\n\nend\n")
  open(path, "w").write(text.replace("**0.78x**", "**0.70x**", 1))
  capsys.readouterr()
  assert report.main(["--check", "--files", path]) == 1
  out = capsys.readouterr().out
  assert "page.md: block 'paper_4k'" in out
  assert "-| causal: fwd+bwd time vs paper | **0.70x**" in out
  assert report.main(["--files", path]) == 0  # rewritten wholesale
  assert open(path).read() == text


def test_links_are_relative_to_the_file(tmp_path):
  root = report.render_block("paper_4k", os.path.join(ROOT, "README.md"))
  docs = report.render_block("paper_4k", os.path.join(ROOT, "docs", "benchmarks.md"))
  assert "](benchmarks/results/attention_cpu_4k.json)" in root
  assert "](../benchmarks/results/attention_cpu_4k.json)" in docs


def test_figures_come_from_the_numbers():
  """Ratios are computed from the raw numbers of the file, not copied."""
  rows = report.load(report.PAPER_4K)["rows"]
  by = {(r["impl"], r["causal"]): r for r in rows}
  ratio = by[("ring-zigzag", True)]["fwdbwd_median_s"] / by[("paper", True)]["fwdbwd_median_s"]
  assert f"**{ratio:.2f}x**" in report.render_block("paper_4k", os.path.join(ROOT, "README.md"))
  assert report.tokens(9256960) == "9.26M" and report.tokens(583680) == "584K"
  assert report.length(655360) == "640K" and report.length(4718592) == "4.5M"
  assert report.sci(5.3e-7) == "5.3e-7"


@pytest.mark.parametrize("name", sorted(report.BLOCKS))
def test_captions_say_where_and_when(name):
  text = report.render_block(name, os.path.join(ROOT, "README.md"))
  assert "benchmarks/results/" in text
  if name != "headline":
    assert "<sub>Source" in text and ("jax " in text)


def _named_in_docs() -> str:
  text = []
  for path in report.markdown_files():
    with open(path) as fh:
      text.append(fh.read())
  return "\n".join(text)


def test_every_result_file_is_named_by_a_doc_or_a_block():
  """A file in benchmarks/results is quoted: named in a *.md or read by a report block (a
  run's console ``.log`` goes with its named ``.json``); provenance.json is report.py's own."""
  docs = _named_in_docs()
  read = {f for _, files in report.BLOCKS.values() for f in files}
  named = lambda f: f in read or re.search(rf"\b{re.escape(f)}\b", docs) is not None
  unnamed = [f for f in sorted(os.listdir(report.RESULTS)) if f != "provenance.json"
             and not named(f) and not (f.endswith(".log") and named(f[:-4] + ".json"))]
  assert unnamed == []


def test_every_result_file_the_docs_name_exists():
  """Every ``benchmarks/results/NAME`` in a *.md (a pattern like ``NAME_{a,b}.json`` aside)."""
  names = set(re.findall(r"benchmarks/results/([\w.\-]+\w)(?![\w{])", _named_in_docs()))
  missing = sorted(n for n in names if not os.path.exists(os.path.join(report.RESULTS, n)))
  assert missing == []


def test_a_block_declared_as_data(tmp_path, monkeypatch):
  """table_block: intro and cells as format strings with the report's units, a column as a
  function, the caption of the file; nothing but the table where no intro is given."""
  (tmp_path / "run.json").write_text(
      '{"ring": 8, "length": 65536, "rows": [{"config": "a+b", "temp_bytes": 3145728, "r": 0.5}]}')
  (tmp_path / "provenance.json").write_text("{}")
  monkeypatch.setattr(report, "RESULTS", str(tmp_path))
  monkeypatch.setattr(report, "BLOCKS", {})
  columns = [("config", "`{config}`"), ("temp MiB", "{temp_bytes:mib}"),
             ("ratio", lambda r: report.x(r["r"]))]
  report.table_block("demo", "run.json", rows=lambda d: d["rows"], align="-rr",
                     intro="Ring of {ring}, {length:len} tokens:", columns=columns)
  report.table_block("bare", "run.json", rows=lambda d: d["rows"], columns=columns[:1])
  caption = ("<sub>Source: [`run.json`](benchmarks/results/run.json): date not recorded, "
             "machine not recorded, jax not recorded.</sub>")
  readme = os.path.join(ROOT, "README.md")
  assert report.render_block("demo", readme) == (
      "Ring of 8, 64K tokens:\n\n| config | temp MiB | ratio |\n|---|---:|---:|\n"
      "| `a+b` | 3.0 | 0.50x |\n\n" + caption)
  assert report.render_block("bare", readme) == "| config |\n|---|\n| `a+b` |\n\n" + caption


def test_a_tpu_table_shows_the_configurations_that_compiled(tmp_path, monkeypatch):
  """tpu_overlap: per configuration of the one result file, its transfers in flight, per kind
  and temp; a configuration that raised (an ``error`` row) is left out."""
  (tmp_path / "tpu_overlap_v5p.json").write_text(json.dumps(dict(
      topology="v5p:2x2x1", length=32768, heads=8, head_dim=128, dtype="bfloat16",
      libtpu="0.0.42.1", rows=[
          dict(config="zigzag-causal", ring_in_flight=10, ring_transfers=10, temp_mib=406.2,
               kinds={"ring K/V": [6, 6], "ring dK/dV": [4, 4]}),
          dict(config="zigzag-causal+splash", error="ValueError: refused")])))
  (tmp_path / "provenance.json").write_text("{}")
  monkeypatch.setattr(report, "RESULTS", str(tmp_path))
  text = report.render_block("tpu_overlap", os.path.join(ROOT, "README.md"))
  assert text.split("\n\n")[1] == (
      "| configuration | in flight | per kind | temp MiB |\n|---|---:|---|---:|\n"
      "| `zigzag-causal` | 10 of 10 | K/V 6/6, dK/dV 4/4 | 406.2 |")
  assert text.startswith("`ring_attention_sharded` fwd+bwd compiled for v5p:2x2x1 (no TPU "
                         "attached), ring of 4 (two-level: 2 x 2), 32K tokens, 8 x 128 heads, ")
  assert text.endswith("Deviceless compiles with libtpu 0.0.42.1.</sub>")
