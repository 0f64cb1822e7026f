"""Flags and gin syntax onto the run's ConfigDict, and the start of the scripts' ``main``.

The ``ml_collections.ConfigDict`` of ``configs/<name>.py:get_config(arg)`` holds every
setting: gin files and ``--gin_param`` bindings are only another syntax for overriding its
fields (``model.num_layers = 4``); nothing is a gin configurable.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Iterable, Sequence

import ml_collections

from training import mesh as mesh_lib
from training.errors import EXIT_USAGE, ConfigError, reraise_as
from training.supervisor import flag_value


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
  """Gin bindings -> ``(dotted.config.path, value)`` pairs: ``model.num_layers = 4`` ->
  ``("model.num_layers", 4)``; a top-level field is ``config.total_steps = 100``;
  ``include 'other.gin'`` is read relative to the including file."""
  from gin import config_parser  # Imported lazily: only needed when gin is used.

  parser = config_parser.ConfigParser(text, _RejectingDelegate())
  out: list[tuple[str, Any]] = []
  for statement in parser:
    if isinstance(statement, config_parser.BindingStatement):
      if statement.scope:
        raise ConfigError(
            f"{source}: gin scopes ('{statement.scope}/...') are not supported; bind the "
            "ConfigDict field directly, e.g. `model.num_layers = 4`.")
      path = f"{statement.selector}.{statement.arg_name}".removeprefix("config.")
      out.append((path, statement.value))
    elif isinstance(statement, config_parser.IncludeStatement):
      base = os.path.dirname(source) if os.path.exists(source) else os.getcwd()
      inc = os.path.join(base, statement.filename)  # an absolute filename stays as it is
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
    # ConfigDict's type safety: an int field cannot take a str.
    with reraise_as(ConfigError, f"gin binding `{path} = {value!r}`: ", catch=TypeError):
      node[leaf] = value
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
  """The start of generate.py's and evaluate.py's ``main``: no stray arguments, INFO logs
  off unless ``-v``, CPU devices for ``--config``'s mesh; returns ``{flag name: value}``."""
  from absl import flags
  from absl import logging

  if len(argv) > 1:
    fail(EXIT_USAGE, f"error: unexpected arguments {list(argv[1:])}; flags are written "
                     "--name=value.")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  values = {name: flag.value for name, flag in script_flags.items()}
  mesh_lib.simulate_cpu_devices(values["config"])
  return values


def fail(status: int, message: str) -> None:
  """Ends the script with ``message``, one line on stderr, and exit status ``status``."""
  print(message, file=sys.stderr, flush=True)
  sys.exit(status)


def quiet_orbax() -> None:
  """train.py without ``-v``: INFO logs off, and Orbax's tracebacks of a failed background
  save (the run reports it in one line) and of a failed read."""
  from absl import flags
  from absl import logging

  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
    logging.get_absl_logger().addFilter(_drop_orbax_tracebacks)
    from training import checkpoint as ckpt_lib  # Local: Orbax only where a run needs it.
    ckpt_lib.drop_failed_read_leftovers()


def _drop_orbax_tracebacks(record) -> bool:
  """Logging filter: keep Orbax's error lines, drop the tracebacks attached to them."""
  if record.exc_info and f"{os.sep}orbax{os.sep}" in record.pathname:
    record.exc_info, record.exc_text = None, None
  return True


def _unknown_field(argv, name: str) -> str:
  """The dotted path, as the command line wrote it, of the unknown config field ``name``."""
  for arg in argv:
    if arg.startswith("--config."):
      parts = arg[len("--config."):].split("=", 1)[0].split(".")
      if name in parts:
        return ".".join(parts[:parts.index(name) + 1])
  return name


def parse_flags(argv: list[str], default_config: str) -> list[str]:
  """absl flag parsing that reports a bad flag or config in one line, exit status 2
  (``--config`` is ``default_config`` when not given)."""
  from absl import flags

  argv = list(argv)
  if flag_value(argv, "config") is None:  # The default, before any --config.* override.
    argv[1:1] = ["--config", default_config]
    sys.argv[:] = argv  # ml_collections reads its overrides from sys.argv.
  path = flag_value(argv, "config").split(":", 1)[0]
  if not os.path.isfile(path):
    fail(EXIT_USAGE, f"config error: --config file {path!r} does not exist; pass a config "
                     "file such as configs/tiny.py.")
  try:
    return flags.FLAGS(argv)
  except Exception as e:  # absl flag errors, and whatever the config file or an override raised
    if isinstance(e, AttributeError) and e.args and isinstance(e.args[0], KeyError):
      e = e.args[0]  # ml_collections: an unknown field below the top (--config.data.seqlen)
    text = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
    lines = [l.strip() for l in text.strip().splitlines() if l.strip()]
    if isinstance(e, KeyError) and lines:  # ConfigDict: "'modell'\nDid you mean ...?"
      field = _unknown_field(argv, lines[0].strip("'"))
      lines[0] = f"the config has no field {field!r}."
    # Tracebacks embedded in the message (ml_collections does that): keep the last line.
    message = lines[-1] if any(l.startswith("Traceback") for l in lines) else " ".join(lines)
    fail(EXIT_USAGE, f"config error: {message} (see --helpfull for the flags; config fields "
                     "are listed in configs/common.py)")
