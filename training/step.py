"""The optimizer, the pure train/eval steps, their jit with explicit shardings, and
:func:`build_train_step`, the one place a train step and its state are assembled.

NNX "tree mode": the model is split once into ``graphdef`` (static structure),
``params`` (``nnx.Param`` leaves, trained) and ``rest`` (any other state,
read-only here; empty for :class:`models.llama.Llama`, which holds only
Params). The jitted step is a pure function
``(params, opt_state, batch) -> (params, opt_state, metrics)`` that rebuilds
the module with ``nnx.merge`` inside the trace, so there is no hidden mutable
state and params/opt_state can be donated. The batch is the one
:mod:`training.batch` defines (fields, dtypes, sharding).

:func:`build_train_step` gathers what :func:`jit_train_step` needs (graphdef,
parameter and optimizer-state shapes and shardings) from ``nnx.eval_shape`` and
``jax.eval_shape``, so building it allocates nothing. ``train.py`` compiles it
against the real state (:meth:`TrainStep.init_state` or a restored checkpoint);
``benchmarks/fit.py`` compiles it against ``jax.ShapeDtypeStruct`` inputs at many
sequence lengths to read ``memory_analysis()`` without running it; the
benchmarks and tests run it on :meth:`TrainStep.init_state`.

Needs JAX, Flax, Optax and einops only (no ml_collections, no Grain), so the
benchmarks run this exact step on accelerator images without them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from models import llama
from models import sharding as shd
from training import batch as batch_lib


# ----------------------------------------------------------------------------
# Optimizer
# ----------------------------------------------------------------------------


def make_schedule(optim_config, total_steps: int) -> optax.Schedule:
  """Linear warmup from 0 to ``lr``, then cosine decay to ``lr * min_lr_ratio``."""
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=optim_config.lr, warmup_steps=optim_config.warmup_steps,
      decay_steps=max(total_steps, optim_config.warmup_steps + 1),
      end_value=optim_config.lr * optim_config.min_lr_ratio)


def make_optimizer(optim_config, total_steps: int) -> optax.GradientTransformation:
  """Global-norm clipping, then AdamW with the warmup + cosine schedule."""
  return optax.chain(
      optax.clip_by_global_norm(optim_config.grad_clip),
      optax.adamw(make_schedule(optim_config, total_steps), b1=optim_config.b1,
                  b2=optim_config.b2, eps=optim_config.eps,
                  weight_decay=optim_config.weight_decay,
                  # Not by ndim: stacked layers make the norm scales [layers, dim].
                  mask=llama.weight_decay_mask))


def opt_state_shardings(tx: optax.GradientTransformation, params, param_shardings, mesh):
  """Moments share their parameter's sharding; counters and scalars are replicated.

  Abstract only: ``tree_map_params`` runs ``tx.init`` on a placeholder to find where the
  parameter trees sit in the state, and here that runs under ``jax.eval_shape``, so no
  counter is created on ``mesh`` (whose devices may be compile-only, a TPU topology's)."""
  abstract = jax.eval_shape(tx.init, params)
  replicated = NamedSharding(mesh, P())
  return optax.tree_utils.tree_map_params(
      lambda placeholder: jax.eval_shape(lambda: tx.init(placeholder)),
      lambda _, sharding: sharding, abstract, param_shardings,
      transform_non_params=lambda _: replicated)


# ----------------------------------------------------------------------------
# Loss
# ----------------------------------------------------------------------------


def loss_sums(graphdef, params, rest, batch) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Summed masked next-token NLL over ``batch`` (any token order: it is a sum).

  Returns the sum (what the gradient is taken of) and the token count and
  number of argmax-correct targets, so microbatches and devices combine exactly
  before the single division by the total token count.
  """
  model = nnx.merge(graphdef, params, rest)
  mask_BL = batch["loss_mask"]
  # The model computes the head + NLL itself, chunk by chunk when
  # model.loss_chunk_size is set, so whole-sequence logits need never exist.
  loss_sum, correct = model.nll_sums(batch["tokens"], batch["positions"], batch["segment_ids"],
                                     batch["labels"], mask_BL)
  return loss_sum, dict(tokens=jnp.sum(mask_BL.astype(jnp.float32)), correct=correct)


# ----------------------------------------------------------------------------
# Steps
# ----------------------------------------------------------------------------


def _split_microbatches(batch, microbatches: int):
  """``[B, L]`` -> ``[M, B/M, L]`` with microbatch ``m`` = rows ``m::M``.

  Taking strided rows keeps every microbatch spread over all 'data' shards
  (row ``b = i*M + m``: the ``i`` axis stays contiguous, hence stays sharded),
  so splitting moves no data between devices.
  """
  def split(x_BL):
    b, length = x_BL.shape
    x = x_BL.reshape(b // microbatches, microbatches, length).swapaxes(0, 1)
    return shd.with_logical_constraint(x, (None, *batch_lib.LOGICAL_AXES))
  return jax.tree.map(split, batch)


def train_step(params, opt_state, batch, *, graphdef, rest, tx: optax.GradientTransformation,
               microbatches: int = 1):
  """One optimizer update over ``batch`` (accumulating ``microbatches`` gradients).

  The loss is mean NLL per target token of the whole batch: numerator and
  denominator are summed over microbatches first, so the update equals the
  single-batch update regardless of ``microbatches``.
  """
  def with_loss(params, mb):
    loss_sum, aux = loss_sums(graphdef, params, rest, mb)
    return loss_sum, dict(aux, loss_sum=loss_sum)

  grad_fn = jax.grad(with_loss, has_aux=True)

  def micro(params, mb):
    grads, aux = grad_fn(params, mb)
    loss_sum = aux.pop("loss_sum")
    return grads, loss_sum, aux

  if microbatches == 1:
    grads, loss_sum, aux = micro(params, batch)
  else:
    def body(carry, mb):
      grads_acc, loss_acc, aux_acc = carry
      grads, loss_sum, aux = micro(params, mb)
      return (jax.tree.map(jnp.add, grads_acc, grads), loss_acc + loss_sum,
              jax.tree.map(jnp.add, aux_acc, aux)), None

    zeros = jax.tree.map(jnp.zeros_like, params)
    init = (zeros, jnp.zeros((), jnp.float32),
            dict(tokens=jnp.zeros((), jnp.float32), correct=jnp.zeros((), jnp.float32)))
    (grads, loss_sum, aux), _ = jax.lax.scan(body, init,
                                             _split_microbatches(batch, microbatches))

  denom = jnp.maximum(aux["tokens"], 1.0)
  grads = jax.tree.map(lambda g: g / denom, grads)
  grad_norm = optax.tree.norm(grads)
  updates, opt_state = tx.update(grads, opt_state, params)
  params = optax.apply_updates(params, updates)
  metrics = dict(loss=loss_sum / denom, grad_norm=grad_norm, accuracy=aux["correct"] / denom,
                 target_tokens=aux["tokens"])
  return params, opt_state, metrics


def eval_step(params, batch, *, graphdef, rest):
  """Summed loss, token count and correct-argmax count (combined over batches on host)."""
  loss_sum, aux = loss_sums(graphdef, params, rest, batch)
  return dict(loss_sum=loss_sum, tokens=aux["tokens"], correct=aux["correct"])


def batch_shardings(mesh) -> dict[str, NamedSharding]:
  """Field name -> sharding of the batch argument (see :func:`training.batch.shardings`)."""
  return batch_lib.shardings(mesh)


def jit_train_step(*, graphdef, rest, tx, microbatches: int, mesh, param_shardings,
                   opt_shardings) -> Callable:
  """``jax.jit`` with explicit in/out shardings; params and opt_state are donated."""
  replicated = NamedSharding(mesh, P())
  step = functools.partial(train_step, graphdef=graphdef, rest=rest, tx=tx,
                           microbatches=microbatches)
  return jax.jit(
      step,
      in_shardings=(param_shardings, opt_shardings, batch_shardings(mesh)),
      out_shardings=(param_shardings, opt_shardings, replicated),
      donate_argnames=("params", "opt_state"))


def jit_eval_step(*, graphdef, rest, mesh, param_shardings) -> Callable:
  replicated = NamedSharding(mesh, P())
  step = functools.partial(eval_step, graphdef=graphdef, rest=rest)
  return jax.jit(step, in_shardings=(param_shardings, batch_shardings(mesh)),
                 out_shardings=replicated)


def init_opt_state(tx, params, opt_shardings):
  """Optimizer state created directly with its target shardings (never gathered)."""
  return jax.jit(tx.init, out_shardings=opt_shardings)(params)



# ----------------------------------------------------------------------------
# The one train-step builder
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TrainStep:
  """The jitted train step of one model config on one mesh, plus its abstract state.

  ``abstract_params`` / ``abstract_opt_state`` are pytrees of
  ``jax.ShapeDtypeStruct`` carrying their target shardings (what
  :meth:`lower` compiles against, and what a checkpoint restores into);
  ``step`` is :func:`jit_train_step` (params and optimizer state donated).
  """
  model_cfg: llama.LlamaConfig
  mesh: jax.sharding.Mesh
  graphdef: Any
  rest: Any
  tx: optax.GradientTransformation
  abstract_params: Any
  param_shardings: Any
  abstract_opt_state: Any
  opt_shardings: Any
  step: Callable
  seed: int = 0

  def init_state(self):
    """``(params, opt_state)``: the model initialised from ``seed`` and AdamW's state,
    each created directly with its target sharding (nothing is gathered)."""
    with jax.set_mesh(self.mesh):
      model = llama.create_sharded_model(self.model_cfg, self.mesh, seed=self.seed)
      _, params, _ = nnx.split(model, nnx.Param, ...)
      return params, init_opt_state(self.tx, params, self.opt_shardings)

  def eval_step(self) -> Callable:
    """The jitted eval step of the same model (:func:`jit_eval_step`), built once per
    TrainStep (a reused TrainStep reuses its compiled eval program too)."""
    if "_eval_step" not in self.__dict__:  # frozen: set once, bypassing __setattr__
      object.__setattr__(self, "_eval_step", jit_eval_step(
          graphdef=self.graphdef, rest=self.rest, mesh=self.mesh,
          param_shardings=self.param_shardings))
    return self.__dict__["_eval_step"]

  def lower(self, batch_shape: tuple[int, int], params=None, opt_state=None):
    """``step.lower`` for a ``[rows, seq_len]`` batch; state defaults to the abstract one."""
    params = self.abstract_params if params is None else params
    opt_state = self.abstract_opt_state if opt_state is None else opt_state
    with jax.set_mesh(self.mesh):
      return self.step.lower(params, opt_state, batch_lib.abstract(batch_shape, self.mesh))

  def compile(self, batch_shape: tuple[int, int], params=None, opt_state=None):
    """The compiled step for ``batch_shape`` (``memory_analysis()`` is per device)."""
    return self.lower(batch_shape, params, opt_state).compile()

  def offloaded_bytes(self, batch_shape: tuple[int, int], layers: int,
                      platform: str = "cuda") -> int:
    """Per-device bytes of saved activations the remat policy places in host memory.

    Read from the step lowered for an accelerator ``platform`` (no device
    needed): XLA:CPU has no host memory space and keeps them on the device,
    so ``memory_analysis()`` on CPU counts them there. Each
    ``annotate_device_placement`` to ``pinned_host`` is one offloaded
    residual of one layer; the layer scan stacks it ``layers`` times (pass 1
    when the layers are unrolled: each then appears on its own). Residuals
    are ``[batch, length, ...]`` activations, so the global size is divided by
    the devices the batch's ``(batch, length)`` axes are sharded over.
    """
    with jax.set_mesh(self.mesh):
      text = self.step.trace(self.abstract_params, self.abstract_opt_state,
                             batch_lib.abstract(batch_shape, self.mesh)).lower(
                                 lowering_platforms=(platform,)).as_text()
    total = 0
    for line in text.splitlines():
      if "annotate_device_placement" in line and '"pinned_host"' in line:
        shape, dtype = _PLACED.search(line).groups()
        total += math.prod(int(d) for d in shape.split("x")) * _DTYPE_BYTES[dtype]
    spec = batch_lib.spec(self.mesh)
    shards = math.prod(self.mesh.shape[a] for part in spec if part is not None
                       for a in ((part,) if isinstance(part, str) else part))
    return total * layers // shards


# The result type of a placement annotation: "-> tensor<1x256x64xbf16>".
_PLACED = re.compile(r"->\s*tensor<((?:\d+x)*\d+)x([a-z]+\d*)>")
_DTYPE_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "f64": 8, "i32": 4, "i8": 1}


def build_train_step(model_cfg: llama.LlamaConfig, mesh, tx: optax.GradientTransformation,
                     *, microbatches: int = 1, seed: int = 0) -> TrainStep:
  """The train step of ``model_cfg`` on ``mesh`` with optimizer ``tx``, built from
  abstract values only (see the module docstring); :meth:`TrainStep.init_state`
  makes the concrete state, seeded by ``seed``."""
  graphdef, params, rest = abstract_model(model_cfg, mesh, seed=seed)
  param_shardings = jax.tree.map(lambda x: x.sharding, params)
  with jax.set_mesh(mesh):
    opt_shardings = opt_state_shardings(tx, params, param_shardings, mesh)
    opt_state = jax.eval_shape(tx.init, params)
  step = jit_train_step(graphdef=graphdef, rest=rest, tx=tx, microbatches=microbatches,
                        mesh=mesh, param_shardings=param_shardings, opt_shardings=opt_shardings)
  return TrainStep(
      model_cfg=model_cfg, mesh=mesh, graphdef=graphdef, rest=rest, tx=tx,
      abstract_params=params, param_shardings=param_shardings,
      abstract_opt_state=abstract_like(opt_state, opt_shardings), opt_shardings=opt_shardings,
      step=step, seed=seed)


def abstract_model(model_cfg: llama.LlamaConfig, mesh, *, seed: int = 0):
  """``(graphdef, params, rest)`` of ``model_cfg`` without allocating: ``params`` are
  ``ShapeDtypeStruct`` leaves carrying their shardings on ``mesh`` (the rules table of
  :mod:`models.sharding`), what a train step compiles against and a checkpoint restores."""
  with jax.set_mesh(mesh):
    model = nnx.eval_shape(lambda: llama.Llama(model_cfg, rngs=nnx.Rngs(seed)))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    return graphdef, abstract_like(params, shd.param_shardings(params, mesh)), rest


def abstract_like(tree, shardings):
  """``ShapeDtypeStruct`` leaves of ``tree`` with the matching shardings attached (what
  :meth:`TrainStep.lower` compiles against and a checkpoint restore fills)."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      tree, shardings)
