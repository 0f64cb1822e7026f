"""The sequence-length rule: which lengths a LLaMA config runs on a ring of ``n`` devices.

One rule, used by config validation (``training/validation.py``), evaluation
(``evaluate.py``), the prompt padding of inference (``models/inference.py``)
and the context-length planner (``benchmarks/fit.py``): the layout splits the
length over the ring (:func:`ring_jax.layouts.check_length`) and every field
of :data:`LOCAL_LENGTH_DIVISORS` that is set divides each device's share (the
ring's query/key blocks, the blockwise FFN's chunk, the output head's loss
chunk). It looks at static numbers only, so a bad length fails with one line
naming the fix before anything is traced, instead of mid-trace in the layer
whose chunk does not divide.
"""

from __future__ import annotations

import math

from ring_jax import layouts

#: ``LlamaConfig`` fields that must divide each device's share of the sequence.
LOCAL_LENGTH_DIVISORS: tuple[str, ...] = ("block_q", "block_kv", "ffn_chunk_size",
                                          "loss_chunk_size")


def length_multiple(cfg, ring: int) -> int:
  """The smallest step between lengths that pass :func:`check_length` (``cfg``: a
  ``LlamaConfig`` or anything with its fields, e.g. ``config.model``)."""
  blocks = [b for b in (getattr(cfg, name, None) for name in LOCAL_LENGTH_DIVISORS) if b]
  return math.lcm(layouts.length_multiple(cfg.layout, ring), ring * math.lcm(1, *blocks))


def check_length(cfg, ring: int, length: int, what: str = "sequence length") -> int:
  """Checks that ``cfg`` runs ``length`` tokens on a ring of ``ring``; returns the
  per-device length ``length // ring``.

  Raises:
    ValueError: naming the field that does not divide and the multiple to pad
      ``what`` (e.g. ``"data.seq_len"``, ``"--lengths"``) to.
  """
  local_len = layouts.check_length(cfg.layout, ring, length, what=what)
  for name in LOCAL_LENGTH_DIVISORS:
    block = getattr(cfg, name, None)
    if block is not None and local_len % block:
      raise ValueError(
          f"model.{name}={block} must divide the per-device sequence length {local_len} "
          f"(= {what} {length} / ring {ring}); use a multiple of "
          f"{length_multiple(cfg, ring)} for {what}, or change model.{name}.")
  return local_len
