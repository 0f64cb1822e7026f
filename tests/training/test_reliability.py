"""`train.py` under hostile conditions, as real subprocesses: signals, divergence, corrupt
checkpoints, a failing disk, bad command lines. Each run uses a tiny config (seconds)."""

import errno
import json
import os
import re
import shutil
import signal
import time

import numpy as np
import orbax.checkpoint as ocp
import pytest

import train_procs as tp
from message_utils import assert_states
from training import checkpoint as ckpt_lib
from training import supervisor


def test_sigterm_and_sigint_finish_the_step_save_and_exit_0(tmp_path):
  workdir = tmp_path / "run"
  flags = ("--config.total_steps=1000", "--config.checkpoint_every=1000")
  proc = tp.start(workdir, *flags)
  tp.wait_for(proc, r"step +2/1000")
  proc.send_signal(signal.SIGTERM)
  rc, out = tp.finish(proc)
  assert rc == 0, out[-3000:]
  stopped = re.search(r"stopped by SIGTERM after step (\d+); checkpoint saved in (\S+)\. "
                      r"Resume with: (.*)", out)
  assert stopped, out[-3000:]
  first = int(stopped.group(1))
  assert 2 <= first < 1000 and stopped.group(2) == str(workdir / "checkpoints")
  assert "train.py" in stopped.group(3) and f"--workdir={workdir}" in stopped.group(3)
  assert tp.checkpoint_steps(workdir) == [first]  # off the interval: saved for the stop
  assert [r["step"] for r in tp.train_rows(workdir)] == list(range(1, first + 1))

  # The same command resumes; Ctrl-C (SIGINT) stops it the same way.
  proc = tp.start(workdir, *flags)
  tp.wait_for(proc, rf"resumed from step {first} ")
  tp.wait_for(proc, rf"step +{first + 2}/1000")
  proc.send_signal(signal.SIGINT)
  rc, out = tp.finish(proc)
  assert rc == 0 and "Traceback" not in out, out[-3000:]
  second = int(re.search(r"stopped by SIGINT after step (\d+)", out).group(1))
  assert second >= first + 2
  assert tp.checkpoint_steps(workdir) == [first, second]
  assert [r["step"] for r in tp.train_rows(workdir)] == list(range(1, second + 1))


def _empty_largest_array_file(step_dir):
  files = [p for p in (step_dir / "state").rglob("*") if p.is_file()]
  max(files, key=lambda p: p.stat().st_size).write_bytes(b"")


def test_mismatch_and_divergence_stop_without_damage_then_corrupt_latest_falls_back(tmp_path):
  workdir = tmp_path / "run"
  flags = ("--config.total_steps=8", "--config.checkpoint_every=2",
           "--config.keep_checkpoints=2")
  good = tp.run(workdir, *flags, "--stop_at_step=4")
  assert good.returncode == 0, good.stderr[-3000:]
  assert tp.checkpoint_steps(workdir) == [2, 4]
  reference = {r["step"]: r["train/loss"] for r in tp.train_rows(workdir)}

  # Another model shape in the same workdir: exit 2 with one line naming the saved config
  # and the flag that restores, and not a byte of the workdir changed, so export_hf.py
  # still exports step 4 under the saved config.
  files = [p for p in workdir.rglob("*") if p.is_file()]
  before = {p: p.read_bytes() for p in files}
  other = tp.run(workdir, *flags, "--config.model.num_layers=2")
  assert other.returncode == 2, other.stdout[-2000:] + other.stderr[-3000:]
  error = other.stderr.strip().splitlines()
  assert len(error) == 1 and error[0].startswith("error: no checkpoint in"), other.stderr
  assert (f"the config saved in {workdir / 'config.json'}, which differs in model.num_layers "
          "(1 there, 2 here): rerunning with the saved values resumes (e.g. add "
          f"--config.model.num_layers=1). This run wrote nothing into {workdir}.") in error[0]
  assert sorted(p for p in workdir.rglob("*") if p.is_file()) == sorted(files)
  assert {p: p.read_bytes() for p in files} == before
  import export_hf
  logs = []
  export_hf.export(str(workdir), str(tmp_path / "hf"), log=logs.append)
  assert logs[-1].startswith(f"exported step 4 of {workdir} "), logs

  # A learning rate that blows up: stops at the first non-finite step, exit 3, one line
  # naming the step and the fix; no checkpoint of it, and retention keeps 2 and 4.
  bad = tp.run(workdir, *flags, "--config.optim.lr=1e30")
  assert bad.returncode == 3, bad.stdout[-2000:] + bad.stderr[-3000:]
  error = bad.stderr.strip().splitlines()[-1]
  diverged = re.search(r"training diverged at step (\d+)", error)
  assert diverged and int(diverged.group(1)) > 4, error
  assert "--config.optim.lr (now 1e+30)" in error and "step 4" in error
  assert "Traceback" not in bad.stderr
  assert tp.checkpoint_steps(workdir) == [2, 4]

  # Corrupt the newest checkpoint: the next run warns once about it, moves it aside,
  # resumes from 2 and redoes 3..6 on the same curve; metrics.jsonl keeps one row a step.
  _empty_largest_array_file(workdir / "checkpoints" / "4")
  resumed = tp.run(workdir, *flags, "--stop_at_step=6")
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  warnings = [l for l in resumed.stdout.splitlines() if l.startswith("warning:")]
  assert len(warnings) == 2 and "checkpoint step 4" in warnings[0], warnings
  assert "resumed from step 2 " in resumed.stdout
  moved = list((workdir / ckpt_lib.CORRUPT_DIRNAME).iterdir())
  assert [p.name.split("-")[0] for p in moved] == ["4"]
  assert tp.checkpoint_steps(workdir) == [4, 6]
  rows = tp.train_rows(workdir)
  assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
  np.testing.assert_allclose([r["train/loss"] for r in rows[:4]],
                             [reference[s] for s in (1, 2, 3, 4)], rtol=1e-6)
  assert all(np.isfinite(r["train/loss"]) for r in rows)

  # Nothing restores: exit 2 with one line listing each step and why; nothing moved.
  for step in (4, 6):
    _empty_largest_array_file(workdir / "checkpoints" / str(step))
  broken = tp.run(workdir, *flags)
  assert broken.returncode == 2, broken.stderr[-3000:]
  last = broken.stderr.strip().splitlines()[-1]
  assert last.startswith("error: no checkpoint in") and "step 6: " in last and "step 4: " in last
  assert tp.checkpoint_steps(workdir) == [4, 6]
  assert "Traceback" not in broken.stderr


# Test-only: runs train.py with Orbax's background JSON write failing like a full disk at
# one step. Patches a private Orbax function in this subprocess only; nothing in the
# shipped code knows about it.
FAILING_DISK = '''
import errno, runpy, sys
from orbax.checkpoint._src.handlers import json_checkpoint_handler as handler

FAIL_STEP = {step!r}
original = handler.JsonCheckpointHandler._save_fn

async def failing_save_fn(self, item, directory):
  # directory: <checkpoints>/<step>.orbax-checkpoint-tmp.../data...
  if directory.parent.name.split(".")[0] == FAIL_STEP:
    raise OSError(errno.ENOSPC, "No space left on device (injected by the test)")
  return await original(self, item, directory)

handler.JsonCheckpointHandler._save_fn = failing_save_fn
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
'''


def test_failing_background_save_stops_the_run_with_one_error(tmp_path):
  wrapper = tmp_path / "failing_disk.py"
  wrapper.write_text(FAILING_DISK.format(step="4"))
  workdir = tmp_path / "run"
  proc = tp.run(workdir, "--config.total_steps=40", "--config.checkpoint_every=2",
                "--config.async_checkpointing=True", wrapper=str(wrapper))
  assert proc.returncode == 4, proc.stdout[-2000:] + proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr
  errors = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
  assert len(errors) == 1, proc.stderr
  assert ("writing the checkpoint of step 4" in errors[0]
          and os.strerror(errno.ENOSPC) in errors[0] and "newest: step 2" in errors[0])
  # Stopped soon after (the write fails in the background), far from the end.
  last_step = max(r["step"] for r in tp.train_rows(workdir))
  assert 4 <= last_step < 12
  assert tp.checkpoint_steps(workdir) == [2]  # step 2 intact; no step 4 listed


@pytest.mark.parametrize("flags, expected", [
    (("--config", "no_such_config.py"), "does not exist"),
    (("--config.modell.num_layers=2",), 'Did you mean "model"'),
    (("--gin_param=modell.num_layers = 2",), "no field 'modell'"),
    (("--gin_param=model.num_layers = (",), "gin"),
    (("--stop_at_step=-3",), "--stop_at_step=-3"),
    (("--config.distributed.heartbeat_timeout_s=0",), "distributed.heartbeat_timeout_s=0"),
    (("--config.optim.lr=-0.001",), "optim.lr=-0.001 must be > 0."),
    # A field below the top level: the same line as a top-level typo, with its path.
    (("--config.data.seqlen=64",), "config error: the config has no field 'data.seqlen'. "
                                   'Did you mean "seq_len" instead of "seqlen"? (see'),
    # data.length_buckets exists (training/buckets.py) and needs text data.
    (("--config.data.length_buckets=3",),
     "config error: data.length_buckets=(3,): length buckets pack documents of text data "
     "(data.kind='text'), got data.kind='kv_retrieval'."),
])
def test_bad_command_lines_give_one_line_and_exit_2(tmp_path, flags, expected):
  proc = tp.run(tmp_path / "run", *flags)
  assert proc.returncode == 2, proc.stderr[-3000:]
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("config error:"), proc.stderr
  assert expected in lines[0]
  assert not (tmp_path / "run" / "checkpoints").exists()


def test_help_names_the_default_config():
  import subprocess
  import sys
  proc = subprocess.run([sys.executable, tp.TRAIN_PY, "--help"], cwd=tp.ROOT, env=tp.env(),
                        capture_output=True, text=True, timeout=300)  # absl: exit status 1
  config_help = proc.stdout.split("  --config:", 1)[1].split("\n  --", 1)[0]
  assert " ".join(config_help.split()).endswith("(default: 'configs/tiny.py')"), config_help


def test_resumed_metrics_keep_one_row_per_step(tmp_path):
  from training import metrics as metrics_lib

  path = tmp_path / "metrics.jsonl"
  rows = [{"step": s, "train/loss": 1.0 / s} for s in (1, 2, 3, 4)] + [{"step": 4, "eval/x": 0}]
  path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 5, "trai')  # cut short
  assert metrics_lib.truncate_jsonl(str(path), 2) == 4
  assert [json.loads(l) for l in path.read_text().splitlines()] == rows[:2]
  assert metrics_lib.truncate_jsonl(str(path), 2) == 0  # nothing past step 2 left
  writer = metrics_lib.MetricWriter(str(tmp_path), resume_step=1, enabled=True)
  writer.write(2, {"loss": 0.25}, prefix="train/")
  writer.close()
  assert [json.loads(l) for l in path.read_text().splitlines()] == [
      rows[0], {"step": 2, "train/loss": 0.25}]


def test_a_save_cut_short_leaves_no_step_and_its_tmp_directory_is_removed(tmp_path):
  """What a process killed mid-save leaves (Orbax renames ``<step>.orbax-checkpoint-tmp``
  to ``<step>`` only once every process has written): never listed nor restored, and
  deleted by the next run's Checkpointer before its first save (Orbax removes it in a
  background thread that a save waits for, so the directory is checked after one)."""
  import jax
  import jax.numpy as jnp

  params, opt_state = {"w": jnp.arange(4.0)}, {"m": jnp.ones(4)}
  checkpointer = ckpt_lib.Checkpointer(str(tmp_path), every=1, async_save=False)
  assert checkpointer.save(1, params, opt_state, {"next_index": 1})
  checkpointer.close()
  directory = ckpt_lib.checkpoint_directory(str(tmp_path))
  half = os.path.join(directory, "2.orbax-checkpoint-tmp")  # step 2's save, cut short
  shutil.copytree(os.path.join(directory, "1"), half)
  for name in ("data", "_CHECKPOINT_METADATA"):
    target = os.path.join(half, name)
    if os.path.isdir(target):
      shutil.rmtree(target)
    elif os.path.exists(target):
      os.remove(target)
  assert supervisor.complete_steps(directory) == [1]
  assert supervisor.complete_steps(str(tmp_path / "nowhere")) == []

  sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  abstract = lambda tree: jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)
  resumed = ckpt_lib.Checkpointer(str(tmp_path), every=1, keep=2, async_save=False)
  step, got, _, data = resumed.restore_latest(abstract(params), abstract(opt_state),
                                              warn=pytest.fail)
  assert (step, data) == (1, {"next_index": 1})
  np.testing.assert_array_equal(np.asarray(got["w"]), np.arange(4.0))
  assert resumed.save(2, got, opt_state, {"next_index": 2})
  resumed.close()
  assert sorted(os.listdir(directory)) == ["1", "2"]  # the cut-short tmp directory is gone


class FakeCoordinationClient:
  """The key-value calls of JAX's coordination client that PeerWatchdog uses, in memory."""

  def __init__(self):
    self.store: dict[str, str] = {}

  def key_value_set(self, key, value, allow_overwrite=False):
    if key in self.store and not allow_overwrite:
      raise RuntimeError(f"ALREADY_EXISTS: {key}")
    self.store[key] = value

  def key_value_dir_get(self, prefix):
    return [(k, v) for k, v in sorted(self.store.items()) if k.startswith(prefix)]


def _checkpoints(tmp_path):
  """A checkpoint directory with the complete steps 4 and 6 and step 8 cut short."""
  for name in ("4", "6", "8.orbax-checkpoint-tmp-1733240000"):
    (tmp_path / "checkpoints" / name).mkdir(parents=True)
  return str(tmp_path / "checkpoints")


def _watchdog(client, process_id, num_processes, exits, timeout_s=1.0,
              checkpoint_dir="/w/checkpoints"):
  from training import distributed as dist_lib

  def describe(lost, step, reason):
    return dist_lib.lost_peer_message(lost, num_processes, reason, step, checkpoint_dir,
                                      "python train.py --workdir=/w")

  return dist_lib.PeerWatchdog(timeout_s, describe, client=client, process_id=process_id,
                               num_processes=num_processes, exit=exits.append)


def test_peer_watchdog_names_the_silent_process_and_every_survivor_exits_75(capsys, tmp_path):
  from training import distributed as dist_lib

  client, exits, checkpoints = FakeCoordinationClient(), [], _checkpoints(tmp_path)
  # Three processes: 2 was killed (it never beats); 1 is alive and hears the verdict.
  coordinator = _watchdog(client, 0, 3, exits, checkpoint_dir=checkpoints)
  survivor = _watchdog(client, 1, 3, exits, checkpoint_dir=checkpoints)
  coordinator.step = 7
  survivor.step = 7
  coordinator.start()
  survivor.start()
  assert coordinator.wait_for_verdict(10.0)
  deadline = time.monotonic() + 10
  while len(exits) < 2 and time.monotonic() < deadline:
    time.sleep(0.05)
  assert exits == [dist_lib.EXIT_PEER_LOST] * 2 == [75, 75]
  lines = capsys.readouterr().err.strip().splitlines()
  assert len(lines) == 2 and lines[0] == lines[1], lines  # each survivor's line, the same
  # Process 2 of 3, how it was noticed, the step the run reached, the last complete
  # checkpoint (of 4, 6) and where, how many processes to restart, and the command.
  assert_states(lines[0], "process 2", "3", "no heartbeat for 1 s", "step 7", "step 6",
                checkpoints, "all 3 processes",
                starts_with="error: ", ends_with=": python train.py --workdir=/w")


def test_after_a_verdict_the_main_thread_waits_for_the_exit(capsys):
  """The loop's error path (a collective failed on the dead peer) waits for the verdict; it
  must not return before the watchdog has printed its line and exited, or the error's
  traceback would follow the line (seen when gloo failed fast on a killed peer)."""
  client, exits = FakeCoordinationClient(), []

  def slow_exit(status):  # printing and exiting take time on a loaded machine
    time.sleep(0.5)
    exits.append(status)

  from training import distributed as dist_lib
  coordinator = dist_lib.PeerWatchdog(
      0.5, lambda lost, step, reason: f"error: process {lost} lost", client=client,
      process_id=0,
      num_processes=2, exit=slow_exit).start()
  assert coordinator.wait_for_verdict(10.0)
  assert exits == [75]  # the exit ran before the main thread could go on
  assert capsys.readouterr().err.strip() == "error: process 1 lost"


def test_peer_watchdog_ignores_a_process_that_exited_cleanly():
  client, exits = FakeCoordinationClient(), []
  peer = _watchdog(client, 1, 2, exits)
  peer.stop(done=True)  # distributed.finish() on a clean end: done, no more beats
  coordinator = _watchdog(client, 0, 2, exits, timeout_s=0.5).start()
  assert not coordinator.wait_for_verdict(2.0)
  coordinator.stop()
  assert exits == []


# What a gloo collective raised in a survivor after a kill -9 of its peer (2 CPU processes on
# localhost; either text on jax 0.10 and 0.12, by timing), and NCCL's report of the same.
GLOO_RESET = ("UNKNOWN: Gloo AllGather failed: [external/gloo/gloo/transport/tcp/pair.cc:538] "
              "Read error [127.0.0.1]:13218: Connection reset by peer")
GLOO_CLOSED = ("UNKNOWN: Gloo AllGather failed: [external/xla++third_party_ext+gloo/gloo/"
               "transport/tcp/pair.cc:547] Connection closed by peer [127.0.0.1]:22958")
NCCL = ("INTERNAL: external/xla/xla/backends/gpu/collectives/nccl_communicator.cc:312: NCCL "
        "operation ncclGroupEnd() failed: remote process exited or there was a network error. "
        "Last NCCL warning(error) log entry (may be unrelated) 'socketProgress: Connection "
        "closed by remote peer node-2<41034>'.")


def test_a_collective_that_lost_its_peer_ends_the_process_at_once_with_one_line(
    capsys, monkeypatch, tmp_path):
  """gloo's and NCCL's closed-connection errors, also as the cause of a failed save, end a
  process of a multi-process run with the line and 75; other errors, even with the same
  socket words, do not."""
  from training import distributed as dist_lib

  assert dist_lib.collective_lost_peer(ValueError(GLOO_RESET)) == (
      "Gloo AllGather", "Connection reset by peer")
  assert dist_lib.collective_lost_peer(ValueError(GLOO_CLOSED)) == (
      "Gloo AllGather", "Connection closed by peer")
  assert dist_lib.collective_lost_peer(RuntimeError(NCCL)) == (
      "NCCL operation ncclGroupEnd", "remote process exited or there was a network error")
  for other in (ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"),
                RuntimeError("Gloo all-reduce failed: Timed out waiting 30000ms for recv"),
                RuntimeError("NCCL operation ncclGroupEnd() failed: unhandled cuda error")):
    assert dist_lib.collective_lost_peer(other) is None, other

  exits, checkpoints = [], _checkpoints(tmp_path)
  monkeypatch.setattr(dist_lib, "_ACTIVE", _watchdog(FakeCoordinationClient(), 0, 2, exits,
                                                     checkpoint_dir=checkpoints))
  dist_lib.note_step(7)
  dist_lib.exit_if_peer_lost(ValueError("not a collective's"))
  assert exits == [] and capsys.readouterr().err == ""
  try:
    try:
      raise ValueError(GLOO_RESET)  # jax.device_get in the save's finiteness check
    except ValueError as e:
      raise ckpt_lib.CheckpointWriteError("writing the checkpoint of step 6 failed") from e
  except ckpt_lib.CheckpointWriteError as e:
    dist_lib.exit_if_peer_lost(e)
  assert exits == [75]
  [line] = capsys.readouterr().err.splitlines()
  # The peer (process 1 of 2; the collective cannot tell which, the watchdog's client can),
  # the collective's own words for the failure, then the step, checkpoint and command.
  assert_states(line, "process 1", "2", dist_lib.COLLECTIVE_CLOSED, "Gloo AllGather",
                "Connection reset by peer", "step 7", "step 6", checkpoints,
                "all 2 processes", starts_with="error: ",
                ends_with=": python train.py --workdir=/w")


def test_the_lost_peer_line_lists_the_complete_checkpoints(tmp_path):
  """The watchdog's line names the last complete step from the directory listing alone (no
  Orbax threads: they cannot start once Python began its shutdown)."""
  from training import distributed as dist_lib

  (tmp_path / "4").mkdir()
  (tmp_path / "6.orbax-checkpoint-tmp-1733240000").mkdir()

  line = dist_lib.lost_peer_message(1, 2, "no heartbeat for 60 s", 7, str(tmp_path),
                                    "python train.py")
  assert_states(line, "process 1", "2", "no heartbeat for 60 s", "step 7", "step 4",
                str(tmp_path), "all 2 processes", starts_with="error: ",
                ends_with=": python train.py")
  assert "step 6" not in line, line  # cut short: not complete


def test_lost_peer_message_before_the_first_step_and_without_checkpoints():
  from training import distributed as dist_lib

  line = dist_lib.lost_peer_message(1, 2, "no heartbeat for 60 s", None, "/w/checkpoints",
                                    "python t.py")
  assert_states(line, "process 1", "2", "no heartbeat for 60 s", "before the first step",
                "no complete checkpoint", "/w/checkpoints", "starts afresh", "all 2 processes",
                starts_with="error: ", ends_with=": python t.py")
  assert not re.search(r"\bstep \d", line), line  # no step reached, none to resume from


# --- training/supervisor.py: the parent of each process of a multi-process train.py -----

# A child that reports like train.py's process 1, then ends as JAX's client ends it when the
# coordination service is gone (its termination line, then abort), or otherwise.
_FAKE_CHILD = """
import os, sys
from training import supervisor
workdir, ending = sys.argv[1], sys.argv[2]
supervisor.report(process_id=0 if ending == "peer_failed" else 1, num_processes=2,
                  workdir=workdir,
                  checkpoint_dir=os.path.join(workdir, "checkpoints"),
                  resume_command="python train.py --workdir=" + workdir,
                  coordinator="127.0.0.1:1")
supervisor.report(step=7)
print("step 7 on stdout", flush=True)
print("a warning on stderr", file=sys.stderr, flush=True)
if ending in ("coordinator_gone", "declared"):
  print("W1203 17:41:24.965709 30040 preemption_sync_manager.cc:147] Failed to retrieve "
        "preemption notice from coordination service: UNAVAILABLE: recvmsg:Connection reset "
        "by peer\\nAdditional GRPC error information from remote target coordination_service "
        "while calling /xla.coordination.CoordinationService/GetKeyValue:\\n:UNKNOWN:Error "
        "received from peer", file=sys.stderr, flush=True)
if ending == "declared":  # its own line (a collective lost process 0) amid JAX's, then abort
  line = "error: process 0 of 2 stopped responding (its own line)"
  supervisor.report(declared=line)
  print(line, file=sys.stderr, flush=True)
if ending in ("coordinator_gone", "declared"):
  print("E1201 12:16:11.010197 2745 coordination_service_agent.cc:289] Polled an error",
        file=sys.stderr, flush=True)
  print("F1201 12:16:11.010259 2745 client.h:80] Terminating process because the JAX "
        "distributed service detected fatal errors. absl::Status: UNAVAILABLE: Failed to send "
        "RPC to coordination service.", file=sys.stderr, flush=True)
  print("*** Check failure stack trace: ***", file=sys.stderr, flush=True)
  os.abort()
if ending == "peer_failed":  # process 0: the service it hosts ends it over process 1's failure
  print("E1203 14:36:49.418131 1893 coordination_service.cc:1549] Use error polling to "
        "propagate the following error to all tasks: INTERNAL: Task "
        "/job:jax_worker/replica:0/task:1 failed", file=sys.stderr, flush=True)
  print("F1203 14:36:49.418301 1893 client.h:80] Terminating process because the JAX "
        "distributed service detected fatal errors. absl::Status: INTERNAL: Task "
        "/job:jax_worker/replica:0/task:1 failed", file=sys.stderr, flush=True)
  os.abort()
if ending == "killed":  # what the kernel's OOM killer does: no word from the child
  os.kill(os.getpid(), 9)
sys.exit(int(ending))
"""


@pytest.mark.parametrize("ending", ["coordinator_gone", "peer_failed", "declared", "killed",
                                    "3", "0"])
def test_supervisor_reports_a_lost_coordinator_and_passes_other_endings_through(
    tmp_path, ending):
  import subprocess
  import sys

  (tmp_path / "checkpoints" / "6").mkdir(parents=True)  # a complete step (Orbax's naming)
  (tmp_path / "checkpoints" / "8.orbax-checkpoint-tmp").mkdir()  # one cut short
  script = tmp_path / "child.py"
  script.write_text(_FAKE_CHILD)
  # The supervisor in a process of its own, as train.py runs it (no JAX imported there).
  proc = subprocess.run(
      [sys.executable, "-c", "import sys; from training import supervisor; "
       "sys.exit(supervisor.supervise(sys.argv[1:]))", str(script), str(tmp_path), ending],
      cwd=tp.ROOT, env=tp.env(), capture_output=True, text=True, timeout=120)
  out, err = proc.stdout, proc.stderr
  assert "step 7 on stdout" in out and "a warning on stderr" in err  # passed through
  if ending == "killed":  # its death by a signal gets a line of the supervisor's own
    assert proc.returncode == 137 and "error:" not in err, err
    assert re.fullmatch(r"supervisor: the training process of process 1 \(pid \d+\) was ended "
                        r"by SIGKILL \(signal 9\); exit status 137", err.splitlines()[-1]), err
    return
  if ending == "declared":  # the child's line stands alone, with its status; JAX's in the file
    assert proc.returncode == 75 and err.splitlines()[-1] == (
        "error: process 0 of 2 stopped responding (its own line)"), err
    for noise in ("Terminating process", "preemption", "GRPC", "supervisor:", "note:"):
      assert noise not in err, err
    assert "Terminating process" in (tmp_path / "abort_process_1.txt").read_text()
    return
  if ending not in ("coordinator_gone", "peer_failed"):
    assert proc.returncode == int(ending) and "supervisor:" not in err and "error:" not in err
    return
  assert proc.returncode == 75, err
  lost, me, reason = ((0, 1, "the coordination service it hosts is gone")
                      if ending == "coordinator_gone" else
                      (1, 0, "JAX's coordination service reported its failure"))
  assert err.splitlines()[-2:] == [
      f"error: process {lost} of 2 stopped responding ({reason}) "
      f"at step 7; the last complete checkpoint is step 6 in {tmp_path / 'checkpoints'}; "
      f"restart all 2 processes with the same command to resume: python train.py "
      f"--workdir={tmp_path}",
      f"note: JAX's report of it is in {tmp_path / f'abort_process_{me}.txt'}"]
  for noise in ("Check failure", "Terminating process", "Polled an error", "error polling",
                "preemption", "GRPC"):
    assert noise not in err, err
  assert "Terminating process" in (tmp_path / f"abort_process_{me}.txt").read_text()


def test_supervisor_lists_the_complete_steps_as_orbax_does(tmp_path):
  """The supervisor's JAX-free listing (it reports a lost coordinator in a process that has
  not imported JAX) equals Orbax's on a local directory: finalized steps only."""
  directory = tmp_path / "checkpoints"
  for name in ("2", "10", "12.orbax-checkpoint-tmp-1733240000", "notes"):
    (directory / name).mkdir(parents=True)
  (directory / "14").write_text("a file, not a step")
  assert supervisor.complete_steps(str(directory)) == sorted(
      ocp.path.step.checkpoint_steps(str(directory))) == [2, 10]
  assert supervisor.complete_steps(str(tmp_path / "missing")) == []


def test_supervisor_is_wanted_on_multi_process_launches_only():
  from training import supervisor

  launch = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234"}
  assert supervisor.wanted(["train.py"], launch)
  assert not supervisor.wanted(["train.py"], {})
  assert not supervisor.wanted(["train.py", "--distributed=off"], launch)
  assert supervisor.wanted(["train.py", "--distributed", "on"], {})
  assert not supervisor.wanted(["train.py"], {**launch, "RING_JAX_SUPERVISED": "1"})  # child
  assert not supervisor.wanted(["train.py"], {**launch, "RING_JAX_SUPERVISOR": "0"})
