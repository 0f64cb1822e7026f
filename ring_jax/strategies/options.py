"""``AttentionOptions``: the attention keywords every strategy takes, built once per call."""

from __future__ import annotations

import dataclasses
from typing import Any

from ring_jax import layouts
from ring_jax import masking
from ring_jax import validation
from ring_jax.hop import HopKernel, HopSpec
from ring_jax.ring import default_block


@dataclasses.dataclass(frozen=True)
class AttentionOptions:
  """What to compute, shared by every strategy (inside ``shard_map`` and on global arrays).

  The fields are the public keywords of :func:`ring_jax.ring_attention` (see
  its docstring); the public entry points build one from their keywords and
  pass it on. ``overlap_dkv`` and ``causal_routing`` are the ring's only (the hybrid's
  ring takes them too). ``sinks`` are an operand, not an option: each strategy's ``local``
  takes them (:class:`ring_jax.strategies.global_arrays.Strategy`).
  """
  is_causal: bool = False
  scale: float | None = None
  local_window_size: Any = None
  layout: str = "contiguous"
  block_q: int | None = None
  block_kv: int | None = None
  precision: Any = None
  hop_kernel: str | HopKernel = "auto"
  return_lse: bool = False
  overlap_dkv: bool | None = None
  causal_routing: bool | None = None
  logits_soft_cap: float | None = None

  @classmethod
  def from_keywords(cls, keywords: dict) -> "AttentionOptions":
    """The options among ``keywords`` (an entry point's ``locals()``); the rest ignored."""
    return cls(**{f.name: keywords[f.name] for f in dataclasses.fields(cls) if f.name in keywords})

  def __post_init__(self):
    layouts.check_layout(self.layout)
    object.__setattr__(self, "logits_soft_cap", validation.check_soft_cap(self.logits_soft_cap))
    if isinstance(self.local_window_size, list):  # hashable, as the other fields
      object.__setattr__(self, "local_window_size", tuple(self.local_window_size))

  def with_attention_layout(self, segment_ids) -> "AttentionOptions":
    """These options with the layout attention runs (``"document"`` -> its mask layout),
    after the document layout's conditions (:func:`ring_jax.layouts.check_attention_layout`:
    ValueError naming the fix)."""
    return dataclasses.replace(self, layout=layouts.check_attention_layout(
        self.layout, segment_ids, self.local_window_size))

  @property
  def masked(self) -> bool:
    """Whether a causal mask or a window relates query and key positions (self-attention)."""
    return bool(self.is_causal) or self.local_window_size is not None

  def ring_kwargs(self) -> dict:
    """The keywords of :func:`ring_jax.ring_attention` (its public API) for these options."""
    return dict(is_causal=self.is_causal, scale=self.scale,
                local_window_size=self.local_window_size, layout=self.layout,
                block_q=self.block_q, block_kv=self.block_kv, precision=self.precision,
                hop_kernel=self.hop_kernel, return_lse=self.return_lse,
                overlap_dkv=self.overlap_dkv, causal_routing=self.causal_routing,
                logits_soft_cap=self.logits_soft_cap)

  def hop_spec(self, head_dim: int, local_len: int, block_length: int,
               kernel=None, value_head_dim: int | None = None) -> HopSpec:
    """The hop kernel's static spec; default blocks divide the layout's chunk of
    ``local_len`` (so they never straddle two chunks of the sequence), are ones ``kernel``
    (the :class:`ring_jax.hop.HopKernel` that runs) takes (:func:`ring_jax.ring
    .default_block`), and every block must divide ``block_length``, the length the
    blocks tile. ``value_head_dim``: V's head size (the spec records it where it differs
    from ``head_dim``)."""
    window = masking.normalize_window(self.local_window_size)
    scale = validation.check_scale(self.scale, head_dim, "float32")
    block_q = (default_block(self.layout, local_len, kernel=kernel) if self.block_q is None
               else self.block_q)
    block_kv = (default_block(self.layout, local_len, kernel=kernel) if self.block_kv is None
                else self.block_kv)
    validation.check_block("block_q", block_q, block_length)
    validation.check_block("block_kv", block_kv, block_length)
    return HopSpec(scale=scale, is_causal=bool(self.is_causal), window=window,
                   block_q=int(block_q), block_kv=int(block_kv), precision=self.precision,
                   logits_soft_cap=self.logits_soft_cap,
                   value_head_dim=None if value_head_dim in (None, head_dim)
                   else int(value_head_dim))
