"""A thin parent process around each process of a multi-process ``train.py`` run:
:func:`supervise` (importing no JAX) re-executes ``train.py`` as its child and prints the
lost-peer line the child could not when JAX's C++ client aborted it (process 0, host of the
coordination service, died). docs/training.md, "When a process dies", has its exit statuses;
``RING_JAX_SUPERVISOR=0`` runs without it."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import time

#: In the child's environment: "1" (do not supervise again); the report pipe's fd.
_CHILD_ENV = "RING_JAX_SUPERVISED"
_FD_ENV = "RING_JAX_SUPERVISOR_FD"
#: "0" turns the supervisor off.
SWITCH_ENV = "RING_JAX_SUPERVISOR"

#: Exit status of every surviving process when a peer process is lost (BSD EX_TEMPFAIL:
#: a temporary failure, rerunning the same command on all processes resumes).
EXIT_PEER_LOST = 75

FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)

# JAX's client ends a process with this line when the coordination service reports an error;
# "Failed to send RPC to coordination service" / UNAVAILABLE: the service itself is gone.
_TERMINATING = "Terminating process because the JAX distributed service detected fatal errors"
_SERVICE_GONE = re.compile(r"UNAVAILABLE|Failed to send RPC to coordination service")
# How the service's errors name a process: its task, "/job:jax_worker/replica:0/task:1".
_TASK = re.compile(r"/task:(\d+)")
# The coordination agent's C++ log lines before it, held back until the next line shows
# whether the termination follows (and the lines continuing one, e.g. gRPC's details).
_AGENT_LOG = re.compile(
    r"^[EWF]\d{4} .*(coordination_service|coordination service|preemption_sync_manager)")
_LOG_LINE = re.compile(r"^[IWEF]\d{4} ")
_HOLD_S = 1.0  # a held line nothing follows is passed on after this long


def multiprocess_launch_detected(environ=os.environ) -> str | None:
  """Names the launcher whose environment asks for several processes (the cases
  ``jax.distributed.initialize()`` completes from the environment), else None."""
  if environ.get("JAX_COORDINATOR_ADDRESS"):
    return "JAX_COORDINATOR_ADDRESS"
  if int(environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_JOB_ID" in environ:
    return "SLURM"
  if int(environ.get("OMPI_COMM_WORLD_SIZE", "1")) > 1 and "OMPI_MCA_orte_hnp_uri" in environ:
    return "Open MPI"
  if "," in environ.get("TPU_WORKER_HOSTNAMES", ""):
    return "multi-host TPU (TPU_WORKER_HOSTNAMES)"
  return None


def flag_value(argv, name: str, default: str | None = None) -> str | None:
  """The value of the absl flag ``--name`` in ``argv`` (the last one given), else ``default``."""
  value = default
  for i, arg in enumerate(argv):
    if arg.startswith(f"--{name}="):
      value = arg.split("=", 1)[1]
    elif arg == f"--{name}" and i + 1 < len(argv):
      value = argv[i + 1]
  return value


def wanted(argv, environ=os.environ) -> bool:
  """Whether this ``train.py`` process should run under :func:`supervise`: a multi-process
  launch (as ``--distributed`` decides it), not already the supervised child, not off."""
  if environ.get(_CHILD_ENV) or environ.get(SWITCH_ENV, "1") == "0":
    return False
  mode = flag_value(argv, "distributed", "auto")
  return mode == "on" or (mode == "auto" and multiprocess_launch_detected(environ) is not None)


def report(**fields) -> None:
  """Sends ``fields`` to the supervisor (no-op without one): ``process_id``, ``num_processes``,
  ``workdir``, ``checkpoint_dir``, ``resume_command``, ``coordinator`` once; ``step`` as the loop
  advances; ``declared``, the lost-peer line, just before the child prints it itself."""
  if fd := os.environ.get(_FD_ENV):
    with contextlib.suppress(OSError):  # The supervisor is gone (SIGKILL next), or not our fd.
      os.write(int(fd), (json.dumps(fields) + "\n").encode())


def _child_setup():
  """The child's ``preexec_fn``: its own process group, and (Linux) death with this process."""
  parent_pid = os.getpid()
  libc = ctypes.CDLL(None) if sys.platform.startswith("linux") else None  # loaded before fork

  def setup():
    os.setpgid(0, 0)  # Our own group: a terminal's signals reach the child once, via us.
    if libc is not None:
      libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the supervisor
      if os.getppid() != parent_pid:  # it died before the prctl
        os._exit(128 + signal.SIGKILL)
  return setup


def coordinator_refuses(address: str, timeout_s: float = 2.0) -> bool:
  """Whether nothing accepts connections at ``host:port`` any more (a dead coordinator)."""
  host, _, port = address.rpartition(":")
  try:
    with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
      return False
  except ConnectionRefusedError:
    return True
  except (OSError, ValueError):  # unreachable, timed out, unparsable: do not guess
    return False


class _Lines:
  """Splits a non-blocking pipe's bytes into lines."""

  def __init__(self, fd: int):
    self.fd, self._buf, self.closed = fd, b"", False

  def read(self) -> list[str]:
    data = os.read(self.fd, 65536)
    if not data:
      self.closed = True
      lines, self._buf = ([self._buf] if self._buf else []), b""
    else:
      *lines, self._buf = (self._buf + data).split(b"\n")
      lines = [l + b"\n" for l in lines]
    return [l.decode(errors="replace") for l in lines]


def supervise(argv: list[str] | None = None) -> int:
  """Runs ``[sys.executable, *argv]`` (default: this interpreter's command line) as the
  supervised child, forwarding :data:`FORWARDED_SIGNALS`, passing its output through (JAX's
  report of a lost service to a file), learning what its line needs from :func:`report`.
  Returns :data:`EXIT_PEER_LOST` after the lost-peer line when the child ended on a lost
  peer, else the child's status (``128 + N`` for signal N, after a line that says so)."""
  argv = list(sys.orig_argv[1:] if argv is None else argv)
  report_r, report_w = os.pipe()
  env = dict(os.environ, **{_CHILD_ENV: "1", _FD_ENV: str(report_w)})
  child = subprocess.Popen([sys.executable, *argv], env=env, pass_fds=(report_w,),
                           stderr=subprocess.PIPE, preexec_fn=_child_setup())
  os.close(report_w)

  previous = {s: signal.signal(s, lambda n, _: child.send_signal(n)) for s in FORWARDED_SIGNALS}

  info: dict = {}
  held: list[str] = []  # stderr lines waiting for the next one (see _AGENT_LOG)
  held_since = 0.0
  swallowed: list[str] = []  # JAX's report of the lost service and all after it
  out = sys.stderr  # written through at once (Python >= 3.9): no flush needed
  err, reports = _Lines(child.stderr.fileno()), _Lines(report_r)
  ended_at = None  # when the child exited: a process it forked may hold the pipes open
  try:
    while not (err.closed and reports.closed):
      if ended_at is None and child.poll() is not None:
        ended_at = time.monotonic()
      if ended_at is not None and time.monotonic() - ended_at > _HOLD_S:
        break
      ready, _, _ = select.select([s.fd for s in (err, reports) if not s.closed], [], [],
                                  _HOLD_S / 4)
      for line in reports.read() if report_r in ready else ():  # first: "declared"
        with contextlib.suppress(ValueError):
          info.update(json.loads(line))
      for line in err.read() if err.fd in ready else ():
        if swallowed:
          swallowed.append(line)
        elif _TERMINATING in line:
          swallowed.extend([*held, line])
          held = []
        elif line == f"{info.get('declared')}\n":  # the child's line: never held as JAX's
          out.write(line)
        elif _AGENT_LOG.match(line) or (held and not _LOG_LINE.match(line)):
          held.append(line)
          held_since = time.monotonic()
        else:
          out.writelines([*held, line])
          held = []
      if held and (time.monotonic() - held_since > _HOLD_S or err.closed):
        out.writelines(held)
        held = []
    returncode = child.wait()
    if info.get("declared"):  # JAX's lines about the loss the child reported go to the file
      swallowed.extend(held)
    else:
      out.writelines(held)
  finally:
    for s, handler in previous.items():
      signal.signal(s, handler)
    os.close(report_r)
    child.stderr.close()
    if child.poll() is None:
      child.kill()
      child.wait()
  status = returncode if returncode >= 0 else 128 - returncode
  if info.get("declared") and returncode != 0:
    # The child printed the lost-peer line itself, then ended (JAX's abort may beat its exit):
    # that line alone (said here if JAX's report swallowed it), the report to the file.
    line = info["declared"] + "\n"
    if line in swallowed:
      swallowed.remove(line)
      out.write(line)
    _save_report(info, swallowed)
    return EXIT_PEER_LOST
  lost = None if returncode in (0, EXIT_PEER_LOST) or "checkpoint_dir" not in info else (
      _lost_process(info, swallowed, aborted=returncode == -signal.SIGABRT))
  if lost is None:  # Some other ending: the child said what it had to say ...
    out.writelines(swallowed)
    if returncode < 0:  # ... unless a signal ended it (an OOM killer's SIGKILL says nothing)
      out.write(f"supervisor: the training process of process {info.get('process_id', '?')} "
                f"(pid {child.pid}) was ended by {signal.Signals(-returncode).name} (signal "
                f"{-returncode}); exit status {status}\n")
    return status
  path = _save_report(info, swallowed)
  sys.stdout.flush()
  out.write(lost_peer_message(lost[0], info["num_processes"], lost[1], info.get("step"),
                              info["checkpoint_dir"], info["resume_command"])
            + "\n" + (f"note: JAX's report of it is in {path}\n" if path else ""))
  return EXIT_PEER_LOST


def _lost_process(info: dict, swallowed: list[str], aborted: bool) -> tuple[int, str] | None:
  """``(process, reason)`` of the peer whose loss ended the child, or None if none did."""
  me = info.get("process_id", 0)
  upto = next((i + 1 for i, l in enumerate(swallowed) if _TERMINATING in l), len(swallowed))
  jax_report = "".join(swallowed[:upto])  # JAX's lines up to its termination line
  if me != 0 and (_SERVICE_GONE.search(jax_report) if swallowed else (
      aborted and info.get("coordinator") and coordinator_refuses(info["coordinator"]))):
    return 0, "the coordination service it hosts is gone"
  others = sorted({int(t) for t in _TASK.findall(jax_report)} - {me})
  if others:
    return others[0], "JAX's coordination service reported its failure"
  return None


def complete_steps(directory: str) -> list[int]:
  """The complete (finalized) checkpoint steps in ``directory``, oldest first; [] if it does
  not exist. Orbax finalizes a step by renaming its directory to ``<step>``; this reads the
  listing alone: no JAX, no Orbax threads, safe from any thread and during shutdown."""
  try:
    names = os.listdir(directory)
  except FileNotFoundError:
    return []
  return sorted(int(n) for n in names if n.isdigit() and os.path.isdir(os.path.join(directory, n)))


def _save_report(info: dict, swallowed: list[str]) -> str | None:
  """Writes JAX's held-back report to ``<workdir>/abort_process_<i>.txt``; returns the path."""
  if not swallowed or not info.get("workdir"):
    return None
  path = os.path.join(info["workdir"], f"abort_process_{info['process_id']}.txt")
  try:
    with open(path, "w") as f:
      f.writelines(swallowed)
  except OSError:
    return None
  return path


def lost_peer_message(lost: int | None, num_processes: int, reason: str, step: int | None,
                      checkpoint_dir: str, resume_command: str) -> str:
  """The one line a survivor prints; ``reason`` says how the loss was noticed; ``lost``
  None: the survivor cannot tell which process it lost. The checkpoint steps are listed
  without Orbax (:func:`complete_steps`: its threads are gone once Python's shutdown began)."""
  who = "another process" if lost is None else f"process {lost}"
  where = f" at step {step}" if step is not None else " before the first step"
  steps = complete_steps(checkpoint_dir)
  kept = (f"the last complete checkpoint is step {steps[-1]} in {checkpoint_dir}"
          if steps else f"no complete checkpoint is in {checkpoint_dir} (a rerun "
          "starts afresh)")
  return (f"error: {who} of {num_processes} stopped responding ({reason}){where}; "
          f"{kept}; restart all {num_processes} processes with the same command to resume: "
          f"{resume_command}")
