"""The repository's line-length rule: no line of a .py file is longer than 100 characters.

The files are those git tracks, plus untracked ones it does not ignore (a new module counts
before it is added). One kind of line is exempt: a comment holding nothing but a link (a
Markdown link ``[text](url)`` or a bare URL, as in the jupytext notebook's Markdown cells),
which cannot be wrapped without breaking it.
"""

import os
import re
import subprocess

import pytest

# Reads text files only: the rule does not depend on the jax version (leg 1 of .ci/run).
pytestmark = pytest.mark.leg1_only

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
MAX_LINE = 100
LINK_ONLY = re.compile(r"^\s*#:?\s*(\[.*\]\(\S+://\S*\)|<?\S+://\S*>?)\s*$")


def python_files(root: str = ROOT) -> list[str]:
  """Repository-relative paths of the .py files git tracks or would track under ``root``."""
  out = subprocess.run(
      ["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", "*.py"],
      cwd=root, capture_output=True, text=True, check=True).stdout
  return sorted(p for p in set(out.splitlines()) if os.path.isfile(os.path.join(root, p)))


def long_lines(text: str, limit: int = MAX_LINE) -> list[tuple[int, int]]:
  """``(line number, length)`` of each line of ``text`` longer than ``limit`` characters,
  link-only comment lines excepted."""
  return [(i, len(line)) for i, line in enumerate(text.splitlines(), 1)
          if len(line) > limit and not LINK_ONLY.match(line)]


@pytest.mark.parametrize("line,flagged", [
    ("x" * MAX_LINE, False),
    ("x" * (MAX_LINE + 1), True),
    ("  # " + "word " * 30, True),
    ("# [docs/guide.md](https://example.com/" + "a" * 90 + ".md)", False),
    ("# [![Open In Colab](https://example.com/badge.svg)](https://example.com/" + "a" * 90 + ")",
     False),
    ("# see [docs/guide.md](https://example.com/" + "a" * 90 + ".md) for more", True),
    ("url = 'https://example.com/" + "a" * 90 + "'", True),
])
def test_long_lines_flags_lines_over_the_limit(line, flagged):
  text = f"first line\n{line}\nlast line\n"
  assert long_lines(text) == ([(2, len(line))] if flagged else [])


def test_python_files_lists_tracked_sources():
  files = python_files()
  for path in ("train.py", "ring_jax/__init__.py", "tests/docs/test_style.py",
               "notebooks/ring_attention_colab.py"):
    assert path in files


def test_no_python_line_is_longer_than_100_characters():
  found = []
  for path in python_files():
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
      found += [f"{path}:{i}: {n} characters" for i, n in long_lines(f.read())]
  assert not found, (f"{len(found)} line(s) longer than {MAX_LINE} characters:\n"
                     + "\n".join(found))
