"""Context-parallel baselines the ring is measured against: the shipped all-gather strategy.

All-gather context parallelism (what MaxText's ``context`` axis and
TransformerEngine's ``cp_comm_type="all_gather"`` default to) ships in the
library as :func:`ring_jax.all_gather_attention` (inside ``shard_map``) and
``ring_jax.attention_sharded(..., strategy="all_gather")`` (global arrays);
see :mod:`ring_jax.strategies`. This module keeps the benchmarks' names for
it and its model backend, so there is one implementation:

* :data:`allgather_attention` is :func:`ring_jax.all_gather_attention`;
* :func:`allgather_attention_sharded` runs it on global arrays;
* :func:`register_attention_backend` adds :func:`allgather_backend` to
  :data:`models.attention.ATTENTION_BACKENDS` as ``"allgather"``, so
  ``LlamaConfig(attention="allgather")`` runs the shipped model and train step
  with it (``benchmarks/train_throughput.py`` does).
"""

from __future__ import annotations

import ring_jax

#: All-gather attention on local shards inside ``jax.shard_map`` (the library's).
allgather_attention = ring_jax.all_gather_attention


def allgather_attention_sharded(query, key, value, *, mesh, seq_axis: str = "sequence",
                                is_causal: bool = False, segment_ids=None,
                                layout: str = "contiguous", inputs_in_layout: bool = False,
                                block_q=None, block_kv=None):
  """All-gather attention on global ``[B, L, N, H]`` arrays sharded over ``seq_axis`` only."""
  return ring_jax.attention_sharded(
      query, key, value, mesh=mesh, strategy="all_gather", seq_axis=seq_axis, batch_axis=None,
      head_axis=None, is_causal=is_causal, segment_ids=segment_ids, layout=layout,
      inputs_in_layout=inputs_in_layout, block_q=block_q, block_kv=block_kv)


def allgather_backend(cfg, q_BLNH, k_BLKH, v_BLKH, positions_BL, segment_ids_BL):
  """The all-gather strategy as a :mod:`models.attention` backend (same contract as ``"ring"``).

  Shards the sequence over the mesh axis the ``length`` rule names, batch and
  heads per the rules, as the ring backend does; without such an axis it
  falls back to the dense backend, as the ring does. Masks come from the
  layout's positions and the segment ids (documents are contiguous, so this
  equals causal masking by per-document ``positions_BL``).
  """
  from models import attention as attn_lib  # Local: ring_jax needs no models/.
  from models import sharding as shd

  mesh = shd.current_mesh()
  seq_axis = attn_lib.sequence_axis(mesh)
  if seq_axis is None:
    return attn_lib.dense(cfg, q_BLNH, k_BLKH, v_BLKH, positions_BL, segment_ids_BL)
  batch_axis, head_axis = attn_lib.sharded_axes(mesh, q_BLNH, k_BLKH)
  return ring_jax.attention_sharded(
      q_BLNH, k_BLKH, v_BLKH, mesh=mesh, strategy="all_gather", seq_axis=seq_axis,
      batch_axis=batch_axis, head_axis=head_axis, is_causal=True, segment_ids=segment_ids_BL,
      layout=cfg.layout, inputs_in_layout=True, block_q=cfg.block_q, block_kv=cfg.block_kv)


ALLGATHER = "allgather"


def register_attention_backend() -> str:
  """Registers :func:`allgather_backend` in :data:`models.attention.ATTENTION_BACKENDS`.

  Idempotent; returns the backend's name, ``"allgather"``.
  """
  from models import attention as attn_lib

  attn_lib.register_attention(ALLGATHER, allgather_backend)
  return ALLGATHER
