"""Hugging Face LLaMA, Mistral, Qwen2/2.5, Qwen3, Gemma 2 and Gemma 3 (text) checkpoints <->
:class:`models.llama.Llama`, local directories only.

The six families are one model with a few fields (:class:`models.llama.LlamaConfig`):
``config.json``'s ``model_type`` (and ``architectures``, when present) picks the
family in :data:`FAMILIES`, which says how its fields map:

* ``llama`` (``LlamaForCausalLM``): no biases, no window.
* ``mistral`` (``MistralForCausalLM``): ``sliding_window`` on every layer (or null).
* ``qwen2`` (``Qwen2ForCausalLM``): q/k/v biases (``qkv_bias``); a window on the
  layers transformers marks ``"sliding_attention"`` (``layer_types``, or derived
  as transformers does: with ``use_sliding_window``, layers ``i >= max_window_layers``).
* ``qwen3`` (``Qwen3ForCausalLM``): RMSNorm on q and k per head (``qk_norm``),
  ``head_dim`` independent of ``hidden_size / heads``; windows as qwen2.
* ``gemma2`` (``Gemma2ForCausalLM``): the Gemma block (``mlp_activation="gelu_tanh"``
  from ``hidden_activation="gelu_pytorch_tanh"``, ``norm_unit_offset``, ``post_norms``,
  ``scale_embeddings``), ``query_pre_attn_scalar``, ``attn_logit_softcapping`` ->
  ``attn_logits_soft_cap``, ``final_logit_softcapping`` -> ``final_logits_soft_cap``,
  ``sliding_window`` on the ``"sliding_attention"`` layers of ``layer_types``
  (default: every other layer, starting with the first).
* ``gemma3`` (``model_type`` ``gemma3_text``, ``Gemma3ForCausalLM``): the Gemma block,
  q/k norms, ``layer_types`` (default: 5 sliding to 1 full, ``sliding_window_pattern``),
  the full layers' RoPE (``rope_parameters["full_attention"]`` or ``rope_theta`` +
  ``rope_scaling``) and the sliding layers' base (``rope_parameters["sliding_attention"]``
  or ``rope_local_base_freq``) -> ``rope_local_theta``; ``final_logit_softcapping``
  (transformers' Gemma 3 does not read ``attn_logit_softcapping``; neither does this).
  The multimodal ``gemma3`` checkpoints (``Gemma3ForConditionalGeneration``) are not read.

RoPE: ``rope_type`` ``default``, ``linear``, ``llama3``, ``yarn`` and ``dynamic``
(``rope_parameters`` of transformers >= 5 or ``rope_theta`` + ``rope_scaling``).
Anything else (another model type or architecture, an activation other than
``silu``, ``attention_bias`` where it would bias ``o_proj``, ``mlp_bias``, a
rope type, ``partial_rotary_factor``) is one ValueError naming it.

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
``model.layers.i.self_attn.q_proj.bias [N*H]``          ``layers.attn.bq[i] [N, H]`` (qwen2)
``model.layers.i.self_attn.{k,v}_proj.bias [K*H]``      ``layers.attn.b{k,v}[i] [K, H]`` (qwen2)
``model.layers.i.self_attn.{q,k}_norm.weight [H]``      ``layers.attn.{q,k}_norm.scale[i]`` (qwen3)
``model.layers.i.mlp.{gate,up}_proj.weight [F, D]``     ``layers.mlp.w_{gate,up}[i] [D, F]``
``model.layers.i.mlp.down_proj.weight [D, F]``          ``layers.mlp.w_down[i] [F, D]``
``model.layers.i.input_layernorm.weight``               ``layers.attn_norm.scale[i]``
``model.layers.i.post_attention_layernorm.weight``      ``layers.mlp_norm.scale[i]`` (not gemma)
``model.layers.i.post_attention_layernorm.weight``      ``layers.post_attn_norm.scale[i]`` (gemma)
``model.layers.i.pre_feedforward_layernorm.weight``     ``layers.mlp_norm.scale[i]`` (gemma)
``model.layers.i.post_feedforward_layernorm.weight``    ``layers.post_mlp_norm.scale[i]`` (gemma)
``model.norm.weight``                                   ``final_norm.scale``
``lm_head.weight [V, D]``                               ``lm_head [D, V]`` (absent if tied)
======================================================  ==============================

Each row is a reshape (splitting an HF axis, e.g. ``N*H -> N, H``) and a
transpose: exact in both directions, so import -> export reproduces the
original tensors bit for bit. (Gemma's norm weights are ``w`` of ``1 + w`` on both sides:
``norm_unit_offset`` keeps them as stored.)

No q/k permutation: HF ``LlamaAttention`` applies RoPE with ``rotate_half``
(first half / second half of each head), which is the convention of
:func:`models.rope.apply_rope`. (Meta's original checkpoints use interleaved
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

#: The ``LlamaConfig`` fields a Hugging Face ``config.json`` determines (see
#: :func:`hf_model_fields`).
HF_FIELDS: tuple[str, ...] = ("vocab_size", "dim", "num_layers", "num_heads", "num_kv_heads",
                              "head_dim", "mlp_dim", "rope_theta", "rope_scaling", "norm_eps",
                              "tie_embeddings", "qkv_bias", "qk_norm", "sliding_window",
                              "layer_types", "mlp_activation", "norm_unit_offset", "post_norms",
                              "scale_embeddings", "query_pre_attn_scalar",
                              "attn_logits_soft_cap", "final_logits_soft_cap",
                              "rope_local_theta", "family")
#: Of those, the ones fixed by the weights (their shapes, which tensors exist, and the
#: architecture they are exported as): they cannot be overridden.
HF_SHAPE_FIELDS: tuple[str, ...] = ("vocab_size", "dim", "num_layers", "num_heads",
                                    "num_kv_heads", "head_dim", "mlp_dim", "tie_embeddings",
                                    "qkv_bias", "qk_norm", "mlp_activation", "norm_unit_offset",
                                    "post_norms", "scale_embeddings", "family")


@dataclasses.dataclass(frozen=True)
class Family:
  """What one Hugging Face architecture is, as fields of :class:`LlamaConfig`."""
  model_type: str
  architecture: str
  qkv_bias: bool  # q/k/v_proj carry biases (always, for this family)
  qk_norm: bool  # q_norm/k_norm (always, for this family)
  window: str  # "none", "all" (one sliding_window for every layer) or "layer_types"
  # The Gemma block: GeGLU, (1 + w) norms, post-norms, sqrt(dim) embedding scale,
  # query_pre_attn_scalar and a final-logit soft-cap.
  gemma: bool = False
  attn_soft_cap: bool = False  # reads attn_logit_softcapping (Gemma 2)
  local_rope: bool = False  # the sliding layers' own RoPE base (Gemma 3)


#: ``LlamaConfig.family`` -> :class:`Family`: the families import and export cover.
FAMILIES: dict[str, Family] = {
    "llama": Family("llama", "LlamaForCausalLM", False, False, "none"),
    "mistral": Family("mistral", "MistralForCausalLM", False, False, "all"),
    "qwen2": Family("qwen2", "Qwen2ForCausalLM", True, False, "layer_types"),
    "qwen3": Family("qwen3", "Qwen3ForCausalLM", False, True, "layer_types"),
    "gemma2": Family("gemma2", "Gemma2ForCausalLM", False, False, "layer_types", gemma=True,
                     attn_soft_cap=True),
    "gemma3": Family("gemma3_text", "Gemma3ForCausalLM", False, True, "layer_types",
                     gemma=True, local_rope=True),
}

#: ``config.json``'s ``model_type`` -> the family name (its key in :data:`FAMILIES`).
MODEL_TYPES: dict[str, str] = {f.model_type: name for name, f in FAMILIES.items()}

#: Gemma's ``hidden_activation`` (transformers' name of the tanh-approximated GELU).
GEMMA_ACTIVATION = "gelu_pytorch_tanh"

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


def _rope_fields(hf: Mapping[str, Any], where: str) -> tuple[float, dict | None]:
  """``(rope_theta, rope_scaling)`` of a config.json, checked (ValueError naming the field)."""
  from models.rope import ROPE_TYPES

  rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
  rope_theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
  rope_type = rope.get("rope_type", rope.get("type", "default"))
  if rope_type not in ROPE_TYPES:
    raise ValueError(f"{where}: rope_type {rope_type!r} is not supported (supported: "
                     f"{', '.join(ROPE_TYPES)}).")
  partial = rope.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
  if partial not in (None, 1, 1.0):
    raise ValueError(f"{where}: partial_rotary_factor={partial} is not supported (RoPE on "
                     "every channel only).")
  if rope_type == "default":
    return float(rope_theta), None
  positions = hf.get("max_position_embeddings")
  if rope_type == "yarn":
    # transformers' standardize_rope_params: the pretraining length defaults to
    # max_position_embeddings; a missing factor is max_position / original.
    rope.setdefault("original_max_position_embeddings", positions)
    if rope.get("factor") is None and positions:
      rope["factor"] = positions / rope["original_max_position_embeddings"]
  if rope_type == "dynamic":
    # _compute_dynamic_ntk_parameters scales against max_position_embeddings.
    rope["original_max_position_embeddings"] = positions
  return float(rope_theta), rope


def _family(hf: Mapping[str, Any], where: str) -> Family:
  model_type = hf.get("model_type", "llama")
  if model_type not in MODEL_TYPES:
    hint = (" (the multimodal Gemma 3; its text model is model_type 'gemma3_text', "
            "Gemma3ForCausalLM)" if model_type == "gemma3" else "")
    raise ValueError(f"{where}: model_type {model_type!r} is not supported{hint} (supported: "
                     f"{', '.join(MODEL_TYPES)}).")
  family = FAMILIES[MODEL_TYPES[model_type]]
  for arch in hf.get("architectures") or []:
    if arch != family.architecture:
      raise ValueError(f"{where}: architecture {arch!r} is not supported for model_type "
                       f"{model_type!r} (supported: {family.architecture}).")
  return family


def hf_model_fields(path: str) -> dict[str, Any]:
  """The :data:`HF_FIELDS` of :class:`LlamaConfig`, read from ``path/config.json``.

  Understands both ``rope_theta`` + ``rope_scaling`` (transformers < 5) and
  ``rope_parameters`` (transformers >= 5). ``rope_scaling`` is None for the
  default RoPE. The family (:data:`FAMILIES`) comes from ``model_type``;
  windows as transformers resolves them (module docstring). Raises ValueError
  naming what this model is not (a model type, an architecture, biases,
  another activation, a rope type).
  """
  hf = read_hf_config_json(path)
  family = _family(hf, path)
  if hf.get("mlp_bias"):
    raise ValueError(f"{path}: mlp_bias=True is not supported (no MLP biases).")
  if hf.get("attention_bias") and family.model_type != "qwen2":
    raise ValueError(f"{path}: attention_bias=True is not supported for {family.model_type!r} "
                     "(it biases o_proj too; only qwen2's q/k/v biases are).")
  if family.gemma:
    return _gemma_fields(hf, family, path)
  act = hf.get("hidden_act", hf.get("hidden_activation", "silu"))
  if act != "silu":
    raise ValueError(f"{path}: hidden_act {act!r} is not supported (only 'silu', SwiGLU).")
  rope_theta, rope_scaling = _rope_fields(hf, path)
  num_heads = hf["num_attention_heads"]
  window, layer_types = None, None
  if family.window == "all":
    window = hf.get("sliding_window")
  elif family.window == "layer_types":
    # Qwen2Config/Qwen3Config.__post_init__: the window only with use_sliding_window, on
    # the layers layer_types marks (derived from max_window_layers when absent).
    window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    if window is not None:
      n = hf["num_hidden_layers"]
      types = hf.get("layer_types") or [
          "sliding_attention" if i >= hf.get("max_window_layers", 28) else "full_attention"
          for i in range(n)]
      if "sliding_attention" not in types:
        window = None
      elif "full_attention" in types:
        layer_types = tuple(types)
  return dict(
      vocab_size=hf["vocab_size"],
      dim=hf["hidden_size"],
      num_layers=hf["num_hidden_layers"],
      num_heads=num_heads,
      num_kv_heads=hf.get("num_key_value_heads") or num_heads,
      head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
      mlp_dim=hf["intermediate_size"],
      rope_theta=rope_theta,
      rope_scaling=rope_scaling,
      norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      qkv_bias=family.qkv_bias,
      qk_norm=family.qk_norm,
      sliding_window=None if window is None else int(window),
      layer_types=layer_types,
      mlp_activation="silu",
      norm_unit_offset=False,
      post_norms=False,
      scale_embeddings=False,
      query_pre_attn_scalar=None,
      attn_logits_soft_cap=None,
      final_logits_soft_cap=None,
      rope_local_theta=None,
      family=family.model_type,
  )


def _gemma_rope(hf: Mapping[str, Any], family: Family, where: str):
  """``(rope_theta, rope_scaling, rope_local_theta)`` of a Gemma config.json.

  Gemma 2: one RoPE (:func:`_rope_fields`). Gemma 3: ``rope_parameters`` per layer type
  (transformers >= 5: ``{"full_attention": {...}, "sliding_attention": {...}}``) or
  ``rope_theta`` + ``rope_scaling`` (the full layers) and ``rope_local_base_freq`` (the
  sliding layers' base); defaults 1e6 and 1e4 as ``Gemma3TextConfig``.
  """
  if not family.local_rope:
    rope_theta, rope_scaling = _rope_fields(hf, where)
    return rope_theta, rope_scaling, None
  params = hf.get("rope_parameters") or {}
  if "full_attention" in params or "sliding_attention" in params:
    full = dict(params.get("full_attention") or {})
    local = dict(params.get("sliding_attention") or {})
  else:
    full = dict(hf.get("rope_scaling") or {})
    if hf.get("rope_theta") is not None:
      full["rope_theta"] = hf["rope_theta"]
    local = {"rope_type": "default"}
    if hf.get("rope_local_base_freq") is not None:
      local["rope_theta"] = hf["rope_local_base_freq"]
  local_type = local.get("rope_type", local.get("type", "default"))
  if local_type != "default":
    raise ValueError(f"{where}: the sliding layers' rope_type {local_type!r} is not supported "
                     "(the sliding layers take the default RoPE with their own base).")
  full.setdefault("rope_theta", 1_000_000.0)
  rope_theta, rope_scaling = _rope_fields(
      {**hf, "rope_parameters": full, "rope_scaling": None}, where)
  return rope_theta, rope_scaling, float(local.get("rope_theta", 10_000.0))


def _gemma_fields(hf: Mapping[str, Any], family: Family, where: str) -> dict[str, Any]:
  """:func:`hf_model_fields` of a Gemma 2 / Gemma 3 text config.json (the module docstring;
  defaults as transformers' ``Gemma2Config`` / ``Gemma3TextConfig``)."""
  act = hf.get("hidden_activation") or GEMMA_ACTIVATION
  if act != GEMMA_ACTIVATION:
    raise ValueError(f"{where}: hidden_activation {act!r} is not supported (only "
                     f"{GEMMA_ACTIVATION!r}, GeGLU with the tanh GELU).")
  if hf.get("use_bidirectional_attention"):
    raise ValueError(f"{where}: use_bidirectional_attention=True is not supported (causal "
                     "attention only).")
  rope_theta, rope_scaling, rope_local_theta = _gemma_rope(hf, family, where)
  n = hf["num_hidden_layers"]
  num_heads = hf["num_attention_heads"]
  # Gemma2Config / Gemma3TextConfig.__post_init__: sliding unless (i + 1) % pattern == 0.
  pattern = 2 if family.model_type == "gemma2" else int(hf.get("sliding_window_pattern") or 6)
  types = tuple(hf.get("layer_types") or [
      "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)])
  window = hf.get("sliding_window", 4096)
  if window is None or "sliding_attention" not in types:
    window, types = None, None
  elif "full_attention" not in types:
    types = None  # one window on every layer
  soft_cap = hf.get("attn_logit_softcapping", 50.0) if family.attn_soft_cap else None
  final_cap = hf.get("final_logit_softcapping", 30.0 if family.attn_soft_cap else None)
  scalar = hf.get("query_pre_attn_scalar", 256)
  return dict(
      vocab_size=hf["vocab_size"],
      dim=hf["hidden_size"],
      num_layers=n,
      num_heads=num_heads,
      num_kv_heads=hf.get("num_key_value_heads") or num_heads,
      head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
      mlp_dim=hf["intermediate_size"],
      rope_theta=rope_theta,
      rope_scaling=rope_scaling,
      norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
      qkv_bias=False,
      qk_norm=family.qk_norm,
      sliding_window=None if window is None else int(window),
      layer_types=types,
      mlp_activation="gelu_tanh",
      norm_unit_offset=True,
      post_norms=True,
      scale_embeddings=True,
      query_pre_attn_scalar=None if scalar is None else float(scalar),
      attn_logits_soft_cap=None if soft_cap is None else float(soft_cap),
      final_logits_soft_cap=None if final_cap is None else float(final_cap),
      rope_local_theta=rope_local_theta,
      family=MODEL_TYPES[family.model_type],
  )


def check_family(cfg: LlamaConfig) -> Family:
  """The :class:`Family` of ``cfg.family``, after checking that its architecture can express
  ``cfg`` (ValueError naming the field and the family that could)."""
  family = FAMILIES[cfg.family]
  if cfg.qkv_bias != family.qkv_bias:
    raise ValueError(f"family {cfg.family!r} {'always has' if family.qkv_bias else 'has no'} "
                     f"q/k/v biases, but qkv_bias={cfg.qkv_bias} (qwen2 has them).")
  if cfg.qk_norm != family.qk_norm:
    raise ValueError(f"family {cfg.family!r} {'always has' if family.qk_norm else 'has no'} "
                     f"q/k norms, but qk_norm={cfg.qk_norm} (qwen3 has them).")
  if cfg.sliding_window is not None and family.window == "none":
    raise ValueError(f"family {cfg.family!r} has no sliding window, but sliding_window="
                     f"{cfg.sliding_window} (mistral, qwen2 and qwen3 have one).")
  if cfg.layer_types is not None and family.window != "layer_types":
    raise ValueError(f"family {cfg.family!r} has one window for all layers, but layer_types="
                     f"{list(cfg.layer_types)} (qwen2 and qwen3 take per-layer types, as do gemma2 "
                     "and gemma3).")
  gemma = {"mlp_activation": "gelu_tanh", "norm_unit_offset": True, "post_norms": True,
           "scale_embeddings": True}
  for name, value in gemma.items():
    if (getattr(cfg, name) == value) != family.gemma:
      raise ValueError(f"family {cfg.family!r} {'has' if family.gemma else 'does not have'} "
                       f"{name}={value!r}, but the config has {getattr(cfg, name)!r} (gemma2 "
                       "and gemma3 have the Gemma block).")
  if cfg.query_pre_attn_scalar is not None and not family.gemma:
    raise ValueError(f"family {cfg.family!r} has no query_pre_attn_scalar, but the config sets "
                     f"{cfg.query_pre_attn_scalar} (gemma2 and gemma3 have one).")
  if cfg.final_logits_soft_cap is not None and not family.gemma:
    raise ValueError(f"family {cfg.family!r} has no final-logit soft-cap, but "
                     f"final_logits_soft_cap={cfg.final_logits_soft_cap} (gemma2 and gemma3 "
                     "have one).")
  if cfg.attn_logits_soft_cap is not None and not family.attn_soft_cap:
    raise ValueError(f"family {cfg.family!r} has no attention soft-cap, but "
                     f"attn_logits_soft_cap={cfg.attn_logits_soft_cap} (gemma2 has one).")
  if (cfg.rope_local_theta is not None) != family.local_rope:
    raise ValueError(f"family {cfg.family!r} {'needs' if family.local_rope else 'has no'} "
                     f"a RoPE base of its own for the sliding layers, but rope_local_theta="
                     f"{cfg.rope_local_theta} (gemma3 has one).")
  if cfg.attn_sinks:
    raise ValueError(f"family {cfg.family!r} has no attention sinks, but attn_sinks=True (no "
                     "family this exports to has them).")
  return family


def load_hf_config(path: str, **overrides: Any) -> LlamaConfig:
  """:class:`LlamaConfig` from ``path/config.json`` (:func:`hf_model_fields`) and ``overrides``.

  ``overrides`` set fields HF does not know about (``attention``, ``layout``,
  ``dtype``, ``param_dtype``, ``remat_policy``, ...) or replace converted ones.
  """
  cfg = LlamaConfig(**{**hf_model_fields(path), **overrides})
  check_family(cfg)
  return cfg


def hf_config_dict(cfg: LlamaConfig, base: Mapping[str, Any] | None = None, *,
                   max_position_embeddings: int | None = None) -> dict[str, Any]:
  """The ``config.json`` of ``cfg``'s family (``LlamaForCausalLM``, ``MistralForCausalLM``,
  ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``, ``Gemma2ForCausalLM`` or ``Gemma3ForCausalLM``;
  the inverse of :func:`hf_model_fields`).

  RoPE is written as ``rope_theta`` + ``rope_scaling`` (what transformers 4.x
  reads; 5.x converts it to ``rope_parameters``). ``torch_dtype`` is the
  parameter dtype (the exported tensors' dtype). From ``base`` (the source
  model's config.json, if any) only the token ids, ``initializer_range`` and
  ``max_position_embeddings`` are kept; ``max_position_embeddings`` is the
  larger of that and the given one (the trained context), except under
  ``dynamic`` RoPE, whose frequencies scale against it: there it is the
  ``original_max_position_embeddings`` the run used, and under ``yarn``, where
  transformers reads ``max_position_embeddings / original_max_position_embeddings`` as
  the scaling factor (and warns when it is not ``factor``): ``original * factor``, the
  context the scaling extends to (as Qwen2.5's configs write it). Windows: mistral's
  ``sliding_window``; qwen2/qwen3's ``use_sliding_window``, ``sliding_window``,
  ``max_window_layers`` (the leading full layers) and ``layer_types``; Gemma's as
  :func:`_gemma_config_dict` writes them.
  """
  family = check_family(cfg)
  base = dict(base or {})
  positions = [p for p in (base.get("max_position_embeddings"), max_position_embeddings) if p]
  rope_scaling = dict(cfg.rope_scaling) if cfg.rope_scaling else None
  max_positions = max(positions) if positions else 2048
  rope_type = rope_scaling.get("rope_type", rope_scaling.get("type")) if rope_scaling else None
  if rope_type == "dynamic":
    max_positions = rope_scaling.pop("original_max_position_embeddings")
  elif rope_type == "yarn" and rope_scaling.get("factor"):
    max_positions = int(round(rope_scaling["original_max_position_embeddings"]
                              * rope_scaling["factor"]))
  if family.gemma:
    return _gemma_config_dict(cfg, family, base, rope_scaling, max_positions)
  out = {
      "architectures": [family.architecture],
      "model_type": family.model_type,
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
      "rope_scaling": rope_scaling,
      "tie_word_embeddings": cfg.tie_embeddings,
      "max_position_embeddings": max_positions,
      "torch_dtype": cfg.param_dtype,
  }
  if family.model_type == "qwen2" and cfg.resolved_head_dim == cfg.dim // cfg.num_heads:
    del out["head_dim"]  # Qwen2Config has no such field (Qwen2Attention reads it if present)
  if family.model_type in ("llama", "qwen3"):
    out["attention_bias"] = False
  if family.model_type == "llama":
    out["mlp_bias"] = False
  if family.window == "all":
    out["sliding_window"] = cfg.sliding_window
  elif family.window == "layer_types":
    windows = cfg.layer_windows
    full = [w is None for w in windows]
    leading = full.index(False) if False in full else cfg.num_layers
    out.update(
        use_sliding_window=cfg.sliding_window is not None,
        sliding_window=cfg.sliding_window,
        # transformers derives layer_types from it when absent (transformers < 5 reads only it).
        max_window_layers=leading if leading < cfg.num_layers and not any(full[leading:])
        else base.get("max_window_layers", cfg.num_layers),
        layer_types=["full_attention" if f else "sliding_attention" for f in full])
  _keep_base(out, base)
  return out


def _keep_base(out: dict[str, Any], base: Mapping[str, Any]) -> None:
  """The source config.json's token ids and ``initializer_range`` (:func:`hf_config_dict`)."""
  for key in ("bos_token_id", "eos_token_id", "pad_token_id", "initializer_range"):
    if key in base:
      out[key] = base[key]


def _number(x: float) -> float | int:
  """``x`` as an int where it is one (transformers types ``query_pre_attn_scalar`` int)."""
  return int(x) if float(x).is_integer() else float(x)


def _gemma_config_dict(cfg: LlamaConfig, family: Family, base: Mapping[str, Any],
                       rope_scaling: dict | None, max_positions: int) -> dict[str, Any]:
  """:func:`hf_config_dict` of a Gemma 2 / Gemma 3 text model: its fields, ``layer_types``
  for every layer (and Gemma 3's ``sliding_window_pattern`` where the types follow one),
  RoPE as ``rope_theta`` + ``rope_scaling`` (+ ``rope_local_base_freq``, Gemma 3: the keys
  both transformers 4.x and 5.x read)."""
  windows = cfg.layer_windows
  out = {
      "architectures": [family.architecture],
      "model_type": family.model_type,
      "vocab_size": cfg.vocab_size,
      "hidden_size": cfg.dim,
      "intermediate_size": cfg.mlp_dim,
      "num_hidden_layers": cfg.num_layers,
      "num_attention_heads": cfg.num_heads,
      "num_key_value_heads": cfg.num_kv_heads,
      "head_dim": cfg.resolved_head_dim,
      "hidden_activation": GEMMA_ACTIVATION,
      "rms_norm_eps": cfg.norm_eps,
      "rope_theta": cfg.rope_theta,
      "rope_scaling": rope_scaling,
      "tie_word_embeddings": cfg.tie_embeddings,
      "max_position_embeddings": max_positions,
      "torch_dtype": cfg.param_dtype,
      "attention_bias": False,
      "query_pre_attn_scalar": _number(cfg.query_pre_attn_scalar
                                       if cfg.query_pre_attn_scalar is not None
                                       else cfg.resolved_head_dim),
      # transformers' default window (4096) stands in where no layer has one: every layer
      # is then "full_attention" and reads none.
      "sliding_window": cfg.sliding_window if cfg.sliding_window is not None else 4096,
      "layer_types": ["full_attention" if w is None else "sliding_attention" for w in windows],
      "final_logit_softcapping": cfg.final_logits_soft_cap,
  }
  if family.attn_soft_cap:
    out["attn_logit_softcapping"] = cfg.attn_logits_soft_cap
  if family.local_rope:
    out["rope_local_base_freq"] = cfg.rope_local_theta
    types = out["layer_types"]
    for pattern in range(1, cfg.num_layers + 1):  # transformers 4.x derives the types from it
      if types == ["sliding_attention" if (i + 1) % pattern else "full_attention"
                   for i in range(cfg.num_layers)]:
        out["sliding_window_pattern"] = pattern
        break
  _keep_base(out, base)
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
  }
  if cfg.post_norms:  # Gemma's four norms: HF's post_attention_layernorm is the post-norm
    table["layers.post_attn_norm.scale"] = _Layout(layer + "post_attention_layernorm.weight",
                                                   ((d,),), (0,))
    table["layers.mlp_norm.scale"] = _Layout(layer + "pre_feedforward_layernorm.weight",
                                             ((d,),), (0,))
    table["layers.post_mlp_norm.scale"] = _Layout(layer + "post_feedforward_layernorm.weight",
                                                  ((d,),), (0,))
  else:
    table["layers.mlp_norm.scale"] = _Layout(layer + "post_attention_layernorm.weight",
                                             ((d,),), (0,))
  if cfg.qkv_bias:  # [N*H] -> [N, H]
    table["layers.attn.bq"] = _Layout(layer + "self_attn.q_proj.bias", ((n, h),), (0, 1))
    table["layers.attn.bk"] = _Layout(layer + "self_attn.k_proj.bias", ((k, h),), (0, 1))
    table["layers.attn.bv"] = _Layout(layer + "self_attn.v_proj.bias", ((k, h),), (0, 1))
  if cfg.qk_norm:
    table["layers.attn.q_norm.scale"] = _Layout(layer + "self_attn.q_norm.weight", ((h,),), (0,))
    table["layers.attn.k_norm.scale"] = _Layout(layer + "self_attn.k_norm.weight", ((h,),), (0,))
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
