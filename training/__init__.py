"""Helpers of train.py: config/mesh checks, the batch, data, optimizer and steps, checkpoints, metrics.

  flags       gin-syntax and dotted-path overrides onto the ConfigDict, the scripts' start,
              train.py's flag parsing (a bad flag or config in one line)
  mesh        config.mesh sizes, the device mesh, simulated CPU devices
  validation  up-front checks of the config (and of each stage), profile_steps, the model's
              LlamaConfig made of config.model, model.attention="auto" resolved
  hf_init     init.hf_dir: the model fields and tokenizer of a Hugging Face checkpoint
  stages      config.stages: progressive context extension, one stage after another; each
              stage's train step, schedule and batch shapes (build_stage)
  errors      ConfigError, UsageError, EXIT_USAGE (imported by all of the above)
  batch       the batch's fields, dtypes and sharding (from the rules table), defined once
  data        synthetic kv-retrieval task and packed local text, Grain pipeline, layouts
  step        AdamW + warmup/cosine + clipping, pure train/eval steps, jit with shardings, and
              build_train_step: the one builder of the train step and its (abstract) state
  checkpoint  Orbax CheckpointManager: train state + data iterator state, any-mesh restore;
              resume or initialise, and the save that never writes a diverged state
  loading     a run's trained model (or a Hugging Face one) for generate.py and evaluate.py;
              the run's saved config.json
  distributed jax.distributed start-up, the watchdog that ends survivors of a dead process,
              the stop request (SIGTERM/SIGINT, preemption) every process agrees on
  supervisor  the parent process of each process of a multi-process train.py (process 0's
              death), importing no JAX
  metrics     tokens/s, MFU with attention FLOPs, the one-step-behind step metrics and
              divergence check, TensorBoard + JSONL + console, profiling, the eval
  compile_only --compile_only: the target devices or TPU slice, each stage's compiled step

The config modules import one way: ``flags`` -> ``mesh``; ``validation`` -> ``mesh``,
``stages`` (and ``data`` inside its data checks; ``stages.build_stage`` imports
``validation`` and ``step`` inside); every one -> ``errors``; ``hf_init`` imports
none of them. Only the config modules (ml_collections; gin when used) and ``data`` (Grain)
need more than JAX, Flax, Optax, einops; ``batch`` and ``step`` import without them (the
benchmarks run them on accelerator images).
"""
