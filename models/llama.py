"""LLaMA in Flax NNX with ring attention (sequence parallelism) and blockwise FFN.

Architecture (Touvron et al. 2023; Dubey et al. 2024 for LLaMA-3 RoPE scaling):
token embedding -> ``num_layers`` x [RMSNorm -> GQA self-attention with RoPE ->
residual -> RMSNorm -> SwiGLU MLP -> residual] -> RMSNorm -> vocabulary head
(untied, or tied to the embedding).

Conventions the rest of the project relies on:

* **Layouts.** The caller reorders tokens, positions, segment ids and labels
  once with :func:`ring_jax.to_layout` and passes ``positions`` explicitly.
  The model never reorders: RoPE uses the given positions, ring attention gets
  ``inputs_in_layout=True``, and the dense backend masks with
  ``q_positions=kv_positions=positions``. Logits come back in the same order.
* **Attention backends.** ``cfg.attention`` names an entry of
  :data:`models.attention.ATTENTION_BACKENDS` (``"ring"``, ``"all_gather"``,
  ``"ulysses"``, ``"hybrid"``, ``"auto"``, ``"dense"``, or one registered with
  :func:`models.attention.register_attention`).
* **Profiles.** Embedding, each layer and its attention and MLP blocks, the
  output head and the loss run under ``jax.named_scope`` (``embed``,
  ``layer/attention/ring``, ``layer/mlp``, ``head``, ``loss``).
* **Sharding.** Parameters carry logical axis names (Variable metadata
  ``logical_axes``); :mod:`models.sharding` maps them to mesh axes. The mesh is
  the one set with ``jax.set_mesh`` (none: everything runs unsharded). The
  residual stream's tokens are named ``residual_length``, those the projections
  and attention see ``length``: the rules table (``cfg.logical_rules``, under
  which the entry points trace) decides whether tensor peers split the former
  (``tensor_sequence_parallel``).
* **Tree mode.** The model holds only ``nnx.Param`` arrays (RoPE tables are
  computed from positions, nothing is cached), no Variable is shared, and
  ``__call__`` is pure, so ``nnx.split`` / ``nnx.merge`` around a ``jax.jit``
  is all a trainer needs.
* **Stacked layers.** The per-layer parameters are stacked along a leading
  ``layers`` axis in one :class:`Block`, and the forward pass runs
  ``jax.lax.scan`` over them (``scan_layers=True``, one compiled layer for any
  depth) or a Python loop over the same arrays (``scan_layers=False``); the
  parameter tree is identical either way.
* **RoPE convention.** ``rotate_half`` (first half / second half of each head),
  as Hugging Face ``LlamaAttention``: HF q/k weights load without permutation.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from einops import rearrange
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

import ring_jax
from models import attention as attn_lib
from models import pipeline as pipeline_lib
from models import sharding as shd

# dtype name -> jnp dtype, for LlamaConfig.dtype (compute) and .param_dtype (storage).
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}

_cp = jax.checkpoint_policies
# remat_policy name -> jax.checkpoint policy; "none" means no jax.checkpoint at all.
REMAT_POLICIES: dict[str, Callable | None] = {
    "none": None,
    # Save nothing: the backward pass recomputes the whole layer from its input.
    "full": _cp.nothing_saveable,
    # Save matmul outputs, recompute elementwise ops (norms, RoPE, SwiGLU gating).
    "save_dots": _cp.dots_saveable,
    # The same without matmuls that have batch dimensions (the attention scores' einsums).
    "save_dots_no_batch": _cp.dots_with_no_batch_dims_saveable,
    # Save only the named projections (q/k/v, attention output, MLP output) tagged below.
    "save_qkv_attn_out": _cp.save_only_these_names("query", "key", "value", "attn_out"),
    "save_attn_mlp_out": _cp.save_only_these_names("attn_out", "mlp_out"),
    # "full", with each layer's input (tagged "layer_in") moved to pinned host memory between
    # the forward and backward passes instead of staying on the device.
    "offload_layer_in": _cp.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=["layer_in"],
        offload_src="device", offload_dst="pinned_host"),
}

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic")

#: The per-layer attention kinds of ``LlamaConfig.layer_types`` (Hugging Face's names).
LAYER_TYPES = ("full_attention", "sliding_attention")


#: The Hugging Face architectures this model covers (``LlamaConfig.family``); the mapping of
#: each one's config.json and weight names is :mod:`models.convert_hf`'s.
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3")

#: The MLP activations of ``LlamaConfig.mlp_activation``: the gate's nonlinearity of the gated
#: MLP, ``"silu"`` (SwiGLU, LLaMA) or ``"gelu_tanh"`` (GeGLU with the tanh approximation of
#: GELU, Gemma; Hugging Face's ``gelu_pytorch_tanh``).
MLP_ACTIVATIONS = ("silu", "gelu_tanh")


def _freeze(value):
  """Hashable form of nested dict/list values (so configs can be static jit arguments)."""
  if isinstance(value, Mapping):
    return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
  if isinstance(value, (list, tuple)):
    return tuple(_freeze(v) for v in value)
  return value


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """Model hyper-parameters; validated on construction (bad values raise ``ValueError``).

  ``head_dim=None`` means ``dim // num_heads`` (see :attr:`resolved_head_dim`).
  ``rope_scaling`` follows Hugging Face: ``None``, ``{"rope_type": "linear",
  "factor": f}``, ``{"rope_type": "llama3", "factor", "low_freq_factor",
  "high_freq_factor", "original_max_position_embeddings"}``, ``{"rope_type":
  "yarn", "factor", "original_max_position_embeddings"}`` (optional
  ``beta_fast``, ``beta_slow``, ``attention_factor``, ``mscale``,
  ``mscale_all_dim``, ``truncate``) or ``{"rope_type": "dynamic", "factor",
  "original_max_position_embeddings"}`` (``"type"`` is accepted for
  ``"rope_type"``; see :func:`rope_inv_freq`).

  The architecture fields (Qwen2, Qwen3, Mistral are this model with them set;
  :mod:`models.convert_hf` maps each family's ``config.json``): ``qkv_bias``
  adds a bias to the q, k and v projections (Qwen2); ``qk_norm`` an RMSNorm
  over each head's ``head_dim`` channels of q and k before RoPE (Qwen3);
  ``sliding_window`` (Hugging Face's meaning: a query sees itself and the
  ``sliding_window - 1`` tokens before it) applies to every layer, or with
  ``layer_types`` (one of :data:`LAYER_TYPES` per layer, as transformers'
  ``config.layer_types``) to the ``"sliding_attention"`` layers only.
  The Gemma fields (Gemma 2 and Gemma 3 are this model with them set, Gemma Team
  2024, arXiv:2408.00118 and arXiv:2503.19786): ``mlp_activation="gelu_tanh"``
  (GeGLU, :data:`MLP_ACTIVATIONS`); ``norm_unit_offset`` stores each RMSNorm scale
  as ``w`` and multiplies by ``1 + w`` (initialised to 0); ``post_norms`` adds an
  RMSNorm on the attention output and on the MLP output before each residual add
  (with the pre-norms, four per layer); ``scale_embeddings`` multiplies the
  embedding output by ``sqrt(dim)`` (in the compute dtype); ``query_pre_attn_scalar``
  ``s`` sets the attention scale to ``s ** -0.5`` (None: ``head_dim ** -0.5``);
  ``attn_logits_soft_cap`` ``c`` caps every attention score as ``c * tanh(score / c)``
  (Gemma 2) and ``final_logits_soft_cap`` the output logits likewise; ``rope_local_theta``
  is the RoPE base of the sliding-window layers (Gemma 3's ``rope_local_base_freq``,
  default RoPE there: ``rope_scaling`` applies to the full layers only; None: the
  sliding layers use ``rope_theta`` and ``rope_scaling`` as the others). ``attn_sinks``
  gives each layer a learned float32 sink logit per query head (GPT-OSS; ``sinks`` of
  :func:`ring_jax.attention_sharded`): every backend runs it.
  ``family`` names the Hugging Face architecture the weights came from and
  are exported to (``"llama"``, ``"mistral"``, ``"qwen2"``, ``"qwen3"``, ``"gemma2"``,
  ``"gemma3"``); the computation never reads it. ``attention`` is a key of
  :data:`models.attention.ATTENTION_BACKENDS` (``"ring"``, ``"all_gather"``,
  ``"ulysses"``, ``"hybrid"`` over ``hybrid_axes``, ``"auto"``, ``"dense"``);
  ``tensor_sequence_parallel`` picks the rules table (:func:`models.sharding.rules`);
  ``hop_kernel`` names the ring's per-hop kernel (a key of
  :data:`ring_jax.kernels.HOP_KERNELS`, or ``"auto"``: see :mod:`ring_jax.kernels`);
  ``causal_routing`` the ring's K/V routing (None: the library's default for the layout);
  ``remat_policy`` a key of :data:`REMAT_POLICIES`; ``dtype`` the compute
  dtype, ``param_dtype`` the storage dtype (keys of :data:`DTYPES`).
  """
  vocab_size: int = 256
  dim: int = 256
  num_layers: int = 2
  num_heads: int = 4
  num_kv_heads: int = 2
  head_dim: int | None = None
  mlp_dim: int = 512
  rope_theta: float = 10000.0
  rope_scaling: dict | None = None
  norm_eps: float = 1e-5
  tie_embeddings: bool = False
  qkv_bias: bool = False
  qk_norm: bool = False
  sliding_window: int | None = None
  layer_types: tuple[str, ...] | None = None
  mlp_activation: str = "silu"
  norm_unit_offset: bool = False
  post_norms: bool = False
  scale_embeddings: bool = False
  query_pre_attn_scalar: float | None = None
  attn_logits_soft_cap: float | None = None
  final_logits_soft_cap: float | None = None
  rope_local_theta: float | None = None
  attn_sinks: bool = False
  family: str = "llama"
  attention: str = "ring"
  layout: str = "contiguous"
  block_q: int | None = None
  block_kv: int | None = None
  hop_kernel: str = "auto"
  # The ring's K/V routing under the causal mask (ring_jax.ring_attention's causal_routing):
  # each K/V part goes only to the devices whose queries can see it. None: the library's
  # default (routed for contiguous rings; routing.check_routing); True / False: forced.
  # Passed to every ring the model runs ("ring", hybrid's ring) and to ring_jax.plan.
  causal_routing: bool | None = None
  ffn_chunk_size: int | None = None
  # Tokens per chunk of the output head inside nll_sums: the [B, L, vocab] logits then exist
  # one chunk of each device's local sequence at a time (forward and, by remat, backward).
  loss_chunk_size: int | None = None
  remat_policy: str = "none"
  scan_layers: bool = True
  dtype: str = "float32"
  param_dtype: str = "float32"
  fsdp: bool = False
  # Megatron-style sequence parallelism on the tensor axis (models.sharding.rules): the
  # residual stream, norms and embedding output split their tokens over (sequence, tensor).
  # None: on whenever the mesh has tensor > 1; False: off (residual replicated over tensor).
  tensor_sequence_parallel: bool | None = None
  # The strategy "hybrid"'s two mesh axes (ring_axis, ulysses_axis): the ring over the first,
  # Ulysses all-to-alls over the second (heads are then not split over it inside attention).
  hybrid_axes: tuple[str, str] = ("sequence", "tensor")
  # Microbatches the pipeline splits each (gradient-accumulation) batch into on a mesh with
  # pipeline > 1; None: models.pipeline.default_microbatches (2 x stages when the batch allows).
  pipeline_microbatches: int | None = None
  # Std of the normal initialiser of every weight matrix and the embedding (as HF LLaMA).
  init_std: float = 0.02

  def __post_init__(self):
    attn_lib.check_backend(self.attention)
    ring_jax.layouts.check_layout(self.layout)
    ring_jax.kernels.check_name(self.hop_kernel)
    try:
      ring_jax.routing.check_routing(self.causal_routing)  # None or a bool
    except TypeError as e:
      raise ValueError(str(e)) from None
    for name in ("vocab_size", "dim", "num_layers", "num_heads", "num_kv_heads", "mlp_dim"):
      value = getattr(self, name)
      if not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}.")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}.")
    if self.head_dim is None and self.dim % self.num_heads:
      raise ValueError(
          f"dim={self.dim} is not divisible by num_heads={self.num_heads}; set head_dim.")
    if self.resolved_head_dim < 2 or self.resolved_head_dim % 2:
      raise ValueError(f"head_dim must be even for RoPE, got {self.resolved_head_dim}.")
    for name in ("block_q", "block_kv", "ffn_chunk_size", "loss_chunk_size",
                 "pipeline_microbatches"):
      value = getattr(self, name)
      if value is not None and (not isinstance(value, (int, np.integer)) or value < 1):
        raise ValueError(f"{name} must be None or a positive int, got {value!r}.")
    if self.remat_policy not in REMAT_POLICIES:
      raise ValueError(
          f"remat_policy must be one of {sorted(REMAT_POLICIES)}, got {self.remat_policy!r}.")
    for name in ("dtype", "param_dtype"):
      if getattr(self, name) not in DTYPES:
        raise ValueError(f"{name} must be one of {sorted(DTYPES)}, got {getattr(self, name)!r}.")
    if self.rope_theta <= 0:
      raise ValueError(f"rope_theta must be positive, got {self.rope_theta}.")
    shd.rules(self.tensor_sequence_parallel)  # validates the switch
    axes = self.hybrid_axes
    if (not isinstance(axes, (tuple, list)) or len(axes) != 2 or len(set(axes)) != 2
        or not all(isinstance(a, str) for a in axes)):
      raise ValueError(f"hybrid_axes must be two different mesh axis names (ring_axis, "
                       f"ulysses_axis), e.g. ('sequence', 'tensor'), got {axes!r}.")
    object.__setattr__(self, "hybrid_axes", tuple(axes))
    if self.rope_scaling is not None:
      # Copy: the config must not alias a dict the caller may mutate later.
      object.__setattr__(self, "rope_scaling", dict(self.rope_scaling))
      rope_inv_freq(self)  # validates the scaling dict
    if self.family not in FAMILIES:
      raise ValueError(f"family must be one of {FAMILIES}, got {self.family!r}.")
    if self.mlp_activation not in MLP_ACTIVATIONS:
      raise ValueError(f"mlp_activation must be one of {MLP_ACTIVATIONS}, got "
                       f"{self.mlp_activation!r}.")
    for name in ("query_pre_attn_scalar", "rope_local_theta", "attn_logits_soft_cap",
                 "final_logits_soft_cap"):
      value = getattr(self, name)
      if value is not None and not (isinstance(value, (int, float, np.number))
                                    and math.isfinite(value) and value > 0):
        cap = " (no cap)" if name.endswith("soft_cap") else ""
        raise ValueError(f"{name} must be None{cap} or a finite number > 0, got {value!r}.")
    window = self.sliding_window
    if window is not None and (not isinstance(window, (int, np.integer)) or window < 1):
      raise ValueError(f"sliding_window must be None or a positive int, got {window!r}.")
    if self.layer_types is not None:
      types = tuple(self.layer_types)
      object.__setattr__(self, "layer_types", types)
      if len(types) != self.num_layers or any(t not in LAYER_TYPES for t in types):
        raise ValueError(f"layer_types must list one of {LAYER_TYPES} for each of the "
                         f"{self.num_layers} layers, got {list(types)}.")
      if "sliding_attention" in types and window is None:
        raise ValueError("layer_types has 'sliding_attention' layers but sliding_window is "
                         "None; set sliding_window.")
    if self.layout == ring_jax.layouts.DOCUMENT and any(
        w is not None for w in self.layer_windows):
      raise ValueError(f"layout='document' does not keep the distances between tokens, so it "
                       f"cannot apply sliding_window={window}; use layout='zigzag' or "
                       "'contiguous' (or 'auto', which picks one the window allows).")

  def __hash__(self):
    # rope_scaling is a dict; hash a frozen view so configs work as static jit arguments.
    return hash(tuple(_freeze(getattr(self, f.name)) for f in dataclasses.fields(self)))

  @classmethod
  def from_dict(cls, values: Mapping[str, Any]) -> "LlamaConfig":
    """Builds a config from a plain dict (e.g. ``ConfigDict.to_dict()``), ignoring unknown keys."""
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {k: v for k, v in dict(values).items() if k in names}
    if kwargs.get("rope_scaling") is not None:
      kwargs["rope_scaling"] = dict(kwargs["rope_scaling"])
    if kwargs.get("layer_types") is not None:  # a list once saved as JSON
      kwargs["layer_types"] = tuple(kwargs["layer_types"])
    return cls(**kwargs)

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  @property
  def layer_windows(self) -> tuple[int | None, ...]:
    """Each layer's sliding window (Hugging Face's meaning, see the class docstring), or
    None for a layer that attends to the whole causal prefix."""
    if self.sliding_window is None:
      return (None,) * self.num_layers
    if self.layer_types is None:
      return (int(self.sliding_window),) * self.num_layers
    return tuple(int(self.sliding_window) if t == "sliding_attention" else None
                 for t in self.layer_types)

  @property
  def layer_groups(self) -> tuple[tuple[int, int, int | None], ...]:
    """``(start, stop, window)`` for each run of consecutive layers with one window: the
    stack is scanned group by group, each with its window static (the ring prunes hops by
    it at trace time). Qwen2's ``max_window_layers`` gives at most two groups."""
    groups: list[tuple[int, int, int | None]] = []
    for i, window in enumerate(self.layer_windows):
      if groups and groups[-1][2] == window:
        groups[-1] = (groups[-1][0], i + 1, window)
      else:
        groups.append((i, i + 1, window))
    return tuple(groups)

  @property
  def layer_segments(self) -> tuple[tuple[int, int, tuple[int | None, ...]], ...]:
    """``(start, stop, pattern)``: layers ``start..stop`` repeat the windows ``pattern``
    (``(stop - start) / len(pattern)`` times); the stack runs one scan per segment whose
    body is one ``pattern`` of layers, each with its window static.

    The runs of :attr:`layer_groups` when there are at most two (a uniform stack, Qwen2's
    ``max_window_layers``); else the shortest pattern that repeats at least twice from the
    first layer (Gemma 2: ``(w, None)``, Gemma 3: five ``w`` and a ``None``), the layers
    after its last whole repetition as runs. So an interleaved stack of any depth traces
    one pattern of layers, not one scan per layer.
    """
    windows, n = self.layer_windows, self.num_layers
    groups = self.layer_groups
    runs = tuple((a, b, (w,)) for a, b, w in groups)
    if len(groups) <= 2:
      return runs
    for period in range(2, n // 2 + 1):
      reps = n // period
      if all(windows[i] == windows[i % period] for i in range(reps * period)):
        stop = reps * period
        tail = []
        for i in range(stop, n):
          if tail and tail[-1][2] == (windows[i],):
            tail[-1] = (tail[-1][0], i + 1, (windows[i],))
          else:
            tail.append((i, i + 1, (windows[i],)))
        return ((0, stop, tuple(windows[:period])), *tail)
    return runs

  @property
  def resolved_head_dim(self) -> int:
    return self.head_dim if self.head_dim is not None else self.dim // self.num_heads

  @property
  def logical_rules(self) -> shd.Rules:
    """The rules table of this model (:func:`models.sharding.rules`); :class:`Llama`'s entry
    points trace under it (:func:`models.sharding.use_rules`)."""
    return shd.rules(self.tensor_sequence_parallel)

  @property
  def compute_dtype(self):
    return DTYPES[self.dtype]

  @property
  def weight_dtype(self):
    return DTYPES[self.param_dtype]

  def num_params(self, include_embedding: bool = True) -> int:
    """Parameter count. ``include_embedding=False`` drops the input embedding table only."""
    d, h, f, v = self.dim, self.resolved_head_dim, self.mlp_dim, self.vocab_size
    per_layer = d * h * (2 * self.num_heads + 2 * self.num_kv_heads) + 3 * d * f + 2 * d
    per_layer += (self.num_heads + 2 * self.num_kv_heads) * h if self.qkv_bias else 0
    per_layer += 2 * h if self.qk_norm else 0
    per_layer += 2 * d if self.post_norms else 0
    per_layer += self.num_heads if self.attn_sinks else 0
    head = 0 if self.tie_embeddings else d * v
    embedding = d * v if include_embedding or self.tie_embeddings else 0
    return self.num_layers * per_layer + d + head + embedding

  def flops_per_token(self, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward), the MFU numerator.

    ``6 * N_matmul + 6 * num_layers * seq_len * num_heads * head_dim`` where
    ``N_matmul`` counts the weights used in matmuls per token (q/k/v/o and MLP
    projections of every layer, and the vocabulary head, tied or not; not the
    embedding gather nor norms): 2 FLOPs per multiply-add forward, x3 for
    forward + backward. Attention scores and the weighted sum cost
    ``2 * 2 * seq_len * num_heads * head_dim`` forward per layer and token;
    the causal mask halves that on average, x3 for training gives the second
    term (PaLM, Chowdhery et al. 2022, App. B, with causal halving).
    """
    d, h, f, v = self.dim, self.resolved_head_dim, self.mlp_dim, self.vocab_size
    matmul_params = self.num_layers * (d * h * (2 * self.num_heads + 2 * self.num_kv_heads)
                                       + 3 * d * f) + d * v
    attention = 6 * self.num_layers * seq_len * self.num_heads * h
    return float(6 * matmul_params + attention)


# ----------------------------------------------------------------------------------------------
# RoPE
# ----------------------------------------------------------------------------------------------


def _base_inv_freq(theta: float, hd: int) -> np.ndarray:
  """``theta ** (-2i / hd)`` in float32, as transformers computes it (float32 exponents)."""
  return (1.0 / (theta ** (np.arange(0, hd, 2, dtype=np.int64).astype(np.float32)
                           / np.float32(hd)))).astype(np.float32)


def _rope_type(scaling) -> str:
  return scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"


def _need(scaling, rope_type: str, *keys: str) -> None:
  missing = sorted(set(keys) - {k for k, v in scaling.items() if v is not None})
  if missing:
    raise ValueError(f"rope_scaling {rope_type!r} is missing {missing}: {scaling}.")


def rope_inv_freq(cfg: LlamaConfig, seq_len: int | None = None) -> np.ndarray:
  """Inverse frequencies ``[head_dim // 2]`` (float32), with optional HF-style scaling.

  ``inv_freq[i] = rope_theta ** (-2i / head_dim)``. ``"linear"`` divides all of
  them by ``factor``. ``"llama3"`` is HF ``_compute_llama3_parameters``:
  wavelengths ``2*pi/inv_freq`` longer than ``original_max_position_embeddings
  / low_freq_factor`` are divided by ``factor``, shorter than ``... /
  high_freq_factor`` kept, and the band between interpolated with
  ``smooth = (original_max / wavelen - low_freq_factor) / (high_freq_factor -
  low_freq_factor)``: ``(1 - smooth) * inv_freq / factor + smooth * inv_freq``.
  Computed in float64 from float32 base frequencies (as HF's torch float32 ones).

  ``"yarn"`` is transformers' ``_compute_yarn_parameters`` (YaRN, Peng et al.
  2023, arXiv:2309.00071, "NTK-by-parts"): the channels that turn fewer than
  ``beta_slow`` times over ``original_max_position_embeddings`` are
  interpolated (divided by ``factor``), those turning more than ``beta_fast``
  times kept, with a linear ramp between (the correction range floored/ceiled
  unless ``truncate=False``). Its attention factor is :func:`rope_attention_factor`.

  ``"dynamic"`` is transformers' ``_compute_dynamic_ntk_parameters`` (dynamic
  NTK): at a sequence length ``L = max(seq_len, original_max_position_embeddings)``
  the base becomes ``theta * (factor * L / original - (factor - 1)) ** (hd / (hd - 2))``,
  so up to the original length it is the default RoPE. ``seq_len`` is the length
  the model runs at (:meth:`Llama.forward_layers`' ``rope_length``: the row
  length in training, the KV cache's length when decoding); None: the original
  length. ``original_max_position_embeddings`` is transformers'
  ``max_position_embeddings`` (:mod:`models.convert_hf` maps it). Other types
  ignore ``seq_len``.
  """
  hd = cfg.resolved_head_dim
  base = _base_inv_freq(cfg.rope_theta, hd)
  scaling = cfg.rope_scaling
  rope_type = _rope_type(scaling)
  if rope_type not in ROPE_TYPES:
    raise ValueError(f"rope_scaling type must be one of {ROPE_TYPES}, got {rope_type!r}.")
  if rope_type == "default":
    return base
  if "factor" not in scaling or not scaling["factor"] > 0:
    raise ValueError(f"rope_scaling {rope_type!r} needs a positive 'factor', got {scaling}.")
  factor = float(scaling["factor"])
  inv_freq = base.astype(np.float64)
  if rope_type == "linear":
    return (inv_freq / factor).astype(np.float32)
  if rope_type == "yarn":
    return _yarn_inv_freq(cfg.rope_theta, hd, scaling)
  if rope_type == "dynamic":
    _need(scaling, rope_type, "original_max_position_embeddings")
    original = int(scaling["original_max_position_embeddings"])
    length = original if seq_len is None else max(int(seq_len), original)
    # Python floats (float64) for the base, float32 exponents: as transformers.
    theta = cfg.rope_theta * ((factor * length / original) - (factor - 1)) ** (hd / (hd - 2))
    return _base_inv_freq(theta, hd)
  _need(scaling, rope_type, "low_freq_factor", "high_freq_factor",
        "original_max_position_embeddings")
  low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
  if not high > low:
    raise ValueError(f"rope_scaling needs high_freq_factor > low_freq_factor, got {scaling}.")
  old_len = float(scaling["original_max_position_embeddings"])
  low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
  wavelen = 2 * math.pi / inv_freq
  scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
  smooth = (old_len / wavelen - low) / (high - low)
  smoothed = (1 - smooth) * scaled / factor + smooth * scaled
  medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
  return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn_inv_freq(theta: float, hd: int, scaling) -> np.ndarray:
  """YaRN's blend of interpolated and kept frequencies (transformers'
  ``_compute_yarn_parameters``, float32 as there)."""
  _need(scaling, "yarn", "original_max_position_embeddings")
  factor = float(scaling["factor"])
  original = float(scaling["original_max_position_embeddings"])
  beta_fast = scaling.get("beta_fast") or 32
  beta_slow = scaling.get("beta_slow") or 1

  def correction_dim(rotations):  # the channel that turns `rotations` times over `original`
    return hd * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

  low, high = correction_dim(beta_fast), correction_dim(beta_slow)
  if scaling.get("truncate", True):
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, hd - 1)
  if low == high:
    high += 0.001  # transformers: avoids a division by zero
  pos_freqs = (theta ** (np.arange(0, hd, 2, dtype=np.int64).astype(np.float32)
                         / np.float32(hd))).astype(np.float32)
  extrapolation = (1.0 / pos_freqs).astype(np.float32)
  interpolation = (1.0 / (np.float32(factor) * pos_freqs)).astype(np.float32)
  ramp = np.clip((np.arange(hd // 2, dtype=np.float32) - np.float32(low))
                 / np.float32(high - low), 0, 1).astype(np.float32)
  keep = (1 - ramp).astype(np.float32)
  return (interpolation * (1 - keep) + extrapolation * keep).astype(np.float32)


def rope_attention_factor(cfg: LlamaConfig) -> float:
  """The factor on cos and sin (1.0 but for ``"yarn"``), as transformers'
  ``_compute_yarn_parameters``: ``attention_factor`` if given, else ``0.1 * ln(factor)
  + 1`` (YaRN's ``sqrt(1/t)``, Peng et al. 2023 eq. 22), or with ``mscale`` and
  ``mscale_all_dim`` both set the ratio ``get_mscale(factor, mscale) /
  get_mscale(factor, mscale_all_dim)`` (DeepSeek's variant); 1.0 for ``factor <= 1``.
  Scaling both q and k's cos/sin scales the attention logits by its square."""
  scaling = cfg.rope_scaling
  if _rope_type(scaling) != "yarn":
    return 1.0
  if scaling.get("attention_factor") is not None:
    return float(scaling["attention_factor"])
  factor = float(scaling["factor"])

  def get_mscale(scale, mscale=1.0):
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

  mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
  if mscale and mscale_all_dim:
    return float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
  return float(get_mscale(factor))


def rope_tables(positions_BL, inv_freq_K, attention_factor: float = 1.0):
  """``cos, sin`` of shape ``[B, L, 1, head_dim]`` (float32) for :func:`apply_rope`.

  Angle of position ``p`` and frequency ``i`` is ``p * inv_freq[i]``; both
  halves of the head share the frequencies (``rotate_half`` convention). Both
  are multiplied by ``attention_factor`` (:func:`rope_attention_factor`; YaRN's
  temperature, applied where transformers applies it).
  """
  angles_BLK = positions_BL.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq_K)
  angles_BLH = jnp.concatenate([angles_BLK, angles_BLK], axis=-1)
  cos_BLH, sin_BLH = jnp.cos(angles_BLH), jnp.sin(angles_BLH)
  if attention_factor != 1.0:
    cos_BLH, sin_BLH = cos_BLH * attention_factor, sin_BLH * attention_factor
  return cos_BLH[:, :, None, :], sin_BLH[:, :, None, :]


def apply_rope(x_BLNH, cos_BL1H, sin_BL1H):
  """``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = [-x2, x1]`` (halves of H).

  Computed in float32, returned in ``x``'s dtype.
  """
  x = x_BLNH.astype(jnp.float32)
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  return (x * cos_BL1H + rotated * sin_BL1H).astype(x_BLNH.dtype)


# ----------------------------------------------------------------------------------------------
# Modules
# ----------------------------------------------------------------------------------------------


def _param(rngs: nnx.Rngs | None, shape, names, cfg: LlamaConfig, stack: int | None,
           init: str = "normal", dtype=None) -> nnx.Param:
  """A Param of ``shape`` (with a leading ``layers`` axis of size ``stack`` if given), stored
  in ``dtype`` (default ``cfg.param_dtype``).

  ``init="normal"``: N(0, cfg.init_std^2) as HF LLaMA; ``"ones"`` for norm scales;
  ``"zeros"`` for biases, sinks and offset norm scales (as transformers' ``_init_weights``).
  """
  dtype = cfg.weight_dtype if dtype is None else dtype
  if stack is not None:
    shape, names = (stack, *shape), ("layers", *names)
  # Under a mesh, create the value sharded: on Explicit axes the random draw itself gets the
  # sharding (each device draws only its shard; threefry is partitionable), on Auto axes the
  # constraint right after lets the partitioner do the same. Without this every device would
  # materialise the full weight before slicing (measured: 4x the model size of temp memory).
  mesh = shd.current_mesh()
  kwargs = {}
  if mesh is not None and shd.is_explicit_mesh(mesh):
    kwargs["out_sharding"] = shd.logical_to_spec(names, mesh=mesh, shape=shape)
  if init in ("ones", "zeros"):
    value = (jnp.ones if init == "ones" else jnp.zeros)(shape, dtype, **kwargs)
  else:
    value = (cfg.init_std * jax.random.normal(rngs.params(), shape, jnp.float32, **kwargs)
             ).astype(dtype)
  value = shd.with_logical_constraint(value, names)
  return nnx.Param(value, **{shd.LOGICAL_AXES_KEY: tuple(names)})


def _embed_name(cfg: LlamaConfig) -> str:
  return "embed_fsdp" if cfg.fsdp else "embed"


def _weight(param: nnx.Param, cfg: LlamaConfig):
  """A weight's value in the compute dtype, sharded for compute.

  Under FSDP the ``embed_fsdp`` dimension is gathered here (all-gather just
  before use; its gradient is reduce-scattered by the transpose); otherwise
  this is only the dtype cast.
  """
  value = param[...].astype(cfg.compute_dtype)
  names = param.get_metadata()[shd.LOGICAL_AXES_KEY]
  if value.ndim == len(names) - 1:  # a layer slice inside the scan: drop "layers"
    names = names[1:]
  if cfg.fsdp:
    value = shd.with_logical_constraint(
        value, tuple("embed" if n == "embed_fsdp" else n for n in names))
  return value


class RMSNorm(nnx.Module):
  """``x / sqrt(mean(x^2) + eps) * scale`` over the last axis (``size`` channels, default
  ``dim``; Qwen3's and Gemma 3's q/k norms have ``head_dim``), in float32 (Zhang & Sennrich
  2019). With ``cfg.norm_unit_offset`` (Gemma) the parameter is ``w`` and the scale
  ``1 + w`` (``w`` starts at 0), as transformers' ``Gemma2RMSNorm``."""

  def __init__(self, cfg: LlamaConfig, *, stack: int | None = None, size: int | None = None):
    self.cfg = cfg
    self.scale = _param(None, (size or cfg.dim,), ("norm",), cfg, stack,
                        init="zeros" if cfg.norm_unit_offset else "ones")

  def __call__(self, x_BLD):
    x = x_BLD.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.cfg.norm_eps)
    scale = self.scale[...].astype(jnp.float32)
    if self.cfg.norm_unit_offset:
      scale = 1.0 + scale
    return (x * scale).astype(self.cfg.compute_dtype)


class Attention(nnx.Module):
  """GQA self-attention: RoPE on q/k, then the configured backend, then the output projection.

  ``wq [D, N, H]``, ``wk, wv [D, K, H]``, ``wo [N, H, D]``; query head ``n``
  uses key/value head ``n // (N // K)`` (the backends take K heads directly,
  nothing is repeated). With ``cfg.qkv_bias`` the projections add ``bq [N, H]``,
  ``bk, bv [K, H]`` (Qwen2's ``q/k/v_proj.bias``); with ``cfg.qk_norm`` q and k
  are RMS-normalised per head over ``H`` (``q_norm``, ``k_norm``: Qwen3's
  ``Qwen3RMSNorm(head_dim)``, Gemma 3's with ``1 + w``) after the bias and before RoPE, as
  transformers' ``Qwen3Attention``. With ``cfg.attn_sinks`` the layer holds ``sinks [N]``
  (float32, initialised to 0), one sink logit per query head passed to the backend.
  """

  def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs, stack: int | None = None):
    self.cfg = cfg
    d, n, k, h = cfg.dim, cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim
    e = _embed_name(cfg)
    self.wq = _param(rngs, (d, n, h), (e, "heads", "head_dim"), cfg, stack)
    self.wk = _param(rngs, (d, k, h), (e, "kv_heads", "head_dim"), cfg, stack)
    self.wv = _param(rngs, (d, k, h), (e, "kv_heads", "head_dim"), cfg, stack)
    self.wo = _param(rngs, (n, h, d), ("heads", "head_dim", e), cfg, stack)
    if cfg.qkv_bias:
      self.bq = _param(None, (n, h), ("heads", "head_dim"), cfg, stack, init="zeros")
      self.bk = _param(None, (k, h), ("kv_heads", "head_dim"), cfg, stack, init="zeros")
      self.bv = _param(None, (k, h), ("kv_heads", "head_dim"), cfg, stack, init="zeros")
    if cfg.qk_norm:
      self.q_norm = RMSNorm(cfg, stack=stack, size=h)
      self.k_norm = RMSNorm(cfg, stack=stack, size=h)
    if cfg.attn_sinks:  # float32 whatever param_dtype: a logit, as ring_jax takes it
      self.sinks = _param(None, (n,), ("heads",), cfg, stack, init="zeros",
                          dtype=jnp.float32)

  def __call__(self, x_BLD, cos_BL1H, sin_BL1H, positions_BL, segment_ids_BL):
    return self.forward(x_BLD, cos_BL1H, sin_BL1H,
                        backend_attend(self.cfg, positions_BL, segment_ids_BL))[0]

  @jax.named_scope("attention")
  def forward(self, x_BLD, cos_BL1H, sin_BL1H, attend):
    """``(output [B, L, D], aux)``: the projections around ``attend(q, k, v) -> (o, aux)``.

    ``attend`` gets the RoPE'd ``q [B, L, N, H]``, ``k, v [B, L, K, H]`` and the
    keyword ``sinks`` (the layer's ``[N]`` float32 sink logits, or None) and
    returns the attention output ``[B, L, N, H]`` and anything else (``aux``,
    passed through): the training backend (:func:`backend_attend`), or the
    KV-cache attention of :mod:`models.inference`, which returns the updated
    cache as ``aux``. The score scale and soft-cap are ``cfg``'s
    (:func:`models.attention.score_options`).
    """
    cfg = self.cfg
    cp = checkpoint_name
    # Column-parallel projections read every token of the ring shard: gathered over the tensor
    # peers when the residual stream is split over them (a no-op otherwise).
    x_BLD = shd.with_logical_constraint(x_BLD, ("batch", "length", "embed"))
    q_BLNH = jnp.einsum("BLD,DNH->BLNH", x_BLD, _weight(self.wq, cfg))
    k_BLKH = jnp.einsum("BLD,DKH->BLKH", x_BLD, _weight(self.wk, cfg))
    v_BLKH = jnp.einsum("BLD,DKH->BLKH", x_BLD, _weight(self.wv, cfg))
    if cfg.qkv_bias:
      q_BLNH = q_BLNH + _weight(self.bq, cfg)
      k_BLKH = k_BLKH + _weight(self.bk, cfg)
      v_BLKH = v_BLKH + _weight(self.bv, cfg)
    if cfg.qk_norm:
      q_BLNH, k_BLKH = self.q_norm(q_BLNH), self.k_norm(k_BLKH)
    q_BLNH = cp(apply_rope(q_BLNH, cos_BL1H, sin_BL1H), "query")
    k_BLKH = cp(apply_rope(k_BLKH, cos_BL1H, sin_BL1H), "key")
    v_BLKH = cp(v_BLKH, "value")
    q_BLNH = shd.with_logical_constraint(q_BLNH, ("batch", "length", "heads", "head_dim"))
    k_BLKH = shd.with_logical_constraint(k_BLKH, ("batch", "length", "kv_heads", "head_dim"))
    v_BLKH = shd.with_logical_constraint(v_BLKH, ("batch", "length", "kv_heads", "head_dim"))
    sinks_N = self.sinks[...] if cfg.attn_sinks else None
    o_BLNH, aux = attend(q_BLNH, k_BLKH, v_BLKH, sinks=sinks_N)
    o_BLNH = cp(o_BLNH, "attn_out")
    # Row-parallel: the partial sums over heads are reduce-scattered into the residual's split.
    return shd.logical_einsum("BLNH,NHD->BLD", o_BLNH, _weight(self.wo, cfg),
                              ("batch", "residual_length", "embed")), aux


def backend_attend(cfg: LlamaConfig, positions_BL, segment_ids_BL, keep_kv: bool = False,
                   window: int | None = None):
  """The ``attend`` of :meth:`Attention.forward` that runs the configured backend.

  Its ``aux`` is the layer's ``(k, v)`` with ``keep_kv`` (prefill keeps them
  as the KV cache), else None (training: nothing extra is carried out of the layer).
  ``window``: the layer's sliding window (:attr:`LlamaConfig.layer_windows`), or None.
  """

  def attend(q_BLNH, k_BLKH, v_BLKH, sinks=None):
    o_BLNH = attn_lib.attention(cfg, q_BLNH, k_BLKH, v_BLKH, positions_BL, segment_ids_BL,
                                window=window, sinks=sinks)
    return o_BLNH, ((k_BLKH, v_BLKH) if keep_kv else None)

  return attend


class MLP(nnx.Module):
  """A gated MLP (Shazeer 2020): ``(act(x @ w_gate) * (x @ w_up)) @ w_down`` with ``act``
  SiLU (SwiGLU) or, with ``cfg.mlp_activation="gelu_tanh"``, the tanh approximation of GELU
  (GeGLU, Gemma)."""

  def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs, stack: int | None = None):
    self.cfg = cfg
    d, f, e = cfg.dim, cfg.mlp_dim, _embed_name(cfg)
    self.w_gate = _param(rngs, (d, f), (e, "mlp"), cfg, stack)
    self.w_up = _param(rngs, (d, f), (e, "mlp"), cfg, stack)
    self.w_down = _param(rngs, (f, d), ("mlp", e), cfg, stack)

  @jax.named_scope("mlp")
  def __call__(self, x_XD, lead_names=("batch", "length"), out_lead_names=None):
    """``x_XD``: any leading dims, model dim last. The input is gathered to ``lead_names``
    (column-parallel ``w_gate``/``w_up``), the output of the row-parallel ``w_down`` is
    sharded as ``out_lead_names`` (default: ``lead_names`` with ``length`` ->
    ``residual_length``, the residual stream's split)."""
    cfg = self.cfg
    if out_lead_names is None:
      out_lead_names = tuple("residual_length" if n == "length" else n for n in lead_names)
    x_XD = shd.with_logical_constraint(x_XD, (*lead_names, "embed"))
    # Named like the attention's q/k/v: the hidden stays split over "mlp" in the backward
    # pass too (left free, GSPMD split it over the tokens there and gathered the weights).
    hidden = lambda h: shd.with_logical_constraint(h, (*lead_names, "mlp"))
    gate_XF = hidden(jnp.einsum("...D,DF->...F", x_XD, _weight(self.w_gate, cfg)))
    up_XF = hidden(jnp.einsum("...D,DF->...F", x_XD, _weight(self.w_up, cfg)))
    if cfg.mlp_activation == "gelu_tanh":
      act_XF = jax.nn.gelu(gate_XF.astype(jnp.float32), approximate=True).astype(gate_XF.dtype)
    else:
      act_XF = jax.nn.silu(gate_XF)
    h_XF = act_XF * up_XF
    return shd.logical_einsum("...F,FD->...D", h_XF, _weight(self.w_down, cfg),
                              (*out_lead_names, "embed"))


def _sequence_shards(name: str = "length") -> int:
  """Devices the logical sequence dimension ``name`` is split over (1 without a mesh)."""
  spec = shd.logical_to_spec((name,))
  mesh = shd.current_mesh()
  if mesh is None or spec[0] is None:
    return 1
  axes = (spec[0],) if isinstance(spec[0], str) else spec[0]
  return int(np.prod([mesh.shape[a] for a in axes]))


class Block(nnx.Module):
  """One pre-norm transformer layer; built with ``stack=L`` it holds all L layers' weights.

  A stacked Block is not called directly: :class:`Llama` scans (or loops) over
  its layer slices, each merged back into a Block with unstacked arrays. With
  ``cfg.post_norms`` (Gemma 2/3) the attention and MLP outputs are RMS-normed
  (``post_attn_norm``, ``post_mlp_norm``) before their residual adds:
  ``x + post_norm(f(pre_norm(x)))``.
  """

  def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs, stack: int | None = None):
    self.cfg = cfg
    self.attn_norm = RMSNorm(cfg, stack=stack)
    self.attn = Attention(cfg, rngs=rngs, stack=stack)
    self.mlp_norm = RMSNorm(cfg, stack=stack)
    self.mlp = MLP(cfg, rngs=rngs, stack=stack)
    if cfg.post_norms:
      self.post_attn_norm = RMSNorm(cfg, stack=stack)
      self.post_mlp_norm = RMSNorm(cfg, stack=stack)

  def __call__(self, x_BLD, cos_BL1H, sin_BL1H, positions_BL, segment_ids_BL):
    return self.forward(x_BLD, cos_BL1H, sin_BL1H,
                        backend_attend(self.cfg, positions_BL, segment_ids_BL))[0]

  @jax.named_scope("layer")
  def forward(self, x_BLD, cos_BL1H, sin_BL1H, attend):
    """``(output, aux)`` of the layer with attention ``attend`` (see :meth:`Attention.forward`)."""
    cfg = self.cfg
    # Named so a remat policy can offload the one activation "full" remat keeps per layer.
    x_BLD = checkpoint_name(x_BLD, "layer_in")
    attn_BLD, aux = self.attn.forward(self.attn_norm(x_BLD), cos_BL1H, sin_BL1H, attend)
    if cfg.post_norms:
      attn_BLD = self.post_attn_norm(attn_BLD)
    x_BLD = shd.with_logical_constraint(x_BLD + attn_BLD, ("batch", "residual_length", "embed"))
    h_BLD = self.mlp_norm(x_BLD)
    if cfg.ffn_chunk_size is None:
      mlp_BLD = self.mlp(h_BLD)
    else:
      mlp_BLD = self._blockwise_mlp(h_BLD)
    if cfg.post_norms:
      mlp_BLD = self.post_mlp_norm(mlp_BLD)
    mlp_BLD = checkpoint_name(mlp_BLD, "mlp_out")
    return shd.with_logical_constraint(x_BLD + mlp_BLD,
                                       ("batch", "residual_length", "embed")), aux

  def _blockwise_mlp(self, h_BLD):
    """The MLP over ``ffn_chunk_size``-token chunks of each device's local sequence (BPT).

    ``[B, L, D]`` is viewed as ``[B, R, L/R, D]`` with ``R`` the residual
    stream's shard count (``sequence``, times ``tensor`` with tensor sequence
    parallelism), so the chunks scanned by :func:`ring_jax.blockwise_ffn` are
    local (the ``R`` axis stays sharded, the scanned axis is not); each chunk is
    gathered over ``tensor`` for the MLP and its output reduce-scattered back.
    """
    length = h_BLD.shape[1]
    r = _sequence_shards("residual_length")
    chunk = self.cfg.ffn_chunk_size
    if length % r or (length // r) % chunk:
      raise ValueError(
          f"ffn_chunk_size={chunk} must divide the local sequence length {length}/{r}.")
    h_BRLD = rearrange(h_BLD, "b (r l) d -> b r l d", r=r)
    h_BRLD = shd.with_logical_constraint(h_BRLD, ("batch", "residual_length", None, "embed"))
    out_BRLD = ring_jax.blockwise_ffn(
        lambda x: self.mlp(x, lead_names=("batch", "length", None)), h_BRLD, chunk, axis=2)
    return rearrange(out_BRLD, "b r l d -> b (r l) d")


def _under_rules(method):
  """Traces ``method`` under the model's rules table (``cfg.logical_rules``): the layers only
  name their activations, the table (e.g. ``tensor_sequence_parallel``) decides the split."""

  @functools.wraps(method)
  def wrapped(self, *args, **kwargs):
    with shd.use_rules(self.cfg.logical_rules):
      return method(self, *args, **kwargs)

  return wrapped


class Llama(nnx.Module):
  """The LLaMA decoder. ``__call__(tokens, positions, segment_ids) -> float32 logits``."""

  def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    e = _embed_name(cfg)
    self.embed = _param(rngs, (cfg.vocab_size, cfg.dim), ("vocab", e), cfg, None)
    self.layers = Block(cfg, rngs=rngs, stack=cfg.num_layers)
    self.final_norm = RMSNorm(cfg)
    if not cfg.tie_embeddings:
      self.lm_head = _param(rngs, (cfg.dim, cfg.vocab_size), (e, "vocab"), cfg, None)

  @_under_rules
  def __call__(self, tokens_BL, positions_BL, segment_ids_BL=None):
    """Logits ``[B, L, vocab]`` (float32) in the order of the inputs.

    Same arguments as :meth:`hidden`; ``head(hidden(...))``.
    """
    return self.head(self.hidden(tokens_BL, positions_BL, segment_ids_BL),
                     ("batch", "length"))

  @_under_rules
  def hidden(self, tokens_BL, positions_BL, segment_ids_BL=None):
    """Final-normed hidden states ``[B, L, dim]`` (compute dtype), before the output head.

    Args:
      tokens_BL: int token ids, in ``cfg.layout`` order when the ring backend
        shards the sequence (the caller applies :func:`ring_jax.to_layout`).
      positions_BL: int positions of those tokens (RoPE angles; the dense
        backend's causal mask), ``[B, L]`` or ``[L]`` (shared by all rows).
        Per-document positions (restarting at 0) work with segment ids.
      segment_ids_BL: optional int ``[B, L]``: tokens attend within equal ids;
        0 is padding (its attention output is 0; its logits are meaningless).
    """
    if segment_ids_BL is not None:
      segment_ids_BL = shd.with_logical_constraint(jnp.asarray(segment_ids_BL, jnp.int32),
                                                   ("batch", "length"))
    make_attend = lambda positions_BL, segment_ids_BL, _, window: backend_attend(
        self.cfg, positions_BL, segment_ids_BL, window=window)
    return self.forward_layers(tokens_BL, positions_BL, make_attend,
                               segment_ids_BL=segment_ids_BL)[0]

  @_under_rules
  def forward_layers(self, tokens_BL, positions_BL, make_attend, layer_xs=None,
                     segment_ids_BL=None, rope_length: int | None = None):
    """``(final-normed hidden [B, L, D], aux stacked over layers)`` with a custom attention.

    The forward pass of :meth:`hidden`, but each layer's attention is
    ``make_attend(positions_BL, segment_ids_BL, x, window)`` (see
    :meth:`Attention.forward`) for the rows the layer runs on, where ``x`` is
    that layer's slice of ``layer_xs`` (a pytree with a leading ``num_layers``
    axis, e.g. a KV cache; None gives None) and ``window`` the layer's sliding
    window (:attr:`LlamaConfig.layer_windows`, a static int or None); the
    attends' ``aux`` come back stacked along a leading layers axis. Inference
    (:mod:`models.inference`) uses it to collect and update the KV cache.

    The layers run as :attr:`LlamaConfig.layer_segments`: one scan (or loop) per
    run of layers sharing a window, or per repeating pattern of windows (Gemma's
    interleaved local and global layers: the scan body is one pattern), so a
    window is static where the ring prunes hops by it; a uniform stack is one scan.

    ``rope_length``: the sequence length dynamic-NTK RoPE is computed at
    (:func:`rope_inv_freq`); None: ``L``, the length of the rows given (training).
    Decoding passes the KV cache's length, the same at prefill and every step.

    On a mesh with a ``pipeline`` axis of ``S > 1`` devices the layers run as
    ``S`` pipeline stages over ``cfg.pipeline_microbatches`` microbatches
    (:mod:`models.pipeline`, GPipe); ``layer_xs`` must then be None and the
    ``aux`` is None. Every stage runs the same program, so a stack mixing
    windowed and full layers is refused there (ValueError).
    """
    cfg = self.cfg
    tokens_BL = shd.with_logical_constraint(jnp.asarray(tokens_BL), ("batch", "length"))
    positions_BL = jnp.asarray(positions_BL, jnp.int32)
    if positions_BL.ndim == 1:
      positions_BL = jnp.broadcast_to(positions_BL, tokens_BL.shape)
    positions_BL = shd.with_logical_constraint(positions_BL, ("batch", "length"))
    with jax.named_scope("embed"):
      # Vocabulary-parallel lookup (partial sums over the tensor peers), reduce-scattered into
      # the residual stream's split (looked up straight into it, GSPMD gathered the table).
      x_BLD = shd.logical_take(_weight(self.embed, cfg), tokens_BL, ("batch", "length", "embed"))
      if cfg.scale_embeddings:  # Gemma: sqrt(dim), rounded to the compute dtype
        x_BLD = x_BLD * jnp.asarray(math.sqrt(cfg.dim), cfg.compute_dtype)
      x_BLD = shd.with_logical_constraint(x_BLD, ("batch", "residual_length", "embed"))
    inv_freq_K = rope_inv_freq(cfg, tokens_BL.shape[1] if rope_length is None else rope_length)
    attention_factor = rope_attention_factor(cfg)
    local_freq_K = (None if cfg.rope_local_theta is None
                    else _base_inv_freq(cfg.rope_local_theta, cfg.resolved_head_dim))

    graphdef, stacked = nnx.split(self.layers)
    groups, segments = cfg.layer_groups, cfg.layer_segments

    def make_layer(window):
      def layer(x_BLD, layer_state, layer_x, rows):
        cos_BL1H, sin_BL1H, positions_BL, segment_ids_BL = rows
        block = nnx.merge(graphdef, layer_state)
        return block.forward(x_BLD, cos_BL1H, sin_BL1H,
                             make_attend(positions_BL, segment_ids_BL, layer_x, window))

      if cfg.remat_policy != "none":
        # prevent_cse matters only outside scan (scan already stops CSE across iterations).
        layer = jax.checkpoint(layer, policy=REMAT_POLICIES[cfg.remat_policy],
                               prevent_cse=not cfg.scan_layers)
      return layer

    def run_group(layer, x_BLD, stacked, layer_xs, rows):
      if cfg.scan_layers:
        return jax.lax.scan(lambda x, s: layer(x, *s, rows), x_BLD, (stacked, layer_xs))
      auxes = []
      for i in range(jax.tree.leaves(stacked)[0].shape[0]):
        x_BLD, aux = layer(x_BLD, *jax.tree.map(lambda a, i=i: a[i], (stacked, layer_xs)), rows)
        auxes.append(aux)
      return x_BLD, jax.tree.map(lambda *a: jnp.stack(a), *auxes)

    def pattern_layer(pattern, rows_of):
      """One repetition of ``pattern`` as one layer over weights ``[len(pattern), ...]``."""
      layers = [make_layer(window) for window in pattern]

      def layer(x_BLD, layer_state, layer_x, _):
        auxes = []
        for j, (one, window) in enumerate(zip(layers, pattern)):
          x_BLD, aux = one(x_BLD, *jax.tree.map(lambda a, j=j: a[j], (layer_state, layer_x)),
                           rows_of(window))
          auxes.append(aux)
        return x_BLD, jax.tree.map(lambda *a: jnp.stack(a), *auxes)

      return layer

    def run_segment(pattern, x_BLD, stacked, layer_xs, rows_of):
      if len(pattern) == 1:
        return run_group(make_layer(pattern[0]), x_BLD, stacked, layer_xs, rows_of(pattern[0]))
      # [reps * p, ...] -> [reps, p, ...]: the scan walks repetitions of the pattern.
      p = len(pattern)
      fold = lambda tree: jax.tree.map(lambda t: t.reshape(t.shape[0] // p, p, *t.shape[1:]),
                                       tree)
      x_BLD, aux = run_group(pattern_layer(pattern, rows_of), x_BLD, fold(stacked),
                             fold(layer_xs), None)
      return x_BLD, jax.tree.map(lambda t: t.reshape(-1, *t.shape[2:]), aux)

    def layer_stack(x_BLD, stacked, layer_xs, positions_BL, segment_ids_BL):
      rows = (*rope_tables(positions_BL, inv_freq_K, attention_factor), positions_BL,
              segment_ids_BL)
      # Gemma 3: the sliding-window layers rotate by their own base (default RoPE).
      local_rows = rows if local_freq_K is None else (
          *rope_tables(positions_BL, local_freq_K), positions_BL, segment_ids_BL)
      rows_of = lambda window: rows if window is None else local_rows
      if len(segments) == 1:
        return run_segment(segments[0][2], x_BLD, stacked, layer_xs, rows_of)
      # A mixed stack (Qwen2 with max_window_layers < num_layers, Gemma's interleaved local
      # and global layers): one scan per segment over its slice of the stacked weights (and
      # cache); the auxes are joined back.
      auxes = []
      for start, stop, pattern in segments:
        part = lambda tree, a=start, b=stop: jax.tree.map(lambda t: t[a:b], tree)
        x_BLD, aux = run_segment(pattern, x_BLD, part(stacked), part(layer_xs), rows_of)
        auxes.append(aux)
      return x_BLD, jax.tree.map(lambda *a: jnp.concatenate(a), *auxes)

    stages = pipeline_lib.num_stages()
    if stages > 1 and len(groups) > 1:
      raise ValueError(
          f"layers with and without a sliding window ({cfg.layer_types}) cannot run as "
          f"pipeline stages (every stage runs one program); use a mesh with pipeline=1, or "
          "one window for all layers (model.sliding_window / model.layer_types).")
    if stages == 1:
      x_BLD, aux = layer_stack(x_BLD, pipeline_lib.unstaged(stacked), layer_xs, positions_BL,
                               segment_ids_BL)
    else:
      if layer_xs is not None:
        raise ValueError("per-layer inputs (e.g. a KV cache for decoding) are not supported on "
                         f"a mesh with pipeline={stages}; use a mesh with pipeline=1.")
      x_BLD, aux = self._pipelined(layer_stack, stacked, x_BLD, positions_BL,
                                   segment_ids_BL, stages), None

    with jax.named_scope("final_norm"):
      return self.final_norm(x_BLD), aux

  def _pipelined(self, layer_stack, stacked, x_BLD, positions_BL, segment_ids_BL, stages):
    """The layer stack as ``stages`` pipeline stages over microbatches (models/pipeline.py)."""
    cfg = self.cfg
    batch = x_BLD.shape[0]
    data = pipeline_lib.rule_shards("batch")
    micro = pipeline_lib.resolve_microbatches(cfg.pipeline_microbatches, batch, stages, data)
    # Only the activations travel from stage to stage; every stage reads the positions and
    # segment ids of the microbatch it is working on from its own copy.
    split = lambda a, n: shd.with_logical_constraint(
        pipeline_lib.split_microbatches(a, micro), (None, *n))
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

    stage_params = pipeline_lib.to_stages(stacked, stages)
    with jax.named_scope("pipeline"):
      out = pipeline_lib.gpipe(stage, stage_params, split(x_BLD, x_names), x_names, rows,
                               stages=stages)
    return shd.with_logical_constraint(pipeline_lib.merge_microbatches(out), x_names)

  @_under_rules
  @jax.named_scope("head")
  def head(self, x_XD, lead_names):
    """Float32 logits ``[..., vocab]`` of hidden states ``[..., dim]`` named ``lead_names``."""
    cfg = self.cfg
    # Column-parallel over the vocabulary: the tokens are gathered over tensor first.
    x_XD = shd.with_logical_constraint(x_XD, (*lead_names, "embed"))
    if cfg.tie_embeddings:
      w, eq = _weight(self.embed, cfg), "...D,VD->...V"
    else:
      w, eq = _weight(self.lm_head, cfg), "...D,DV->...V"
    logits_XV = shd.logical_einsum(eq, x_XD, w, (*lead_names, "vocab"),
                                   preferred_element_type=jnp.float32)
    if cfg.final_logits_soft_cap is not None:  # Gemma 2: c * tanh(logits / c)
      cap = float(cfg.final_logits_soft_cap)
      logits_XV = cap * jnp.tanh(logits_XV / cap)
    return logits_XV

  @_under_rules
  def nll_sums(self, tokens_BL, positions_BL, segment_ids_BL, labels_BL, mask_BL):
    """``(sum of masked next-token NLL, count of masked argmax hits)``, both float32 scalars.

    With ``cfg.loss_chunk_size`` the head and log-softmax run over chunks of
    each device's local sequence under a rematerialised scan (as the
    blockwise FFN does), so the ``[B, L, vocab]`` float32 logits, and their
    gradient, exist for one chunk at a time instead of the whole sequence.
    """
    x_BLD = self.hidden(tokens_BL, positions_BL, segment_ids_BL)
    with jax.named_scope("loss"):
      return self._nll_sums(x_BLD, labels_BL, mask_BL)

  def _nll_sums(self, x_BLD, labels_BL, mask_BL):
    chunk = self.cfg.loss_chunk_size
    # The head is column-parallel over the vocabulary: gather the tokens over tensor once.
    x_BLD = shd.with_logical_constraint(x_BLD, ("batch", "length", "embed"))

    def sums(x_XD, labels_X, mask_X, lead_names):
      logits_XV = self.head(x_XD, lead_names)
      logp_XV = jax.nn.log_softmax(logits_XV, axis=-1)
      # The label's log-probability as a masked sum over the vocabulary, not a gather: the
      # vocabulary is sharded over tensor, and a sum reduces over shards (Megatron's
      # vocab-parallel cross entropy) where a gather would need every logit on one device
      # (on an Explicit mesh take_along_axis refuses such a gather outright).
      vocab_XV = jax.lax.broadcasted_iota(labels_X.dtype, logp_XV.shape, logp_XV.ndim - 1)
      nll_X = -jnp.sum(jnp.where(vocab_XV == labels_X[..., None], logp_XV, 0.0), axis=-1)
      correct_X = (jnp.argmax(logits_XV, axis=-1) == labels_X).astype(jnp.float32)
      mask_X = mask_X.astype(jnp.float32)
      return jnp.sum(nll_X * mask_X), jnp.sum(correct_X * mask_X)

    if chunk is None:
      return sums(x_BLD, labels_BL, mask_BL, ("batch", "length"))
    length = x_BLD.shape[1]
    r = _sequence_shards()
    if length % r or (length // r) % chunk:
      raise ValueError(
          f"loss_chunk_size={chunk} must divide the local sequence length {length}/{r}.")
    c = length // r // chunk

    def chunks(x):
      # [B, L, ...] -> [C, B, R, chunk, ...]: R stays sharded, the scan walks local chunks.
      return rearrange(x, "b (r c k) ... -> c b r k ...", r=r, c=c)

    names = ("batch", "length", None)

    def body(acc, xs):
      x_CD, labels_C, mask_C = xs
      nll, correct = sums(x_CD, labels_C, mask_C, names)
      return (acc[0] + nll, acc[1] + correct), None

    zero = jnp.zeros((), jnp.float32)
    (nll, correct), _ = jax.lax.scan(
        jax.checkpoint(body), (zero, zero),
        (chunks(x_BLD), chunks(labels_BL), chunks(mask_BL)))
    return nll, correct


# ----------------------------------------------------------------------------------------------
# Construction helpers
# ----------------------------------------------------------------------------------------------


def weight_decay_mask(params):
  """``True`` for weight matrices and embeddings, ``False`` for RMSNorm scales and attention
  sinks (optax ``mask=``).

  Decided by the ``logical_axes`` metadata, not by ``ndim``: the stacked norm
  scales are ``[layers, dim]``, 2-D like a matrix; a parameter whose last axis is
  ``heads`` is a sink logit per head (every weight's last axis is ``head_dim`` or ``embed``). Takes a Module, a State or
  any pytree of Variables and returns the same structure holding bools.
  """
  if isinstance(params, nnx.Module):
    params = nnx.state(params)

  def one(var):
    return var.replace(var.get_metadata()[shd.LOGICAL_AXES_KEY][-1] not in ("norm", "heads"))

  return jax.tree.map(one, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


@functools.lru_cache(maxsize=8)
def _sharded_init(cfg: LlamaConfig, mesh, seed: int):
  """``(graphdef, init)``: ``init()`` is a jitted function returning the sharded param State.

  Cached per (config, mesh, seed): compiling the initialisers costs seconds on CPU, and a
  caller that first inspects ``init.lower().compile()`` then reuses the executable.
  """
  abstract = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(seed)))
  graphdef, abstract_state = nnx.split(abstract)

  def init():
    return nnx.split(Llama(cfg, rngs=nnx.Rngs(seed)))[1]

  return graphdef, jax.jit(init, out_shardings=shd.param_shardings(abstract_state, mesh))


def create_sharded_model(cfg: LlamaConfig, mesh, seed: int = 0) -> Llama:
  """A freshly initialised :class:`Llama` whose parameters are created already sharded.

  The initialiser runs under ``jax.jit`` with ``out_shardings`` from the
  rules table, and each weight is drawn with its sharding (see ``_param``), so
  every device computes and stores only its shards: no full host or device
  copy. Values depend on ``seed`` only, not on the mesh.
  """
  graphdef, init = _sharded_init(cfg, mesh, seed)
  with jax.set_mesh(mesh):
    state = init()
  return nnx.merge(graphdef, state)
