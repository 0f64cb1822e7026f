"""Helpers of train.py, one concern per module: ``flags`` (gin and dotted overrides, the
scripts' start), ``mesh``, ``validation`` (config checks, ``"auto"`` decisions, the model's
``LlamaConfig``), ``hf_init``, ``stages``, ``errors``, ``batch`` (the batch's fields and
sharding), ``data`` + ``sources`` + ``tokenizer`` + ``buckets`` (Grain pipelines), ``step``
(optimizer and the one train-step builder), ``checkpoint`` (Orbax), ``loading`` (a run's
model for generate.py/evaluate.py), ``distributed`` + ``supervisor`` (multi-process start,
stop and lost peers), ``metrics`` (MFU, writers, divergence, profile, eval), ``compile_only``.

``batch`` and ``step`` import only JAX, Flax, Optax and einops (the benchmarks run them on
accelerator images); the config modules add ml_collections, ``data`` Grain.
"""
