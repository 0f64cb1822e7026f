"""The trainer's error types and exit status for bad input, in a module of their own so that
every training module can raise them without importing another's (``training.validation``
imports ``training.stages``, which raises :class:`ConfigError`)."""

#: Exit status of train.py, generate.py and evaluate.py for a bad flag, config or input.
EXIT_USAGE = 2


class ConfigError(ValueError):
  """A setting that cannot work; raised before any compilation."""


class UsageError(ValueError):
  """Bad command-line input to a script (a prompt, a length, a workdir without a
  checkpoint): reported in one line, exit status :data:`EXIT_USAGE`, before anything
  compiles."""
