r"""Writes docs/api.md: every public name of ``ring_jax`` (its ``__all__``), from the code.

  python scripts/api_doc.py           # writes docs/api.md
  python scripts/api_doc.py --check   # exit 1 with a unified diff if docs/api.md is stale

Each entry is the name, its signature (classes: the constructor's; constants: their type
and value), the first paragraph of its docstring and a link to its source file. Constants
have no docstring of their own: their text is the ``#:`` comment above their assignment
(Sphinx's convention), found in the module ``ring_jax/__init__.py`` imports them from.

:data:`SECTIONS` places every name on the page; a name of ``ring_jax.__all__`` that no
section lists, or a listed name that is not exported, is an error (:func:`check_sections`),
so a new export cannot be left off the page. ``tests/docs/test_api_doc.py`` checks the page.

The page must read the same on every supported Python and jax: annotations are rendered
from their source text (``from __future__ import annotations``), never from reprs of
evaluated types, with the module prefixes of class names dropped (``jax.Array`` ->
``Array``, ``jax.lax.Precision`` -> ``Precision``; ``np.ndarray`` keeps its ``np.``);
defaults are literals, and any other object is written by its name (never a repr with an
address); source links name the file, not line numbers.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import enum
import inspect
import os
import re
import sys
import typing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # `python scripts/api_doc.py` puts scripts/ first, not the root
  sys.path.insert(0, ROOT)

import ring_jax  # noqa: E402

PAGE = os.path.join(ROOT, "docs", "api.md")
WIDTH = 88  # a signature longer than this is written one parameter per line

# (title, what the section is for, the names in the order a user reads them).
SECTIONS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("Attention on global arrays",
     "Call these on global ``[B, L, N, H]`` arrays (sharded or not): they build the "
     "``jax.shard_map`` for you.",
     ("attention_sharded", "ring_attention_sharded", "STRATEGIES", "flax_attention_fn",
      "attention_axes", "AttentionAxes")),
    ("Inside shard_map",
     "Call these inside ``jax.shard_map`` on the local sequence shards, in ``layout`` "
     "order; each computes the same exact attention.",
     ("ring_attention", "two_level_ring_attention", "all_gather_attention",
      "ulysses_attention", "hybrid_attention")),
    ("Layouts",
     "How tokens are placed on the ring's devices: reorder a global array before sharding "
     "it, or a shard inside ``shard_map``, and the positions each device holds.",
     ("LAYOUTS", "to_layout", "from_layout", "layout_positions", "local_positions",
      "shard_to_layout", "shard_from_layout", "document_layout", "DocumentLayout")),
    ("Planning",
     "Which strategy to run and what it costs (host-side, nothing compiled), and which "
     "block pairs a ring computes.",
     ("plan", "Plan", "schedule", "Schedule")),
    ("Hop kernels (the per-hop seam)",
     "The kernel one ring hop runs, chosen by name with ``hop_kernel=``, or your own "
     "object implementing ``HopKernel``.",
     ("HOP_KERNELS", "get_hop_kernel", "HopKernel", "XlaHopKernel", "HopSpec", "HopMasks")),
    ("Reference and helpers",
     "A dense oracle to check results against, and a memory-saving feed-forward.",
     ("reference_attention", "blockwise_ffn")),
)


class SectionsError(ValueError):
  """SECTIONS and ``ring_jax.__all__`` disagree."""


def check_sections(sections=SECTIONS, exported=None) -> None:
  """Raises :class:`SectionsError` unless every exported name is listed exactly once."""
  exported = list(ring_jax.__all__ if exported is None else exported)
  listed = [name for _, _, names in sections for name in names]
  problems = []
  missing = sorted(set(exported) - set(listed))
  if missing:
    problems.append(f"exported by ring_jax.__all__ but in no section: {missing}")
  extra = sorted(set(listed) - set(exported))
  if extra:
    problems.append(f"listed in a section but not in ring_jax.__all__: {extra}")
  twice = sorted({name for name in listed if listed.count(name) > 1})
  if twice:
    problems.append(f"listed in more than one place: {twice}")
  if problems:
    raise SectionsError("scripts/api_doc.py SECTIONS and ring_jax.__all__ disagree: "
                        + "; ".join(problems) + ". Edit SECTIONS in scripts/api_doc.py.")


# -- signatures ------------------------------------------------------------------------

_MODULE_PREFIX = re.compile(r"\b(?:[A-Za-z_]\w*\.)+(?=[A-Z])")


def _annotation(annotation) -> str:
  """Source text of an annotation, without the module prefixes of class names."""
  if isinstance(annotation, typing.ForwardRef):
    text = annotation.__forward_arg__
  elif isinstance(annotation, str):
    text = annotation
  elif isinstance(annotation, type):
    text = annotation.__qualname__
  else:  # an evaluated typing construct: not expected under future annotations
    text = repr(annotation).replace("typing.", "")
  while len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
    text = text[1:-1]  # "'Routes | None'": a quoted annotation inside a string
  return _MODULE_PREFIX.sub("", text)


def _default(value) -> str:
  """A default value written the same on every Python and jax (no addresses)."""
  if value is None or isinstance(value, (bool, int, float, str, bytes)):
    return repr(value)
  if isinstance(value, enum.Enum):
    return f"{type(value).__name__}.{value.name}"
  if isinstance(value, tuple):
    items = [_default(v) for v in value]
    return f"({items[0]},)" if len(items) == 1 else f"({', '.join(items)})"
  if isinstance(value, list):
    return f"[{', '.join(_default(v) for v in value)}]"
  name = getattr(value, "__qualname__", None) or getattr(value, "__name__", None)
  return name if name else f"<{type(value).__name__}>"


def _parameters(signature: inspect.Signature) -> list[str]:
  """The parameters as written in a ``def``, with the ``/`` and ``*`` markers."""
  parts, star_done = [], False
  params = list(signature.parameters.values())
  for i, p in enumerate(params):
    if p.kind is p.KEYWORD_ONLY and not star_done:
      parts.append("*")
      star_done = True
    text = p.name
    if p.kind is p.VAR_POSITIONAL:
      text, star_done = "*" + text, True
    elif p.kind is p.VAR_KEYWORD:
      text = "**" + text
    if p.annotation is not p.empty:
      text += f": {_annotation(p.annotation)}"
    if p.default is not p.empty:
      text += (" = " if p.annotation is not p.empty else "=") + _default(p.default)
    parts.append(text)
    last_positional_only = p.kind is p.POSITIONAL_ONLY and (
        i + 1 == len(params) or params[i + 1].kind is not p.POSITIONAL_ONLY)
    if last_positional_only:
      parts.append("/")
  return parts


def _call(head: str, parts: list[str], tail: str = "", indent: str = "") -> str:
  """``head(parts)tail`` on one line if it fits in WIDTH, else one part per line."""
  line = f"{indent}{head}({', '.join(parts)}){tail}"
  if len(line) <= WIDTH or not parts:
    return line
  inner = "".join(f"{indent}    {part},\n" for part in parts)
  return f"{indent}{head}(\n{inner}{indent}){tail}"


def _function_signature(name: str, fn, indent: str = "", prefix: str = "") -> str:
  sig = inspect.signature(fn)
  tail = ""
  if sig.return_annotation is not sig.empty:
    tail = f" -> {_annotation(sig.return_annotation)}"
  return _call(prefix + name, _parameters(sig), tail, indent)


def _is_protocol(obj) -> bool:
  return isinstance(obj, type) and getattr(obj, "_is_protocol", False)


def _protocol_signature(name: str, cls) -> str:
  """``class Name(Protocol):`` with its annotated attributes and public methods."""
  lines = [f"class {name}(Protocol):"]
  for attr, annotation in inspect.get_annotations(cls).items():
    lines.append(f"    {attr}: {_annotation(annotation)}")
  for attr, member in vars(cls).items():
    if not attr.startswith("_") and inspect.isfunction(member):
      lines.append(_function_signature(attr, member, indent="    ", prefix="def "))
  return "\n".join(lines)


def _class_signature(name: str, cls) -> str:
  if _is_protocol(cls):
    return _protocol_signature(name, cls)
  return _call(f"class {name}", _parameters(inspect.signature(cls)))


# -- constants -------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Definition:
  path: str  # the source file, relative to ROOT
  annotation: str | None  # the assignment's annotation (source text), if any
  comment: str  # the ``#:`` lines above the assignment, joined


def _module_file(module: str) -> str:
  parts = module.split(".")
  package = os.path.join(ROOT, *parts, "__init__.py")
  return package if os.path.exists(package) else os.path.join(ROOT, *parts) + ".py"


def _imported_from(tree: ast.Module, name: str) -> str | None:
  for node in tree.body:
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      if any((alias.asname or alias.name) == name for alias in node.names):
        return node.module
  return None


def _constant_definition(name: str, module: str = "ring_jax") -> _Definition:
  """Where ``module``'s ``name`` is assigned, following ``from X import name``."""
  path = _module_file(module)
  with open(path) as f:
    source = f.read()
  tree = ast.parse(source)
  lines = source.splitlines()
  for node in tree.body:
    targets = (node.targets if isinstance(node, ast.Assign)
               else [node.target] if isinstance(node, ast.AnnAssign) else [])
    if any(isinstance(t, ast.Name) and t.id == name for t in targets):
      comment, row = [], node.lineno - 2  # the line above the assignment (0-based)
      while row >= 0 and lines[row].lstrip().startswith("#:"):
        comment.insert(0, lines[row].lstrip()[2:].strip())
        row -= 1
      annotation = (ast.get_source_segment(source, node.annotation)
                    if isinstance(node, ast.AnnAssign) else None)
      return _Definition(os.path.relpath(path, ROOT), annotation, " ".join(comment))
  origin = _imported_from(tree, name)
  if origin is None:
    raise LookupError(f"{name}: no assignment or import of it in {path}")
  return _constant_definition(name, origin)


def _constant_type(value) -> str:
  if isinstance(value, tuple) and value and all(isinstance(v, str) for v in value):
    return "tuple[str, ...]"
  return type(value).__name__


def _constant_signature(name: str, value, annotation: str | None) -> str:
  head = f"{name}: {_MODULE_PREFIX.sub('', annotation) if annotation else _constant_type(value)}"
  if isinstance(value, dict):  # a registry: its keys (the values are factories)
    items = [f"{_default(k)}: ..." for k in value]
    text = f"{head} = {{{', '.join(items)}}}"
    if len(text) > WIDTH:
      text = f"{head} = {{\n" + "".join(f"    {item},\n" for item in items) + "}"
    return text
  text = f"{head} = {_default(value)}"
  if len(text) > WIDTH and isinstance(value, (tuple, list)):
    open_, close = "()" if isinstance(value, tuple) else "[]"
    text = (f"{head} = {open_}\n" + "".join(f"    {_default(v)},\n" for v in value) + close)
  return text


# -- docstrings ------------------------------------------------------------------------

_ROLE = re.compile(r":[a-z]+:`(?P<short>~?)(?P<target>[^`]+)`")


def first_paragraph(doc: str) -> str:
  """The first paragraph of a docstring as one line of Markdown."""
  paragraph = inspect.cleandoc(doc).strip().split("\n\n")[0]
  text = " ".join(paragraph.split())
  # :func:`x` -> `x`; :class:`~a.b.C` -> `C` (Sphinx's ~: the last component)
  text = _ROLE.sub(lambda m: "``" + (m["target"].rsplit(".", 1)[-1] if m["short"]
                                     else m["target"]) + "``", text)
  return text.replace("``", "`")


def _own_doc(obj) -> str | None:
  """The object's own docstring: not one inherited from a base class or ``object``."""
  if isinstance(obj, type):
    return obj.__dict__.get("__doc__")
  return getattr(obj, "__doc__", None)


# -- the page --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Entry:
  name: str
  signature: str
  summary: str  # first paragraph of the docstring, Markdown
  source: str  # the source file, relative to ROOT


def entry(name: str) -> Entry:
  """The page's entry for ``ring_jax.<name>``."""
  obj = getattr(ring_jax, name)
  if inspect.isclass(obj) or inspect.isfunction(inspect.unwrap(obj)):
    source = os.path.relpath(inspect.getsourcefile(inspect.unwrap(obj)), ROOT)
    if inspect.isclass(obj):
      signature = _class_signature(name, obj)
    else:
      signature = _function_signature(name, obj)
    doc = _own_doc(obj)
    where = "a docstring"
  else:
    definition = _constant_definition(name)
    source, doc = definition.path, definition.comment
    signature = _constant_signature(name, obj, definition.annotation)
    where = "a '#:' comment on the line(s) above its assignment"
  if not doc or not doc.strip():
    raise ValueError(f"ring_jax.{name} has no documentation: give it {where} ({source}).")
  return Entry(name, signature, first_paragraph(doc), source.replace(os.sep, "/"))


def _anchor(title: str) -> str:
  """GitHub's anchor for a heading."""
  return re.sub(r"[^a-z0-9 _-]", "", title.lower()).replace(" ", "-")


INTRO = """\
# API reference

Every public name of `ring_jax` (its `__all__`): the signature, the first paragraph of
the docstring and the source file, where the rest of the docstring (arguments, shapes,
errors) is. Generated by `python scripts/api_doc.py` from the code; do not edit by hand
(`python scripts/api_doc.py --check` and `tests/docs/test_api_doc.py` fail when this page and
the code disagree). Signatures drop the module of a class name (`Array` is `jax.Array`,
`Precision` is `jax.lax.Precision`); `[B, L, N, H]` is (batch, sequence, heads, head dim).

Everything is imported from the package itself; `ring_jax` needs JAX and numpy only
(`flax_attention_fn` plugs into Flax without importing it):

```python
import ring_jax
from ring_jax import attention_sharded, ring_attention, plan, reference_attention
```
"""


def render() -> str:
  """The page, from ``ring_jax.__all__`` and :data:`SECTIONS`."""
  check_sections()
  out = [INTRO]
  out.append("Sections:\n")
  for title, _, names in SECTIONS:
    out.append(f"- [{title}](#{_anchor(title)}): " + ", ".join(f"`{n}`" for n in names))
  for title, about, names in SECTIONS:
    out.append(f"\n## {title}\n\n{about.replace('``', '`')}")
    for name in names:
      e = entry(name)
      out.append(f"\n### `{e.name}`\n\n```text\n{e.signature}\n```\n\n{e.summary}\n\n"
                 f"Source: [{e.source}](../{e.source})")
  return "\n".join(out) + "\n"


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--check", action="store_true",
                      help="exit 1 with a diff if docs/api.md differs from the code")
  args = parser.parse_args(argv)
  text = render()
  if args.check:
    try:
      with open(PAGE) as f:
        current = f.read()
    except FileNotFoundError:
      current = ""
    if current == text:
      return 0
    sys.stdout.writelines(difflib.unified_diff(
        current.splitlines(keepends=True), text.splitlines(keepends=True),
        "docs/api.md", "docs/api.md (from the code)"))
    print("\ndocs/api.md is out of date: run `python scripts/api_doc.py`.", file=sys.stderr)
    return 1
  with open(PAGE, "w") as f:
    f.write(text)
  print(f"wrote {os.path.relpath(PAGE)}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
