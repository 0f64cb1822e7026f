"""Orbax checkpoints of the train state (``{"params", "opt_state"}``, each process writing the
shards it owns) and the data iterator's state (JSON), restorable onto any mesh. Beyond Orbax
(docs/training.md, "When things go wrong"): a non-finite state is never written, a failed
background save is one :class:`CheckpointWriteError`, and :meth:`Checkpointer.restore_latest`
falls back past steps that do not restore."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import sys
import time
import traceback
from typing import Any, Callable

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from absl import logging as absl_logging
from jax.experimental import multihost_utils

from training import distributed
from training.metrics import Diverged

CORRUPT_DIRNAME = "checkpoints_corrupt"


def _whole_array_saves() -> None:
  """One process: Orbax writes each replicated array whole instead of one slice per replica
  (each slice shape is an eager program compiled on first use; the files are the same).
  Orbax reads the option only from the handler registered for ``jax.Array``."""
  current = ocp.type_handlers.get_type_handler(jax.Array)
  if getattr(current, "_use_replica_parallel", None) is False:
    return
  handler = ocp.type_handlers.ArrayHandler(
      use_replica_parallel=False,
      array_metadata_store=getattr(current, "_array_metadata_store", None))
  with _absl_errors_only():  # "Type handler registry ... overriding"
    ocp.type_handlers.register_type_handler(jax.Array, handler, override=True)


@contextlib.contextmanager
def _absl_errors_only(on: bool = True):
  """Inside, absl (Orbax's log) shows errors only (if ``on``)."""
  verbosity = absl_logging.get_verbosity()
  if on:
    absl_logging.set_verbosity(absl_logging.ERROR)
  try:
    yield
  finally:
    absl_logging.set_verbosity(verbosity)


def _is_failed_read_error(exc, tb) -> bool:
  """Whether ``exc`` (raised through ``tb``) is the leftover of a failed Orbax read: its
  other reads in flight end after the restore's event loop closed (``RuntimeError('Event
  loop is closed')`` or the same corruption); the restore reports the step in one line."""
  return (isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed") or any(
      f"{os.sep}orbax{os.sep}" in frame.f_code.co_filename for frame, _ in traceback.walk_tb(tb))


def _keeps_asyncio_record(record) -> bool:
  """The ``asyncio`` logger's filter once a restore has failed: False for its "exception was
  never retrieved" records of a failed Orbax read (the same leftovers, or TensorStore's own
  read error)."""
  exc = record.exc_info[1] if record.exc_info else None
  if exc is None or "exception was never retrieved" not in record.getMessage():
    return True
  return not (_is_failed_read_error(exc, record.exc_info[2]) or "Error reading" in str(exc)
              or "TensorStore" in str(exc))


def drop_failed_read_leftovers() -> None:
  """From now on ``sys.unraisablehook`` (in front of the previous one) and the ``asyncio``
  logger drop the leftovers of a failed Orbax read, and those already unreachable are
  collected now rather than reported later against unrelated code (after a failed restore,
  and for the whole of a train.py run without ``-v``)."""
  if not getattr(sys.unraisablehook, "_drops_failed_read_leftovers", False):
    previous = sys.unraisablehook

    def hook(unraisable):
      if not _is_failed_read_error(unraisable.exc_value, unraisable.exc_traceback):
        previous(unraisable)

    hook._drops_failed_read_leftovers = True
    sys.unraisablehook = hook
  asyncio_logger = logging.getLogger("asyncio")
  if _keeps_asyncio_record not in asyncio_logger.filters:
    asyncio_logger.addFilter(_keeps_asyncio_record)
  gc.collect()


class CheckpointWriteError(RuntimeError):
  """Writing a checkpoint failed (in the background, for async saves)."""


class NonFiniteStateError(ValueError):
  """The state to save holds NaN or inf: saving it would replace good checkpoints."""


class NoRestorableCheckpointError(RuntimeError):
  """The checkpoint directory holds steps, but none of them restores."""


class NoCheckpointError(FileNotFoundError):
  """A read-only checkpointer was opened on a workdir without a checkpoints/ directory."""


@jax.jit
def all_finite(tree) -> jax.Array:
  """Whether every floating-point value in ``tree`` is finite (one fused reduction)."""
  leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves])) if leaves else True


def _one_line(error: BaseException) -> str:
  """``Type: first line of the message``."""
  lines = [l.strip() for l in str(error).strip().splitlines() if l.strip()]
  return f"{type(error).__name__}: {lines[0] if lines else '(no message)'}"


def checkpoint_directory(workdir: str) -> str:
  """Where a run in ``workdir`` keeps its checkpoint steps."""
  return os.path.join(os.path.abspath(workdir), "checkpoints")


class Checkpointer:
  """Periodic + final saves into ``<workdir>/checkpoints``, keeping the last ``keep``;
  ``read_only=True`` opens an existing one for reading (nothing saved, moved or created)."""

  def __init__(self, workdir: str, *, every: int = 1, keep: int = 1, async_save: bool = True,
               read_only: bool = False):
    self.workdir = os.path.abspath(workdir)
    self.directory = checkpoint_directory(self.workdir)
    self.every, self.read_only = every, read_only
    self._writing: int | None = None  # step of the newest save that may still be in flight
    self.last_saved: int | None = None  # the newest step this run saved or resumed from
    if read_only and not os.path.isdir(self.directory):
      raise NoCheckpointError(f"{workdir} has no checkpoints/ directory")
    if jax.process_count() == 1 and not read_only:
      _whole_array_saves()
    # Read-only, Orbax warns that it saves nothing: what was asked for. Shown with -v.
    with _absl_errors_only(read_only and absl_logging.get_verbosity() <= absl_logging.WARNING):
      if read_only:
        options = ocp.CheckpointManagerOptions(create=False, read_only=True)
      else:  # Preemption saves are train.py's save(force=True) at the agreed stop step.
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=async_save,
            cleanup_tmp_directories=True,  # what a process killed mid-save left behind
            save_decision_policy=ocp.checkpoint_managers.FixedIntervalPolicy(every))
      self.manager = ocp.CheckpointManager(self.directory, options=options,
                                           item_names=("state", "data"))

  def all_steps(self) -> list[int]:
    return sorted(self.manager.all_steps())

  def check_for_errors(self) -> None:
    """Raises :class:`CheckpointWriteError` if a background save has failed."""
    try:
      self.manager.check_for_errors()
    except Exception as e:  # Whatever the storage raised (OSError, TensorStore's ValueError).
      raise self._write_error(self._writing, e) from e

  def _write_error(self, step: int | None, error: BaseException) -> CheckpointWriteError:
    good = [s for s in self.all_steps() if s != step]
    intact = (f"earlier checkpoints are intact (newest: step {good[-1]})" if good
              else "no earlier checkpoint exists")
    return CheckpointWriteError(
        f"writing the checkpoint of step {step} to {self.directory} failed: "
        f"{_one_line(error)}. The run stopped; {intact}. Free space or fix the directory "
        "(quota, permissions, mount), then rerun the same command to resume.")

  def save(self, step: int, params, opt_state, data_state: dict[str, Any], *,
           force: bool = False) -> bool:
    """Saves if ``step`` is on the interval (or ``force``); returns whether it saved. Async
    saves copy the arrays to host first, so the step may donate them right after.

    Raises:
      CheckpointWriteError: this save, or an earlier background one, failed.
      NonFiniteStateError: ``params`` or ``opt_state`` hold NaN/inf (nothing is written).
    """
    if self.read_only:
      raise ValueError(f"{self.directory} was opened read_only; open a Checkpointer without "
                       "read_only=True to save.")
    self.check_for_errors()
    if not force and step % self.every:
      return False
    if not all_finite((params, opt_state)):
      raise NonFiniteStateError(f"the state of step {step} holds NaN or inf; not saving it.")
    try:
      saved = self.manager.save(step, force=force, args=ocp.args.Composite(
          state=ocp.args.StandardSave({"params": params, "opt_state": opt_state}),
          data=ocp.args.JsonSave(data_state)))
    except Exception as e:  # This save failed, or Orbax waited on the previous one and it did.
      previous_failed = self._writing is not None and self._writing not in self.all_steps()
      raise self._write_error(self._writing if previous_failed else step, e) from e
    if saved:
      self._writing = self.last_saved = step
    return saved

  def close(self) -> None:
    """Waits for pending async saves to land (:class:`CheckpointWriteError` if one failed),
    then releases Orbax's threads."""
    try:
      self.manager.wait_until_finished()
      self.manager.check_for_errors()
    except Exception as e:
      raise self._write_error(self._writing, e) from e
    finally:
      self.manager.close()

  def restore(self, step: int, params_target, opt_state_target):
    """``(params, opt_state, data_state)`` of ``step``, restored into the given abstract
    targets (their shardings decide placement)."""
    restored = self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore({"params": params_target, "opt_state": opt_state_target}),
        data=ocp.args.JsonRestore()))
    if restored["data"] is None:
      raise FileNotFoundError("the data iterator state ('data' item) is missing")
    return restored["state"]["params"], restored["state"]["opt_state"], restored["data"]

  def restore_latest(self, params_target, opt_state_target=None,
                     warn: Callable[[str], None] = print):
    """``(step, params, opt_state, data_state)`` of the newest step that restores (on every
    process), or None without steps; ``opt_state_target=None`` reads the parameters alone
    (the others come back None). Each step that fails gets one ``warn`` line; once an older
    one restores, the bad newer ones are moved to ``checkpoints_corrupt/`` (not read_only).

    Raises:
      NoRestorableCheckpointError: there are steps but none restores (nothing moved).
    """
    failures: list[tuple[int, str]] = []
    for step in reversed(self.all_steps()):
      try:
        if opt_state_target is None:
          params, opt_state, data_state = self.restore_params(step, params_target), None, None
        else:
          params, opt_state, data_state = self.restore(step, params_target, opt_state_target)
        reason = None if all_finite((params, opt_state)) else "it holds NaN or inf values"
      except Exception as e:  # Corruption shows as many error types (OSError, ValueError, ...).
        reason = _one_line(e)
        del e
        drop_failed_read_leftovers()
      if distributed.on_any_process(reason is not None):
        reason = reason or "it failed to restore on another process"
        warn(f"warning: checkpoint step {step} in {self.directory} does not restore "
             f"({reason}); trying the previous one.")
        failures.append((step, reason))
        continue
      for bad, _ in failures if not self.read_only else ():
        moved = self._move_aside(bad)
        warn(f"warning: moved the unrestorable checkpoint step {bad} to {moved} "
             "(kept for inspection, not deleted).")
      self.last_saved = step
      return step, params, opt_state, data_state
    if failures:
      listing = "; ".join(f"step {s}: {r}" for s, r in failures)
      raise NoRestorableCheckpointError(
          f"no checkpoint in {self.directory} restores ({listing}). Nothing was moved or "
          "deleted. If the config changed (model shape), use the original config"
          + ("." if self.read_only else "; otherwise start afresh with a new --workdir, or "
             "move the checkpoints directory aside."))
    return None

  def restore_params(self, step: int, params_target):
    """The parameters of ``step`` only (not the optimizer or data state), placed per
    the shardings of ``params_target`` (``ShapeDtypeStruct`` leaves)."""
    target = {"params": params_target}
    restored = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
        target, partial_restore=True,
        restore_args=jax.tree.map(lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding),
                                  target))))
    return restored["state"]["params"]

  def _move_aside(self, step: int) -> str:
    """Moves step ``step``'s directory out of Orbax's view; returns where it went."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target = os.path.join(self.workdir, CORRUPT_DIRNAME, f"{step}-{stamp}")
    if jax.process_index() == 0:
      os.makedirs(os.path.dirname(target), exist_ok=True)
      os.rename(os.path.join(self.directory, str(step)), target)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices(f"ring_jax_move_aside_{step}")
    self.manager.reload()  # Forget the step: no save or retention may touch it again.
    return target


def save(config, checkpointer, step_metrics, step: int, params, opt_state, train_iter, *,
         force: bool = False) -> None:
  """Checkpoints ``step`` if it is on the interval (or ``force``); :class:`Diverged` (nothing
  written) if the step's metrics, or the state itself, are non-finite."""
  if force or step % config.checkpoint_every == 0:
    step_metrics.fetch(step)  # Never save the state of a diverged step.
  try:
    checkpointer.save(step, params, opt_state, train_iter.get_state(), force=force)
  except NonFiniteStateError:  # Finite metrics, non-finite state: still diverged.
    raise Diverged(divergence_message(config, step_metrics.history[-1], checkpointer,
                                      state=True)) from None


def divergence_message(config, row, checkpointer, state=False) -> str:
  """What diverged, what was kept, and which settings to change."""
  what = ("the parameters or optimizer state became non-finite" if state else
          f"loss {row['loss']:.4g}, grad_norm {row['grad_norm']:.4g}")
  last_saved = checkpointer.last_saved
  kept = (f"the newest checkpoint is step {last_saved} in {checkpointer.directory}; rerunning "
          f"resumes from it" if last_saved else "no checkpoint was written; rerunning starts "
          "afresh")
  o = config.optim
  return (f"training diverged at step {row['step']} ({what}). No checkpoint of a diverged "
          f"state is written; {kept}. Lower --config.optim.lr (now {o.lr:g}), tighten "
          f"--config.optim.grad_clip (now {o.grad_clip:g}) or lengthen "
          f"--config.optim.warmup_steps (now {o.warmup_steps}).")
