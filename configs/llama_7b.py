"""LLaMA-2-7B-shaped model at 256K context, for large TPU/GPU meshes.

  python train.py --config configs/llama_7b.py --workdir $RUN_DIR

Mesh ``data=-1 x sequence=16 x tensor=4``: a 262144-token row is split over a
ring of 16 (16384 tokens per device; ``model.layout="auto"``: ``"document"`` for the kv
task's two documents per row and for packed text), heads and MLP over 4-way tensor
parallelism with its sequence parallelism (``model.tensor_sequence_parallel``, on for
tensor > 1: the residual stream holds 4096 tokens per device), FSDP over the rest (e.g. 512
chips -> data=8). Full rematerialisation per layer keeps activation memory at one layer's
worth.
``:text`` trains on local files (``--config.data.path``).

``:4d`` uses all four mesh axes: ``data=-1 x pipeline=4 x sequence=8 x tensor=4``
(e.g. 256 chips -> data=2): 4 GPipe stages of 8 layers, 16 rows in 8 pipeline
microbatches (bubble (4-1)/(8+4-1) = 0.27), a ring of 8 (32768 tokens per
device). Tensor peers on the fastest links, then the ring, then the pipeline
stages (one activation per microbatch and stage boundary), data outermost
(docs/training.md, "Choosing the mesh").
"""

import ml_collections

from configs import common


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  config = common.base_config()
  config.mesh.update(dict(data=-1, sequence=16, tensor=4))
  config.model.update(dict(
      vocab_size=32_000, dim=4096, num_layers=32, num_heads=32, num_kv_heads=32,
      head_dim=128, mlp_dim=11008, rope_theta=10_000.0, tie_embeddings=False,
      layout="auto", block_q=2048, block_kv=2048, ffn_chunk_size=4096,
      loss_chunk_size=2048,  # ffn_chunk_size=4096: the residual's 262144 / (16 * 4) tokens
      tensor_sequence_parallel=None,  # None: on (tensor=4); False: the residual replicated
      remat_policy="full", dtype="bfloat16", param_dtype="float32", fsdp=True))
  # Position interpolation from LLaMA-2's 4K training length to 256K.
  config.model.rope_scaling = dict(rope_type="linear", factor=64.0)
  config.data.seq_len = 262_144
  config.data.kv.update(dict(num_pairs=64, num_queries=32, num_keys=4096, num_values=4096,
                             num_filler=8192))
  config.batch_size = 8  # 2M tokens per step
  config.eval_batch_size = 8
  config.eval_batches = 2
  config.total_steps = 5_000
  config.optim.update(dict(lr=1.5e-4, warmup_steps=250, min_lr_ratio=0.1, weight_decay=0.1))
  config.log_every = 10
  config.eval_every = 500
  config.checkpoint_every = 250
  config.keep_checkpoints = 3
  if arg == "text":
    config.data.kind = "text"
  elif arg == "4d":
    config.mesh.update(dict(data=-1, pipeline=4, sequence=8, tensor=4))
    config.model.pipeline_microbatches = 8
    config.batch_size = config.eval_batch_size = 16  # 4M tokens per step
  elif arg:
    raise ValueError(f"unknown llama_7b.py variant {arg!r}; known: 'text', '4d'")
  return config
