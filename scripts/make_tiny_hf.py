r"""Writes a tiny random Hugging Face LLaMA (or Qwen2, Qwen3, Mistral, Gemma 2, Gemma 3), its BPE
tokenizer and a small JSONL corpus.

  python scripts/make_tiny_hf.py --out /tmp/tiny_hf --corpus /tmp/tiny_corpus.jsonl
  python scripts/make_tiny_hf.py --family qwen3 --out /tmp/tiny_qwen3 --corpus /tmp/c.jsonl

``--family`` picks the architecture (:data:`FAMILY_FIELDS`): ``llama``
(untied), ``qwen2`` (q/k/v biases, tied, a 64-token window on the second
layer), ``qwen3`` (q/k norms, ``head_dim`` 32 != dim / heads, tied),
``mistral`` (a 64-token window on every layer), ``gemma2`` (the Gemma block, soft-caps
50 / 30 as Gemma 2's, a 32-token window on every other layer, tied), ``gemma3`` (the Gemma
block, q/k norms, a 32-token window on the local layers with their own RoPE base 1e4, global
base 1e6, final soft-cap 30 (as Gemma 2's, so that path runs too), tied).

For trying the fine-tuning path (the README's step 3, which runs this script) on a
CPU with nothing downloaded: ``--out`` gets ``config.json``,
``model.safetensors`` (random weights written by :func:`export_hf.write_hf_dir`,
no torch needed), ``tokenizer.json`` (a byte-level BPE trained with the
``tokenizers`` package on the corpus) and ``tokenizer_config.json`` naming its
BOS/EOS (``<s>`` / ``</s>``, BOS added to every document, EOS too). ``--corpus``
gets one JSON object ``{"text": ...}`` per line. The vocabulary is exactly
``--vocab_size`` ids, so the model's embedding covers the tokenizer.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:  # run as `python scripts/make_tiny_hf.py` from anywhere
  sys.path.insert(0, _ROOT)

SPECIALS = ("<unk>", "<s>", "</s>")
TOKENIZER_CONFIG = dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                        add_bos_token=True, add_eos_token=True, model_max_length=4096)
_SUBJECTS = ("The ring", "Each device", "A block of keys", "The zigzag layout", "Attention",
             "The sequence axis", "A packed row", "The model")
_VERBS = ("passes", "holds", "computes", "balances", "sends", "receives", "masks", "merges")
_OBJECTS = ("key and value blocks", "one chunk of the sequence", "the causal work",
            "partial softmax sums", "the next device's queries", "segment ids",
            "blockwise attention", "a longer context")


def corpus_texts(num_docs: int = 400, seed: int = 0) -> list[str]:
  """Small synthetic English documents (a few sentences each), deterministic in ``seed``."""
  import random
  rng = random.Random(seed)
  docs = []
  for _ in range(num_docs):
    sentences = [f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}."
                 for _ in range(rng.randint(2, 6))]
    docs.append(" ".join(sentences))
  return docs


def write_corpus(path: str, texts: list[str]) -> str:
  """``texts`` as JSONL (``{"text": ...}`` per line) at ``path``."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w", encoding="utf-8") as f:
    for text in texts:
      f.write(json.dumps({"text": text}) + "\n")
  return path


def write_tokenizer(directory: str, texts: list[str], vocab_size: int) -> str:
  """A byte-level BPE of exactly ``vocab_size`` ids trained on ``texts``, saved in
  ``directory`` as ``tokenizer.json`` + ``tokenizer_config.json`` (BOS/EOS as
  :data:`TOKENIZER_CONFIG`); returns the directory."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  alphabet = pre_tokenizers.ByteLevel.alphabet()
  if vocab_size < len(alphabet) + len(SPECIALS):
    raise ValueError(f"vocab_size={vocab_size} is below the byte alphabet + specials "
                     f"({len(alphabet) + len(SPECIALS)}).")
  tok = Tokenizer(models.BPE(unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(texts, trainers.BpeTrainer(
      vocab_size=vocab_size, special_tokens=list(SPECIALS), initial_alphabet=alphabet,
      show_progress=False))
  got = tok.get_vocab_size(with_added_tokens=True)
  if got != vocab_size:  # the corpus has too few merges to fill the vocabulary
    raise ValueError(f"the corpus yields a {got}-id BPE, not {vocab_size}; pass more text or a "
                     "smaller vocab_size.")
  os.makedirs(directory, exist_ok=True)
  tok.save(os.path.join(directory, "tokenizer.json"))
  with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
    json.dump(TOKENIZER_CONFIG, f, indent=2)
  return directory


_GEMMA = dict(mlp_activation="gelu_tanh", norm_unit_offset=True, post_norms=True,
              scale_embeddings=True, tie_embeddings=True, query_pre_attn_scalar=16.0)

#: ``--family`` -> the :class:`models.llama.LlamaConfig` fields that make the family
#: (besides the shape): what transformers' Qwen2/Qwen3/Mistral classes hold by default
#: for small checkpoints (tied heads for the small Qwens), with short windows so a
#: 128-token run uses them.
FAMILY_FIELDS = {
    "llama": dict(family="llama"),
    "qwen2": dict(family="qwen2", qkv_bias=True, tie_embeddings=True, sliding_window=64,
                  layer_types=("full_attention", "sliding_attention")),
    "qwen3": dict(family="qwen3", qk_norm=True, head_dim=32, tie_embeddings=True),
    "mistral": dict(family="mistral", sliding_window=64),
    "gemma2": dict(family="gemma2", **_GEMMA, attn_logits_soft_cap=50.0,
                   final_logits_soft_cap=30.0, sliding_window=32,
                   layer_types=("sliding_attention", "full_attention")),
    "gemma3": dict(family="gemma3", **_GEMMA, qk_norm=True, final_logits_soft_cap=30.0,
                   rope_theta=1e6, rope_local_theta=1e4, sliding_window=32,
                   layer_types=("sliding_attention", "full_attention")),
}

#: Gemma's layer pattern (``--family gemma2|gemma3`` with more layers): Gemma 2 alternates
#: local and global layers, Gemma 3 has 5 local to 1 global (as transformers' defaults).
GEMMA_PATTERN = {"gemma2": 2, "gemma3": 6}


def write_model(directory: str, *, vocab_size: int, dim: int = 64, num_layers: int = 2,
                num_heads: int = 4, num_kv_heads: int = 2, mlp_dim: int = 128,
                seed: int = 0, family: str = "llama") -> list[str]:
  """A random model of ``family`` (``models.llama``, init_std 0.1; :data:`FAMILY_FIELDS`)
  written as a Hugging Face directory by :func:`export_hf.write_hf_dir`: config.json (the
  family's ``model_type`` and architecture) + model.safetensors, float32."""
  import jax
  from flax import nnx

  import export_hf
  from models.llama import Llama, LlamaConfig

  if family not in FAMILY_FIELDS:
    raise ValueError(f"family must be one of {sorted(FAMILY_FIELDS)}, got {family!r}.")
  fields = dict(FAMILY_FIELDS[family])
  if fields.get("layer_types") is not None and num_layers != len(fields["layer_types"]):
    if family in GEMMA_PATTERN:  # sliding unless (i + 1) % pattern == 0; the last layer global
      pattern = GEMMA_PATTERN[family]
      fields["layer_types"] = tuple(
          "sliding_attention" if (i + 1) % pattern and i + 1 < num_layers else "full_attention"
          for i in range(num_layers))
    else:
      fields["layer_types"] = ("full_attention",) + ("sliding_attention",) * (num_layers - 1)
  cfg = LlamaConfig(vocab_size=vocab_size, dim=dim, num_layers=num_layers, num_heads=num_heads,
                    num_kv_heads=num_kv_heads, mlp_dim=mlp_dim, init_std=0.1,
                    attention="dense", **fields)
  params = nnx.split(Llama(cfg, rngs=nnx.Rngs(seed)), nnx.Param, ...)[1]
  if cfg.qkv_bias:  # biases start at zero: give them values so they matter
    for i, name in enumerate(("bq", "bk", "bv")):
      var = params["layers"]["attn"][name]
      var.set_value(0.1 * jax.random.normal(jax.random.key(seed + 1 + i),
                                            var.get_value().shape))
  return export_hf.write_hf_dir(params, cfg, directory, max_position_embeddings=4096)


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--out", default="/tmp/tiny_hf", help="the Hugging Face directory to write")
  p.add_argument("--corpus", default="/tmp/tiny_corpus.jsonl", help="the JSONL corpus to write")
  p.add_argument("--vocab_size", type=int, default=320)
  p.add_argument("--docs", type=int, default=400)
  p.add_argument("--family", choices=sorted(FAMILY_FIELDS), default="llama",
                 help="the architecture: llama, qwen2, qwen3, mistral, gemma2 or gemma3")
  args = p.parse_args(argv)
  if os.path.isdir(args.out) and os.listdir(args.out):
    sys.exit(f"error: --out {args.out} exists and is not empty; pass a new directory.")
  texts = corpus_texts(args.docs)
  write_corpus(args.corpus, texts)
  write_tokenizer(args.out, texts, args.vocab_size)
  write_model(args.out, vocab_size=args.vocab_size, family=args.family)
  print(f"wrote {args.out} (random {args.family}, {args.vocab_size}-id BPE) and {args.corpus} "
        f"({len(texts)} documents)")


if __name__ == "__main__":
  main()
