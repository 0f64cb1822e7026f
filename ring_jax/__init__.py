"""ring_jax: blockwise ring attention (sequence/context parallelism) in pure JAX.

Entry points: ``ring_attention_sharded`` (global arrays), ``ring_attention`` (inside
``jax.shard_map``), ``attention_sharded`` (any strategy: ring, all-gather, Ulysses, hybrid,
two-level, or ``plan()``'s pick). Every public name is in ``__all__``; docs/api.md lists each
with its signature and what it computes (generated from this package by scripts/api_doc.py).
Map (docs/design.md, "Where things live"): the ring's loop and its custom backward in
ring.py (two_level.py for two mesh axes), the kernel seam in hop.py (HopKernel; kernels/),
the K/V routes in routing.py, the masks and block table in masking.py.
``ring_jax.testing`` (not imported here; docs/conformance.md) is the conformance kit: any
context-parallel attention against a float64 oracle on fake CPU devices.
"""

from ring_jax.documents import DocumentLayout, document_layout
from ring_jax.ffn import blockwise_ffn
from ring_jax.flax_attention import flax_attention_fn
from ring_jax.layouts import (LAYOUTS, from_layout, layout_positions, local_positions,
                              shard_from_layout, shard_to_layout, to_layout)
from ring_jax.scheduling import Schedule, schedule
from ring_jax.hop import HopKernel, HopMasks, HopSpec
from ring_jax.kernels import HOP_KERNELS, XlaHopKernel, get_hop_kernel
from ring_jax.reference import reference_attention
from ring_jax.ring import ring_attention
from ring_jax.sharded import ring_attention_sharded
from ring_jax.two_level import two_level_ring_attention
from ring_jax.planning import Plan, plan
from ring_jax.strategies import (STRATEGIES, AttentionAxes, all_gather_attention,
                                 attention_axes, attention_sharded, hybrid_attention,
                                 ulysses_attention)

__all__ = [
    "HOP_KERNELS",
    "Plan",
    "STRATEGIES",
    "AttentionAxes",
    "DocumentLayout",
    "all_gather_attention",
    "attention_axes",
    "attention_sharded",
    "hybrid_attention",
    "plan",
    "ulysses_attention",
    "HopKernel",
    "HopMasks",
    "HopSpec",
    "XlaHopKernel",
    "flax_attention_fn",
    "get_hop_kernel",
    "ring_attention",
    "ring_attention_sharded",
    "LAYOUTS",
    "Schedule",
    "blockwise_ffn",
    "document_layout",
    "from_layout",
    "layout_positions",
    "local_positions",
    "reference_attention",
    "schedule",
    "shard_from_layout",
    "shard_to_layout",
    "to_layout",
    "two_level_ring_attention",
]

__version__ = "0.1.0"
