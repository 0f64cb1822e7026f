"""Helpers of train.py: config/mesh checks, the batch, data, optimizer and steps, checkpoints, metrics.

  config      gin-syntax overrides onto the ConfigDict, mesh building (and simulated CPU
              devices), up-front validation, profile_steps, the scripts' usage errors
  batch       the batch's fields, dtypes and sharding (from the rules table), defined once
  data        synthetic kv-retrieval task and packed local text, Grain pipeline, layouts
  step        AdamW + warmup/cosine + clipping, pure train/eval steps, jit with shardings, and
              build_train_step: the one builder of the train step and its (abstract) state
  checkpoint  Orbax CheckpointManager: train state + data iterator state, any-mesh restore
  loading     a run's trained model (or a Hugging Face one) for generate.py and evaluate.py
  distributed jax.distributed start-up, the watchdog that ends survivors of a dead process
  supervisor  the parent process of each process of a multi-process train.py (process 0's
              death), importing no JAX
  metrics     tokens/s, MFU with attention FLOPs, the one-step-behind step metrics and
              divergence check, TensorBoard + JSONL + console, profiling

Only ``config`` (ml_collections) and ``data`` (Grain) need more than JAX, Flax, Optax, einops;
``batch`` and ``step`` import without them (the benchmarks run them on accelerator images).
"""
