"""The optimizer, the pure train/eval steps, their jit with explicit shardings, and
:func:`build_train_step`, the one place a train step and its state are assembled.

The model is split once (NNX) into ``graphdef``, ``params`` (``nnx.Param`` leaves, trained)
and ``rest`` (read-only); the step merges them inside the trace, so params and opt_state can
be donated. Every shape and sharding comes from ``nnx.eval_shape``/``jax.eval_shape``: building
a step allocates nothing. Needs JAX, Flax, Optax and einops only (the benchmarks' images).
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


def loss_sums(graphdef, params, rest, batch) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Summed masked next-token NLL over ``batch`` (any token order: it is a sum), and the
  target and argmax-correct counts, so microbatches combine exactly before one division."""
  model = nnx.merge(graphdef, params, rest)
  mask_BL = batch["loss_mask"]
  # Head + NLL in the model, by chunks with model.loss_chunk_size: no whole-sequence logits.
  loss_sum, correct = model.nll_sums(batch["tokens"], batch["positions"], batch["segment_ids"],
                                     batch["labels"], mask_BL)
  return loss_sum, dict(tokens=jnp.sum(mask_BL.astype(jnp.float32)), correct=correct)


def _split_microbatches(batch, microbatches: int):
  """``[B, L]`` -> ``[M, B/M, L]`` with microbatch ``m`` = rows ``m::M``: each spread over
  every 'data' shard, so splitting moves no data between devices."""
  def split(x_BL):
    b, length = x_BL.shape
    x = x_BL.reshape(b // microbatches, microbatches, length).swapaxes(0, 1)
    return shd.with_logical_constraint(x, (None, *batch_lib.LOGICAL_AXES))
  return jax.tree.map(split, batch)


def train_step(params, opt_state, batch, *, graphdef, rest, tx: optax.GradientTransformation,
               microbatches: int = 1):
  """One optimizer update over ``batch``: the mean NLL per target token of the whole batch,
  numerator and denominator summed over ``microbatches`` first (the same update for any M)."""
  grad_fn = jax.value_and_grad(functools.partial(loss_sums, graphdef), has_aux=True)

  def micro(mb):
    (loss_sum, aux), grads = grad_fn(params, rest, mb)
    return grads, loss_sum, aux

  if microbatches == 1:
    grads, loss_sum, aux = micro(batch)
  else:
    zero = jnp.zeros((), jnp.float32)
    init = (jax.tree.map(jnp.zeros_like, params), zero, dict(tokens=zero, correct=zero))
    (grads, loss_sum, aux), _ = jax.lax.scan(
        lambda carry, mb: (jax.tree.map(jnp.add, carry, micro(mb)), None), init,
        _split_microbatches(batch, microbatches))

  denom = jnp.maximum(aux["tokens"], 1.0)
  grads = jax.tree.map(lambda g: g / denom, grads)
  grad_norm = optax.tree.norm(grads)
  updates, opt_state = tx.update(grads, opt_state, params)
  params = optax.apply_updates(params, updates)
  metrics = dict(loss=loss_sum / denom, grad_norm=grad_norm, accuracy=aux["correct"] / denom,
                 target_tokens=aux["tokens"])
  return params, opt_state, metrics


@dataclasses.dataclass(frozen=True)
class TrainStep:
  """The train step of one model config on one mesh (:meth:`jit`), and its abstract state:
  ``ShapeDtypeStruct`` trees with their target shardings."""
  model_cfg: llama.LlamaConfig
  mesh: jax.sharding.Mesh
  graphdef: Any
  rest: Any
  tx: optax.GradientTransformation
  abstract_params: Any
  param_shardings: Any
  abstract_opt_state: Any
  opt_shardings: Any
  microbatches: int = 1
  seed: int = 0

  def jit(self, mesh=None, microbatches: int | None = None) -> Callable:
    """:func:`train_step` over ``microbatches`` (default: the step's) under ``jax.jit`` with
    explicit in/out shardings, the batch's on ``mesh`` (default: the step's; a length bucket's
    re-split of its devices, so the state keeps its shardings); params and opt_state are
    donated."""
    mesh, state = mesh or self.mesh, (self.param_shardings, self.opt_shardings)
    return jax.jit(functools.partial(train_step, graphdef=self.graphdef, rest=self.rest,
                                     tx=self.tx, microbatches=microbatches or self.microbatches),
                   in_shardings=(*state, batch_lib.shardings(mesh)),
                   out_shardings=(*state, NamedSharding(mesh, P())),
                   donate_argnames=("params", "opt_state"))

  @functools.cached_property
  def step(self) -> Callable:
    """The jitted step on the step's own mesh (:meth:`jit`), built once."""
    return self.jit()

  def init_state(self):
    """``(params, opt_state)``: the model initialised from ``seed`` and AdamW's state,
    each created directly with its target sharding (nothing is gathered)."""
    with jax.set_mesh(self.mesh):
      model = llama.create_sharded_model(self.model_cfg, self.mesh, seed=self.seed)
      _, params, _ = nnx.split(model, nnx.Param, ...)
      return params, self.init_opt_state(params)

  def init_opt_state(self, params):
    """A fresh optimizer state of ``params``, created directly with its target shardings."""
    return jax.jit(self.tx.init, out_shardings=self.opt_shardings)(params)

  @functools.cached_property
  def eval_step(self) -> Callable:
    """The jitted eval step of the same model, built once per TrainStep: the summed loss,
    target count and correct-argmax count of a batch (combined over batches on host)."""
    def step(params, batch):
      loss_sum, aux = loss_sums(self.graphdef, params, self.rest, batch)
      return dict(loss_sum=loss_sum, **aux)
    return jax.jit(step, in_shardings=(self.param_shardings, batch_lib.shardings(self.mesh)),
                   out_shardings=NamedSharding(self.mesh, P()))

  def lower(self, batch_shape: tuple[int, int], params=None, opt_state=None,
            platform: str | None = None):
    """``step.lower`` for a ``[rows, seq_len]`` batch (for ``platform`` if given, else the
    default backend); state defaults to the abstract one."""
    params = self.abstract_params if params is None else params
    opt_state = self.abstract_opt_state if opt_state is None else opt_state
    with jax.set_mesh(self.mesh):
      traced = self.step.trace(params, opt_state, batch_lib.abstract(batch_shape, self.mesh))
      return traced.lower(lowering_platforms=(platform,) if platform else None)

  def compile(self, batch_shape: tuple[int, int], params=None, opt_state=None):
    """The compiled step for ``batch_shape`` (``memory_analysis()`` is per device)."""
    return self.lower(batch_shape, params, opt_state).compile()

  def offloaded_bytes(self, batch_shape: tuple[int, int], layers: int,
                      platform: str = "cuda") -> int:
    """Per-device bytes of saved activations the remat policy places in host memory, read
    from the step lowered for ``platform`` (XLA:CPU has no host memory space): each
    ``pinned_host`` placement is one layer's residual, stacked ``layers`` times by the layer
    scan (1 when unrolled), divided over the devices of the batch's ``(batch, length)``."""
    text = self.lower(batch_shape, platform=platform).as_text()
    total = 0
    for line in text.splitlines():
      if "annotate_device_placement" in line and '"pinned_host"' in line:
        shape, dtype = _PLACED.search(line).groups()
        total += math.prod(int(d) for d in shape.split("x")) * _DTYPE_BYTES[dtype]
    shard = batch_lib.sharding(self.mesh).shard_shape(batch_shape)
    return total * layers // (math.prod(batch_shape) // math.prod(shard))


# The result type of a placement annotation: "-> tensor<1x256x64xbf16>".
_PLACED = re.compile(r"->\s*tensor<((?:\d+x)*\d+)x([a-z]+\d*)>")
_DTYPE_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "f64": 8, "i32": 4, "i8": 1}


def build_train_step(model_cfg: llama.LlamaConfig, mesh, tx: optax.GradientTransformation,
                     *, microbatches: int = 1, seed: int = 0) -> TrainStep:
  """The train step of ``model_cfg`` on ``mesh`` with optimizer ``tx``, from abstract values
  only; :meth:`TrainStep.init_state` makes the concrete state, seeded by ``seed``."""
  graphdef, params, rest = abstract_model(model_cfg, mesh, seed=seed)
  param_shardings = jax.tree.map(lambda x: x.sharding, params)
  with jax.set_mesh(mesh):  # moments: their parameter's sharding; counters: replicated
    opt_state = jax.eval_shape(tx.init, params)
    opt_shardings = optax.tree_utils.tree_map_params(
        lambda placeholder: jax.eval_shape(lambda: tx.init(placeholder)),
        lambda _, sharding: sharding, opt_state, param_shardings,
        transform_non_params=lambda _: NamedSharding(mesh, P()))
  return TrainStep(
      model_cfg=model_cfg, mesh=mesh, graphdef=graphdef, rest=rest, tx=tx,
      abstract_params=params, param_shardings=param_shardings,
      abstract_opt_state=abstract_like(opt_state, opt_shardings), opt_shardings=opt_shardings,
      microbatches=microbatches, seed=seed)


def abstract_model(model_cfg: llama.LlamaConfig, mesh, *, seed: int = 0):
  """``(graphdef, params, rest)`` of ``model_cfg`` without allocating: ``params`` are
  ``ShapeDtypeStruct`` leaves with their shardings on ``mesh`` (:mod:`models.sharding`)."""
  with jax.set_mesh(mesh):
    model = nnx.eval_shape(lambda: llama.Llama(model_cfg, rngs=nnx.Rngs(seed)))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    return graphdef, abstract_like(params, shd.param_shardings(params, mesh)), rest


def abstract_like(tree, shardings):
  """``ShapeDtypeStruct`` leaves of ``tree`` with the matching shardings attached."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      tree, shardings)
