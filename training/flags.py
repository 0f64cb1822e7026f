"""Flags and gin syntax onto the run's ConfigDict, and the start of the scripts' ``main``.

There is one source of truth for settings: the ``ml_collections.ConfigDict``
returned by ``configs/<name>.py:get_config(arg)``. Gin files and ``--gin_param``
bindings are only another *syntax* for overriding fields of that ConfigDict
(``model.num_layers = 4`` sets ``config.model.num_layers``); nothing is
registered as a gin configurable and gin holds no settings of its own.
:func:`start_script` is what generate.py and evaluate.py do before anything
else (stray arguments, log verbosity, simulated CPU devices for the mesh).
"""

from __future__ import annotations

import os
import sys
from typing import Any, Iterable, Sequence

import ml_collections

from training import mesh as mesh_lib
from training.errors import EXIT_USAGE, ConfigError


class _RejectingDelegate:
  """Gin parser delegate: ``@references`` and ``%macros`` have no ConfigDict meaning."""

  def configurable_reference(self, name, evaluate):
    raise ConfigError(
        f"gin reference '@{name}' is not supported: gin bindings here only override "
        "ConfigDict fields with literal values (e.g. `model.num_layers = 4`).")

  def macro(self, name):
    raise ConfigError(
        f"gin macro '%{name}' is not supported: gin bindings here only override ConfigDict "
        "fields with literal values.")


def parse_gin_bindings(text: str, source: str = "<gin_param>") -> list[tuple[str, Any]]:
  """Parses gin binding syntax into ``(dotted.config.path, value)`` pairs.

  ``model.num_layers = 4`` -> ``("model.num_layers", 4)``;
  ``optim.lr = 1e-3`` -> ``("optim.lr", 0.001)``. A top-level field is written
  with the ``config.`` prefix (``config.total_steps = 100``) because a gin
  binding always needs a ``selector.name`` pair. ``include 'other.gin'`` is
  followed relative to the including file.
  """
  from gin import config_parser  # Imported lazily: only needed when gin is used.

  parser = config_parser.ConfigParser(text, _RejectingDelegate())
  out: list[tuple[str, Any]] = []
  for statement in parser:
    if isinstance(statement, config_parser.BindingStatement):
      if statement.scope:
        raise ConfigError(
            f"{source}: gin scopes ('{statement.scope}/...') are not supported; bind the "
            "ConfigDict field directly, e.g. `model.num_layers = 4`.")
      selector = statement.selector
      if selector == "config":
        path = statement.arg_name
      elif selector.startswith("config."):
        path = f"{selector[len('config.'):]}.{statement.arg_name}"
      else:
        path = f"{selector}.{statement.arg_name}"
      out.append((path, statement.value))
    elif isinstance(statement, config_parser.IncludeStatement):
      base = os.path.dirname(source) if os.path.exists(source) else os.getcwd()
      inc = statement.filename
      inc = inc if os.path.isabs(inc) else os.path.join(base, inc)
      with open(inc) as f:
        out.extend(parse_gin_bindings(f.read(), inc))
    else:
      raise ConfigError(
          f"{source}: unsupported gin statement {type(statement).__name__}; only "
          "`field.path = value` bindings and `include` are accepted.")
  return out


def apply_overrides(config: ml_collections.ConfigDict,
                    overrides: Iterable[tuple[str, Any]]) -> ml_collections.ConfigDict:
  """Sets dotted paths on ``config``; unknown fields and wrong types raise ConfigError."""
  for path, value in overrides:
    *parents, leaf = path.split(".")
    node = config
    for i, name in enumerate(parents):
      if name not in node:
        raise ConfigError(f"gin binding `{path}`: config has no field "
                          f"'{'.'.join(parents[:i + 1])}'.")
      node = node[name]
    if not isinstance(node, ml_collections.ConfigDict) or leaf not in node:
      raise ConfigError(f"gin binding `{path}`: config has no field '{path}'. Known fields "
                        f"here: {sorted(node.keys()) if hasattr(node, 'keys') else '-'}.")
    if isinstance(value, list):
      value = tuple(value)
    try:
      node[leaf] = value
    except TypeError as e:  # ConfigDict's type safety: an int field cannot take a str.
      raise ConfigError(f"gin binding `{path} = {value!r}`: {e}") from None
  return config


def apply_gin(config: ml_collections.ConfigDict, gin_files: Sequence[str] = (),
              gin_params: Sequence[str] = ()) -> ml_collections.ConfigDict:
  """Applies gin files, then gin parameter strings, onto ``config`` (in that order)."""
  for path in gin_files:
    if not os.path.exists(path):
      raise ConfigError(f"--gin_file {path!r} does not exist.")
    with open(path) as f:
      apply_overrides(config, parse_gin_bindings(f.read(), path))
  for text in gin_params:
    apply_overrides(config, parse_gin_bindings(text))
  return config


def start_script(argv: Sequence[str], script_flags: dict) -> dict:
  """The start of generate.py's and evaluate.py's ``main``: no stray arguments (else one
  line, exit :data:`EXIT_USAGE`), Orbax's INFO logs off unless ``-v``, and enough CPU
  devices for ``--config``'s mesh. Returns ``{flag name: value}`` of ``script_flags``."""
  from absl import flags
  from absl import logging

  if len(argv) > 1:
    print(f"error: unexpected arguments {list(argv[1:])}; flags are written --name=value.",
          file=sys.stderr)
    sys.exit(EXIT_USAGE)
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  values = {name: flag.value for name, flag in script_flags.items()}
  mesh_lib.simulate_cpu_devices(values["config"])
  return values
