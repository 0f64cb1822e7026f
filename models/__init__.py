"""Flax NNX LLaMA on ring_jax: model, attention backends, sharding rules, Hugging Face import.

``models.config``: :class:`LlamaConfig` and its validation (no Flax).
``models.rope``: the RoPE variants (default, linear, llama3, yarn, dynamic).
``models.layers``: RMSNorm, attention, MLP, the decoder layer (``Block``).
``models.llama``: :class:`Llama`, :func:`create_sharded_model`, :func:`weight_decay_mask`
(and the names of the three above, re-exported).
``models.attention``: the registry of attention backends (``ATTENTION_BACKENDS``).
``models.sharding``: the logical-axis rules table, ``MESH_AXES``, parameter shardings.
``models.pipeline``: the GPipe schedule of the layers over the ``pipeline`` mesh axis.
``models.convert_hf``: local Hugging Face checkpoints -> :class:`Llama`.

The names re-exported here load their module on first use (``LlamaConfig``
``models.config``, the others ``models.llama`` and so Flax), so ``models.attention``,
``models.sharding``, ``models.pipeline`` and ``models.config`` import without Flax.
"""

import importlib

__all__ = ["Llama", "LlamaConfig", "create_sharded_model", "weight_decay_mask"]


def __getattr__(name):
  if name in __all__:
    module = "models.config" if name == "LlamaConfig" else "models.llama"
    return getattr(importlib.import_module(module), name)
  raise AttributeError(f"module 'models' has no attribute {name!r}")
