"""Pipeline parallelism: a GPipe schedule over the ``pipeline`` mesh axis.

The stacked layers ``[L, ...]`` of :class:`models.llama.Llama` are viewed as
``[S, L/S, ...]`` (``S`` = the mesh ``pipeline`` axis; the ``layers`` rule
already shards ``L`` in contiguous blocks over it, so the view moves nothing).
The schedule runs under ``jax.shard_map`` over the ``pipeline`` axis only
(the other axes stay automatic, so the layers inside keep their GSPMD
shardings over ``data``, ``sequence`` and ``tensor``, and ring attention its
own ``shard_map`` over ``sequence``): pipeline device ``s`` holds stage ``s``'s
layers. The batch is split into ``M`` microbatches; at iteration ``t`` stage
``s`` runs its layers once on microbatch ``t - s`` (stage 0 takes microbatch
``t``, stage ``S-1`` emits microbatch ``t - (S-1)``). ``M + S - 1`` iterations
run in all (GPipe, Huang et al. 2019, fig. 2); the backward pass is the
autodiff transpose of the loop (the reverse schedule, every transfer the other
way). Each stage idles for ``S - 1`` of the ``M + S - 1`` iterations:
:func:`bubble_fraction`. (Here a stage in the bubble computes on a real
microbatch's rows and on what it received, and the result is dropped, so the
bubble costs its compute and its saved activations; the embedding, output head
and loss run outside the schedule, replicated over ``pipeline``.)

What moves over ``pipeline``, per device and step: after each iteration but
the last (whose outputs no stage reads), one ``ppermute`` of the activations
``[B/M, L, D]`` (local shard) from stage ``s`` to ``s + 1`` only -- ``M + S -
2`` of them, and as many in the backward. Nothing else travels with them: the
positions and segment ids are inputs every stage holds for all microbatches
(replicated over ``pipeline``, as the batch is), and a stage indexes the
microbatch it is working on. At the ends, one all-reduce of all ``M``
microbatches' activations brings the last stage's outputs to every stage (the
head runs on each), and one in the backward sums the stages' cotangents of the
inputs (stage 0's). ``tests/models/test_pipeline.py`` counts these in the compiled
program. On an ``Explicit`` mesh the schedule runs with the other axes made
``Auto`` (:func:`gpipe`): jax 0.10 would otherwise all-gather its inputs and
saved activations over ``sequence`` at the ``shard_map`` boundary.

Why a ``shard_map`` and not MaxText's stage-``vmap``: on jax 0.10 a ``vmap``
over a ``shard_map(check_vma=True)`` (ring attention, the dense backend)
fails its varying-axes checks (``Primitive clamp requires varying manual axes
to match``), and autodiff of a ``check_vma=True`` shard_map nested in another
one names the outer axis in its residuals (an MLIR verifier error). With the
outer ``shard_map`` at ``check_vma=False`` (its body has one collective, the
explicit ``ppermute``) the nested ring ``shard_map`` differentiates correctly.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from models import sharding as shd


def bubble_fraction(stages: int, microbatches: int) -> float:
  """Idle fraction of each stage in GPipe: ``(S - 1) / (M + S - 1)`` (Huang et al. 2019)."""
  return (stages - 1) / (microbatches + stages - 1)


def num_stages(mesh=None) -> int:
  """Size of the mesh axis the ``stages`` rule names (1 without a mesh or such an axis)."""
  return shd.rule_shards("stages", mesh)


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


def gpipe(stage_fn: Callable, stage_params, x, x_names, rows, *, stages: int):
  """Runs the microbatches ``x`` (``[M, ...]``) through ``S`` stages in GPipe order.

  Args:
    stage_fn: ``(params of one stage, x of one microbatch, rows of it) -> x``.
    stage_params: pytree with a leading stage axis ``S`` (see :func:`to_stages`).
    x: ``[M, ...]``, the activations: what flows from stage to stage (the only
      thing that does).
    x_names: the logical names of ``x``'s dimensions after the microbatch axis.
    rows: pytree of ``[M, ...]`` per-microbatch inputs every stage reads but none
      changes (positions, segment ids). Every stage holds all of them (they are
      replicated over ``pipeline``, as the batch is) and indexes the microbatch it
      is working on, so they never travel.
    stages: ``S``, the size of the ``pipeline`` axis.

  Returns:
    the last stage's output for every microbatch, ``[M, ...]``, in order.
  """
  mesh = shd.current_mesh()
  axis = stage_axis(mesh)
  m = x.shape[0]
  # Stage s sends to s + 1 only: the last stage's output goes nowhere and stage 0 receives
  # zeros (it reads its microbatch instead). The transpose of this ppermute, the backward's,
  # is the reverse chain (s + 1 -> s).
  forward = [(s, s + 1) for s in range(stages - 1)]
  P = jax.sharding.PartitionSpec

  def body(params, x, rows):
    params = jax.tree.map(lambda a: a[0], params)
    stage = jax.lax.axis_index(axis)
    index = lambda a, i: jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False)

    def iteration(received, t):
      # Stage s works on microbatch t - s; in its bubble (before the first microbatch
      # arrives, after the last one left) it computes on the rows of microbatch 0 or M - 1
      # and on what it received: finite values whose results never reach the output.
      own = jax.tree.map(lambda a: index(a, jnp.clip(t - stage, 0, m - 1)), rows)
      x_t = jnp.where(stage == 0, index(x, jnp.minimum(t, m - 1)), received)
      out = stage_fn(params, x_t, own)
      # The last iteration's outputs are read by no stage: no transfer then (M + S - 2 in
      # all, each direction; the backward's first iteration skips it likewise). A cond, not
      # that iteration outside the loop: a second copy of the stage would double its compile.
      send = lambda o: jax.lax.ppermute(o, axis, forward)
      return jax.lax.cond(t < m + stages - 2, send, jnp.zeros_like, out), out

    _, outs = jax.lax.scan(iteration, x[0], jnp.arange(m + stages - 1))
    # The last stage emits microbatch j at iteration j + S - 1.
    return outs[stages - 1:][None]

  # The inputs enter as they are outside, replicated over pipeline (nothing moves); autodiff
  # sums the stages' cotangents of x (only stage 0's are not zero) with one psum.
  def run(params, x, rows):  # the context mesh: auto_axes below changes its axis types
    return jax.shard_map(body, mesh=shd.current_mesh(), in_specs=(P(axis), P(), P()),
                         out_specs=P(axis), axis_names={axis}, check_vma=False)(params, x, rows)

  if shd.is_explicit_mesh(mesh):
    # A shard_map's specs may name only its manual axes (here pipeline), and jax 0.10 lowers
    # one over part of an all-Explicit mesh with every other dimension closed and replicated:
    # the inputs, the outputs and the activations autodiff saves were all-gathered over
    # sequence, data and tensor at the boundary and sliced back (jax 0.12 lowers the
    # arguments' own shardings). With those axes Auto the dimensions stay open, as on an Auto
    # mesh, and nothing moves. The layers inside then see Auto axes (and constrain their
    # activations with with_sharding_constraint instead of reshard).
    explicit = jax.sharding.AxisType.Explicit
    others = tuple(a for a, t in zip(mesh.axis_names, mesh.axis_types)
                   if a != axis and t == explicit)
    out_spec = shd.logical_to_spec(("stages", None, *x_names), mesh=mesh,
                                   shape=(stages, *x.shape))
    run = jax.sharding.auto_axes(run, axes=others, out_sharding=out_spec)
  outs = run(stage_params, x, rows)

  # Only the last stage's copy holds the results, and every stage needs them (the head runs
  # replicated over pipeline): a masked sum over the stage axis is one all-reduce, whose
  # transpose moves nothing. (Slicing out the last stage is not allowed on Explicit axes, and
  # on Auto ones XLA made it a collective-permute, an all-reduce and, in the backward,
  # another collective-permute.)
  last = (jnp.arange(stages) == stages - 1).reshape((stages,) + (1,) * (outs.ndim - 1))
  return jnp.sum(jnp.where(last, outs, jnp.zeros((), outs.dtype)), axis=0, dtype=outs.dtype)


def run_layers(cfg, layer_stack, stacked, x_BLD, positions_BL, segment_ids_BL, layer_xs):
  """``(x, aux)`` of the model's layers, run as pipeline stages on a mesh with ``pipeline > 1``.

  ``layer_stack(x, stacked, layer_xs, positions, segment_ids) -> (x, aux)`` runs the stacked
  layers' State ``stacked`` (:meth:`models.llama.Llama.forward_layers`). With one stage it
  runs once over all layers (:func:`unstaged`); with ``S > 1`` as :func:`pipelined` over
  ``cfg.pipeline_microbatches``, and ``aux`` is None. Every stage runs the same program, so
  a stack mixing windowed and full layers is refused there (ValueError), as are per-layer
  inputs ``layer_xs`` (e.g. a KV cache).
  """
  stages = num_stages()
  if stages > 1 and len(cfg.layer_groups) > 1:
    raise ValueError(
        f"layers with and without a sliding window ({cfg.layer_types}) cannot run as "
        f"pipeline stages (every stage runs one program); use a mesh with pipeline=1, or "
        "one window for all layers (model.sliding_window / model.layer_types).")
  if stages == 1:
    return layer_stack(x_BLD, unstaged(stacked), layer_xs, positions_BL, segment_ids_BL)
  if layer_xs is not None:
    raise ValueError("per-layer inputs (e.g. a KV cache for decoding) are not supported on "
                     f"a mesh with pipeline={stages}; use a mesh with pipeline=1.")
  return pipelined(layer_stack, stacked, x_BLD, positions_BL, segment_ids_BL, stages,
                   cfg.pipeline_microbatches), None


def pipelined(layer_stack, stacked, x_BLD, positions_BL, segment_ids_BL, stages: int,
              microbatches: int | None):
  """The layer stack as ``stages`` pipeline stages over microbatches (:func:`gpipe`);
  ``microbatches``: ``LlamaConfig.pipeline_microbatches`` (None: :func:`default_microbatches`)."""
  batch = x_BLD.shape[0]
  data = shd.rule_shards("batch")
  micro = resolve_microbatches(microbatches, batch, stages, data)
  # Only the activations travel from stage to stage; every stage reads the positions and
  # segment ids of the microbatch it is working on from its own copy.
  split = lambda a, n: shd.with_logical_constraint(split_microbatches(a, micro), (None, *n))
  x_names = ("batch", "residual_length", "embed")
  rows = dict(positions=split(positions_BL, ("batch", "length")))
  if segment_ids_BL is not None:
    rows["segment_ids"] = split(segment_ids_BL, ("batch", "length"))

  def stage(stage_state, x_BLD, rows):
    x_BLD, aux = layer_stack(x_BLD, stage_state, None, rows["positions"],
                             rows.get("segment_ids"))
    if jax.tree.leaves(aux):
      raise ValueError("attention outputs carried out of the layers (e.g. a prefill's KV "
                       f"cache) are not supported on a mesh with pipeline={stages}; use "
                       "a mesh with pipeline=1.")
    return x_BLD

  stage_params = to_stages(stacked, stages)
  with jax.named_scope("pipeline"):
    out = gpipe(stage, stage_params, split(x_BLD, x_names), x_names, rows, stages=stages)
  return shd.with_logical_constraint(merge_microbatches(out), x_names)
