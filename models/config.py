"""The model's configuration: :class:`LlamaConfig`, its validation, and the registries its
fields name (:data:`DTYPES`, :data:`REMAT_POLICIES`, :data:`LAYER_TYPES`, :data:`FAMILIES`,
:data:`MLP_ACTIVATIONS`; the RoPE types are :data:`models.rope.ROPE_TYPES`).

Imports no Flax: configs, the trainer's validation and the Hugging Face mapping read it
without building a model.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

import ring_jax
from models import attention as attn_lib
from models import sharding as shd
from models.rope import rope_inv_freq

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
