"""Tiny LLaMA on the synthetic long-range retrieval task: the CPU default.

  python train.py --config configs/tiny.py --workdir /tmp/tiny

Runs on 8 simulated CPU devices (train.py creates them when the backend is
CPU) as a ``data=2 x sequence=4`` mesh: every attention layer is a ring over 4
sequence shards. Each 128-token row packs two documents whose key/value pairs
and queries sit on different devices of the ring, so retrieval accuracy above
chance (1/16) means information crossed the ring. ``model.layout="auto"``
resolves to ``"document"`` for these packed rows (two documents of equal length:
dealt exactly as zigzag deals a row).
Measured on a shared 2-core CPU: ~2.5 min, loss 4.30 -> 1.43, eval retrieval
accuracy 0.44 after 600 steps (0.39 after 300).

Variants (``--config configs/tiny.py:<arg>[,<arg>...]``):
  text                  LM on local files, streamed: add --config.data.path=... (byte
                        tokenizer; --config.data.tokenizer=DIR|tokenizer.json|*.model and
                        --config.model.vocab_size=... for another)
  dense                 dense attention (the oracle) instead of the ring
  zigzag, striped,      a pinned sequence layout instead of "auto"
  contiguous, document  (document: ring_jax.document_layout, causal work balanced per
                        packed document, each row by its own permutation)
  micro                 2 microbatches of gradient accumulation
"""

import ml_collections

from configs import common

VARIANTS = ("text", "dense", "zigzag", "striped", "contiguous", "document", "micro")


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  variants = set(filter(None, (arg or "").split(",")))
  if variants - set(VARIANTS):
    raise ValueError(f"unknown tiny.py variants {sorted(variants - set(VARIANTS))}; "
                     f"known: {VARIANTS}")
  config = common.base_config()  # The defaults are the tiny settings.

  if "text" in variants:
    config.data.kind = "text"
    config.model.vocab_size = 264  # 259 byte-tokenizer ids (data.tokenizer="byte"), rounded up
    config.data.seq_len = 512
    config.batch_size = config.eval_batch_size = 8
  if "dense" in variants:
    config.model.attention = "dense"
  for layout in ("zigzag", "striped", "contiguous", "document"):
    if layout in variants:
      config.model.layout = layout
  if "micro" in variants:
    config.microbatches = 2
  return config
