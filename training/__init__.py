"""Helpers of train.py, one concern per module (each module's docstring says which). ``batch``
and ``step`` import only JAX, Flax, Optax and einops (the benchmarks run them on accelerator
images); the config modules add ml_collections, ``data`` Grain.
"""
