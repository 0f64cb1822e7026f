"""Flax NNX LLaMA on ring_jax: model, attention backends, sharding rules, Hugging Face import.

``models.llama``: :class:`LlamaConfig`, :class:`Llama`, :func:`create_sharded_model`,
:func:`weight_decay_mask`.
``models.attention``: the registry of attention backends (``ATTENTION_BACKENDS``).
``models.sharding``: the logical-axis rules table, ``MESH_AXES``, parameter shardings.
``models.pipeline``: the GPipe schedule of the layers over the ``pipeline`` mesh axis.
``models.convert_hf``: local Hugging Face checkpoints -> :class:`Llama`.

The names re-exported here load ``models.llama`` (and so Flax) on first use,
so ``models.attention``, ``models.sharding`` and ``models.pipeline`` import without Flax.
"""

import importlib

__all__ = ["Llama", "LlamaConfig", "create_sharded_model", "weight_decay_mask"]


def __getattr__(name):
  if name in __all__:
    return getattr(importlib.import_module("models.llama"), name)
  raise AttributeError(f"module 'models' has no attribute {name!r}")
