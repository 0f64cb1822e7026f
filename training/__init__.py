"""Helpers of train.py: config/mesh checks, data, optimizer and steps, checkpoints, metrics.

  config      gin-syntax overrides onto the ConfigDict, mesh building, up-front validation
  data        synthetic kv-retrieval task and packed local text, Grain pipeline, layouts
  step        AdamW + warmup/cosine + clipping, pure train/eval steps, jit with shardings
  checkpoint  Orbax CheckpointManager: train state + data iterator state, any-mesh restore
  metrics     tokens/s, MFU with attention FLOPs, TensorBoard + JSONL + console
"""
