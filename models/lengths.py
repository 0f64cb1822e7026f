"""The sequence-length rule: which lengths a LLaMA config runs on a ring of ``n`` devices.

One rule, used by config validation (``training/validation.py``), the data
pipeline (``training/data.py``), evaluation (``evaluate.py``), the prompt padding
of inference (``models/inference.py``) and the context-length planner
(``benchmarks/fit.py``): the layout splits the length over the ring
(:func:`ring_jax.layouts.check_length`) and every field of
:data:`LOCAL_LENGTH_DIVISORS` that is set divides each device's share (the
ring's query/key blocks, the blockwise FFN's chunk, the output head's loss
chunk). It looks at static numbers only.

Any length runs: a row of ``L`` tokens runs at :func:`padded_length` (the next
length the rule accepts), its end padded with segment 0 (attends nothing, is
never attended) and no loss target, so the loss, its gradients and the
predictions at the real tokens are those of the ``L`` tokens alone.
:func:`check_length` is the rule itself, for code that builds rows of an exact length.
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


def padded_length(cfg, ring: int, length: int) -> int:
  """The length a row of ``length`` tokens runs at on a ring of ``ring``: the smallest
  multiple of :func:`length_multiple` that is ``>= length`` (``length`` itself when it
  passes :func:`check_length`). The ``padded_length - length`` tokens at the row's end are
  padding (segment 0, loss mask 0): they cost compute and memory like real tokens, and
  change no result (but dynamic-NTK RoPE's, computed at the length the rows run at)."""
  if length < 1:
    raise ValueError(f"a sequence length must be >= 1, got {length}.")
  multiple = length_multiple(cfg, ring)
  return -(-length // multiple) * multiple


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
