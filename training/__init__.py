"""Helpers of train.py: config/mesh checks, the batch, data, optimizer and steps, checkpoints, metrics.

  config      gin-syntax overrides onto the ConfigDict, mesh building, up-front validation
  batch       the batch's fields, dtypes and sharding (from the rules table), defined once
  data        synthetic kv-retrieval task and packed local text, Grain pipeline, layouts
  step        AdamW + warmup/cosine + clipping, pure train/eval steps, jit with shardings
  aot         the jitted train step from abstract values (ahead-of-time compile, memory plan)
  checkpoint  Orbax CheckpointManager: train state + data iterator state, any-mesh restore
  metrics     tokens/s, MFU with attention FLOPs, TensorBoard + JSONL + console

Only ``config`` (ml_collections) and ``data`` (Grain) need more than JAX, Flax, Optax, einops;
``batch``, ``step`` and ``aot`` import without them (the benchmarks run them on accelerator images).
"""
