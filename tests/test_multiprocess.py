"""`train.py` as two processes over `jax.distributed` on localhost (gloo, 4 CPU devices each).

One scenario, to stay within a couple of minutes on 2 cores: a 2-process run is stopped
by a SIGTERM to one of its processes (both must finish the same step, save and exit 0),
resumed by a 1-process run on the same 8-device mesh for two steps, then by a 2-process
run for two more; the whole loss curve must equal an uninterrupted 1-process run's.
"""

import re
import signal

import numpy as np

import train_procs as tp

FLAGS = ("--config.total_steps=1000", "--config.checkpoint_every=1000")


def start_two(workdir, *flags):
  port = tp.free_port()
  return [tp.start(workdir, *FLAGS, *flags, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                   JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(i)) for i in range(2)]


def test_two_processes_preempted_then_resumed_by_one_match_one_process(tmp_path):
  workdir = tmp_path / "run"
  procs = start_two(workdir)
  try:
    head = tp.wait_for(procs[0], r"step +2/1000")
  except AssertionError:
    for p in procs:
      p.kill()
    raise
  assert "(2 process(es)); mesh {'data': 2, 'sequence': 4, 'tensor': 1}" in head
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
