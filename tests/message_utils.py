"""Assertions on the one-line messages a user reads: the facts a line states (names,
numbers, paths, commands), in order, rather than the sentence around them."""

import re


def assert_states(line: str, *facts: str, starts_with: str = "", ends_with: str = "") -> None:
  """``line`` is one line that starts with ``starts_with``, names each of ``facts`` as whole
  words (not inside a longer name, number or path) in this order, and ends with
  ``ends_with`` (say, the command to paste), however it is worded around them."""
  assert "\n" not in line, line
  assert line.startswith(starts_with) and line.endswith(ends_with), (starts_with, ends_with, line)
  pattern = ".*?".join(rf"(?<![\w/.]){re.escape(f)}(?![\w/])" for f in facts)
  assert re.search(pattern, line), (facts, line)
