"""LLaMA-3.2-1B-shaped model at 128K context, for TPU/GPU meshes.

  python train.py --config configs/llama_1b.py --workdir $RUN_DIR

Mesh ``data=-1 x sequence=16``: each 131072-token row is split over a ring
of 16 devices (8192 tokens each), the remaining devices run data
parallelism with FSDP-sharded weights (e.g. 256 chips -> data=16). Default
data: the kv-retrieval task at 128K (a passkey-style long-context check that
needs no files); ``:text`` trains on local files (``--config.data.path``) with
the byte tokenizer. ``model.layout="auto"`` resolves at startup to
``"document"`` for both (the kv task's two documents per row, packed text). Peak
FLOP/s for MFU come from the device-kind table.

:func:`model_fields` gives the model of a variant as a plain dict of every
``models.llama.LlamaConfig`` field, for code without ml_collections
(``benchmarks/accelerator_check.py`` measures the ``long`` variant on one GPU with it; a test
checks it equals ``get_config``'s model).
"""

from __future__ import annotations

VARIANTS = ("text", "long")

# The model fields this config sets (the others keep models.llama.LlamaConfig's defaults).
MODEL = dict(
    vocab_size=128_256,  # LLaMA-3 vocabulary, so converted HF weights fit
    dim=2048, num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64, mlp_dim=8192,
    rope_theta=500_000.0, tie_embeddings=True, layout="auto",
    block_q=1024, block_kv=1024, ffn_chunk_size=4096,
    loss_chunk_size=2048,
    remat_policy="save_dots_no_batch", dtype="bfloat16", param_dtype="float32", fsdp=True,
    rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                      high_freq_factor=4.0, original_max_position_embeddings=8192))
# "long": the backward pass recomputes each layer from its input, and the layer inputs wait
# in pinned host memory (accelerators only, see docs/performance.md).
LONG_MODEL = dict(remat_policy="offload_layer_in")


def _model_values(arg: str | None) -> dict:
  """The model fields variant ``arg`` sets."""
  if arg and arg not in VARIANTS:
    raise ValueError(f"unknown llama_1b.py variant {arg!r}; known: 'text', 'long'")
  return {**MODEL, **(LONG_MODEL if arg == "long" else {})}


def model_fields(arg: str | None = None) -> dict:
  """Every ``LlamaConfig`` field of variant ``arg``: the class's defaults, updated with this
  config's (plain data; no ml_collections needed)."""
  from models.llama import LlamaConfig

  return {**LlamaConfig().to_dict(), **_model_values(arg)}


def get_config(arg: str | None = None):
  """The ``ml_collections.ConfigDict`` of variant ``arg`` (None, 'text' or 'long')."""
  from configs import common  # ml_collections: imported here, so model_fields() needs none

  config = common.base_config()
  config.mesh.update(dict(data=-1, sequence=16, tensor=1))
  config.model = common.model_config(**_model_values(arg))
  config.data.seq_len = 131_072
  config.data.kv.update(dict(num_pairs=64, num_queries=32, num_keys=4096, num_values=4096,
                             num_filler=8192))
  config.batch_size = 16  # 2M tokens per step
  config.eval_batch_size = 16
  config.eval_batches = 2
  config.total_steps = 10_000
  config.optim.update(dict(lr=3e-4, warmup_steps=500, min_lr_ratio=0.1, weight_decay=0.1))
  config.log_every = 10
  config.eval_every = 500
  config.checkpoint_every = 500
  config.keep_checkpoints = 3
  if arg == "text":
    config.data.kind = "text"
  elif arg == "long":
    # One 512K-token row per step with every device on the ring (model: LONG_MODEL).
    config.mesh.update(dict(data=1, sequence=-1, tensor=1))
    config.data.seq_len = 524_288
    config.batch_size = config.eval_batch_size = 1
  return config
