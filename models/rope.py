"""Rotary position embeddings (Su et al. 2021, RoFormer) and Hugging Face's scaled variants.

:func:`rope_inv_freq` gives the frequencies of ``LlamaConfig.rope_scaling``'s type (one of
:data:`ROPE_TYPES`: default, linear, llama3, yarn, dynamic), :func:`rope_attention_factor`
YaRN's factor on cos and sin, :func:`rope_tables` the cos/sin tables of given positions and
:func:`apply_rope` the rotation. Convention ``rotate_half`` (first half / second half of
each head), as Hugging Face ``LlamaAttention``: HF q/k weights load without permutation.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import jax.numpy as jnp
import numpy as np

if TYPE_CHECKING:
  from models.config import LlamaConfig

#: The ``rope_scaling`` types :func:`rope_inv_freq` computes (Hugging Face's ``rope_type``).
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic")


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
