"""training/event_file.py: TensorBoard event files, read back with protobuf's own parser.

The oracle is the real wire-format parser of the ``protobuf`` package, given the message
definitions of tensorflow's ``event.proto`` / ``summary.proto`` (the fields the trainer
writes, same numbers and types), not our own decoder.
"""

import json
import os
import struct

import numpy as np
import pytest
from google.protobuf import descriptor_pb2
from google.protobuf import descriptor_pool
from google.protobuf import message_factory

from training import event_file
from training import metrics as metrics_lib

F = descriptor_pb2.FieldDescriptorProto


def _event_class():
  """``Event`` as tensorflow defines it, restricted to the fields written here."""
  proto = descriptor_pb2.FileDescriptorProto(name="tb_event_test.proto", package="tbtest",
                                             syntax="proto3")

  def message(name, *fields):
    m = proto.message_type.add(name=name)
    for field_name, number, kind, type_name, label in fields:
      f = m.field.add(name=field_name, number=number, type=kind, label=label)
      if type_name:
        f.type_name = type_name
    return m

  one, many = F.LABEL_OPTIONAL, F.LABEL_REPEATED
  message("Value", ("tag", 1, F.TYPE_STRING, None, one),
          ("simple_value", 2, F.TYPE_FLOAT, None, one))
  message("Summary", ("value", 1, F.TYPE_MESSAGE, ".tbtest.Value", many))
  message("SessionLog", ("status", 1, F.TYPE_INT32, None, one))
  message("Event", ("wall_time", 1, F.TYPE_DOUBLE, None, one),
          ("step", 2, F.TYPE_INT64, None, one), ("file_version", 3, F.TYPE_STRING, None, one),
          ("summary", 5, F.TYPE_MESSAGE, ".tbtest.Summary", one),
          ("session_log", 6, F.TYPE_MESSAGE, ".tbtest.SessionLog", one))
  pool = descriptor_pool.DescriptorPool()
  pool.Add(proto)
  return message_factory.GetMessageClass(pool.FindMessageTypeByName("tbtest.Event"))


Event = _event_class()


def read_events(logdir):
  (name,) = os.listdir(logdir)
  assert name.startswith("events.out.tfevents.")
  return [Event.FromString(r) for r in event_file.read_records(os.path.join(logdir, name))]


def test_crc32c_matches_the_rfc_3720_check_values():
  assert event_file.crc32c(b"123456789") == 0xE3069283
  assert event_file.crc32c(b"\x00" * 32) == 0x8A9136AA  # RFC 3720 B.4: 32 bytes of zeros
  assert event_file.crc32c(b"\xff" * 32) == 0x62A8AB43  # ... and of ones
  assert event_file.crc32c(bytes(range(32))) == 0x46DD794E  # ... incrementing


def test_scalars_and_purge_read_back_with_protobuf(tmp_path):
  logdir = str(tmp_path / "tb")
  writer = event_file.EventFileWriter(logdir, purge_step=3)
  writer.add_scalars(3, {"train/loss": 2.5, "train/lr": 1e-3})
  writer.add_scalars(2 ** 40, {"eval/x": -0.125})  # a step past 32 bits
  writer.close()
  header, purge, first, second = read_events(logdir)
  assert header.file_version == "brain.Event:2" and header.wall_time > 1e9
  assert purge.step == 3 and purge.session_log.status == 1  # SessionLog.START
  assert first.step == 3
  assert {v.tag: v.simple_value for v in first.summary.value} == {
      "train/loss": 2.5, "train/lr": np.float32(1e-3)}
  assert second.step == 2 ** 40 and second.summary.value[0].simple_value == -0.125


def test_a_corrupt_record_is_reported(tmp_path):
  logdir = str(tmp_path / "tb")
  writer = event_file.EventFileWriter(logdir)
  writer.add_scalars(1, {"a": 1.0})
  writer.close()
  (name,) = os.listdir(logdir)
  path = os.path.join(logdir, name)
  data = bytearray(open(path, "rb").read())
  data[-5] ^= 0xFF  # inside the last record's payload
  open(path, "wb").write(bytes(data))
  with pytest.raises(ValueError, match="bad data CRC"):
    event_file.read_records(path)
  assert struct.unpack("<Q", data[:8])[0] > 0


def test_metric_writer_writes_both_and_purges_a_resumed_curve(tmp_path):
  path = tmp_path / "metrics.jsonl"
  path.write_text("".join(json.dumps({"step": s, "train/loss": 1.0}) + "\n" for s in (1, 2, 3)))
  writer = metrics_lib.MetricWriter(str(tmp_path), resume_step=1, enabled=True)
  writer.write(2, {"loss": 0.5}, prefix="train/")
  writer.close()
  header, purge, row = read_events(str(tmp_path / "tensorboard"))
  assert purge.step == 2 and purge.session_log.status == 1  # rows past step 1 were dropped
  assert row.step == 2 and [(v.tag, v.simple_value) for v in row.summary.value] == [
      ("train/loss", 0.5)]
  assert [json.loads(l)["step"] for l in path.read_text().splitlines()] == [1, 2]
