"""The decoder's layers: RMSNorm, GQA self-attention with RoPE, the gated MLP, and
:class:`Block` (one pre-norm layer, or all of them stacked along a leading ``layers`` axis).

Every weight is an ``nnx.Param`` made by :func:`_param` with its logical axis names (see
:mod:`models.sharding`); :func:`_weight` reads it in the compute dtype, gathered under FSDP.
:class:`models.llama.Llama` runs the stacked :class:`Block`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from einops import rearrange
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

import ring_jax
from models import attention as attn_lib
from models import sharding as shd
from models.config import LlamaConfig
from models.rope import apply_rope


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
  # materialise the full weight before slicing (the figure: commit b2b2771).
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
    r = shd.rule_shards("residual_length")
    chunk = self.cfg.ffn_chunk_size
    if length % r or (length // r) % chunk:
      raise ValueError(
          f"ffn_chunk_size={chunk} must divide the local sequence length {length}/{r}.")
    h_BRLD = rearrange(h_BLD, "b (r l) d -> b r l d", r=r)
    h_BRLD = shd.with_logical_constraint(h_BRLD, ("batch", "residual_length", None, "embed"))
    out_BRLD = ring_jax.blockwise_ffn(
        lambda x: self.mlp(x, lead_names=("batch", "length", None)), h_BRLD, chunk, axis=2)
    return rearrange(out_BRLD, "b r l d -> b (r l) d")
