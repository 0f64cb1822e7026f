"""ring_jax: blockwise ring attention (sequence/context parallelism) in pure JAX.

Public API:
  ring_attention          inside ``jax.shard_map``, on local sequence shards.
  ring_attention_sharded  on global arrays: builds the shard_map for you.
  two_level_ring_attention
                          inside ``jax.shard_map`` over a pair of axes (outer, inner): an
                          inner ring over the fast axis, the outer transfers issued a whole
                          inner ring ahead (ring_jax.two_level; on global arrays:
                          attention_sharded(strategy="ring", seq_axis=(outer, inner))).
  attention_sharded       on global arrays, by any strategy: "ring", "all_gather",
                          "ulysses", "hybrid" (Ulysses x ring), or "auto" (plan()'s pick).
  all_gather_attention / ulysses_attention / hybrid_attention
                          the other strategies inside ``jax.shard_map`` (ring_jax.strategies:
                          one module per strategy, one wrapper for global arrays).
  attention_axes / AttentionAxes
                          the mesh axes attention shards batch, heads and key/value heads
                          over (a single key/value head, MQA, is replicated).
  plan / Plan             cost model: per-device compute, bytes moved, overlap and memory
                          of each strategy, and the choice with its reasons
                          (ring_jax.planning; device figures in ring_jax.hardware).
  reference_attention     dense single-device oracle with the same arguments.
  blockwise_ffn           chunked, rematerialised position-wise feed-forward.
  flax_attention_fn       ring attention as a Flax attention module's attention_fn=.
  to_layout / from_layout / layout_positions
                          contiguous, zigzag and striped layouts (ring_jax.layouts).
  document_layout / DocumentLayout
                          the "document" layout of packed rows: causal work balanced
                          per document, a per-row permutation built on the host
                          (ring_jax.documents).
  shard_to_layout / shard_from_layout
                          the same reorder inside shard_map, with collectives.
  schedule / Schedule     the block pairs each device computes at each hop
                          (ring_jax.scheduling; the module is not called
                          ``schedule`` so it cannot shadow this function).
  HopKernel / HopMasks / HopSpec
                          the per-hop kernel seam (ring_jax.hop).
  HOP_KERNELS / get_hop_kernel / XlaHopKernel
                          hop kernels by name (ring_jax.kernels).
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
