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

A heartbeat timeout long enough for a legitimately slow process (60 s by default) is
too long to wait when a process is *known* to be gone. A process killed by a signal (the
kernel's OOM killer, ``kill -9``; a supervisor killed takes its child along) or crashed
has its sockets closed by the kernel at once. So every other process also keeps one TCP
connection to process 0, its *link* (process 0 listens on a port of its own and publishes
it in the key-value store; the others connect to the coordinator's host): when a link
closes without a word, process 0 declares that process lost at once, within a second of
the death rather than after ``heartbeat_timeout_s``, and sends the verdict down the links
of the others (and to the key-value store, as before). A process that ends through
Python (an error of its own, then its exit handlers) says so first ("exiting"): process 0
then waits :data:`EXIT_GRACE_S` before declaring it lost, so a failure that ends every
process alike (a divergence) is reported by each as itself, not as a lost peer; a clean
end (:func:`finish`) says "done" and is never declared. Nothing here reads exceptions:
a collective that failed on the dead peer (gloo's "Connection reset by peer") is only a
symptom; the link names the process. A host that vanishes without closing its
connections (power loss, a cut network) still ends the run through the heartbeat. A link
that cannot connect (a port filtered between hosts) costs only this speed: the process
says so in one warning line at start-up.

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
import secrets
import select
import socket
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
#: The key-value entry of process 0's link listener: "<port> <token>".
_LINK_KEY = f"{_PREFIX}/link"

#: Seconds process 0 waits, after a process announced its exit through Python (an error
#: of its own) and its link closed, before declaring it lost: process 0 may be about to
#: stop on the same error (every process sees the same divergence), and should then say so.
EXIT_GRACE_S = 5.0
#: The reason in the line when a link closed without a word (SIGKILL, a crash, an abort).
KILLED = "its process was killed or crashed"
#: ... and when it closed after the process announced its exit (the grace above passed).
EXITED = "it exited before the end of the run; its own output says why"


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

  describe = describer(state.num_processes, checkpoint_dir, resume_command, steps)
  _ACTIVE = PeerWatchdog(timeout_s, describe, client=state.client,
                         process_id=state.process_id, num_processes=state.num_processes,
                         coordinator_address=state.coordinator_address)
  atexit.register(_ACTIVE.stop)
  return _ACTIVE.start()


_ACTIVE: "PeerWatchdog | None" = None


def describer(num_processes: int, checkpoint_dir: str, resume_command: str,
              steps: Callable[[str], list[int]]) -> Callable[[int, int | None, str], str]:
  """The watchdog's ``describe``: the lost-peer line of this run.

  Where ``steps`` raises RuntimeError, the checkpoint steps are listed plainly
  (``supervisor.complete_steps``): Orbax's listing runs a thread pool, which Python refuses
  ("cannot schedule new futures after interpreter shutdown") once the main thread has ended
  on an error, e.g. a collective on the dead peer, while other threads (Orbax's, waiting on
  the same peer) keep the process alive until the verdict; the line must still say which
  step a rerun resumes from.
  """
  def describe(lost: int, step: int | None, reason: str) -> str:
    try:
      kept = steps(checkpoint_dir)
    except RuntimeError:
      kept = supervisor.complete_steps(checkpoint_dir)
    return lost_peer_message(lost, num_processes, reason, step, kept, checkpoint_dir,
                             resume_command)
  return describe


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
  """Liveness counters in the coordination service, and links to process 0; a lost peer
  ends every survivor (the module docstring says how).

  Args:
    heartbeat_timeout_s: a process whose counter has not moved this long is lost.
    describe: ``describe(lost_process, step, reason) -> str``, the line printed on stderr
      (it may read the filesystem; it runs on a watchdog thread).
    client: the coordination service's client (``jax._src.distributed.global_state``).
    coordinator_address: ``host:port`` of the coordination service as this process
      reaches it; the links connect to its host. None: no links (the heartbeat only).
    exit: called with :data:`EXIT_PEER_LOST` after the line; ``os._exit`` in a run (no
      atexit handler may wait on the dead peer).
    exit_grace_s: :data:`EXIT_GRACE_S` (shorter in tests).
  """

  def __init__(self, heartbeat_timeout_s: float,
               describe: Callable[[int, int | None, str], str], *, client, process_id: int,
               num_processes: int, coordinator_address: str | None = None,
               exit: Callable[[int], None] = os._exit, exit_grace_s: float = EXIT_GRACE_S):
    self.timeout_s = float(heartbeat_timeout_s)
    self.interval_s = max(self.timeout_s / 5, 0.2)
    self.describe = describe
    self._exit = exit
    self._client = client
    self.process_id = process_id
    self.num_processes = num_processes
    self.coordinator_address = coordinator_address
    self.exit_grace_s = exit_grace_s
    self.step: int | None = None  # the newest step the loop started (note_step)
    self._stop = threading.Event()
    self._verdict = threading.Event()
    self._verdict_lock = threading.Lock()  # the heartbeat and the links may both find one
    self._exited = threading.Event()  # the exit call returned (only a test's exit does)
    self._thread = threading.Thread(target=self._run, name="ring_jax-peer-watchdog",
                                    daemon=True)
    # Process 0: the other processes' links, by process index (the verdict goes down them).
    self._links: dict[int, socket.socket] = {}
    self._links_lock = threading.Lock()
    self._link: socket.socket | None = None  # any other process: its link to process 0
    self._link_lock = threading.Lock()  # a link is up, or stop() has run, never both unsaid
    self._token: str | None = None  # process 0: what a link says first to be heard

  def start(self) -> "PeerWatchdog":
    self._thread.start()
    if self.coordinator_address is not None and self.num_processes > 1:
      if self.process_id == 0:
        server = self._listen()
        if server is not None:
          threading.Thread(target=self._serve, args=(server,), name="ring_jax-peer-links",
                           daemon=True).start()
      else:
        threading.Thread(target=self._follow, name="ring_jax-peer-link", daemon=True).start()
    return self

  def note_step(self, step: int) -> None:
    self.step = step

  def stop(self, done: bool = False) -> None:
    """Stops beating; ``done``: a clean end, so the watchers stop expecting this process.
    Not done (the exit handler of a process ending on an error): tells process 0 that this
    process is exiting through Python, not killed (see :data:`EXIT_GRACE_S`)."""
    with self._link_lock:
      if self._stop.is_set():
        return
      self._stop.set()
      link = self._link
    if link is not None:
      try:
        link.sendall(b"done\n" if done else b"exiting\n")
      except OSError:
        pass
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
          peer, _, reason = next(iter(lost.values())).partition(" ")
          self._declare(int(peer), reason, publish=False)
          return
        if self.process_id == 0:
          peer = self._silent_peer(seen)
          if peer is not None:
            self._declare(peer, f"no heartbeat for {self.timeout_s:g} s", publish=True)
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

  def _declare(self, lost: int, reason: str, *, publish: bool) -> None:
    with self._verdict_lock:  # One verdict per process, whichever thread finds it first.
      if self._verdict.is_set():
        return
      self._verdict.set()
    try:
      line = self.describe(lost, self.step, reason)
    except Exception as e:  # Never let the report itself hide the verdict.
      line = f"error: process {lost} of {self.num_processes} stopped responding ({e!r})"
    sys.stdout.flush()
    print(line, file=sys.stderr, flush=True)
    if publish:  # Tell the other survivors; keep the coordination service up until they read it.
      with self._links_lock:
        links = [s for peer, s in self._links.items() if peer != lost]
      for link in links:  # at once, where a link is up ...
        try:
          link.sendall(f"lost {lost} {reason}\n".encode())
        except OSError:
          pass
      try:  # ... and where the watchdogs poll
        self._client.key_value_set(f"{_PREFIX}/lost/verdict", f"{lost} {reason}",
                                   allow_overwrite=True)
        deadline = time.monotonic() + 2 * self.interval_s + 1.0
        # Neither us nor the lost one, nor one that ended cleanly (it reads nothing more).
        others = set(range(self.num_processes)) - {self.process_id, lost} - self._ids("done")
        while others - self._ids("exiting") and time.monotonic() < deadline:
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

  def _ids(self, kind: str) -> set[int]:
    """The processes with a key under ``<prefix>/<kind>/`` ("done", "exiting")."""
    return {int(k.rsplit("/", 1)[-1])
            for k, _ in self._client.key_value_dir_get(f"{_PREFIX}/{kind}/")}

  # --- The links (see the module docstring) -----------------------------------------------

  def _listen(self) -> socket.socket | None:
    """Process 0: a listening socket on every interface, published with a token (only the
    run's processes are heard: anything else that connects is ignored)."""
    try:
      if socket.has_dualstack_ipv6():
        server = socket.create_server(("", 0), family=socket.AF_INET6, dualstack_ipv6=True)
      else:
        server = socket.create_server(("", 0))
      self._token = secrets.token_hex(8)
      self._client.key_value_set(_LINK_KEY, f"{server.getsockname()[1]} {self._token}",
                                 allow_overwrite=True)
      return server
    except Exception as e:  # No links: the heartbeat alone notices a death.
      _warn_no_link(e)
      return None

  def _serve(self, server: socket.socket) -> None:
    """Process 0: reads every link; a link that closes unannounced is a lost process."""
    peers: dict[socket.socket, dict] = {}  # link -> {"id", "state" (None/exiting/done), "buf"}
    exited: dict[int, float] = {}  # announced exits whose links closed: process -> when
    try:
      while not self._stop.is_set():
        ready, _, _ = select.select([server, *peers], [], [], 0.2)
        for sock in ready:
          if sock is server:
            try:
              conn, _ = server.accept()
            except OSError:
              continue
            peers[conn] = {"id": None, "state": None, "buf": b""}
            continue
          peer = peers[sock]
          try:
            data = sock.recv(4096)
          except ConnectionResetError:  # killed with our bytes unread: the kernel's RST
            data = b""
          except OSError:  # some other trouble with the connection: do not guess
            del peers[sock]
            sock.close()
            continue
          if data:
            *lines, peer["buf"] = (peer["buf"] + data).split(b"\n")
            for line in lines:
              self._heard(sock, peer, line.decode(errors="replace").split())
            continue
          del peers[sock]
          sock.close()
          if peer["id"] is None or peer["state"] == "done":
            continue
          if peer["state"] != "exiting":
            self._declare(peer["id"], KILLED, publish=True)
            return
          exited[peer["id"]] = time.monotonic()
        for lost, since in exited.items():
          if time.monotonic() - since > self.exit_grace_s and not self._stop.is_set():
            self._declare(lost, EXITED, publish=True)
            return
    finally:
      server.close()
      for sock in peers:
        sock.close()

  def _heard(self, sock: socket.socket, peer: dict, words: list[str]) -> None:
    if (words[:1] == ["hello"] and len(words) == 3 and words[1].isdigit()
        and words[2] == self._token):
      peer["id"] = int(words[1])
      with self._links_lock:
        self._links[peer["id"]] = sock
    elif peer["id"] is not None and words in (["done"], ["exiting"]):
      peer["state"] = words[0]

  def _follow(self) -> None:
    """Any other process: connects its link to process 0, then waits for a verdict on it."""
    while not self._stop.is_set():
      try:  # Process 0 publishes it in its start_watchdog, at about the time we reach ours.
        port, token = self._client.blocking_key_value_get(_LINK_KEY, 2000).split()
        break
      except Exception:  # not there yet (DEADLINE_EXCEEDED), or the service is gone
        if self._verdict.is_set() or self._stop.wait(0.2):
          return
    else:
      return
    host = self.coordinator_address.rpartition(":")[0].strip("[]")
    try:
      link = socket.create_connection((host, int(port)), timeout=30)
      link.settimeout(None)
      with self._link_lock:  # Not after stop(): its "done"/"exiting" would be missing.
        if self._stop.is_set():
          link.close()  # unheard: process 0 ignores a link that never said hello
          return
        link.sendall(f"hello {self.process_id} {token}\n".encode())
        self._link = link
    except OSError as e:
      _warn_no_link(e)
      return
    buf = b""
    while True:
      try:
        data = link.recv(4096)
      except OSError:
        return
      if not data:  # Process 0 ended: its end is reported by this process's supervisor.
        return
      *lines, buf = (buf + data).split(b"\n")
      for line in lines:
        word, lost, reason = (line.decode(errors="replace").split(" ", 2) + ["", ""])[:3]
        if word == "lost" and lost.isdigit() and not self._stop.is_set():
          self._declare(int(lost), reason, publish=False)
          return


def _warn_no_link(error: Exception) -> None:
  print(f"warning: no link to process 0 of this run ({error}); a process that dies is "
        "noticed only after --config.distributed.heartbeat_timeout_s", file=sys.stderr,
        flush=True)
