"""Multi-process start-up and the clean exit when a peer process dies: every survivor ends
with one line (:func:`lost_peer_message`) and status :data:`EXIT_PEER_LOST`, from a failed
collective (:func:`exit_if_peer_lost`) or a stopped heartbeat (:class:`PeerWatchdog`);
docs/training.md, "When a process dies", has the whole story."""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import re
import signal
import sys
import threading
import time
from typing import Any, Callable

import jax
import numpy as np
from jax.experimental import multihost_utils

from training import supervisor
# Re-exported: the supervisor (no JAX; it reports a lost coordinator itself) defines them.
from training.supervisor import EXIT_PEER_LOST, lost_peer_message

#: JAX's coordination-service heartbeat timeout, as a multiple of ``heartbeat_timeout_s``
#: (it may fire from half its value on): the watchdog's verdict comes first.
JAX_HEARTBEAT_FACTOR = 4

_PREFIX = "ring_jax/liveness"

#: What a collective's error says when a peer process's connection went away, searched in an
#: exception and those it was raised from: group 1 names the collective, group 2 holds the
#: transport's words. A timeout, or a reset socket outside a collective, does not count.
PEER_CONNECTION_CLOSED = (
    # gloo (CPU): XLA wraps gloo's pair.cc error as "Gloo <collective> failed: <what>".
    re.compile(r"\b(Gloo [\w -]+?) failed: .*?(Connection closed by peer|Connection reset by "
               r"peer|Broken pipe)", re.S),
    # NCCL (GPU): nccl_errors.h's report of ncclRemoteError.
    re.compile(r"\b(NCCL operation \w+).*? failed: (remote process exited or there was a "
               r"network error)", re.S),
)
#: The start of the reason in the line of a lost peer found by a failed collective.
COLLECTIVE_CLOSED = "its connection closed in a collective"


def start(mode: str, distributed_config) -> int:
  """train.py's ``--distributed`` (``mode``): :func:`initialize` if asked or detected (gloo
  collectives on CPU); returns the process count. Starts no backend."""
  launcher = supervisor.multiprocess_launch_detected()
  if mode == "off" or (mode == "auto" and launcher is None):
    return 1
  kwargs = {arg: int(os.environ[name]) for arg, name in (("num_processes", "JAX_NUM_PROCESSES"),
                                                         ("process_id", "JAX_PROCESS_ID"))
            if os.environ.get(name)}
  if os.environ.get("JAX_PLATFORMS", "") == "cpu":
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(  # the heartbeat and start-up timeouts of config.distributed
      heartbeat_timeout_seconds=JAX_HEARTBEAT_FACTOR * int(distributed_config.heartbeat_timeout_s),
      initialization_timeout=int(distributed_config.initialization_timeout_s), **kwargs)
  print(f"jax.distributed initialised ({launcher or 'forced by --distributed=on'})", flush=True)
  sizes = [os.environ.get(n) for n in ("JAX_NUM_PROCESSES", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE")]
  return int(next((n for n in sizes if n), 1))  # 1: unknown (TPU metadata), sizes CPU devices only


_ACTIVE: "PeerWatchdog | None" = None


def start_watchdog(distributed_config, checkpoint_dir: str,
                   resume_command: str) -> "PeerWatchdog | None":
  """Starts the :class:`PeerWatchdog` of a multi-process run (None on one process). Without
  :func:`finish` it stops beating at exit, so the others report an error exit as a death."""
  global _ACTIVE
  from jax._src import distributed as jax_distributed
  state = jax_distributed.global_state
  if state.client is None or state.num_processes <= 1:
    return None
  supervisor.report(process_id=state.process_id, num_processes=state.num_processes,
                    workdir=os.path.dirname(checkpoint_dir), checkpoint_dir=checkpoint_dir,
                    resume_command=resume_command, coordinator=state.coordinator_address)
  describe = functools.partial(lost_peer_message, num_processes=state.num_processes,
                               checkpoint_dir=checkpoint_dir, resume_command=resume_command)
  _ACTIVE = PeerWatchdog(float(distributed_config.heartbeat_timeout_s), describe,
                         client=state.client, process_id=state.process_id,
                         num_processes=state.num_processes)
  atexit.register(_ACTIVE.stop)
  return _ACTIVE.start()


def on_any_process(flag: bool) -> bool:
  """Whether ``flag`` holds on some process (a collective on several processes)."""
  if jax.process_count() == 1:
    return flag
  return bool(np.max(multihost_utils.process_allgather(np.int32(flag))))


def collective_lost_peer(error: BaseException) -> tuple[str, str] | None:
  """``(collective, transport's words)`` of :data:`PEER_CONNECTION_CLOSED` in ``error`` or its
  ``__cause__``/``__context__`` chain; None for any other error."""
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    for pattern in PEER_CONNECTION_CLOSED:
      if match := pattern.search(str(error)):
        return match.group(1), match.group(2)
    error = error.__cause__ or error.__context__
  return None


def exit_if_peer_lost(error: BaseException) -> None:
  """After an error on a multi-process run: where :func:`collective_lost_peer` finds it, the
  lost-peer line and :data:`EXIT_PEER_LOST` at once (``os._exit``: closing the checkpointer or
  JAX would wait on the dead peer's barriers); else the watchdog's time to find a lost peer (it
  then prints its line and exits). Returns if none is lost, and on one process."""
  if _ACTIVE is not None and (found := collective_lost_peer(error)) is not None:
    _ACTIVE.collective_failed(*found)
  elif _ACTIVE is not None:
    _ACTIVE.wait_for_verdict()


def finish() -> None:
  """A clean end of this process (all its steps done): the others stop expecting its beats."""
  if _ACTIVE is not None:
    _ACTIVE.stop(done=True)


def note_step(step: int) -> None:
  """Tells the watchdog and the supervisor (if any) the loop's step, for their line."""
  if _ACTIVE is not None:
    _ACTIVE.step = step
    supervisor.report(step=step)


class PeerWatchdog:
  """Liveness counters in the coordination service (``client``: JAX's coordination client):
  process 0 declares a process whose counter has not moved for ``heartbeat_timeout_s`` lost
  and publishes the verdict; every survivor prints ``describe(lost=process or None, step=,
  reason=)`` and calls ``exit(EXIT_PEER_LOST)``; so does a collective that lost a peer's
  connection (:meth:`collective_failed`)."""

  def __init__(self, heartbeat_timeout_s: float, describe: Callable[..., str], *, client,
               process_id: int, num_processes: int, exit: Callable[[int], None] = os._exit):
    self.timeout_s = float(heartbeat_timeout_s)
    self.interval_s = max(self.timeout_s / 5, 0.2)
    self.describe, self._exit, self._client = describe, exit, client
    self.process_id, self.num_processes = process_id, num_processes
    self.step: int | None = None  # the newest step the loop started (note_step sets it)
    self._stop = threading.Event()
    self._verdict = threading.Event()
    self._verdict_lock = threading.Lock()  # the watchdog and the main thread may both find one
    self._exited = threading.Event()  # the exit call returned (only a test's exit does)
    self._thread = threading.Thread(target=self._run, name="ring_jax-peer-watchdog", daemon=True)

  def start(self) -> "PeerWatchdog":
    self._thread.start()
    return self

  def stop(self, done: bool = False) -> None:
    """Stops beating; ``done``: a clean end, so the watchers stop expecting this process."""
    if self._stop.is_set():
      return
    self._stop.set()
    if done:  # (if the coordination service is gone, nobody is watching any more)
      with contextlib.suppress(Exception):
        self._client.key_value_set(f"{_PREFIX}/done/{self.process_id}", "1", allow_overwrite=True)

  def collective_failed(self, collective: str, closed: str) -> None:
    """A collective of this process failed because a peer's connection closed: the verdict
    (published for the survivors in no collective), the line and the exit, from the calling
    thread."""
    # Of more than two processes, gloo's and NCCL's errors name an address at most.
    lost = 1 - self.process_id if self.num_processes == 2 else None
    self._declare(lost, f"{COLLECTIVE_CLOSED}, {collective} failed: {closed}", publish=True)
    self._exited.wait()  # The watchdog thread's verdict came first: it is ending the process.

  def wait_for_verdict(self, timeout_s: float | None = None) -> bool:
    """Blocks until the watchdog declares a peer lost (it then exits the process) or
    ``timeout_s`` (default: long enough for any verdict) passes; returns False then."""
    wait = 2 * self.timeout_s + 5 * self.interval_s if timeout_s is None else timeout_s
    if not self._verdict.wait(wait):
      return False
    self._exited.wait()  # Going on would print the failed collective's traceback after the line.
    return True

  def _run(self) -> None:
    counter = 0
    seen: dict[int, tuple[str | None, float]] = {}  # peer -> (counter value, when it moved)
    while not self._stop.wait(self.interval_s):
      counter += 1
      try:
        self._client.key_value_set(f"{_PREFIX}/beat/{self.process_id}", str(counter),
                                   allow_overwrite=True)
        if lost := self._client.key_value_dir_get(f"{_PREFIX}/lost/"):
          peer, _, reason = lost[0][1].partition(" ")  # [(key, "<process or ?> <reason>")]
          self._declare(int(peer) if peer.isdigit() else None, reason, publish=False)
          return
        if self.process_id == 0 and (peer := self._silent_peer(seen)) is not None:
          self._declare(peer, f"no heartbeat for {self.timeout_s:g} s", publish=True)
          return
      except Exception:  # A transient RPC error; a dead coordinator ends us from C++.
        continue

  def _silent_peer(self, seen) -> int | None:
    now, beats, done = time.monotonic(), self._values("beat"), self._values("done")
    for peer in range(1, self.num_processes):
      if peer not in seen or seen[peer][0] != beats.get(peer):
        seen[peer] = (beats.get(peer), now)
      elif peer not in done and now - seen[peer][1] > self.timeout_s:
        return peer
    return None

  def _declare(self, lost: int | None, reason: str, *, publish: bool) -> None:
    """The verdict, once per process: the supervisor told (its line would repeat ours if
    JAX's abort beat the exit), the line, the verdict shared through the coordination
    service (unless it died with process 0), then the exit."""
    with self._verdict_lock:
      if self._verdict.is_set():
        return
      self._verdict.set()
    try:
      line = self.describe(lost=lost, step=self.step, reason=reason)
    except Exception as e:  # Never let the report itself hide the verdict.
      who = "another process" if lost is None else f"process {lost}"
      line = f"error: {who} of {self.num_processes} stopped responding ({reason}; {e!r})"
    supervisor.report(declared=line)
    sys.stdout.flush()
    print(line, file=sys.stderr, flush=True)
    if lost != 0:  # Process 0 hosts the coordination service: none is left to tell.
      with contextlib.suppress(Exception):
        if publish:  # For the survivors in no collective: their watchdogs poll it.
          self._client.key_value_set(f"{_PREFIX}/lost/verdict",
                                     f"{'?' if lost is None else lost} {reason}",
                                     allow_overwrite=True)
        if self.process_id == 0:  # Keep the service up until the other survivors read it.
          self._wait_for_survivors(lost)
        else:
          self._client.key_value_set(f"{_PREFIX}/exiting/{self.process_id}", "1",
                                     allow_overwrite=True)
    self._exit(EXIT_PEER_LOST)
    self._exited.set()

  def _wait_for_survivors(self, lost: int | None) -> None:
    """Process 0: until every other survivor has acknowledged the verdict ("exiting"), at
    most two polls of theirs. Neither the lost process nor one that ended cleanly will;
    where the lost one is unknown, one process may be missing."""
    deadline = time.monotonic() + 2 * self.interval_s + 1.0
    others = set(range(1, self.num_processes)) - {lost} - set(self._values("done"))
    missing = 1 if lost is None else 0
    while len(others - set(self._values("exiting"))) > missing and time.monotonic() < deadline:
      time.sleep(0.05)

  def _values(self, kind: str) -> dict[int, str]:
    """``{process: value}`` of the keys under ``<prefix>/<kind>/`` ("beat", "done", "exiting")."""
    return {int(k.rsplit("/", 1)[-1]): v
            for k, v in self._client.key_value_dir_get(f"{_PREFIX}/{kind}/")}


class StopRequest:
  """SIGTERM / SIGINT -> finish the current step, agree on it, save, exit cleanly: several
  processes agree through JAX's preemption notifier (SIGINT re-sent as SIGTERM; docs/training.md,
  "Preemption"). A second signal of the same kind goes to the previous handler (exits at once)."""

  SIGNALS = (signal.SIGTERM, signal.SIGINT)

  def __init__(self):
    self.received: str | None = None
    self._previous: dict[int, Any] = {}
    self._jax_notice = jax.process_count() > 1 and bool(jax.config.jax_enable_preemption_service)

  def __enter__(self) -> "StopRequest":
    if threading.current_thread() is not threading.main_thread():
      return self  # signal.signal only works there (e.g. train() called from a worker thread)
    for sig in self.SIGNALS:
      if self._jax_notice and sig == signal.SIGTERM:
        continue  # JAX's C++ handler; replacing it would hide the notice from other processes.
      self._previous[sig] = signal.signal(sig, self._handle)
    return self

  def __exit__(self, *exc_info) -> None:
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
    self._previous.clear()

  def _handle(self, signum, frame) -> None:
    name = signal.Signals(signum).name
    if self.received is not None:  # Second signal: give up on the clean stop.
      signal.signal(signum, self._previous.pop(signum, signal.SIG_DFL))
      os.kill(os.getpid(), signum)
      return
    self.received = name
    print(f"{name} received: finishing the current step, then saving a checkpoint and "
          f"exiting (send {name} again to exit at once without saving)", file=sys.stderr,
          flush=True)
    if self._jax_notice:
      os.kill(os.getpid(), signal.SIGTERM)  # Hand it to JAX's preemption notifier.

  def reached(self, step: int) -> bool:
    """Whether to stop after ``step`` (called once per step, same steps on every process)."""
    if self._jax_notice:
      if multihost_utils.reached_preemption_sync_point(step):
        self.received = self.received or "SIGTERM (preemption notice)"
        return True
      return False
    return on_any_process(self.received is not None)  # Without the notice: a collective.
