"""TensorBoard event files of scalars, written without TensorBoard, TensorFlow or tensorboardX.

TensorBoard reads a run's ``events.out.tfevents.*`` files: TFRecord files whose records are
``tensorflow.Event`` protocol buffers. The trainer writes only scalars, so this module writes
the few fields they need by hand (protobuf wire format, ``tensorflow/core/util/event.proto``
and ``summary.proto``): no dependency, and no import cost per process (tensorboardX imports
torch whenever it is installed: 1.40 -> 3.15 s of CPU for a fresh ``import jax, numpy``
process, in every ``train.py`` run).

Records (TFRecord framing, ``tensorflow/core/lib/io/record_writer.cc``)::

    uint64 length | uint32 masked_crc32c(length) | data | uint32 masked_crc32c(data)

little-endian, where ``masked_crc32c(x) = rotr15(crc32c(x)) + 0xa282ead8`` (CRC-32C,
Castagnoli polynomial, as RFC 3720 uses).
"""

from __future__ import annotations

import os
import socket
import struct
import time

# Field numbers of event.proto / summary.proto.
_EVENT_WALL_TIME, _EVENT_STEP, _EVENT_FILE_VERSION = 1, 2, 3
_EVENT_SUMMARY, _EVENT_SESSION_LOG = 5, 6
_SUMMARY_VALUE, _VALUE_TAG, _VALUE_SIMPLE_VALUE = 1, 1, 2
_SESSION_LOG_STATUS, _SESSION_LOG_START = 1, 1
# Wire types.
_VARINT, _FIXED64, _BYTES, _FIXED32 = 0, 1, 2, 5


def _crc32c_table() -> tuple[int, ...]:
  table = []
  for byte in range(256):
    crc = byte
    for _ in range(8):
      crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)  # reflected Castagnoli polynomial
    table.append(crc)
  return tuple(table)


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
  """CRC-32C of ``data`` (``crc32c(b"123456789") == 0xE3069283``, RFC 3720 B.4)."""
  crc = 0xFFFFFFFF
  for b in data:
    crc = _TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
  return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
  crc = crc32c(data)
  return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(value: int) -> bytes:
  value &= (1 << 64) - 1  # negative int64: ten bytes of two's complement, as protobuf does
  out = bytearray()
  while True:
    low = value & 0x7F
    value >>= 7
    if value:
      out.append(low | 0x80)
    else:
      out.append(low)
      return bytes(out)


def _key(field: int, wire_type: int) -> bytes:
  return _varint(field << 3 | wire_type)


def _bytes_field(field: int, payload: bytes) -> bytes:
  return _key(field, _BYTES) + _varint(len(payload)) + payload


def event(*, wall_time: float, step: int = 0, file_version: str | None = None,
          scalars: dict[str, float] | None = None, session_start: bool = False) -> bytes:
  """One serialized ``Event``: the file-version header, scalars at ``step``
  (``Summary.Value.simple_value``, a float32), or a ``SessionLog(status=START)``."""
  out = _key(_EVENT_WALL_TIME, _FIXED64) + struct.pack("<d", wall_time)
  if step:
    out += _key(_EVENT_STEP, _VARINT) + _varint(step)
  if file_version is not None:
    out += _bytes_field(_EVENT_FILE_VERSION, file_version.encode())
  if scalars:
    values = b"".join(
        _bytes_field(_SUMMARY_VALUE,
                     _bytes_field(_VALUE_TAG, tag.encode())
                     + _key(_VALUE_SIMPLE_VALUE, _FIXED32) + struct.pack("<f", value))
        for tag, value in scalars.items())
    out += _bytes_field(_EVENT_SUMMARY, values)
  if session_start:
    out += _bytes_field(_EVENT_SESSION_LOG,
                        _key(_SESSION_LOG_STATUS, _VARINT) + _varint(_SESSION_LOG_START))
  return out


def record(data: bytes) -> bytes:
  """``data`` framed as one TFRecord."""
  header = struct.pack("<Q", len(data))
  return (header + struct.pack("<I", masked_crc32c(header)) + data
          + struct.pack("<I", masked_crc32c(data)))


class EventFileWriter:
  """Scalars into a new ``events.out.tfevents.<time>.<host>.<pid>`` file of ``logdir``.

  ``purge_step``: TensorBoard drops the events of this run from that step on (a
  ``SessionLog.START`` at that step, as ``SummaryWriter(purge_step=)`` writes), so a run
  resumed from an earlier checkpoint draws one curve, not two.
  """

  def __init__(self, logdir: str, *, purge_step: int | None = None):
    os.makedirs(logdir, exist_ok=True)
    now = time.time()
    self.path = os.path.join(
        logdir, f"events.out.tfevents.{int(now)}.{socket.gethostname()}.{os.getpid()}")
    self._file = open(self.path, "ab")
    self._file.write(record(event(wall_time=now, file_version="brain.Event:2")))
    if purge_step is not None:
      self._file.write(record(event(wall_time=now, step=purge_step, session_start=True)))
    self._file.flush()

  def add_scalars(self, step: int, scalars: dict[str, float]) -> None:
    self._file.write(record(event(wall_time=time.time(), step=step, scalars=scalars)))
    self._file.flush()

  def close(self) -> None:
    self._file.close()


def read_records(path: str) -> list[bytes]:
  """The records of a TFRecord file, each checked against its two CRCs."""
  out = []
  with open(path, "rb") as f:
    data = f.read()
  at = 0
  while at < len(data):
    header = data[at:at + 8]
    (length,) = struct.unpack("<Q", header)
    (crc,) = struct.unpack("<I", data[at + 8:at + 12])
    if crc != masked_crc32c(header):
      raise ValueError(f"{path}: bad length CRC at byte {at}")
    payload = data[at + 12:at + 12 + length]
    (crc,) = struct.unpack("<I", data[at + 12 + length:at + 16 + length])
    if len(payload) != length or crc != masked_crc32c(payload):
      raise ValueError(f"{path}: bad data CRC at byte {at}")
    out.append(payload)
    at += 16 + length
  return out
