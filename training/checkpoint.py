"""Orbax checkpoints: train state + data iterator state, restorable onto any mesh.

A checkpoint step holds two items:

* ``state``: ``{"params": ..., "opt_state": ...}`` saved with
  ``StandardSave`` (each process writes the shards it owns).
* ``data``: the Grain iterator state (JSON), so a resumed run reads exactly the
  batches an uninterrupted run would have read next.

Restoring passes ``jax.ShapeDtypeStruct`` targets carrying the shardings of the
*current* mesh, so a run saved on ``data=2 x sequence=4`` resumes on
``data=1 x sequence=8`` (or any other shape): Orbax reads each device's slice
of every array straight from storage.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp


def abstract_like(tree, shardings):
  """``ShapeDtypeStruct`` leaves with the given target shardings (what restore fills)."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree,
                      shardings)


class Checkpointer:
  """Periodic + final saves into ``<workdir>/checkpoints``, keeping the last ``keep``."""

  def __init__(self, workdir: str, *, every: int, keep: int, async_save: bool = True):
    self.directory = os.path.join(os.path.abspath(workdir), "checkpoints")
    policies = ocp.checkpoint_managers
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, create=True, enable_async_checkpointing=async_save,
        # Every `every` steps, and when JAX reports a preemption notice (TPU/multi-host).
        # Unlike Orbax's default, no extra save of a fresh run's first step.
        save_decision_policy=policies.AnySavePolicy([
            policies.FixedIntervalPolicy(every),
            policies.PreemptionCheckpointingPolicy()]))
    self.manager = ocp.CheckpointManager(self.directory, options=options,
                                         item_names=("state", "data"))

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self.manager.all_steps())

  def save(self, step: int, params, opt_state, data_state: dict[str, Any], *,
           force: bool = False) -> bool:
    """Saves if ``step`` is on the interval (or ``force``); returns whether it saved.

    With async saving Orbax copies the arrays to host memory before returning,
    so the train step may donate (overwrite) them right after.
    """
    return self.manager.save(
        step,
        args=ocp.args.Composite(
            state=ocp.args.StandardSave({"params": params, "opt_state": opt_state}),
            data=ocp.args.JsonSave(data_state)),
        force=force)

  def restore(self, step: int, params_target, opt_state_target):
    """Restores ``step`` into the given abstract targets (their shardings decide placement).

    Returns ``(params, opt_state, data_state)``.
    """
    restored = self.manager.restore(
        step,
        args=ocp.args.Composite(
            state=ocp.args.StandardRestore({"params": params_target,
                                            "opt_state": opt_state_target}),
            data=ocp.args.JsonRestore()))
    state = restored["state"]
    return state["params"], state["opt_state"], restored["data"]

  def wait(self) -> None:
    """Blocks until pending async saves are durable."""
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()
