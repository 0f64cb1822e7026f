"""Every ```python block in docs/*.md runs, on the 8 fake CPU devices of tests/conftest.py.

The blocks of one guide run in order in one namespace (a guide reads top to
bottom, later blocks use names defined earlier). A block that cannot run here
(a TPU pod, several hosts, a long training run) is preceded by the marker

  <!-- docs-test: skip: <the reason> -->

and is then only compiled (syntax-checked); the reason must not be empty. Shell
commands go in ```bash blocks, which are not run. Relative links between the
docs, the README and the notebook must point at files that exist.
"""

import os
import re
import time

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
DOCS = os.path.join(ROOT, "docs")
GUIDES = sorted(f for f in os.listdir(DOCS) if f.endswith(".md"))
SKIP = re.compile(r"<!--\s*docs-test:\s*skip:\s*(?P<reason>.*?)\s*-->\s*$")
FENCE = re.compile(r"^(?P<indent> *)```(?P<info>[^`]*)$")
# placeholder org/repo, as in the notebook
GITHUB = "https://github.com/ring-jax/ring_jax/blob/main/"


def code_blocks(path):
  """``[(line, info, code, skip_reason)]`` for every fenced block of ``path``."""
  with open(path) as f:
    lines = f.read().splitlines()
  blocks, i = [], 0
  while i < len(lines):
    m = FENCE.match(lines[i])
    if not m:
      i += 1
      continue
    start, info, indent = i + 1, m["info"].strip(), len(m["indent"])
    j = i + 1
    while j < len(lines) and lines[j].strip() != "```":
      j += 1
    if j == len(lines):
      raise AssertionError(f"{path}:{start}: unclosed ``` fence")
    code = "\n".join(line[indent:] for line in lines[i + 1:j])
    prev = next((lines[p] for p in range(i - 1, -1, -1) if lines[p].strip()), "")
    skip = SKIP.match(prev.strip())
    blocks.append((start, info, code, skip["reason"] if skip else None))
    i = j + 1
  return blocks


def test_guides_exist():
  assert {"using_the_kernel.md", "training.md", "performance.md"} <= set(GUIDES)


@pytest.mark.parametrize("guide", GUIDES)
def test_fences_are_labelled_and_skips_have_reasons(guide):
  for line, info, _, reason in code_blocks(os.path.join(DOCS, guide)):
    assert info, f"{guide}:{line}: label the fence (```python, ```bash, ```text)"
    if reason is not None:
      assert info == "python", f"{guide}:{line}: only python blocks take a skip marker"
      assert len(reason) >= 10, f"{guide}:{line}: a skip marker needs a real reason"


@pytest.mark.parametrize("guide", GUIDES)
def test_python_blocks_run(guide):
  path = os.path.join(DOCS, guide)
  namespace = {"__name__": f"docs.{guide[:-3]}"}
  start = time.perf_counter()
  ran = 0
  for line, info, code, reason in code_blocks(path):
    if info != "python":
      continue
    compiled = compile(code, f"{path}:{line}", "exec")  # line numbers point into the guide
    if reason is None:
      exec(compiled, namespace)  # noqa: S102 - the docs are ours
      ran += 1
  print(f"{guide}: {ran} blocks in {time.perf_counter() - start:.1f}s")
  # A guide may hold no code (the generated API page, the benchmark figures); one that holds
  # python blocks must run at least one, so skip markers cannot hide a whole guide.
  has_python = any(info == "python" for _, info, _, _ in code_blocks(path))
  assert ran > 0 or not has_python, f"{guide}: every python block is skipped"


def test_relative_links_resolve():
  targets = [os.path.join(DOCS, g) for g in GUIDES] + [
      os.path.join(ROOT, "notebooks", "ring_attention_colab.py"),
      os.path.join(ROOT, "README.md"), os.path.join(ROOT, "benchmarks", "README.md")]
  link = re.compile(r"\]\((?P<target>[^)#\s]+)(#[^)]*)?\)")
  for path in targets:
    with open(path) as f:
      text = f.read()
    for m in link.finditer(text):
      target = m["target"]
      if target.startswith(GITHUB):  # a file of this repository, linked from Colab
        target = os.path.join(ROOT, target[len(GITHUB):])
      elif re.match(r"[a-z]+:", target):
        continue  # other web pages
      else:
        target = os.path.normpath(os.path.join(os.path.dirname(path), target))
      assert os.path.exists(target), f"{path}: broken link {m['target']}"


def test_readme_python_blocks_run():
  """The README's fences are labelled and closed, and its kernel example runs as written (on
  the 8 fake CPU devices)."""
  path = os.path.join(ROOT, "README.md")
  every = code_blocks(path)
  assert all(info for _, info, _, _ in every), "label every fence of the README"
  blocks = [(line, code) for line, info, code, _ in every if info == "python"]
  assert blocks, "the README lost its kernel example"
  # It says how to get its devices on a CPU: the flag tests/conftest.py sets to run it here.
  import jax
  stated = re.findall(r"XLA_FLAGS=(\S+)", blocks[0][1])
  assert stated == [f"--xla_force_host_platform_device_count={jax.device_count()}"], stated
  assert stated[0] in os.environ.get("XLA_FLAGS", "").split()
  namespace = {"__name__": "docs.README"}
  for line, code in blocks:
    exec(compile(code, f"{path}:{line}", "exec"), namespace)  # noqa: S102 - the README is ours
  assert namespace["out"].shape == namespace["q"].shape


# `docs/training.md, "Profiling"`, `README: "..."`: a file sending the reader to a section.
SECTION_REFERENCE = re.compile(
    r'(?P<doc>README(?:\.md)?|(?:docs|benchmarks)/[\w/.-]+\.md)[:,]?[ \t]+"(?P<section>[^"]+)"')


def _headings(path) -> list[str]:
  """The headings of a markdown file (outside its code blocks), without their #s."""
  with open(path) as f:
    lines = f.read().splitlines()
  inside = set()
  for start, _, code, _ in code_blocks(path):
    inside.update(range(start, start + code.count("\n") + 1))
  return [l.lstrip("#").strip() for i, l in enumerate(lines)
          if l.startswith("#") and i not in inside]


def test_quoted_sections_exist():
  """Every "see <doc>, "<section>"" in the repository's code, configs and docs names the start
  of a heading of that file (the README's Hugging Face parity section moved to
  docs/development.md once, and pyproject.toml kept pointing at it)."""
  sources = [os.path.join(ROOT, name) for name in ("pyproject.toml", "README.md",
                                                   os.path.join(".ci", "run"))]
  for top in ("benchmarks", "configs", "docs", "models", "ring_jax", "scripts", "tests",
              "training"):
    for directory, _, names in os.walk(os.path.join(ROOT, top)):
      sources += [os.path.join(directory, n) for n in names if n.endswith((".py", ".md"))]
  sources += [os.path.join(ROOT, n) for n in os.listdir(ROOT) if n.endswith(".py")]
  checked, broken = 0, []
  for source in sources:
    if not os.path.isfile(source) or source == os.path.abspath(__file__):  # its examples
      continue
    with open(source, encoding="utf-8") as f:
      text = f.read()
    for m in SECTION_REFERENCE.finditer(text):
      doc = "README.md" if m["doc"].startswith("README") else m["doc"]
      section = " ".join(m["section"].split())
      checked += 1
      if not any(h.startswith(section) for h in _headings(os.path.join(ROOT, doc))):
        broken.append(f"{os.path.relpath(source, ROOT)}: {m[0]!r}")
  assert checked >= 10 and not broken, broken
