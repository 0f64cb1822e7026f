"""Helpers for tests that run `train.py` as real subprocesses (signals, exit statuses)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time

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
  return out


def command(workdir, *flags: str, wrapper: str | None = None) -> list[str]:
  prefix = [sys.executable] + ([wrapper] if wrapper else [])
  return prefix + [TRAIN_PY, *TINY_FLAGS, f"--workdir={workdir}", *flags]


def run(workdir, *flags: str, wrapper: str | None = None, timeout: float = 300,
        **env_extra: str) -> subprocess.CompletedProcess:
  return subprocess.run(command(workdir, *flags, wrapper=wrapper), cwd=ROOT,
                        env=env(**env_extra), capture_output=True, text=True, timeout=timeout)


def start(workdir, *flags: str, stderr_path=None, **env_extra: str) -> subprocess.Popen:
  """A background run; stdout (and stderr, unless ``stderr_path`` names a file to write it
  to) read line by line with wait_for."""
  stderr = subprocess.STDOUT if stderr_path is None else open(stderr_path, "w")
  try:
    return subprocess.Popen(command(workdir, *flags), cwd=ROOT, env=env(**env_extra),
                            stdout=subprocess.PIPE, stderr=stderr, text=True)
  finally:
    if stderr_path is not None:
      stderr.close()  # The child holds its own copy.


def wait_for(proc: subprocess.Popen, pattern: str, timeout: float = 240) -> str:
  """Reads ``proc``'s output until a line matches ``pattern``; returns what was read."""
  deadline, seen = time.monotonic() + timeout, []
  while time.monotonic() < deadline:
    line = proc.stdout.readline()
    if not line:
      break  # exited
    seen.append(line)
    if re.search(pattern, line):
      return "".join(seen)
  proc.kill()
  raise AssertionError(f"no line matching {pattern!r}; output:\n" + "".join(seen)[-4000:])


def finish(proc: subprocess.Popen, timeout: float = 240) -> tuple[int, str]:
  """Waits for ``proc`` (killing it if it overruns); returns (exit status, output)."""
  try:
    out, _ = proc.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    proc.kill()
    out, _ = proc.communicate()
    raise AssertionError(f"still running after {timeout}s; output:\n{out[-4000:]}") from None
  return proc.returncode, out


def finish_all(procs: list[subprocess.Popen], timeout: float = 240) -> list[tuple[int, str]]:
  """:func:`finish` for each; none is left running, whatever happens."""
  try:
    return [finish(p, timeout) for p in procs]
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
