"""Multi-process start-up and the clean exit when a peer process dies.

``jax.distributed.initialize`` connects the processes of a run through JAX's
coordination service (hosted by process 0). When a process dies (``kill -9``,
a crashed host), the survivors stall in their next collective (or gloo raises
"Connection closed by peer"), and the coordination service notices the missing
heartbeats only after its heartbeat timeout; it then terminates every
survivor from C++ (a "Check failure" stack trace, "Fatal Python error:
Aborted", status 134), with no word on what happened or how to resume.

:class:`PeerWatchdog` makes that a documented failure: a daemon thread in every
process bumps a liveness counter in the coordination service's key-value store
every ``heartbeat_timeout_s / 5`` seconds; process 0 watches every counter and
declares a process lost when its counter has not moved for
``heartbeat_timeout_s``. It then publishes the verdict (a key every survivor
polls), and each survivor prints one line naming the lost process, the step,
the last complete checkpoint and the command that resumes, and exits with
:data:`EXIT_PEER_LOST` (75, ``EX_TEMPFAIL``: rerunning is the fix). JAX's own
heartbeat timeout is set to :data:`JAX_HEARTBEAT_FACTOR` times
``heartbeat_timeout_s`` so this happens well before its C++ abort, which stays
as the backstop (e.g. if a survivor's Python is wedged).

Why a watchdog of our own and not JAX's ``missed_heartbeat_callback``:
``jax.distributed.initialize`` does not expose it, and on jaxlib 0.10 a Python
callback passed to the client is never reached (converting its ``absl::Status``
argument throws ``std::bad_cast``, which terminates the process just the same).

Process 0 is the one case no watchdog inside the run can report: the coordination
service dies with it, and JAX's client terminates every survivor from C++ within
milliseconds, before any Python code runs. ``train.py`` therefore runs each process of a
multi-process run as the child of a thin supervisor (``training.supervisor``, which imports
no JAX while the child runs); :func:`start_watchdog` and :func:`note_step` tell it the
process index, the checkpoint directory, the resume command and the step, and when JAX
ends a child of a process other than 0 because the service is gone, the supervisor prints
the same line for process 0 (:func:`lost_peer_message`) and exits with
:data:`EXIT_PEER_LOST` too.
"""

from __future__ import annotations

import atexit
import inspect
import os
import sys
import threading
import time
from typing import Callable

import jax

from training import supervisor

# The exit status and the line of a lost peer are the supervisor's (it imports no JAX and
# reports a lost coordinator itself); this module re-exports them.
EXIT_PEER_LOST = supervisor.EXIT_PEER_LOST
lost_peer_message = supervisor.lost_peer_message

#: JAX's coordination-service heartbeat timeout, as a multiple of ``heartbeat_timeout_s``:
#: it may fire from half its value after a death on, so this keeps the watchdog's verdict
#: (at most 1.6 x heartbeat_timeout_s, the survivors' acknowledgements included) first.
JAX_HEARTBEAT_FACTOR = 4

_PREFIX = "ring_jax/liveness"


def initialize(distributed_config, **kwargs) -> None:
  """``jax.distributed.initialize(**kwargs)`` with the heartbeat and start-up timeouts of
  ``config.distributed``, passing only the arguments the installed JAX accepts."""
  accepted = inspect.signature(jax.distributed.initialize).parameters
  timeouts = {
      "heartbeat_timeout_seconds": JAX_HEARTBEAT_FACTOR * int(
          distributed_config.heartbeat_timeout_s),
      "initialization_timeout": int(distributed_config.initialization_timeout_s),
  }
  kwargs.update({k: v for k, v in timeouts.items() if k in accepted})
  if "heartbeat_timeout_seconds" not in accepted:  # JAX's default (100 s) may then fire first.
    print("warning: this JAX's jax.distributed.initialize takes no heartbeat_timeout_seconds; "
          "a process that dies may end the others with JAX's abort instead of status 75",
          file=sys.stderr, flush=True)
  jax.distributed.initialize(**kwargs)


def start_watchdog(distributed_config, checkpoint_dir: str, resume_command: str,
                   steps: Callable[[str], list[int]]) -> "PeerWatchdog | None":
  """Starts the :class:`PeerWatchdog` of a multi-process run (None on one process).

  ``steps(checkpoint_dir)`` lists the complete checkpoint steps for the line.
  :func:`finish` after a clean end tells the others not to expect this process any more;
  otherwise the watchdog just stops beating at interpreter exit (before JAX's shutdown),
  so a process that exits with an error is reported by the others like one that died.
  :func:`note_step` and :func:`wait_for_verdict` reach it from the loop.
  """
  global _ACTIVE
  from jax._src import distributed as jax_distributed
  state = jax_distributed.global_state
  if state.client is None or state.num_processes <= 1:
    return None
  timeout_s = float(distributed_config.heartbeat_timeout_s)
  supervisor.report(process_id=state.process_id, num_processes=state.num_processes,
                    workdir=os.path.dirname(checkpoint_dir), checkpoint_dir=checkpoint_dir,
                    resume_command=resume_command, coordinator=state.coordinator_address)

  def describe(lost: int, step: int | None) -> str:
    return lost_peer_message(lost, state.num_processes, f"no heartbeat for {timeout_s:g} s",
                             step, steps(checkpoint_dir), checkpoint_dir, resume_command)

  _ACTIVE = PeerWatchdog(timeout_s, describe, client=state.client,
                         process_id=state.process_id, num_processes=state.num_processes)
  atexit.register(_ACTIVE.stop)
  return _ACTIVE.start()


_ACTIVE: "PeerWatchdog | None" = None


def finish() -> None:
  """A clean end of this process (all its steps done): the others stop expecting its beats."""
  if _ACTIVE is not None:
    _ACTIVE.stop(done=True)


def note_step(step: int) -> None:
  """Tells the running watchdog and the supervisor (if any) which step the loop is on, for
  their line."""
  if _ACTIVE is not None:
    _ACTIVE.note_step(step)
    supervisor.report(step=step)


def wait_for_verdict() -> bool:
  """After an unexpected error on a multi-process run: gives the watchdog the time to
  find a lost peer (it then prints its line and exits the process); False if none is."""
  return _ACTIVE is not None and _ACTIVE.wait_for_verdict()


class PeerWatchdog:
  """Liveness counters in the coordination service; a lost peer ends every survivor.

  Args:
    heartbeat_timeout_s: a process whose counter has not moved this long is lost.
    describe: ``describe(lost_process, step) -> str``, the line printed on stderr (it
      may read the filesystem; it runs on the watchdog thread).
    client: the coordination service's client (``jax._src.distributed.global_state``).
    exit: called with :data:`EXIT_PEER_LOST` after the line; ``os._exit`` in a run (no
      atexit handler may wait on the dead peer).
  """

  def __init__(self, heartbeat_timeout_s: float, describe: Callable[[int, int | None], str],
               *, client, process_id: int, num_processes: int,
               exit: Callable[[int], None] = os._exit):
    self.timeout_s = float(heartbeat_timeout_s)
    self.interval_s = max(self.timeout_s / 5, 0.2)
    self.describe = describe
    self._exit = exit
    self._client = client
    self.process_id = process_id
    self.num_processes = num_processes
    self.step: int | None = None  # the newest step the loop started (note_step)
    self._stop = threading.Event()
    self._verdict = threading.Event()
    self._exited = threading.Event()  # the exit call returned (only a test's exit does)
    self._thread = threading.Thread(target=self._run, name="ring_jax-peer-watchdog",
                                    daemon=True)

  def start(self) -> "PeerWatchdog":
    self._thread.start()
    return self

  def note_step(self, step: int) -> None:
    self.step = step

  def stop(self, done: bool = False) -> None:
    """Stops beating; ``done``: a clean end, so the watchers stop expecting this process."""
    if self._stop.is_set():
      return
    self._stop.set()
    if not done:
      return
    try:
      self._client.key_value_set(f"{_PREFIX}/done/{self.process_id}", "1", allow_overwrite=True)
    except Exception:  # The coordination service is gone: nobody is watching any more.
      pass

  def wait_for_verdict(self, timeout_s: float | None = None) -> bool:
    """Blocks until the watchdog declares a peer lost (it then exits the process) or
    ``timeout_s`` (default: long enough for any verdict) passes; returns False then."""
    wait = 2 * self.timeout_s + 5 * self.interval_s if timeout_s is None else timeout_s
    if not self._verdict.wait(wait):
      return False
    # The watchdog is printing its line and exiting the process: the caller must not go on
    # (a traceback of the collective that failed meanwhile would follow the line).
    self._exited.wait()
    return True

  # --- The watchdog thread ----------------------------------------------------------------

  def _run(self) -> None:
    counter = 0
    seen: dict[int, tuple[str | None, float]] = {}  # peer -> (counter value, when it moved)
    while not self._stop.wait(self.interval_s):
      counter += 1
      try:
        self._client.key_value_set(f"{_PREFIX}/beat/{self.process_id}", str(counter),
                                   allow_overwrite=True)
        lost = dict(self._client.key_value_dir_get(f"{_PREFIX}/lost/"))
        if lost:
          self._declare(int(next(iter(lost.values()))), publish=False)
          return
        if self.process_id == 0:
          peer = self._silent_peer(seen)
          if peer is not None:
            self._declare(peer, publish=True)
            return
      except Exception:  # A transient RPC error; a dead coordinator ends us from C++.
        continue

  def _silent_peer(self, seen) -> int | None:
    now = time.monotonic()
    beats = dict(self._client.key_value_dir_get(f"{_PREFIX}/beat/"))
    done = {k.rsplit("/", 1)[-1] for k, _ in self._client.key_value_dir_get(f"{_PREFIX}/done/")}
    for peer in range(1, self.num_processes):
      value = beats.get(f"{_PREFIX}/beat/{peer}")
      if peer not in seen or seen[peer][0] != value:
        seen[peer] = (value, now)
      elif str(peer) not in done and now - seen[peer][1] > self.timeout_s:
        return peer
    return None

  def _declare(self, lost: int, *, publish: bool) -> None:
    self._verdict.set()
    try:
      line = self.describe(lost, self.step)
    except Exception as e:  # Never let the report itself hide the verdict.
      line = f"error: process {lost} of {self.num_processes} stopped responding ({e!r})"
    sys.stdout.flush()
    print(line, file=sys.stderr, flush=True)
    if publish:  # Tell the other survivors; keep the coordination service up until they read it.
      try:
        self._client.key_value_set(f"{_PREFIX}/lost/verdict", str(lost), allow_overwrite=True)
        deadline = time.monotonic() + 2 * self.interval_s + 1.0
        others = self.num_processes - 2  # neither us nor the lost one
        while others > 0 and time.monotonic() < deadline:
          if len(self._client.key_value_dir_get(f"{_PREFIX}/exiting/")) >= others:
            break
          time.sleep(0.05)
      except Exception:
        pass
    else:
      try:
        self._client.key_value_set(f"{_PREFIX}/exiting/{self.process_id}", "1",
                                   allow_overwrite=True)
      except Exception:
        pass
    self._exit(EXIT_PEER_LOST)
    self._exited.set()
