"""The trainer's error types and exit status for bad input, importable by every training
module without importing another."""

#: Exit status of train.py, generate.py and evaluate.py for a bad flag, config or input.
EXIT_USAGE = 2


class ConfigError(ValueError):
  """A setting that cannot work; raised before any compilation."""


class UsageError(ValueError):
  """Bad command-line input to a script (a prompt, a length, a workdir without a
  checkpoint): reported in one line, exit status :data:`EXIT_USAGE`, before anything
  compiles."""
