"""The train step built from abstract values only, for ahead-of-time compilation.

:func:`abstract_train_step` gathers what ``jit_train_step`` needs (graphdef,
parameter and optimizer-state shapes and shardings) from ``nnx.eval_shape``
and ``jax.eval_shape``, so nothing is allocated. ``train.py`` builds its step
with it and compiles that against the real state; ``benchmarks/fit.py``
compiles the same step against ``jax.ShapeDtypeStruct`` inputs at many
sequence lengths to read ``memory_analysis()`` without ever running it.

Needs JAX, Flax, Optax and einops only (no ml_collections, no Grain), like
:mod:`training.step`.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Callable

import jax
import optax
from flax import nnx

from models import llama
from models import sharding as shd
from training import batch as batch_lib
from training import step as step_lib


@dataclasses.dataclass(frozen=True)
class AbstractTrainStep:
  """The jitted train step of one model config on one mesh, plus abstract state.

  ``abstract_params`` / ``abstract_opt_state`` are pytrees of
  ``jax.ShapeDtypeStruct`` carrying their target shardings; ``step`` is
  :func:`training.step.jit_train_step` (params and optimizer state donated).
  """
  mesh: jax.sharding.Mesh
  graphdef: Any
  rest: Any
  tx: optax.GradientTransformation
  abstract_params: Any
  param_shardings: Any
  abstract_opt_state: Any
  opt_shardings: Any
  step: Callable

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


def _with_shardings(tree, shardings):
  """``ShapeDtypeStruct`` leaves of ``tree`` with the matching ``NamedSharding`` attached."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      tree, shardings)


def abstract_train_step(model_cfg: llama.LlamaConfig, mesh, tx: optax.GradientTransformation,
                        *, microbatches: int = 1, seed: int = 0) -> AbstractTrainStep:
  """Builds :class:`AbstractTrainStep` without allocating any array (see module docstring)."""
  with jax.set_mesh(mesh):
    abstract_model = nnx.eval_shape(lambda: llama.Llama(model_cfg, rngs=nnx.Rngs(seed)))
    graphdef, params, rest = nnx.split(abstract_model, nnx.Param, ...)
    param_shardings = shd.param_shardings(params, mesh)
    opt_shardings = step_lib.opt_state_shardings(tx, params, param_shardings, mesh)
    opt_state = jax.eval_shape(tx.init, params)
  step = step_lib.jit_train_step(graphdef=graphdef, rest=rest, tx=tx, microbatches=microbatches,
                                 mesh=mesh, param_shardings=param_shardings,
                                 opt_shardings=opt_shardings)
  return AbstractTrainStep(
      mesh=mesh, graphdef=graphdef, rest=rest, tx=tx,
      abstract_params=_with_shardings(params, param_shardings), param_shardings=param_shardings,
      abstract_opt_state=_with_shardings(opt_state, opt_shardings), opt_shardings=opt_shardings,
      step=step)


def per_device_bytes(compiled) -> int | None:
  """Bytes one device holds while ``compiled`` runs, from its ``memory_analysis()``.

  Arguments + outputs + temporaries, minus outputs that alias (donated)
  arguments; ``None`` when the backend reports no analysis.
  """
  ma = compiled.memory_analysis()
  if ma is None:
    return None
  return int(ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes
             - ma.alias_size_in_bytes)
