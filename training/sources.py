"""Streamed document sources: ``.jsonl``/``.json``, ``.txt``, ``.parquet`` and ArrayRecord files.

A corpus is cut into spans (:class:`Span`), half-open ranges of one file's *units* (bytes of
line files, parquet rows, ArrayRecord records), measured without reading the file, then split
(:func:`split_spans`) and sharded (:func:`shard_spans`); a byte range owns every line that
*starts* inside it, so any cut gives each line to one reader. Parquet is read by row-group
batches (Grain's ``ParquetIterDataset`` reads whole files). docs/training.md, "Data", has the
formats, the bad records and the resume.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import glob
import itertools
import json
import os
from typing import Any, Iterator

import grain
import numpy as np
from absl import logging

#: Data file extension -> the kind of reader that reads it.
FILE_KINDS = {".jsonl": "lines", ".json": "lines", ".txt": "txt", ".parquet": "parquet",
              ".arrayrecord": "array_record", ".array_record": "array_record"}
DATA_EXTS = tuple(FILE_KINDS)

READ_BUFFER_BYTES = 1 << 20  # file read buffer of the line readers
TXT_PIECE_BYTES = 1 << 20  # a .txt document is tokenised in pieces of about this size
PARQUET_BATCH_ROWS = 1024  # rows decoded at a time from a parquet row group
ARRAY_RECORD_BATCH = 64  # records fetched at a time from an ArrayRecord file
# Pieces read ahead and tokenised in one native call: this many, or fewer once this much text.
ENCODE_BATCH, ENCODE_BATCH_BYTES = 32, 1 << 20
FIRST_LOCATIONS = 3  # locations kept (and printed) per kind of bad record

BAD_KINDS = {"invalid_json": "invalid JSON", "missing_field": "no string text field",
             "undecodable": "bytes that are not UTF-8", "empty": "an empty document"}


class DataError(ValueError):
  """A bad record with ``data.strict=True`` (or a shard with no usable document)."""


def file_kind(path: str) -> str:
  kind = FILE_KINDS.get(os.path.splitext(path)[1])
  if kind is None:
    raise ValueError(f"{path}: unknown data file type; known: {DATA_EXTS}")
  return kind


def list_data_files(path: str) -> list[str]:
  """The data files of ``data.path``, a file, a directory (searched recursively) or a glob,
  sorted; ValueError if there are none."""
  if os.path.isfile(path):
    return [path]
  pattern = os.path.join(path, "**", "*") if os.path.isdir(path) else os.path.expanduser(path)
  found = glob.glob(pattern, recursive=True)
  if not (files := sorted(f for f in found if os.path.isfile(f) and f.endswith(DATA_EXTS))):
    raise ValueError(f"data.path={path!r} matches no {'/'.join(DATA_EXTS)} files.")
  return files


def num_units(path: str) -> int:
  """Size of ``path`` in its units (bytes, parquet rows, ArrayRecord records), unread."""
  kind = file_kind(path)
  if kind in ("lines", "txt"):
    return os.path.getsize(path)
  if kind == "parquet":
    import pyarrow.parquet as pq
    return pq.ParquetFile(path).metadata.num_rows
  return len(grain.sources.ArrayRecordDataSource([path]))


@dataclasses.dataclass(frozen=True)
class Span:
  """Units ``[start, stop)`` of ``path``."""
  path: str
  start: int
  stop: int


def split_spans(files: list[str], eval_fraction: float, split: str) -> list[Span]:
  """The spans of ``split`` ('train' | 'eval'), which share no unit: of several files the last
  ``max(1, round(eval_fraction * files))`` are eval, of one file its last ``eval_fraction``."""
  if not files:
    raise ValueError("no data files")
  if len(files) > 1:
    num_eval = min(len(files) - 1, max(1, int(round(len(files) * eval_fraction))))
    chosen = files[:-num_eval] if split == "train" else files[-num_eval:]
    return [Span(f, 0, num_units(f)) for f in chosen]
  size = num_units(files[0])
  cut = min(max(int(size * (1 - eval_fraction)), 1), max(size - 1, 0))
  return [Span(files[0], 0, cut) if split == "train" else Span(files[0], cut, size)]


def shard_spans(spans: list[Span], index: int, count: int) -> list[Span]:
  """Shard ``index`` of ``count``: with at least ``count`` spans, span ``i`` goes to shard
  ``i % count``, else each span is cut in ``count`` equal unit ranges."""
  if not 0 <= index < count:
    raise ValueError(f"shard index {index} is not in [0, {count})")
  if len(spans) >= count:
    return spans[index::count]
  cut = lambda s, i: s.start + (s.stop - s.start) * i // count
  return [Span(s.path, cut(s, index), cut(s, index + 1)) for s in spans]


class BadRecords:
  """Counts of skipped records per kind, with the first locations of each."""

  def __init__(self, strict: bool, counts=None, first=None):
    self.strict = strict
    self.counts: dict[str, int] = dict(counts or {})
    self.first: dict[str, list[str]] = {k: list(v) for k, v in (first or {}).items()}

  def add(self, kind: str, location: str, detail: str = "", *, quiet: bool = False) -> None:
    what = BAD_KINDS[kind] + (f" ({detail})" if detail else "")
    if self.strict:
      raise DataError(f"{location}: {what}. data.strict=True stops at the first bad record; "
                      "fix or remove it, or set --config.data.strict=False to count and skip "
                      "bad records.")
    n = self.counts[kind] = self.counts.get(kind, 0) + 1
    if len(self.first.setdefault(kind, [])) < FIRST_LOCATIONS:
      self.first[kind].append(location)
    if not quiet and n & (n - 1) == 0 and (n.bit_length() - 1) % 3 == 0:  # 1, 8, 64, ...
      logging.warning("data: skipped %d record(s) with %s so far (first at %s)", n,
                      BAD_KINDS[kind], ", ".join(self.first[kind]))

  def summary(self) -> str:
    if not self.counts:
      return "no bad records"
    return "; ".join(f"{n} with {BAD_KINDS[k]} (first at {', '.join(self.first[k])})"
                     for k, n in sorted(self.counts.items()))

  def state(self) -> dict:
    return dict(counts=dict(self.counts), first={k: list(v) for k, v in self.first.items()})


# --- Readers: (text, is_first_piece, is_last_piece, location()) of one span, from an offset ---


class _Cursor:
  """Where a reader stands: unit offset, and lines read since the span start."""

  def __init__(self, span: Span, offset: int, line: int):
    self.span, self.offset, self.line = span, offset, line
    self._line_base = 0 if span.start == 0 else None

  def line_location(self, line: int) -> str:
    """``path:N`` of the ``line``-th line since the span start (N counts from 1 in the file)."""
    if self._line_base is None:  # Lazily, once: the lines starting before the span's first,
      end = self.span.start - 1  # the one at 0 and one after each newline in [0, end).
      with open(self.span.path, "rb") as f:
        self._line_base = 1 + sum(f.read(min(READ_BUFFER_BYTES, end - done)).count(b"\n")
                                  for done in range(0, end, READ_BUFFER_BYTES))
    return f"{self.span.path}:{self._line_base + line + 1}"


def _lines(cur: _Cursor) -> Iterator[tuple[int, bytes]]:
  """``(line number since the span start, bytes)`` of each line the span owns from
  ``cur.offset`` on (the first line starting there or after), advancing ``cur``."""
  with open(cur.span.path, "rb", buffering=READ_BUFFER_BYTES) as f:
    if cur.offset > 0:  # from the byte before: the rest of a line the range before owns
      f.seek(cur.offset - 1)
      cur.offset += len(f.readline()) - 1
    while cur.offset < cur.span.stop and (raw := f.readline()):
      cur.offset += len(raw)
      cur.line += 1
      yield cur.line - 1, raw


def _record(value, bad: BadRecords, where, missing) -> Iterator[tuple]:
  """The one piece of a record whose text is ``value``, a non-empty string (bytes: decoded as
  UTF-8), else none after counting why not at ``where()``; ``missing(value)`` details a
  value that is no string."""
  if isinstance(value, bytes):
    try:
      value = value.decode("utf-8")
    except UnicodeDecodeError as e:
      bad.add("undecodable", where(), str(e))
      return
  if not isinstance(value, str):
    bad.add("missing_field", where(), missing(value))
  elif not value:
    bad.add("empty", where())
  else:
    yield value, True, True, where


def _json_record(raw: bytes, field: str, bad: BadRecords, where) -> Iterator[tuple]:
  """:func:`_record` of the ``field`` text of one JSON record, or none after counting why it
  is bad at ``where()`` (computed for a bad one only)."""
  try:
    record = json.loads(raw.decode("utf-8"))
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    bad.add("undecodable" if isinstance(e, UnicodeDecodeError) else "invalid_json", where(), str(e))
    return
  yield from _record(record.get(field) if isinstance(record, dict) else None, bad, where,
                     lambda _: f"data.text_field={field!r}")


def _read_lines(cur: _Cursor, bad: BadRecords, field: str) -> Iterator[tuple]:
  for here, raw in _lines(cur):
    if raw.strip():  # a blank line is no record
      yield from _json_record(raw, field, bad, lambda here=here: cur.line_location(here))


def _read_txt(cur: _Cursor, bad: BadRecords, field=None) -> Iterator[tuple]:
  """A text file's pieces (it has no ``field``: the file is the document)."""
  first = cur.offset == cur.span.start  # Else resumed mid-document.
  emitted, lines, last = not first, _lines(cur), False
  while not last:
    piece, size, last = [], 0, True
    for here, raw in lines:
      size += len(raw)
      try:
        piece.append(raw.decode("utf-8"))
      except UnicodeDecodeError as e:
        bad.add("undecodable", cur.line_location(here), str(e))
      if size >= TXT_PIECE_BYTES:
        last = cur.offset >= cur.span.stop
        break
    text = "".join(piece)
    if text or (last and emitted):  # "" last: the previous piece ended at the end, EOS owed
      yield text, first, last, lambda line=cur.line: cur.line_location(line - 1)
      emitted, first = True, False
  if not emitted:
    bad.add("empty", cur.line_location(0))


def _read_parquet(cur: _Cursor, bad: BadRecords, field: str):
  import pyarrow.parquet as pq

  pf = pq.ParquetFile(cur.span.path)
  names, meta = pf.schema_arrow.names, pf.metadata
  if field in names:  # from the row group holding cur.offset on
    ends = np.cumsum([meta.row_group(g).num_rows for g in range(meta.num_row_groups)])
    first = int(np.searchsorted(ends, cur.offset, side="right"))
    row = int(ends[first - 1]) if first else 0
    values = itertools.chain.from_iterable(
        b.column(0).to_pylist() for b in pf.iter_batches(
            PARQUET_BATCH_ROWS, row_groups=list(range(first, meta.num_row_groups)),
            columns=[field]))
  else:  # each row is a record without the field
    row, values = cur.offset, itertools.repeat(None)
  missing = lambda value: f"data.text_field={field!r}" + (
      f" is {value!r:.40}" if field in names else f"; columns {names}")
  rows = range(cur.offset, cur.span.stop)  # the rows before cur.offset skipped
  for r, value in zip(rows, itertools.islice(values, cur.offset - row, None)):
    cur.offset = r + 1
    yield from _record(value, bad, lambda r=r: f"{cur.span.path}:row {r}", missing)


def _read_array_record(cur: _Cursor, bad: BadRecords, field: str):
  source = grain.sources.ArrayRecordDataSource([cur.span.path])
  while cur.offset < cur.span.stop:
    indices = list(range(cur.offset, min(cur.offset + ARRAY_RECORD_BATCH, cur.span.stop)))
    for i, raw in zip(indices, source.__getitems__(indices)):
      cur.offset = i + 1
      yield from _json_record(bytes(raw), field, bad, lambda i=i: f"{cur.span.path}:record {i}")


# File kind -> its reader: ``reader(cursor, bad records, text field)`` yields the pieces
# of the cursor's span from its offset on, advancing the cursor.
_READERS = {"lines": _read_lines, "txt": _read_txt, "parquet": _read_parquet,
            "array_record": _read_array_record}


# --- Grain dataset: tokenised documents of one shard, endless, checkpointable -----------------


class DocumentDataset(grain.IterDataset):
  """Tokenised documents (``{"tokens": int32[n]}``) of shard ``shard_index`` of ``shard_count``:
  epoch ``e`` reads this shard's spans (reshuffled with ``(seed, e)`` when ``shuffle``, the
  same on every process), forever when ``repeat``. The iterator's state is JSON-able (epoch,
  span, unit offset, bad-record counts): a restore seeks straight there."""

  def __init__(self, spans: list[Span], tokenizer, *, text_field: str = "text",
               shard_index: int = 0, shard_count: int = 1, shuffle: bool = False, seed: int = 0,
               repeat: bool = True, strict: bool = False):
    super().__init__()
    self.spans, self.tokenizer, self.text_field = list(spans), tokenizer, text_field
    self.shard_index, self.shard_count = shard_index, shard_count
    self.shuffle, self.seed, self.repeat, self.strict = shuffle, seed, repeat, strict
    shard_spans(self.spans, shard_index, shard_count)  # Validates the shard index.

  def epoch_spans(self, epoch: int) -> list[Span]:
    spans = self.spans
    if self.shuffle:
      order = np.random.default_rng([self.seed, epoch]).permutation(len(spans))
      spans = [spans[i] for i in order]
    return shard_spans(spans, self.shard_index, self.shard_count)

  def __iter__(self) -> "DocumentIterator":
    return DocumentIterator(self)

  def __str__(self) -> str:
    return f"DocumentDataset({len(self.spans)} spans, shard {self.shard_index}/{self.shard_count})"


class DocumentIterator(grain.DatasetIterator):
  """Reads pieces ``ENCODE_BATCH`` at a time, tokenises them in one call, yields one by one;
  each buffered document keeps the reader state from before it, so ``get_state()`` is exact."""

  def __init__(self, ds: DocumentDataset):
    super().__init__()
    self._ds = ds
    self.bad = BadRecords(ds.strict)
    self._buffer: collections.deque = collections.deque()  # (state before it, tokens)
    self._error: Exception | None = None  # the end or a DataError, once the buffer is out
    self._set(epoch=0, span=0)

  def _set(self, *, epoch, span, offset=None, line=0, epoch_docs=0):
    """Stand at ``offset`` (None: the start) of span ``span`` of epoch ``epoch``."""
    self._epoch, self._span, self._epoch_docs = epoch, span, epoch_docs
    self._spans = self._ds.epoch_spans(epoch)
    self._cursor = self._reader = None
    if self._span < len(self._spans):
      s = self._spans[self._span]
      self._cursor = _Cursor(s, s.start if offset is None else offset, line)
      self._reader = _READERS[file_kind(s.path)](self._cursor, self.bad, self._ds.text_field)

  def _read_piece(self):
    """(state before it, (text, first, last, location)) of the next piece; StopIteration."""
    while True:
      if self._cursor is None:  # End of this epoch's spans.
        if not self._ds.repeat:
          raise StopIteration
        if self._epoch_docs <= 0:  # Repeating an empty epoch would never return.
          raise DataError(
              f"data shard {self._ds.shard_index} of {self._ds.shard_count} holds no usable "
              f"document in {len(self._spans)} span(s) of {len(self._ds.spans)} "
              f"({self.bad.summary()}); add data or use fewer processes per data shard.")
        self._set(epoch=self._epoch + 1, span=0)
        continue
      before = self._reader_state()
      if (piece := next(self._reader, None)) is None:
        self._set(epoch=self._epoch, span=self._span + 1, epoch_docs=self._epoch_docs)
        continue
      self._epoch_docs += 1
      return before, piece

  def _fill(self) -> None:
    if self._error is not None:
      raise self._error
    entries, size = [], 0
    try:
      while len(entries) < ENCODE_BATCH and size < ENCODE_BATCH_BYTES:
        entries.append(self._read_piece())
        size += len(entries[-1][1][0])
    except (StopIteration, DataError) as e:  # raised once the documents read before it are out
      if not entries:
        raise
      self._error = e
    tokens = self._ds.tokenizer.encode_documents([p[:3] for _, p in entries])
    for i, ((before, (_, first, _, where)), ids) in enumerate(zip(entries, tokens)):
      if len(ids):
        self._buffer.append((before, ids))
      else:  # e.g. only whitespace, with a tokenizer that adds no BOS/EOS: not a document
        self._uncount(before["epoch"], first, where(), [b for b, _ in entries[i + 1:]])

  def _uncount(self, epoch: int, first: bool, location: str, later: list[dict]) -> None:
    """A piece empty once tokenised: out of the counts, here and in ``later`` states; a
    first piece is an empty document (a bad record)."""
    self._epoch_docs -= self._epoch == epoch
    if first:
      self.bad.add("empty", location)
    for state in later:
      state["epoch_docs"] -= state["epoch"] == epoch
      if first:
        bad = BadRecords(False, **state["bad_records"])
        bad.add("empty", location, quiet=True)
        state["bad_records"] = bad.state()

  def __next__(self) -> dict[str, Any]:
    while not self._buffer:
      self._fill()
    return {"tokens": self._buffer.popleft()[1]}

  def _reader_state(self) -> dict[str, Any]:
    cur = self._cursor
    return dict(epoch=self._epoch, span=self._span, offset=cur.offset if cur else 0,
                line=cur.line if cur else 0, epoch_docs=self._epoch_docs,
                bad_records=self.bad.state())

  def get_state(self) -> dict[str, Any]:
    return copy.deepcopy(self._buffer[0][0]) if self._buffer else self._reader_state()

  def set_state(self, state: dict[str, Any]) -> None:
    self.bad = BadRecords(self._ds.strict, **state.get("bad_records", {}))
    self._buffer.clear()
    self._error = None
    self._set(**{k: state[k] for k in ("epoch", "span", "offset", "line", "epoch_docs")})
