"""Helpers shared by the model and trainer tests: meshes, random params, packed batches, configs.

Random params come from numpy, shaped by the model: compiling the threefry
initialisers of every weight costs seconds on CPU (test_sharding.py covers
the model's own sharded initialiser).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import inference
from models import sharding as shd
from models.llama import Llama


def make_mesh(auto: bool = False, **sizes: int) -> jax.sharding.Mesh:
  """A mesh over the first devices with the given axis sizes, in ``MESH_AXES`` order.

  ``make_mesh(data=2, sequence=4)`` has the axes ``data, sequence, tensor``
  (sizes 2, 4, 1). Axes not in ``MESH_AXES`` follow in the order given. Explicit
  axis types unless ``auto``.
  """
  names = [a for a in shd.MESH_AXES] + [a for a in sizes if a not in shd.MESH_AXES]
  shape = tuple(sizes.get(a, 1) for a in names)
  kw = {"axis_types": (jax.sharding.AxisType.Auto,) * len(names)} if auto else {}
  return jax.make_mesh(shape, tuple(names), devices=jax.devices()[:int(np.prod(shape))], **kw)


def graphdef(cfg):
  """The static structure of ``Llama(cfg)`` (no arrays allocated)."""
  return nnx.graphdef(nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0))))


def random_params(cfg, seed: int = 0):
  """An ``nnx.State`` of Params shaped by ``Llama(cfg)``: weights ``init_std * N(0, 1)``.

  Norm scales are ``1 + 0.1 * N(0, 1)``, not 1, so a misplaced norm cannot hide.
  """
  abstract = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
  _, params, rest = nnx.split(abstract, nnx.Param, ...)
  assert not jax.tree.leaves(rest)  # tree mode: the model holds Params only
  rng = np.random.default_rng(seed)

  def fill(var):
    noise = rng.normal(size=var.get_value().shape).astype(np.float32)
    is_norm = var.get_metadata()[shd.LOGICAL_AXES_KEY][-1] == "norm"
    return var.replace(jnp.asarray(1.0 + 0.1 * noise if is_norm else cfg.init_std * noise))

  return jax.tree.map(fill, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def packed_batch(vocab_size: int, doc_lengths=((5, 7), (9, 3, 4)), length: int = 16,
                 seed: int = 0):
  """``(tokens, positions, segment_ids)``, ``[rows, length]`` int32, natural order.

  Row ``r`` packs documents of ``doc_lengths[r]`` tokens (segment ids 1, 2,
  ...; positions restart at 0 per document); the rest of a row is padding
  (segment 0, position 0).
  """
  rows = len(doc_lengths)
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, vocab_size, size=(rows, length)).astype(np.int32)
  segs = np.zeros((rows, length), np.int32)
  pos = np.zeros((rows, length), np.int32)
  for b, lengths in enumerate(doc_lengths):
    assert sum(lengths) <= length
    start = 0
    for d, n in enumerate(lengths):
      segs[b, start:start + n] = d + 1
      pos[b, start:start + n] = np.arange(n)
      start += n
  return tokens, pos, segs


def tiny_config(**overrides):
  """``configs/tiny.py`` with dotted-path overrides (``{"model.dim": 32}``), as a ConfigDict.

  ``model.layout`` is pinned to ``"zigzag"`` (override it to test another, or ``"auto"``,
  which train.py resolves at startup): a test that builds the model or the data from the
  config itself, without train.py's startup, then names the layout it runs.
  """
  from configs import tiny
  from training import flags as flags_lib

  return flags_lib.apply_overrides(tiny.get_config(),
                                   {"model.layout": "zigzag", **overrides}.items())


def dense_greedy(cfg, params, prompts, steps):
  """Greedy tokens ``[B, steps]``: the full forward pass (dense, one device) at every step."""
  dense_cfg = dataclasses.replace(cfg, attention="dense", layout="contiguous")
  gdef = graphdef(dense_cfg)
  length = max(sum(len(d) for d in inference._documents(p)) for p in prompts) + steps

  @jax.jit
  def last_logits(params, tokens, positions, segments, last):
    logits = nnx.merge(gdef, params)(tokens, positions, segments)
    return jnp.take_along_axis(logits, last[:, None, None], axis=1)[:, 0]

  out = np.zeros((len(prompts), steps), np.int32)
  for s in range(steps):
    batch = inference.prepare_prompts(
        [list(inference._documents(p)[:-1]) + [inference._documents(p)[-1] + out[b, :s].tolist()]
         for b, p in enumerate(prompts)], length, "right")
    logits = last_logits(params, batch["tokens"], batch["positions"], batch["segment_ids"],
                         batch["last"])
    out[:, s] = np.argmax(np.asarray(logits), axis=-1)
  return out
