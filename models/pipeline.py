"""Pipeline parallelism: a GPipe schedule over the ``pipeline`` mesh axis.

The stacked layers ``[L, ...]`` of :class:`models.llama.Llama` are viewed as
``[S, L/S, ...]`` (``S`` = the mesh ``pipeline`` axis; the ``layers`` rule
already shards ``L`` in contiguous blocks over it, so the view moves nothing).
The schedule runs under ``jax.shard_map`` over the ``pipeline`` axis only
(the other axes stay automatic, so the layers inside keep their GSPMD
shardings over ``data``, ``sequence`` and ``tensor``, and ring attention its
own ``shard_map`` over ``sequence``): pipeline device ``s`` holds stage ``s``'s
layers. The batch is split into ``M`` microbatches; at iteration ``t`` stage 0
takes microbatch ``t``, every stage runs its layers once, and each stage's
output goes to the next stage with one ``ppermute`` (stage ``S-1`` emits
microbatch ``t - (S-1)``). ``M + S - 1`` iterations run in all (GPipe, Huang et
al. 2019, fig. 2); the backward pass is the autodiff transpose of the loop (the
reverse schedule, the ``ppermute`` the other way). Each stage idles for
``S - 1`` of the ``M + S - 1`` iterations: :func:`bubble_fraction`. (Here a
stage in the bubble computes on a copy of a real microbatch whose result is
dropped, so the bubble costs its compute and its saved activations; the
embedding, output head and loss run outside the schedule, replicated over
``pipeline``.)

Why a ``shard_map`` and not MaxText's stage-``vmap``: on jax 0.10 a ``vmap``
over a ``shard_map(check_vma=True)`` (ring attention, the dense backend)
fails its varying-axes checks (``Primitive clamp requires varying manual axes
to match``), and autodiff of a ``check_vma=True`` shard_map nested in another
one names the outer axis in its residuals (an MLIR verifier error). With the
outer ``shard_map`` at ``check_vma=False`` (its body has one collective, the
explicit ``ppermute``) the nested ring ``shard_map`` differentiates correctly.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp

from models import sharding as shd


def bubble_fraction(stages: int, microbatches: int) -> float:
  """Idle fraction of each stage in GPipe: ``(S - 1) / (M + S - 1)`` (Huang et al. 2019)."""
  return (stages - 1) / (microbatches + stages - 1)


def num_stages(mesh=None) -> int:
  """Size of the mesh axis the ``stages`` rule names (1 without a mesh or such an axis)."""
  return rule_shards("stages", mesh)


def rule_shards(name: str, mesh=None) -> int:
  """How many devices the rule of logical axis ``name`` shards over (1 without a mesh)."""
  mesh = shd.current_mesh() if mesh is None else mesh
  if mesh is None:
    return 1
  entry = shd.logical_to_spec((name,), mesh=mesh)[0]
  axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
  return int(math.prod(mesh.shape[a] for a in axes))


def stage_axis(mesh=None) -> str | None:
  """The mesh axis name the ``stages`` rule names on ``mesh`` (default: the context mesh)."""
  mesh = shd.current_mesh() if mesh is None else mesh
  if mesh is None:
    return None
  entry = shd.logical_to_spec(("stages",), mesh=mesh)[0]
  return entry if isinstance(entry, str) else None


def default_microbatches(batch: int, stages: int, data: int = 1) -> int:
  """Pipeline microbatches when none is configured: ``2 S`` when the batch allows.

  The largest ``M <= 2 S`` that divides ``batch`` into microbatches whose rows
  still divide over the ``data`` axis (bubble ``(S-1)/(M+S-1)``: 1/3 at
  ``S=2, M=4``); 1 when nothing larger fits (the stages then run one after another).
  """
  for m in range(2 * stages, 0, -1):
    if batch % m == 0 and (batch // m) % data == 0:
      return m
  return 1


def resolve_microbatches(configured: int | None, batch: int, stages: int, data: int = 1) -> int:
  """``configured`` (``LlamaConfig.pipeline_microbatches``) or, when None, the default;
  checked against ``batch`` rows over ``data`` shards (:func:`check_microbatches`)."""
  micro = default_microbatches(batch, stages, data) if configured is None else configured
  check_microbatches(batch, micro, data)
  return micro


def check_microbatches(batch: int, microbatches: int, data: int = 1) -> None:
  """ValueError naming the fix unless ``microbatches`` splits ``batch`` over ``data``."""
  if microbatches < 1 or batch % microbatches:
    raise ValueError(f"pipeline_microbatches={microbatches} must be >= 1 and divide the "
                     f"batch of {batch} rows (per gradient-accumulation microbatch).")
  if (batch // microbatches) % data:
    raise ValueError(f"pipeline_microbatches={microbatches}: {batch // microbatches} rows per "
                     f"pipeline microbatch do not divide over the mesh 'data' axis ({data}).")


def split_microbatches(x_B, microbatches: int):
  """``[B, ...] -> [M, B/M, ...]`` with microbatch ``m`` = rows ``m::M``.

  Strided rows keep every microbatch spread over all ``data`` shards (as
  ``training.step``'s gradient-accumulation split), so splitting moves nothing.
  """
  b = x_B.shape[0]
  return x_B.reshape(b // microbatches, microbatches, *x_B.shape[1:]).swapaxes(0, 1)


def merge_microbatches(x_M):
  """Inverse of :func:`split_microbatches`: ``[M, B/M, ...] -> [B, ...]``."""
  return x_M.swapaxes(0, 1).reshape(-1, *x_M.shape[2:])


def to_stages(stacked, stages: int):
  """``[L, ...] -> [S, L/S, ...]`` for every array of ``stacked`` (stage ``s``: layers
  ``s L/S`` to ``(s+1) L/S - 1``), constrained to the ``stages`` rule on dim 0.

  ``stacked``: an ``nnx.State`` of the stacked layers' Variables; each keeps its
  metadata (``logical_axes`` still starts with ``layers``, which a stage's scan
  then slices off as before).
  """
  from flax import nnx

  def one(var):
    x = var.get_value()
    if x.shape[0] % stages:
      raise ValueError(f"the pipeline's {stages} stages do not divide {x.shape[0]} layers; "
                       "set mesh.pipeline to a divisor of model.num_layers.")
    y = x.reshape(stages, x.shape[0] // stages, *x.shape[1:])
    names = var.get_metadata()[shd.LOGICAL_AXES_KEY]
    return var.replace(shd.with_logical_constraint(y, ("stages", *names)))

  return jax.tree.map(one, stacked, is_leaf=lambda x: isinstance(x, nnx.Variable))


def unstaged(stacked):
  """``stacked`` with its ``layers`` dimension replicated, for a plain scan over the layers.

  On ``Explicit`` mesh axes a scan's ``xs`` must be replicated along the scanned
  dimension, and the ``layers`` rule names ``pipeline`` even where it has one
  device; resharding over a size-1 axis moves nothing. Auto axes need nothing.
  """
  from flax import nnx

  mesh = shd.current_mesh()
  if mesh is None or not shd.is_explicit_mesh(mesh):
    return stacked

  def one(var):
    names = var.get_metadata()[shd.LOGICAL_AXES_KEY]
    return var.replace(shd.with_logical_constraint(var.get_value(), (None, *names[1:])))

  return jax.tree.map(one, stacked, is_leaf=lambda x: isinstance(x, nnx.Variable))


def gpipe(stage_fn: Callable, stage_params, inputs, names, *, stages: int):
  """Runs ``inputs`` (pytree, leading microbatch axis ``M``) through ``S`` stages, GPipe order.

  Args:
    stage_fn: ``(params of one stage, carry) -> carry``; ``carry`` is a pytree
      like one microbatch of ``inputs`` (what flows between stages; leaves that
      a stage leaves unchanged, e.g. positions, simply travel along).
    stage_params: pytree with a leading stage axis ``S`` (see :func:`to_stages`).
    inputs: pytree of ``[M, ...]`` arrays.
    names: pytree like ``inputs`` (a tuple where it has an array): the logical
      names of each leaf's dimensions after the microbatch axis.
    stages: ``S``, the size of the ``pipeline`` axis.

  Returns:
    the last stage's carry for every microbatch, ``[M, ...]`` leaves, in order.
  """
  mesh = shd.current_mesh()
  axis = stage_axis(mesh)
  m = jax.tree.leaves(inputs)[0].shape[0]
  forward = [(i, (i + 1) % stages) for i in range(stages)]

  def per_stage(x, n):
    # Every stage gets the inputs (only stage 0 reads them): broadcast outside the
    # shard_map, so autodiff sums the stages' cotangents (zero but stage 0's) by itself.
    x = jnp.broadcast_to(x[None], (stages, *x.shape))
    return shd.with_logical_constraint(x, ("stages", None, *n))

  def body(params, inputs):
    params, inputs = jax.tree.map(lambda x: x[0], (params, inputs))
    first = jax.lax.axis_index(axis) == 0

    def iteration(carry, t):
      new = jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(
          x, jnp.minimum(t, m - 1), 0, keepdims=False), inputs)
      out = stage_fn(params, jax.tree.map(lambda a, b: jnp.where(first, a, b), new, carry))
      return jax.tree.map(lambda x: jax.lax.ppermute(x, axis, forward), out), out

    # Before microbatch 0 reaches it a stage runs on a copy of microbatch 0, and stage 0
    # runs on copies of the last one after it: the bubble computes on real rows (finite
    # values whose results never reach the output) instead of zeros.
    carry = jax.tree.map(lambda x: x[0], inputs)
    _, outs = jax.lax.scan(iteration, carry, jnp.arange(m + stages - 1))
    return jax.tree.map(lambda x: x[stages - 1:][None], outs)

  spec = jax.sharding.PartitionSpec(axis)
  run = jax.shard_map(body, mesh=mesh, in_specs=(spec, spec), out_specs=spec,
                      axis_names={axis}, check_vma=False)
  outs = run(stage_params, jax.tree.map(per_stage, inputs, names))

  def last_stage(x, n):
    # Only the last stage's copy holds the results (Explicit axes: say where they go).
    if shd.is_explicit_mesh(mesh):  # no slicing of a sharded dim there: a masked sum
      last = (jnp.arange(stages) == stages - 1).reshape((stages,) + (1,) * (x.ndim - 1))
      return jnp.sum(jnp.where(last, x, jnp.zeros((), x.dtype)), axis=0, dtype=x.dtype)
    return x[stages - 1]

  return jax.tree.map(last_stage, outs, names)
