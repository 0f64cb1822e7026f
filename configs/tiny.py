"""Tiny LLaMA on the synthetic long-range retrieval task: the CPU default.

  python train.py --config configs/tiny.py --workdir /tmp/tiny

runs on 8 simulated CPU devices (``train.py`` creates them when the backend is
CPU) as a ``data=2 x sequence=4`` mesh: every attention layer is a ring over 4
sequence shards in the zigzag layout. Key/value pairs sit in the first shard
and the queries in the last, so retrieval accuracy above chance (1/16) is
proof that information crossed the ring. Takes a few minutes on 2 cores.

Variants (``--config configs/tiny.py:<arg>``, comma-separated):
  text     byte-level LM on local files: add ``--config.data.path=...``
  dense    dense attention (the oracle) instead of the ring
  striped / contiguous   other sequence layouts
  micro    2 microbatches of gradient accumulation
"""

import ml_collections
from ml_collections import config_dict


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  variants = set(filter(None, (arg or "").split(",")))
  known = {"text", "dense", "striped", "contiguous", "micro"}
  if variants - known:
    raise ValueError(f"unknown tiny.py variants {sorted(variants - known)}; known: {sorted(known)}")

  config = ml_collections.ConfigDict()
  config.seed = 0

  # Mesh: axis sizes; one may be -1 (= all remaining devices). The product must equal
  # the device count. On CPU, train.py simulates `cpu_devices` devices when the sizes
  # do not pin the count (a -1 is present).
  config.mesh = ml_collections.ConfigDict(dict(data=2, sequence=4, tensor=1))
  config.cpu_devices = 8

  config.model = ml_collections.ConfigDict(dict(
      vocab_size=72,  # >= the kv task's 67 ids; 259+ for the byte tokenizer
      dim=64,
      num_layers=2,
      num_heads=4,
      num_kv_heads=2,
      head_dim=config_dict.placeholder(int),
      mlp_dim=128,
      rope_theta=10_000.0,
      rope_scaling=config_dict.placeholder(dict),
      norm_eps=1e-5,
      tie_embeddings=False,
      attention="ring",
      layout="zigzag",
      block_q=config_dict.placeholder(int),
      block_kv=config_dict.placeholder(int),
      ffn_chunk_size=config_dict.placeholder(int),
      remat_policy="none",
      scan_layers=True,
      dtype="float32",
      param_dtype="float32",
      fsdp=False,
      init_std=0.02,
  ))

  config.data = ml_collections.ConfigDict(dict(
      kind="kv_retrieval",  # or "text"
      seq_len=256,
      # kind="text": a .txt/.jsonl file, a directory or a glob; byte tokenizer.
      path=config_dict.placeholder(str),
      text_field="text",
      eval_fraction=0.05,
      kv=dict(num_pairs=8, num_queries=8, num_keys=32, num_values=16, num_filler=16),
  ))

  config.batch_size = 16  # global, across the 'data' axis and all processes
  config.microbatches = 1  # gradient accumulation steps per update
  config.eval_batch_size = 16
  config.eval_batches = 4

  config.total_steps = 400
  config.optim = ml_collections.ConfigDict(dict(
      lr=3e-3, warmup_steps=40, min_lr_ratio=0.1, weight_decay=0.1, b1=0.9, b2=0.95,
      eps=1e-8, grad_clip=1.0))

  config.log_every = 20
  config.eval_every = 100
  config.checkpoint_every = 200
  config.keep_checkpoints = 2
  config.async_checkpointing = True

  # MFU denominator. None: look up the device kind (see training/metrics.py). On CPU
  # there is no such figure; MFU is reported against this nominal value instead.
  config.peak_flops_per_device = config_dict.placeholder(float)
  config.cpu_peak_flops_per_device = 25e9  # ~200 GFLOP/s f32 for 2 cores / 8 fake devices

  if "text" in variants:
    config.data.kind = "text"
    config.model.vocab_size = 264  # 259 byte ids, rounded up
    config.data.seq_len = 512
    config.batch_size = config.eval_batch_size = 8
  if "dense" in variants:
    config.model.attention = "dense"
  if "striped" in variants:
    config.model.layout = "striped"
  if "contiguous" in variants:
    config.model.layout = "contiguous"
  if "micro" in variants:
    config.microbatches = 2
  return config
