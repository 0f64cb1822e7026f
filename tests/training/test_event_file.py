"""training/metrics.py's TensorBoard event files (tensorboardX's writer), read back here.

The reader is this file's own: TFRecord framing checked against an independent CRC-32C
(RFC 3720's check values), each record parsed as tensorboardX's ``Event`` protocol buffer
(tensorflow's event.proto / summary.proto).
"""

import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest
from tensorboardX.proto import event_pb2

from training import metrics as metrics_lib


def crc32c(data: bytes) -> int:
  """CRC-32C (Castagnoli), bit by bit."""
  crc = 0xFFFFFFFF
  for b in data:
    crc ^= b
    for _ in range(8):
      crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
  return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
  """TFRecord's ``rotr15(crc32c(x)) + 0xa282ead8`` (tensorflow/core/lib/io/record_writer.cc)."""
  crc = crc32c(data)
  return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


def read_records(path: str) -> list[bytes]:
  """``uint64 length | uint32 masked_crc(length) | data | uint32 masked_crc(data)`` records,
  little-endian, each checked against its two CRCs."""
  with open(path, "rb") as f:
    data = f.read()
  out, at = [], 0
  while at < len(data):
    header = data[at:at + 8]
    (length,) = struct.unpack("<Q", header)
    if struct.unpack("<I", data[at + 8:at + 12])[0] != masked_crc32c(header):
      raise ValueError(f"{path}: bad length CRC at byte {at}")
    payload = data[at + 12:at + 12 + length]
    crc = data[at + 12 + length:at + 16 + length]
    if len(payload) != length or len(crc) != 4 or (
        struct.unpack("<I", crc)[0] != masked_crc32c(payload)):
      raise ValueError(f"{path}: bad data CRC at byte {at}")
    out.append(payload)
    at += 16 + length
  return out


def read_events(logdir):
  (name,) = os.listdir(logdir)
  assert name.startswith("events.out.tfevents.")
  return [event_pb2.Event.FromString(r) for r in read_records(os.path.join(logdir, name))]


def scalars(events) -> list[tuple[int, str, float]]:
  """``(step, tag, value)`` of every scalar, in the file's order."""
  return [(e.step, v.tag, v.simple_value) for e in events for v in e.summary.value]


def purges(events) -> list[int]:
  """The steps of the ``SessionLog.START`` events (TensorBoard drops what follows them)."""
  return [e.step for e in events if e.session_log.status == event_pb2.SessionLog.START]


def test_the_readers_crc32c_matches_the_rfc_3720_check_values():
  assert crc32c(b"123456789") == 0xE3069283
  assert crc32c(b"\x00" * 32) == 0x8A9136AA  # RFC 3720 B.4: 32 bytes of zeros
  assert crc32c(b"\xff" * 32) == 0x62A8AB43  # ... and of ones
  assert crc32c(bytes(range(32))) == 0x46DD794E  # ... incrementing


def test_scalars_and_purge_read_back(tmp_path):
  """A resumed run's file: the version header, the purge (SessionLog.START at the first
  step it does again) before any scalar, then each write's scalars (float32) at its step."""
  (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 3, "train/loss": 9.0}) + "\n")
  writer = metrics_lib.MetricWriter(str(tmp_path), resume_step=2, enabled=True)
  writer.write(3, {"loss": 2.5, "lr": 1e-3}, prefix="train/")
  writer.write(2 ** 40, {"x": -0.125}, prefix="eval/")  # a step past 32 bits
  writer.close()
  logdir = tmp_path / "tensorboard"
  (name,) = os.listdir(logdir)
  assert name.startswith("events.out.tfevents.") and f".{os.getpid()}." in name
  events = read_events(logdir)
  header = events[0]
  assert header.file_version == "brain.Event:2" and header.wall_time > 1e9
  assert purges(events) == [3] and event_pb2.SessionLog.START == 1
  first_scalar = next(i for i, e in enumerate(events) if e.summary.value)
  assert purges(events[:first_scalar]) == [3]
  assert all(e.wall_time >= header.wall_time for e in events)
  assert scalars(events) == [(3, "train/loss", 2.5), (3, "train/lr", np.float32(1e-3)),
                             (2 ** 40, "eval/x", -0.125)]


def test_a_corrupt_record_is_reported(tmp_path):
  """The reader's CRC check catches a flipped byte (so the checks above mean something)."""
  writer = metrics_lib.MetricWriter(str(tmp_path), enabled=True)
  writer.write(1, {"a": 1.0})
  writer.close()
  logdir = tmp_path / "tensorboard"
  (name,) = os.listdir(logdir)
  path = os.path.join(logdir, name)
  assert len(read_records(path)) == 2  # the header and step 1, all CRCs intact
  data = bytearray(open(path, "rb").read())
  data[-5] ^= 0xFF  # inside the last record's payload
  open(path, "wb").write(bytes(data))
  with pytest.raises(ValueError, match="bad data CRC"):
    read_records(path)


def test_metric_writer_writes_both_and_purges_a_resumed_curve(tmp_path):
  path = tmp_path / "metrics.jsonl"
  path.write_text("".join(json.dumps({"step": s, "train/loss": 1.0}) + "\n" for s in (1, 2, 3)))
  writer = metrics_lib.MetricWriter(str(tmp_path), resume_step=1, enabled=True)
  writer.write(2, {"loss": 0.5}, prefix="train/")
  writer.close()
  events = read_events(str(tmp_path / "tensorboard"))
  assert purges(events) == [2]  # rows past step 1 were dropped
  assert scalars(events) == [(2, "train/loss", 0.5)]
  assert [json.loads(l)["step"] for l in path.read_text().splitlines()] == [1, 2]
  # A fresh run with nothing to drop writes no purge: the header, then its rows.
  writer = metrics_lib.MetricWriter(str(tmp_path / "fresh"), enabled=True)
  writer.write(1, {"loss": 0.25}, prefix="train/")
  writer.close()
  header, *rest = read_events(str(tmp_path / "fresh" / "tensorboard"))
  assert header.file_version == "brain.Event:2" and purges(rest) == []
  assert scalars(rest) == [(1, "train/loss", 0.25)]


def test_the_writer_leaves_torch_unimported_and_importable():
  """tensorboardX's import would import torch where it is installed (seconds of CPU per
  train.py process); the writer imports tensorboardX without it, and torch stays
  importable afterwards."""
  script = ("import importlib.util, sys, tempfile\n"
            "from training import metrics\n"
            "metrics.MetricWriter(tempfile.mkdtemp(), enabled=True).close()\n"
            "assert 'tensorboardX' in sys.modules and 'torch' not in sys.modules\n"
            "if importlib.util.find_spec('torch') is not None:\n"
            "  import torch; print('torch', torch.zeros(2).sum().item())\n"
            "print('ok')\n")
  proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                        timeout=300, cwd=os.path.abspath(os.path.join(
                            os.path.dirname(__file__), "..", "..")))
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.splitlines()[-1] == "ok", proc.stdout
