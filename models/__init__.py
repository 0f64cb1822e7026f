"""Flax NNX LLaMA on ring_jax: model, sharding rules, Hugging Face import.

``models.llama``: :class:`LlamaConfig`, :class:`Llama`, :func:`create_sharded_model`,
:func:`param_shardings`, :func:`weight_decay_mask`.
``models.sharding``: the logical-axis rules table.
``models.convert_hf``: local Hugging Face checkpoints -> :class:`Llama`.
"""

from models.llama import (Llama, LlamaConfig, create_sharded_model, param_shardings,
                          weight_decay_mask)

__all__ = ["Llama", "LlamaConfig", "create_sharded_model", "param_shardings",
           "weight_decay_mask"]
