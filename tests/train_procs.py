"""Helpers for tests that run `train.py` as real subprocesses (signals, exit statuses)."""

from __future__ import annotations

import fcntl
import json
import os
import queue
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

from training import supervisor as supervisor_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN_PY = os.path.join(ROOT, "train.py")

# configs/tiny.py shrunk so a run compiles and steps in seconds on 2 cores.
TINY_FLAGS = (
    "--config.model.dim=32", "--config.model.mlp_dim=64", "--config.model.num_layers=1",
    "--config.data.seq_len=64", "--config.data.kv.num_pairs=4",
    "--config.data.kv.num_queries=4", "--config.eval_batches=1", "--config.eval_every=1000",
    "--config.optim.warmup_steps=0", "--config.log_every=1",
)


def env(**extra: str) -> dict[str, str]:
  """The environment of a child that sizes its own CPU devices (train.py, the benchmarks):
  the test environment with ``XLA_FLAGS`` minus its device count. The rest of the flags
  stays, so the child compiles as the suite does (LLVM -O0, tests/conftest.py: 0.68x the CPU
  time of a tiny train.py run)."""
  out = dict(os.environ)
  flags = [f for f in out.pop("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count")]
  if flags:
    out["XLA_FLAGS"] = " ".join(flags)
  out.update(JAX_PLATFORMS="cpu", PYTHONPATH=ROOT, **extra)
  cache = out.get("JAX_COMPILATION_CACHE_DIR")
  if cache and supervisor_lib.multiprocess_launch_detected(out):
    # One process of several: its programs' cache keys equal a 1-process run's on as many
    # devices (tests/conftest.py), so it keeps to a cache of its own kind, shared by the
    # runs of several processes only (JAX writes from process 0, every process reads: its
    # multi-host design), where keys meet programs of the same process layout.
    out["JAX_COMPILATION_CACHE_DIR"] = os.path.join(cache, "multiprocess")
  return out


def command(workdir, *flags: str, wrapper: str | None = None) -> list[str]:
  prefix = [sys.executable] + ([wrapper] if wrapper else [])
  return prefix + [TRAIN_PY, *TINY_FLAGS, f"--workdir={workdir}", *flags]


# How the waits below decide that a child is stuck rather than slow. On a loaded machine
# (load ~6 on 2 cores) a tiny train step has taken 145-155 s to compile, printing nothing:
# a fixed wall-clock deadline fails such a run although it progresses. So a wait fails only
# when, for STALL_S, the child printed no line and no process of this test's tree (the
# child, its peers of a multi-process run, their supervised children) used CPU; LIMIT_S caps
# the whole wait, far above any healthy run, so a busy-looping child still ends the test.
STALL_S = 120.0
LIMIT_S = 1800.0
_POLL_S = 1.0
_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _descendants_cpu_s(root: int) -> float | None:
  """CPU seconds (user + system) of the live processes under ``root`` (not ``root``),
  from /proc; None where /proc has no children lists (then only output and LIMIT_S count)."""
  total, seen, todo = 0.0, set(), [root]
  while todo:
    pid = todo.pop()
    try:
      tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
      if pid == root:
        return None
      continue
    for tid in tasks:
      try:
        with open(f"/proc/{pid}/task/{tid}/children") as f:
          kids = [int(c) for c in f.read().split()]
      except OSError:
        kids = []
      for kid in kids:
        if kid not in seen:
          seen.add(kid)
          todo.append(kid)
  for pid in seen:
    try:
      with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
      total += (int(fields[11]) + int(fields[12])) / _CLK_TCK  # utime, stime
    except (OSError, IndexError, ValueError):
      pass  # exited meanwhile
  return total


class _Watch:
  """Tells whether the children of this process still progress (see STALL_S)."""

  def __init__(self, stall: float, limit: float):
    self.stall, self.start = stall, time.monotonic()
    self.deadline = self.start + limit
    self.cpu, self.last_progress = _descendants_cpu_s(os.getpid()), self.start

  def progressed(self) -> None:
    self.last_progress = time.monotonic()

  def stuck(self) -> str | None:
    """None while progressing, else why the wait gives up."""
    now = time.monotonic()
    if now > self.deadline:
      return f"still running after {now - self.start:.0f}s (the {LIMIT_S:.0f}s cap)"
    cpu = _descendants_cpu_s(os.getpid())
    if cpu is not None and self.cpu is not None and cpu > self.cpu + 0.2:
      self.last_progress = now
    self.cpu = cpu
    if now - self.last_progress > self.stall:
      return (f"no output and no CPU use for {self.stall:.0f}s "
              f"({now - self.start:.0f}s in all)")
    return None


def _read_lines(proc: subprocess.Popen) -> None:
  for line in proc.stdout:
    proc.lines.put(line)
  proc.lines.put(None)  # end of output


def _popen(cmd, **kw) -> subprocess.Popen:
  """Popen whose stdout lines arrive on ``proc.lines`` (a queue; None at the end) from a
  reader thread, so waits can poll without blocking on a silent child."""
  proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True, **kw)
  proc.lines, proc.seen = queue.Queue(), []
  proc.reader = threading.Thread(target=_read_lines, args=(proc,), daemon=True)
  proc.reader.start()
  return proc


def run(workdir, *flags: str, wrapper: str | None = None, stall: float = STALL_S,
        **env_extra: str) -> subprocess.CompletedProcess:
  """``train.py`` to its end; stdout and stderr captured apart (as ``subprocess.run``)."""
  with tempfile.TemporaryFile("w+") as err:
    proc = _popen(command(workdir, *flags, wrapper=wrapper), env=env(**env_extra), stderr=err)
    rc, out = finish(proc, stall=stall)
    err.seek(0)
    return subprocess.CompletedProcess(proc.args, rc, out, err.read())


def start(workdir, *flags: str, stderr_path=None, **env_extra: str) -> subprocess.Popen:
  """A background run; stdout (and stderr, unless ``stderr_path`` names a file to write it
  to) read line by line with wait_for."""
  stderr = subprocess.STDOUT if stderr_path is None else open(stderr_path, "w")
  try:
    return _popen(command(workdir, *flags), env=env(**env_extra), stderr=stderr)
  finally:
    if stderr_path is not None:
      stderr.close()  # The child holds its own copy.


def wait_for(proc: subprocess.Popen, pattern: str, stall: float = STALL_S,
             limit: float = LIMIT_S) -> str:
  """Reads ``proc``'s output until a line matches ``pattern``; returns what was read. Fails
  if the child ends first or stops progressing (STALL_S)."""
  watch, start = _Watch(stall, limit), len(proc.seen)
  while True:
    try:
      line = proc.lines.get(timeout=_POLL_S)
    except queue.Empty:
      why = watch.stuck()
      if why is None:
        continue
      proc.kill()
      raise AssertionError(f"no line matching {pattern!r}: {why}; output:\n"
                           + "".join(proc.seen)[-4000:]) from None
    if line is None:
      proc.lines.put(None)  # stays at the end for later reads
      raise AssertionError(f"exited before a line matching {pattern!r}; output:\n"
                           + "".join(proc.seen)[-4000:])
    proc.seen.append(line)
    watch.progressed()
    if re.search(pattern, line):
      return "".join(proc.seen[start:])


def finish(proc: subprocess.Popen, timeout: float | None = None,
           stall: float = STALL_S) -> tuple[int, str]:
  """Waits for ``proc`` to exit; returns (exit status, its output from where the last
  wait_for stopped reading). ``timeout``: a wall-clock bound the test asserts (the product
  promises an exit within it); otherwise the wait lasts while the child progresses."""
  watch = _Watch(stall, LIMIT_S if timeout is None else timeout)
  rest = []
  while True:
    try:
      line = proc.lines.get(timeout=_POLL_S)
    except queue.Empty:
      why = watch.stuck() if timeout is None else (
          f"still running after {timeout}s" if time.monotonic() > watch.deadline else None)
      if why is None:
        continue
      proc.kill()
      proc.wait()
      raise AssertionError(f"{why}; output:\n" + "".join(proc.seen + rest)[-4000:]) from None
    if line is None:
      break
    rest.append(line)
    watch.progressed()
  proc.seen.extend(rest)
  return proc.wait(), "".join(rest)


def finish_all(procs: list[subprocess.Popen]) -> list[tuple[int, str]]:
  """:func:`finish` for each; none is left running, whatever happens."""
  try:
    return [finish(p) for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def train_rows(workdir) -> list[dict]:
  """The ``train/`` rows of ``metrics.jsonl``, in file order."""
  path = os.path.join(workdir, "metrics.jsonl")
  with open(path) as f:
    return [r for r in map(json.loads, f) if "train/loss" in r]


def checkpoint_steps(workdir) -> list[int]:
  directory = os.path.join(workdir, "checkpoints")
  return sorted(int(n) for n in os.listdir(directory) if n.isdigit())


def shared_run(tmp_path_factory, name: str, make) -> dict:
  """What ``make(directory)`` returns (JSON data), made once per test session.

  For runs that several tests read (a ``train.py`` workdir, an export): the first test to ask
  makes it, in a directory shared by pytest-xdist's workers, while a file lock makes the
  others wait and then read the same result; pytest's own session fixtures would run it
  once per worker. A ``make`` that raised is retried by the next test that asks, so each
  reports the failure itself.
  """
  root = tmp_path_factory.getbasetemp()
  if os.environ.get("PYTEST_XDIST_WORKER"):
    root = root.parent  # the workers' basetemps share this parent
  directory, done = root / f"shared-{name}", root / f"shared-{name}.json"
  with open(root / f"shared-{name}.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not done.exists():
      shutil.rmtree(directory, ignore_errors=True)
      directory.mkdir()
      done.write_text(json.dumps(make(directory)))
    return json.loads(done.read_text())
