"""Hugging Face LLaMA checkpoints <-> :class:`models.llama.Llama`, local directories only.

Import reads ``config.json`` and ``model.safetensors`` or the shards listed in
``model.safetensors.index.json`` with the ``safetensors`` package
(``safe_open(..., framework="numpy")``: bfloat16 reads as
``ml_dtypes.bfloat16`` once ``ml_dtypes`` is imported, no torch). Given
shardings, every parameter is built with ``jax.make_array_from_callback``
whose callback reads only the requested slice (``get_slice(name)[index]``),
so a process reads just what its devices hold and never holds more than the
addressable shards of one parameter on the host. Export
(:func:`hf_state_dict`, :func:`hf_config_dict`) is the exact inverse of the
same table.

Weight mapping (HF ``nn.Linear`` stores ``[out, in]``):

======================================================  ==============================
HF                                                      ours
======================================================  ==============================
``model.embed_tokens.weight [V, D]``                    ``embed [V, D]``
``model.layers.i.self_attn.q_proj.weight [N*H, D]``     ``layers.attn.wq[i] [D, N, H]``
``model.layers.i.self_attn.{k,v}_proj.weight [K*H, D]`` ``layers.attn.w{k,v}[i] [D, K, H]``
``model.layers.i.self_attn.o_proj.weight [D, N*H]``     ``layers.attn.wo[i] [N, H, D]``
``model.layers.i.mlp.{gate,up}_proj.weight [F, D]``     ``layers.mlp.w_{gate,up}[i] [D, F]``
``model.layers.i.mlp.down_proj.weight [D, F]``          ``layers.mlp.w_down[i] [F, D]``
``model.layers.i.input_layernorm.weight``               ``layers.attn_norm.scale[i]``
``model.layers.i.post_attention_layernorm.weight``      ``layers.mlp_norm.scale[i]``
``model.norm.weight``                                   ``final_norm.scale``
``lm_head.weight [V, D]``                               ``lm_head [D, V]`` (absent if tied)
======================================================  ==============================

Each row is a reshape (splitting an HF axis, e.g. ``N*H -> N, H``) and a
transpose: exact in both directions, so import -> export reproduces the
original tensors bit for bit.

No q/k permutation: HF ``LlamaAttention`` applies RoPE with ``rotate_half``
(first half / second half of each head), which is the convention of
:func:`models.llama.apply_rope`. (Meta's original checkpoints use interleaved
pairs; HF's conversion script permutes q/k rows into halves, so HF-format
weights are already in our convention.)
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Iterator, Mapping

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  registers bfloat16 with numpy: safetensors' numpy reader needs it
import numpy as np
from flax import nnx

from models import sharding as shd
from models.llama import Llama, LlamaConfig

#: The ``LlamaConfig`` fields a Hugging Face ``config.json`` determines (see :func:`hf_model_fields`).
HF_FIELDS: tuple[str, ...] = ("vocab_size", "dim", "num_layers", "num_heads", "num_kv_heads",
                              "head_dim", "mlp_dim", "rope_theta", "rope_scaling", "norm_eps",
                              "tie_embeddings")
#: Of those, the ones fixed by the weights' shapes (they cannot be overridden).
HF_SHAPE_FIELDS: tuple[str, ...] = ("vocab_size", "dim", "num_layers", "num_heads",
                                    "num_kv_heads", "head_dim", "mlp_dim", "tie_embeddings")

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


# ----------------------------------------------------------------------------------------------
# config.json
# ----------------------------------------------------------------------------------------------


def read_hf_config_json(path: str) -> dict[str, Any]:
  """The parsed ``path/config.json`` (FileNotFoundError naming the directory if absent)."""
  filename = os.path.join(path, "config.json")
  if not os.path.isfile(filename):
    raise FileNotFoundError(f"{path} has no config.json (a Hugging Face model directory, as "
                            "save_pretrained writes it, is needed).")
  with open(filename) as f:
    return json.load(f)


def hf_model_fields(path: str) -> dict[str, Any]:
  """The :data:`HF_FIELDS` of :class:`LlamaConfig`, read from ``path/config.json``.

  Understands both ``rope_theta`` + ``rope_scaling`` (transformers < 5) and
  ``rope_parameters`` (transformers >= 5). ``rope_scaling`` is None for the
  default RoPE. Raises ValueError for a model this LLaMA is not (biases,
  another activation, another ``model_type``).
  """
  hf = read_hf_config_json(path)
  model_type = hf.get("model_type", "llama")
  if model_type != "llama":
    raise ValueError(f"{path}: model_type {model_type!r} is not 'llama'.")
  for flag in ("attention_bias", "mlp_bias"):
    if hf.get(flag):
      raise ValueError(f"{path}: {flag}=True is not supported (LLaMA has no biases).")
  if hf.get("hidden_act", "silu") != "silu":
    raise ValueError(f"{path}: hidden_act {hf['hidden_act']!r} is not 'silu' (SwiGLU).")
  rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
  rope_theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
  rope_type = rope.get("rope_type", rope.get("type", "default"))
  num_heads = hf["num_attention_heads"]
  return dict(
      vocab_size=hf["vocab_size"],
      dim=hf["hidden_size"],
      num_layers=hf["num_hidden_layers"],
      num_heads=num_heads,
      num_kv_heads=hf.get("num_key_value_heads") or num_heads,
      head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
      mlp_dim=hf["intermediate_size"],
      rope_theta=float(rope_theta),
      rope_scaling=None if rope_type == "default" else rope,
      norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
  )


def load_hf_config(path: str, **overrides: Any) -> LlamaConfig:
  """:class:`LlamaConfig` from ``path/config.json`` (:func:`hf_model_fields`) and ``overrides``.

  ``overrides`` set fields HF does not know about (``attention``, ``layout``,
  ``dtype``, ``param_dtype``, ``remat_policy``, ...) or replace converted ones.
  """
  return LlamaConfig(**{**hf_model_fields(path), **overrides})


def hf_config_dict(cfg: LlamaConfig, base: Mapping[str, Any] | None = None, *,
                   max_position_embeddings: int | None = None) -> dict[str, Any]:
  """A ``LlamaForCausalLM`` ``config.json`` for ``cfg`` (the inverse of :func:`hf_model_fields`).

  RoPE is written as ``rope_theta`` + ``rope_scaling`` (what transformers 4.x
  reads; 5.x converts it to ``rope_parameters``). ``torch_dtype`` is the
  parameter dtype (the exported tensors' dtype). From ``base`` (the source
  model's config.json, if any) only the token ids, ``initializer_range`` and
  ``max_position_embeddings`` are kept; ``max_position_embeddings`` is the
  larger of that and the given one (the trained context).
  """
  base = dict(base or {})
  positions = [p for p in (base.get("max_position_embeddings"), max_position_embeddings) if p]
  out = {
      "architectures": ["LlamaForCausalLM"],
      "model_type": "llama",
      "vocab_size": cfg.vocab_size,
      "hidden_size": cfg.dim,
      "intermediate_size": cfg.mlp_dim,
      "num_hidden_layers": cfg.num_layers,
      "num_attention_heads": cfg.num_heads,
      "num_key_value_heads": cfg.num_kv_heads,
      "head_dim": cfg.resolved_head_dim,
      "hidden_act": "silu",
      "rms_norm_eps": cfg.norm_eps,
      "rope_theta": cfg.rope_theta,
      "rope_scaling": dict(cfg.rope_scaling) if cfg.rope_scaling else None,
      "tie_word_embeddings": cfg.tie_embeddings,
      "attention_bias": False,
      "mlp_bias": False,
      "max_position_embeddings": max(positions) if positions else 2048,
      "torch_dtype": cfg.param_dtype,
  }
  for key in ("bos_token_id", "eos_token_id", "pad_token_id", "initializer_range"):
    if key in base:
      out[key] = base[key]
  return out


# ----------------------------------------------------------------------------------------------
# The weight table
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Layout:
  """How one parameter of ours is an HF tensor: ``ours = hf.reshape(split).transpose(perm)``.

  ``groups[a]`` are the sizes HF axis ``a`` splits into (their product is its
  length); ``split`` is all groups flattened; ``perm`` orders the split axes
  into ours (per layer: a stacked parameter adds a leading ``layers`` axis).
  """
  hf_name: str  # with ``{i}`` for the layer index if stacked
  groups: tuple[tuple[int, ...], ...]
  perm: tuple[int, ...]

  @property
  def stacked(self) -> bool:
    return "{i}" in self.hf_name

  @property
  def hf_shape(self) -> tuple[int, ...]:
    return tuple(math.prod(g) for g in self.groups)

  @property
  def our_shape(self) -> tuple[int, ...]:
    split = [n for g in self.groups for n in g]
    return tuple(split[p] for p in self.perm)

  def to_hf(self, ours: np.ndarray) -> np.ndarray:
    """One layer's (or an unstacked) parameter of ours as the HF tensor (exact)."""
    return np.ascontiguousarray(ours.transpose(np.argsort(self.perm)).reshape(self.hf_shape))

  def read(self, read_slice, index: tuple[slice, ...]) -> np.ndarray:
    """``ours[index]`` for one layer, reading only the HF slice that covers it.

    ``read_slice(hf_index)`` returns ``hf[hf_index]``. A split HF axis is read
    over the rows of the selected range of its first group (whole inner
    groups), then the inner groups are sliced after the reshape.
    """
    split = [n for g in self.groups for n in g]
    split_index: list[slice | None] = [None] * len(split)
    for ours_axis, split_axis in enumerate(self.perm):
      split_index[split_axis] = index[ours_axis]
    hf_index, block_shape, inner = [], [], []
    pos = 0
    for group in self.groups:
      bounds = [split_index[pos + j].indices(n) for j, n in enumerate(group)]
      if any(step != 1 for _, _, step in bounds):
        raise ValueError(f"{self.hf_name}: strided index {index} is not supported.")
      (start, stop, _), rest = bounds[0], bounds[1:]
      outer = math.prod(group[1:])
      hf_index.append(slice(start * outer, stop * outer))
      block_shape += [stop - start, *group[1:]]
      inner += [slice(None)] + [slice(a, b) for a, b, _ in rest]
      pos += len(group)
    block = np.asarray(read_slice(tuple(hf_index))).reshape(block_shape)[tuple(inner)]
    return np.ascontiguousarray(block.transpose(self.perm))


def _layouts(cfg: LlamaConfig) -> dict[str, _Layout]:
  """Our parameter path -> its :class:`_Layout` (the table of the module docstring)."""
  d, n, k, h, f, v = (cfg.dim, cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim,
                      cfg.mlp_dim, cfg.vocab_size)
  layer = "model.layers.{i}."
  table = {
      "embed": _Layout("model.embed_tokens.weight", ((v,), (d,)), (0, 1)),
      "final_norm.scale": _Layout("model.norm.weight", ((d,),), (0,)),
      # [N*H, D] -> [N, H, D] -> [D, N, H]
      "layers.attn.wq": _Layout(layer + "self_attn.q_proj.weight", ((n, h), (d,)), (2, 0, 1)),
      "layers.attn.wk": _Layout(layer + "self_attn.k_proj.weight", ((k, h), (d,)), (2, 0, 1)),
      "layers.attn.wv": _Layout(layer + "self_attn.v_proj.weight", ((k, h), (d,)), (2, 0, 1)),
      # [D, N*H] -> [D, N, H] -> [N, H, D]
      "layers.attn.wo": _Layout(layer + "self_attn.o_proj.weight", ((d,), (n, h)), (1, 2, 0)),
      "layers.mlp.w_gate": _Layout(layer + "mlp.gate_proj.weight", ((f,), (d,)), (1, 0)),
      "layers.mlp.w_up": _Layout(layer + "mlp.up_proj.weight", ((f,), (d,)), (1, 0)),
      "layers.mlp.w_down": _Layout(layer + "mlp.down_proj.weight", ((d,), (f,)), (1, 0)),
      "layers.attn_norm.scale": _Layout(layer + "input_layernorm.weight", ((d,),), (0,)),
      "layers.mlp_norm.scale": _Layout(layer + "post_attention_layernorm.weight", ((d,),),
                                       (0,)),
  }
  if not cfg.tie_embeddings:
    table["lm_head"] = _Layout("lm_head.weight", ((v,), (d,)), (1, 0))
  return table


def _path_name(path) -> str:
  return ".".join(str(getattr(p, "key", getattr(p, "name", p))) for p in path)


def _is_var(x) -> bool:
  return isinstance(x, nnx.Variable)


# ----------------------------------------------------------------------------------------------
# Reading
# ----------------------------------------------------------------------------------------------


class HFCheckpoint:
  """The tensors of a local HF checkpoint directory, opened lazily (nothing is read up front).

  ``model.safetensors``, or the shards named by ``model.safetensors.index.json``.
  Each file is opened once with ``safetensors.safe_open(..., framework="numpy")``
  (memory-mapped); :meth:`read` returns one slice of one tensor.
  """

  def __init__(self, path: str):
    from safetensors import safe_open  # the `hf` extra

    index, single = os.path.join(path, INDEX_FILE), os.path.join(path, SINGLE_FILE)
    if os.path.exists(index):
      with open(index) as f:
        files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.exists(single):
      files = [SINGLE_FILE]
    else:
      found = sorted(os.listdir(path)) if os.path.isdir(path) else []
      raise FileNotFoundError(
          f"{path} holds neither {SINGLE_FILE} nor {INDEX_FILE} (found {found}); save the "
          "model with save_pretrained(..., safe_serialization=True).")
    self.path = path
    self._handles: dict[str, Any] = {}
    for name in files:
      filename = os.path.join(path, name)
      if not os.path.isfile(filename):
        raise FileNotFoundError(f"{index} names {name}, which is missing from {path}.")
      handle = safe_open(filename, framework="numpy")
      for key in handle.keys():
        self._handles[key] = handle

  def names(self) -> list[str]:
    return sorted(self._handles)

  def __contains__(self, name: str) -> bool:
    return name in self._handles

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self._handles[name].get_slice(name).get_shape())

  def read(self, name: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
    """``tensor[index]`` (the whole tensor for None), read from the file."""
    if name not in self._handles:
      raise KeyError(f"{self.path}: the checkpoint has no tensor {name!r}.")
    view = self._handles[name].get_slice(name)
    return view[index] if index is not None else view[tuple(slice(None) for _ in
                                                            view.get_shape())]


def _param_reader(ckpt: HFCheckpoint, layout: _Layout, num_layers: int, dtype):
  """``index -> ours[index]`` (numpy, ``dtype``) for one parameter, stacked over layers if so."""
  if not layout.stacked:
    return lambda index: layout.read(lambda i: ckpt.read(layout.hf_name, i), index).astype(dtype)

  def read(index):
    layers = range(num_layers)[index[0]]
    return np.stack([
        layout.read(lambda i, l=l: ckpt.read(layout.hf_name.format(i=l), i), index[1:])
        for l in layers]).astype(dtype)

  return read


def _check_tensors(ckpt: HFCheckpoint, cfg: LlamaConfig, layouts: Mapping[str, _Layout]) -> None:
  """Every tensor the model needs is there with its HF shape, and nothing else is."""
  used: set[str] = set()
  missing = []
  for layout in layouts.values():
    names = ([layout.hf_name.format(i=i) for i in range(cfg.num_layers)] if layout.stacked
             else [layout.hf_name])
    for name in names:
      if name not in ckpt:
        missing.append(name)
        continue
      if ckpt.shape(name) != layout.hf_shape:
        raise ValueError(f"{name}: checkpoint gives shape {ckpt.shape(name)}, the config "
                         f"expects {layout.hf_shape}.")
      used.add(name)
  if missing:
    raise KeyError(f"checkpoint lacks {missing[:3]}{' ...' if len(missing) > 3 else ''}.")
  # Rotary caches are recomputed from the config; anything else unread means a mismatch.
  # A tied checkpoint may still store lm_head.weight as a copy of the embedding: not needed.
  # A different lm_head means the checkpoint is untied and tie_embeddings is wrong.
  if (cfg.tie_embeddings and "lm_head.weight" in ckpt and
      np.array_equal(ckpt.read("lm_head.weight"), ckpt.read("model.embed_tokens.weight"))):
    used.add("lm_head.weight")
  unexpected = [k for k in ckpt.names() if k not in used and "rotary_emb" not in k]
  if unexpected:
    raise ValueError(f"checkpoint tensors not used by the model: {unexpected[:5]}"
                     f"{' ...' if len(unexpected) > 5 else ''} (is tie_embeddings right?).")


def load_hf_params(path: str, cfg: LlamaConfig, *, mesh=None, shardings=None):
  """The ``nnx.State`` of :class:`Llama` ``(cfg)`` Params, holding the weights at ``path``.

  Args:
    path: directory with ``config.json`` and safetensors weights.
    cfg: the model config; its shapes must match the checkpoint.
    mesh: place every parameter by the rules table (:func:`models.sharding.param_shardings`).
    shardings: or these shardings (a State of ``NamedSharding`` like
      ``param_shardings`` returns, e.g. a compiled train step's ``in_shardings``).
      With neither, parameters live on the default device.

  Each device's shard is read on its own (``jax.make_array_from_callback``;
  devices holding the same index share one read), cast to ``cfg.param_dtype``.
  Raises ``KeyError``/``ValueError`` on missing, unexpected or mis-shaped tensors.
  """
  ckpt = HFCheckpoint(path)
  layouts = _layouts(cfg)
  _check_tensors(ckpt, cfg, layouts)
  abstract = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
  _, abstract_params, rest = nnx.split(abstract, nnx.Param, ...)
  assert not jax.tree.leaves(rest)  # tree mode: the model holds Params only
  if shardings is None and mesh is not None:
    shardings = shd.param_shardings(abstract_params, mesh)
  dtype = np.dtype(cfg.weight_dtype)

  def convert(path_keys, var, sharding=None):
    name = _path_name(path_keys)
    if name not in layouts:
      raise KeyError(f"no Hugging Face source for parameter {name!r}.")
    layout = layouts[name]
    shape = ((cfg.num_layers,) if layout.stacked else ()) + layout.our_shape
    expected = tuple(var.get_value().shape)
    if shape != expected:
      raise ValueError(f"{name}: checkpoint gives shape {shape}, the config expects {expected}.")
    read = _param_reader(ckpt, layout, cfg.num_layers, dtype)
    if sharding is None:
      return var.replace(jnp.asarray(read((slice(None),) * len(shape))))
    sharding = sharding.get_value() if _is_var(sharding) else sharding
    cache: dict[tuple, np.ndarray] = {}

    def shard(index):
      key = tuple(s.indices(n) for s, n in zip(index, shape))
      if key not in cache:  # replicas of one shard (e.g. over 'data') share one read
        cache[key] = read(index)
      return cache[key]

    return var.replace(jax.make_array_from_callback(shape, sharding, shard))

  if shardings is None:
    return jax.tree_util.tree_map_with_path(convert, abstract_params, is_leaf=_is_var)
  return jax.tree_util.tree_map_with_path(convert, abstract_params, shardings, is_leaf=_is_var)


def load_hf_checkpoint(path: str, cfg: LlamaConfig | None = None, *, mesh=None,
                       **overrides: Any) -> Llama:
  """A :class:`Llama` holding the weights of the local HF checkpoint at ``path``.

  ``cfg`` defaults to :func:`load_hf_config` ``(path, **overrides)``; ``mesh``
  as in :func:`load_hf_params`.
  """
  if cfg is None:
    cfg = load_hf_config(path, **overrides)
  elif overrides:
    raise TypeError("pass either cfg or config overrides, not both.")
  graphdef = nnx.graphdef(nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0))))
  return nnx.merge(graphdef, load_hf_params(path, cfg, mesh=mesh))


# ----------------------------------------------------------------------------------------------
# Export
# ----------------------------------------------------------------------------------------------


def hf_state_dict(params, cfg: LlamaConfig) -> Iterator[tuple[str, np.ndarray]]:
  """``(HF tensor name, array)`` for every tensor of ``params`` (a State or :class:`Llama`).

  Arrays keep the parameter dtype (``cfg.param_dtype``) and are produced one
  parameter at a time (each fetched to the host whole: call it where the
  parameters are addressable, e.g. restored onto one device).
  """
  if isinstance(params, nnx.Module):
    params = nnx.state(params, nnx.Param)
  layouts = _layouts(cfg)
  flat = jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_var)[0]
  values = {_path_name(p): (v.get_value() if _is_var(v) else v) for p, v in flat}
  if set(values) != set(layouts):
    raise ValueError(f"parameters {sorted(values)} do not match the model of the config "
                     f"({sorted(layouts)}).")
  for name, layout in layouts.items():
    ours = np.asarray(jax.device_get(values[name]))
    if ours.dtype != np.dtype(cfg.weight_dtype):
      raise ValueError(f"{name} is {ours.dtype}, the config's param_dtype is {cfg.param_dtype}.")
    if layout.stacked:
      for i in range(cfg.num_layers):
        yield layout.hf_name.format(i=i), layout.to_hf(ours[i])
    else:
      yield layout.hf_name, layout.to_hf(ours)
