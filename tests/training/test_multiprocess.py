"""`train.py` as two processes over `jax.distributed` on localhost (gloo, 4 CPU devices each).

Two scenarios, each within a few minutes on 2 cores: a 2-process run is stopped by a
SIGTERM to one of its processes (both must finish the same step, save and exit 0),
resumed by a 1-process run on the same 8-device mesh for two steps, then by a 2-process
run for two more; the whole loss curve must equal an uninterrupted 1-process run's. And a
2-process run one of whose processes is killed (``kill -9``), the training process of
process 1 (what an OOM killer picks; its supervisor says so) and then, after the resume,
process 0 (the coordination service's host, supervisor and all): each time the survivor
exits 75 with one line within 10 s; both restarted resume from the last complete checkpoint.
"""

import os
import re
import signal
import time

import numpy as np

import train_procs as tp

FLAGS = ("--config.total_steps=1000", "--config.checkpoint_every=1000")


def start_two(workdir, *flags, base_flags=FLAGS, stderr_dir=None):
  port = tp.free_port()
  return [tp.start(workdir, *base_flags, *flags, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                   JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(i),
                   stderr_path=stderr_dir and os.path.join(stderr_dir, f"stderr_{i}.txt"))
          for i in range(2)]


def test_two_processes_preempted_then_resumed_by_one_match_one_process(tmp_path):
  workdir = tmp_path / "run"
  procs = start_two(workdir)
  try:
    head = tp.wait_for(procs[0], r"step +2/1000")
  except AssertionError:
    for p in procs:
      p.kill()
    raise
  assert ("(2 process(es)); mesh {'data': 2, 'pipeline': 1, 'sequence_outer': 1, 'sequence': 4, "
          "'tensor': 1}") in head
  # The notice reaches one process only; JAX's preemption sync point makes both stop.
  procs[1].send_signal(signal.SIGTERM)
  results = tp.finish_all(procs)
  for rc, out in results:
    assert rc == 0, out[-3000:]
  stopped = re.search(r"stopped by SIGTERM \(preemption notice\) after step (\d+)",
                      results[0][1])
  assert stopped, results[0][1][-3000:]
  k = int(stopped.group(1))
  assert 2 <= k < 1000 and tp.checkpoint_steps(workdir) == [k]
  # Process 1 wrote its shards of the same step (the resume below reads them).
  assert (workdir / "checkpoints" / str(k) / "state" / "ocdbt.process_1").is_dir()

  # One process continues the run for two more steps ...
  resumed = tp.run(workdir, *FLAGS, f"--stop_at_step={k + 2}")
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert f"resumed from step {k} " in resumed.stdout and "(1 process(es))" in resumed.stdout
  # ... then two processes again (each restores its part of a 1-process checkpoint) ...
  results = tp.finish_all(start_two(workdir, f"--stop_at_step={k + 4}"))
  for rc, out in results:
    assert rc == 0, out[-3000:]
  assert f"resumed from step {k + 2} " in results[0][1]
  assert tp.checkpoint_steps(workdir) == [k + 2, k + 4]
  # ... and one process runs the same steps uninterrupted.
  reference = tp.run(tmp_path / "reference", *FLAGS, f"--stop_at_step={k + 4}")
  assert reference.returncode == 0, reference.stderr[-3000:]

  rows, want = tp.train_rows(workdir), tp.train_rows(tmp_path / "reference")
  assert [r["step"] for r in rows] == [r["step"] for r in want] == list(range(1, k + 5))
  for key in ("train/loss", "train/grad_norm"):
    np.testing.assert_allclose([r[key] for r in rows], [r[key] for r in want], rtol=1e-5)
  assert rows[-1]["train/loss"] < rows[0]["train/loss"]  # it trained


# The default heartbeat timeout (60 s; JAX's own, the C++ backstop, is 4x that): a killed
# process is noticed by a collective that lost its connection (gloo) or by the end of the
# coordination service, not by a missing heartbeat. Steps are ~1 s here: a checkpoint every
# 2 steps is often in flight when the kill lands (the test passes either way).
KILL_FLAGS = ("--config.total_steps=14", "--config.checkpoint_every=2")
SURVIVOR_S = 10  # the most seconds from a kill to the survivor's exit


def kill_one(procs, victim: int, tmp_path, after: str, child: bool = False):
  """Once process 0 prints ``after``, ``kill -9`` of process ``victim`` (its supervisor, and
  with it the training process; ``child``: the training process alone); returns the
  survivor's (exit status, seconds from the kill to its exit, its stderr) and the victim's
  (exit status, stderr)."""
  survivor = 1 - victim
  try:
    tp.wait_for(procs[0], after)
    pid = procs[victim].pid
    if child:  # The supervisor's one child, the process under it that runs train.py.
      with open(f"/proc/{pid}/task/{pid}/children") as f:
        pid = int(f.read().split()[0])
    os.kill(pid, signal.SIGKILL)  # no handler, no flush, no goodbye to the coordinator
    killed_at = time.monotonic()
    rc, _ = tp.finish(procs[survivor], timeout=120)
    survivor_s = time.monotonic() - killed_at
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
      p.wait(timeout=60)
  print(f"process {survivor} exited {rc} {survivor_s:.1f}s after the kill of process {victim}")
  read = lambda i: (tmp_path / f"stderr_{i}.txt").read_text()
  return (rc, survivor_s, read(survivor)), (procs[victim].returncode, read(victim))


def check_lost_line(rc, survivor_s, stderr, workdir, lost: int, reasons: tuple[str, ...],
                    earliest_step: int) -> int:
  """The survivor's end: status 75 within SURVIVOR_S, one clean line whose reason matches
  one of the patterns ``reasons``; returns its last complete checkpoint step."""
  assert rc == 75, stderr[-3000:]
  assert survivor_s < SURVIVOR_S, survivor_s
  for noise in ("Fatal Python error", "Check failure", "Traceback"):
    assert noise not in stderr, stderr[-3000:]
  errors = [l for l in stderr.splitlines() if l.startswith("error:")]
  assert len(errors) == 1, stderr[-3000:]
  line = re.fullmatch(
      rf"error: process {lost} of 2 stopped responding \(({'|'.join(reasons)})\)"
      r" at step (\d+); "
      r"the last complete checkpoint is step (\d+) in (\S+); restart all 2 processes with the "
      r"same command to resume: (.*)", errors[0])
  assert line, errors[0]
  lost_step, kept = int(line.group(2)), int(line.group(3))
  assert earliest_step <= lost_step < 14 and line.group(4) == str(workdir / "checkpoints")
  assert "train.py" in line.group(5) and f"--workdir={workdir}" in line.group(5)
  # Only complete steps are listed (a save cut short is at most a tmp directory), as they
  # stand when the line is written: an async save whose commit (process 0's rename, its parts
  # all written before the death) lands after the line adds the next checkpoint step (every
  # 2 in KILL_FLAGS). Returns the newest complete step, the one a restart resumes from.
  steps = tp.checkpoint_steps(workdir)
  assert 2 <= kept <= max(steps) <= lost_step and kept in steps, (kept, steps)
  assert max(steps) - kept in (0, 2), (kept, steps)
  return max(steps)


def test_a_killed_process_ends_the_survivor_with_75_and_one_line_then_both_resume(tmp_path):
  """Process 1's training process killed (its supervisor lives on): process 0's next
  collective fails, and process 0 reports it. Both restarted resume; then process 0 killed
  (with it the coordination service): process 1's supervisor reports it, or process 1
  itself where a collective failed first. Both restarted resume again and finish the
  schedule."""
  from training import distributed as dist_lib

  workdir = tmp_path / "run"
  (rc, survivor_s, stderr), (victim_rc, victim_err) = kill_one(
      start_two(workdir, base_flags=KILL_FLAGS, stderr_dir=tmp_path), 1, tmp_path,
      after=r"step +5/14", child=True)
  # gloo's connection to it closed. (JAX's service may learn of the death first and end
  # process 0 itself (seen once in CI, a kill during a checkpoint write): its supervisor
  # then says so.)
  collective = re.escape(dist_lib.COLLECTIVE_CLOSED) + r", Gloo [\w -]+ failed: [\w ]+"
  kept = check_lost_line(rc, survivor_s, stderr, workdir, 1,
                         (collective, "JAX's coordination service reported its failure"),
                         earliest_step=5)
  # The victim's supervisor says what ended its training process, in one line of its own.
  assert victim_rc == 137, victim_err[-3000:]
  assert re.fullmatch(r"supervisor: the training process of process 1 \(pid \d+\) was ended "
                      r"by SIGKILL \(signal 9\); exit status 137",
                      victim_err.strip().splitlines()[-1]), victim_err[-3000:]
  assert "error:" not in victim_err and "Traceback" not in victim_err, victim_err[-3000:]

  # The same command on both processes resumes from it; 3 steps on, process 0 dies.
  procs = start_two(workdir, base_flags=KILL_FLAGS, stderr_dir=tmp_path)
  try:
    tp.wait_for(procs[0], rf"resumed from step {kept} ")
  except AssertionError:
    for p in procs:
      p.kill()
    raise
  (rc, survivor_s, stderr), _ = kill_one(procs, 0, tmp_path, after=rf"step +{kept + 3}/14")
  kept = check_lost_line(rc, survivor_s, stderr, workdir, 0,
                         ("the coordination service it hosts is gone", collective),
                         earliest_step=kept + 3)
  notes = [l for l in stderr.splitlines() if l.startswith("note:")]
  # JAX's abort report (held back from stderr) is kept in a file when it said why it ended.
  assert len(notes) <= 1 and all(os.path.isfile(n.rsplit(" ", 1)[-1]) for n in notes), notes

  results = tp.finish_all(start_two(workdir, base_flags=KILL_FLAGS))
  for rc, out in results:
    assert rc == 0, out[-3000:]
  assert f"resumed from step {kept} " in results[0][1], results[0][1][-3000:]
  assert "done: step 14" in results[0][1]
  leftovers = [n for n in os.listdir(workdir / "checkpoints") if "tmp" in n]
  assert leftovers == [], leftovers  # the interrupted saves' tmp directories are gone
  assert [r["step"] for r in tp.train_rows(workdir)] == list(range(1, 15))
