"""docs/api.md is what scripts/api_doc.py renders from the code, and covers ring_jax.__all__.

Fast: imports ring_jax and reads signatures and docstrings, compiles nothing.
"""

import os
import re

import pytest

import ring_jax
from scripts import api_doc

# The page renders our signatures and docstrings, whatever the jax: leg 1 of .ci/run.
pytestmark = pytest.mark.leg1_only

ENTRY = re.compile(r"^### `(?P<name>[^`]+)`\n\n```text\n(?P<signature>.*?)\n```\n\n"
                   r"(?P<summary>.*?)\n\nSource: \[[^]]+\]\(\.\./(?P<source>[^)]+)\)$",
                   re.MULTILINE | re.DOTALL)


@pytest.fixture(scope="module")
def page():
  with open(api_doc.PAGE) as f:
    return f.read()


def test_page_is_what_the_code_renders(page):
  assert page == api_doc.render(), (
      "docs/api.md differs from the code: run `python scripts/api_doc.py` "
      "(`python scripts/api_doc.py --check` shows the diff)")


def test_every_export_has_an_entry(page):
  names = [m["name"] for m in ENTRY.finditer(page)]
  assert sorted(names) == sorted(ring_jax.__all__)
  assert len(names) == len(set(names))


def test_every_entry_has_a_summary_and_a_source(page):
  for m in ENTRY.finditer(page):
    assert m["signature"].strip(), m["name"]
    assert m["summary"].strip() and "\n\n" not in m["summary"], m["name"]
    assert os.path.isfile(os.path.join(api_doc.ROOT, m["source"])), m["name"]


def test_sections_must_match_all():
  api_doc.check_sections()
  sections = api_doc.SECTIONS + (("New", "", ("not_exported",)),)
  with pytest.raises(api_doc.SectionsError, match=r"not in ring_jax.__all__: \['not_exported'\]"):
    api_doc.check_sections(sections)
  with pytest.raises(api_doc.SectionsError, match=r"in no section: \['new_export'\]"):
    api_doc.check_sections(exported=[*ring_jax.__all__, "new_export"])


def test_defaults_and_annotations_render_without_reprs():
  assert api_doc._default(object()) == "<object>"
  assert api_doc._default(len) == "len"
  assert api_doc._default(("a", 1, None)) == "('a', 1, None)"
  assert api_doc._annotation("jax.Array | None") == "Array | None"
  assert api_doc._annotation("'routing.Routes | None'") == "Routes | None"
  assert api_doc._annotation("np.ndarray") == "np.ndarray"


def test_first_paragraph_reads_as_markdown():
  doc = """Uses :func:`ring_jax.plan` and :class:`~ring_jax.hop.HopKernel` on ``[B, L]``
  arrays.

  More."""
  assert api_doc.first_paragraph(doc) == (
      "Uses `ring_jax.plan` and `HopKernel` on `[B, L]` arrays.")
