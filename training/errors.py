"""The trainer's error types and exit status for bad input, importable by every training
module without importing another."""

import contextlib

#: Exit status of train.py, generate.py and evaluate.py for a bad flag, config or input.
EXIT_USAGE = 2


class ConfigError(ValueError):
  """A setting that cannot work; raised before any compilation."""


class UsageError(ValueError):
  """Bad command-line input to a script (a prompt, a length, a workdir without a
  checkpoint): reported in one line, exit status :data:`EXIT_USAGE`, before anything
  compiles."""


@contextlib.contextmanager
def reraise_as(error: type[Exception], prefix: str = "", catch=ValueError, suffix: str = ""):
  """Inside: a ``catch`` exception re-raised as ``error(prefix + its message + suffix)``,
  without the original's chain (the line a script prints)."""
  try:
    yield
  except catch as e:
    raise error(f"{prefix}{e}{suffix}") from None
