"""Import Hugging Face LLaMA checkpoints from a local directory into :class:`models.llama.Llama`.

Reads ``config.json`` and ``model.safetensors`` or the shards listed in
``model.safetensors.index.json``. Tensors are memory-mapped (a small reader
of the safetensors format, so bfloat16 checkpoints need no torch), converted
one parameter at a time, and, given a mesh, placed with
``jax.make_array_from_callback`` so each device reads only its shard.

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

No q/k permutation: HF ``LlamaAttention`` applies RoPE with ``rotate_half``
(first half / second half of each head), which is the convention of
:func:`models.llama.apply_rope`. (Meta's original checkpoints use interleaved
pairs; HF's conversion script permutes q/k rows into halves, so HF-format
weights are already in our convention.)
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from models import sharding as shd
from models.llama import Llama, LlamaConfig

_SAFETENSORS_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_, "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
}


# ----------------------------------------------------------------------------------------------
# Reading
# ----------------------------------------------------------------------------------------------


def read_safetensors(filename: str) -> dict[str, np.ndarray]:
  """Memory-mapped read-only arrays of one ``.safetensors`` file.

  Format: little-endian u64 header length, JSON header ``{name: {dtype, shape,
  data_offsets: [begin, end]}}`` (offsets relative to the end of the header),
  then the raw row-major data.
  """
  with open(filename, "rb") as f:
    (header_len,) = struct.unpack("<Q", f.read(8))
    header = json.loads(f.read(header_len))
  data = np.memmap(filename, dtype=np.uint8, mode="r", offset=8 + header_len)
  out = {}
  for name, info in header.items():
    if name == "__metadata__":
      continue
    if info["dtype"] not in _SAFETENSORS_DTYPES:
      raise ValueError(f"{filename}: tensor {name!r} has unsupported dtype {info['dtype']}.")
    begin, end = info["data_offsets"]
    dtype = np.dtype(_SAFETENSORS_DTYPES[info["dtype"]])
    out[name] = data[begin:end].view(dtype).reshape(info["shape"])
  return out


def read_hf_tensors(path: str) -> dict[str, np.ndarray]:
  """All tensors of a local HF checkpoint directory (single file or sharded index)."""
  index = os.path.join(path, "model.safetensors.index.json")
  single = os.path.join(path, "model.safetensors")
  if os.path.exists(index):
    with open(index) as f:
      files = sorted(set(json.load(f)["weight_map"].values()))
  elif os.path.exists(single):
    files = ["model.safetensors"]
  else:
    found = sorted(os.listdir(path)) if os.path.isdir(path) else []
    raise FileNotFoundError(
        f"{path} holds neither model.safetensors nor model.safetensors.index.json "
        f"(found {found}); save the model with save_pretrained(..., safe_serialization=True).")
  tensors: dict[str, np.ndarray] = {}
  for name in files:
    tensors.update(read_safetensors(os.path.join(path, name)))
  return tensors


def load_hf_config(path: str, **overrides: Any) -> LlamaConfig:
  """:class:`LlamaConfig` from ``path/config.json`` (a ``LlamaForCausalLM`` config).

  Understands both ``rope_theta`` + ``rope_scaling`` (transformers < 5) and
  ``rope_parameters`` (transformers >= 5). ``overrides`` set fields HF does not
  know about (``attention``, ``layout``, ``dtype``, ``param_dtype``,
  ``remat_policy``, ...) or replace converted ones.
  """
  with open(os.path.join(path, "config.json")) as f:
    hf = json.load(f)
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
  rope_scaling = None if rope_type == "default" else rope
  num_heads = hf["num_attention_heads"]
  kwargs = dict(
      vocab_size=hf["vocab_size"],
      dim=hf["hidden_size"],
      num_layers=hf["num_hidden_layers"],
      num_heads=num_heads,
      num_kv_heads=hf.get("num_key_value_heads") or num_heads,
      head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
      mlp_dim=hf["intermediate_size"],
      rope_theta=float(rope_theta),
      rope_scaling=rope_scaling,
      norm_eps=hf.get("rms_norm_eps", 1e-6),
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
  )
  kwargs.update(overrides)
  return LlamaConfig(**kwargs)


# ----------------------------------------------------------------------------------------------
# Conversion
# ----------------------------------------------------------------------------------------------


def _param_sources(cfg: LlamaConfig) -> dict[str, tuple[str, Callable[[np.ndarray], np.ndarray]]]:
  """Our parameter path -> (HF name pattern with ``{i}`` for the layer, HF -> ours transform)."""
  d, n, k, h = cfg.dim, cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim
  prefix = "model.layers.{i}."
  sources = {
      "embed": ("model.embed_tokens.weight", lambda w: w),
      "final_norm.scale": ("model.norm.weight", lambda w: w),
      # [N*H, D] -> [N, H, D] -> [D, N, H]
      "layers.attn.wq": (prefix + "self_attn.q_proj.weight",
                         lambda w: w.reshape(n, h, d).transpose(2, 0, 1)),
      "layers.attn.wk": (prefix + "self_attn.k_proj.weight",
                         lambda w: w.reshape(k, h, d).transpose(2, 0, 1)),
      "layers.attn.wv": (prefix + "self_attn.v_proj.weight",
                         lambda w: w.reshape(k, h, d).transpose(2, 0, 1)),
      # [D, N*H] -> [N*H, D] -> [N, H, D]
      "layers.attn.wo": (prefix + "self_attn.o_proj.weight", lambda w: w.T.reshape(n, h, d)),
      "layers.mlp.w_gate": (prefix + "mlp.gate_proj.weight", lambda w: w.T),
      "layers.mlp.w_up": (prefix + "mlp.up_proj.weight", lambda w: w.T),
      "layers.mlp.w_down": (prefix + "mlp.down_proj.weight", lambda w: w.T),
      "layers.attn_norm.scale": (prefix + "input_layernorm.weight", lambda w: w),
      "layers.mlp_norm.scale": (prefix + "post_attention_layernorm.weight", lambda w: w),
  }
  if not cfg.tie_embeddings:
    sources["lm_head"] = ("lm_head.weight", lambda w: w.T)
  return sources


def _path_name(path) -> str:
  return ".".join(str(getattr(p, "key", getattr(p, "name", p))) for p in path)


def _lazy_param(tensors: Mapping[str, np.ndarray], pattern: str, transform, stacked: bool,
                num_layers: int, used: set[str]):
  """A function ``index -> np.ndarray`` reading (only) the requested slice of one parameter."""
  if stacked:
    names = [pattern.format(i=i) for i in range(num_layers)]
  else:
    names = [pattern]
  missing = [name for name in names if name not in tensors]
  if missing:
    raise KeyError(f"checkpoint lacks {missing[:3]}{' ...' if len(missing) > 3 else ''}.")
  used.update(names)
  views = [transform(tensors[name]) for name in names]  # reshape/transpose: views, no copy

  def read(index=None):
    if index is None:
      index = (slice(None),) * (views[0].ndim + int(stacked))
    if not stacked:
      return np.ascontiguousarray(views[0][index])
    layers = range(num_layers)[index[0]]
    return np.stack([np.ascontiguousarray(views[i][index[1:]]) for i in layers])

  shape = ((num_layers,) if stacked else ()) + views[0].shape
  return read, shape


def load_hf_checkpoint(path: str, cfg: LlamaConfig | None = None, *, mesh=None,
                       **overrides: Any) -> Llama:
  """A :class:`Llama` holding the weights of the local HF checkpoint at ``path``.

  Args:
    path: directory with ``config.json`` and safetensors weights.
    cfg: model config; default :func:`load_hf_config` ``(path, **overrides)``.
      Its shapes must match the checkpoint.
    mesh: if given, every parameter is created sharded by the rules table
      (each device reads only its slice from the memory-mapped files);
      otherwise parameters live on the default device.
    overrides: passed to :func:`load_hf_config` when ``cfg`` is None.

  Parameters are cast to ``cfg.param_dtype``. Raises ``KeyError``/``ValueError``
  on missing, unexpected or mis-shaped tensors.
  """
  if cfg is None:
    cfg = load_hf_config(path, **overrides)
  elif overrides:
    raise TypeError("pass either cfg or config overrides, not both.")
  tensors = read_hf_tensors(path)
  sources = _param_sources(cfg)
  abstract = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
  graphdef, abstract_state = nnx.split(abstract)
  shardings = shd.param_shardings(abstract_state, mesh) if mesh is not None else None
  dtype = np.dtype(cfg.weight_dtype)
  used: set[str] = set()

  def convert(path_keys, var, sharding=None):
    name = _path_name(path_keys)
    if name not in sources:
      raise KeyError(f"no Hugging Face source for parameter {name!r}.")
    pattern, transform = sources[name]
    read, shape = _lazy_param(tensors, pattern, transform, name.startswith("layers."),
                              cfg.num_layers, used)
    expected = var.get_value().shape
    if tuple(shape) != tuple(expected):
      raise ValueError(f"{name}: checkpoint gives shape {shape}, the config expects {expected}.")
    if sharding is None:
      value = jnp.asarray(read().astype(dtype))
    else:
      value = jax.make_array_from_callback(
          tuple(shape), sharding.get_value(), lambda idx: read(idx).astype(dtype))
    return var.replace(value)

  is_var = lambda x: isinstance(x, nnx.Variable)
  if shardings is None:
    state = jax.tree_util.tree_map_with_path(convert, abstract_state, is_leaf=is_var)
  else:
    state = jax.tree_util.tree_map_with_path(convert, abstract_state, shardings, is_leaf=is_var)
  # Rotary caches are recomputed from the config; anything else unread means a mismatch.
  # A tied checkpoint may still store lm_head.weight as a copy of the embedding: not needed.
  # A different lm_head means the checkpoint is untied and tie_embeddings is wrong.
  if (cfg.tie_embeddings and "lm_head.weight" in tensors and
      np.array_equal(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"])):
    used.add("lm_head.weight")
  unexpected = sorted(k for k in tensors if k not in used and "rotary_emb" not in k)
  if unexpected:
    raise ValueError(f"checkpoint tensors not used by the model: {unexpected[:5]}"
                     f"{' ...' if len(unexpected) > 5 else ''} (is tie_embeddings right?).")
  return nnx.merge(graphdef, state)
