"""All-gather context parallelism: every device gathers the whole K/V and attends its queries.

K, V (and the key segment ids) are gathered over the sequence axis with
``all_gather``; the backward gathers them again and ``psum_scatter`` s the
float32 dK/dV home (MaxText's ``context`` axis, TransformerEngine's
``cp_comm_type="all_gather"``). Memory linear in the *global* length (the
whole K/V and, in the backward, its float32 gradients on every device).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from ring_jax import kernels
from ring_jax import layouts
from ring_jax import validation
from ring_jax.hop import HopKernel
from ring_jax.ring import with_sinks
from ring_jax.strategies import global_arrays
from ring_jax.strategies.local import (LocalConfig, check_self_attention, heads_last,
                                      local_attention)
from ring_jax.strategies.options import AttentionOptions


def all_gather_attention(query, key, value, *, axis_name, is_causal: bool = False,
                         segment_ids=None, scale: float | None = None, local_window_size=None,
                         layout: str = "contiguous", block_q: int | None = None,
                         block_kv: int | None = None, precision=None,
                         hop_kernel: str | HopKernel = "auto", return_lse: bool = False,
                         sinks=None, logits_soft_cap: float | None = None):
  """Exact attention over a sequence sharded along ``axis_name``, by all-gathering the keys
  and values: each device attends its local queries to the whole sequence. Call inside
  ``jax.shard_map`` on the local shards.

  Same arguments and result as :func:`ring_jax.ring_attention` (``return_lse``, ``sinks``
  ``[N]`` of this device's query heads applied once to the result, ``logits_soft_cap``): local
  ``[B, T, N, H]`` queries and ``[B, T, K, H]`` keys/values in ``layout`` order
  over ``axis_name``. K, V and the key segment ids are gathered over the axis
  (``[B, n*T, ...]``); the local queries attend to them blockwise, block pairs
  that the causal mask, window or documents hide are skipped (from the
  tokens' global positions, as in the ring). The backward gathers K/V again
  and reduce-scatters (``psum_scatter``) their float32 gradients; only local
  arrays are kept between the passes. ``block_q``/``block_kv`` must divide
  the local length.
  """
  options = AttentionOptions.from_keywords(locals()).with_attention_layout(segment_ids)
  return _local(query, key, value, segment_ids, axis_name=axis_name, options=options,
                sinks=sinks)


def _local(query, key, value, segment_ids, *, axis_name, options: AttentionOptions,
           sinks=None):
  n = check_self_attention(query, key, value, segment_ids, axis_name, options,
                           "all_gather_attention")
  sinks = validation.check_sinks(sinks, query.shape[2])
  b, t, nh, h = query.shape
  kh = key.shape[2]
  layout = options.layout
  validation.check_split(layout, n, n * t, what="query length")
  kernel = kernels.get_hop_kernel(options.hop_kernel)
  cfg = LocalConfig(spec=options.hop_spec(h, local_len=t, block_length=t, kernel=kernel,
                                          value_head_dim=value.shape[-1]),
                    kernel=kernel, gather_axis=axis_name,
                    return_lse=options.return_lse or sinks is not None)
  q_pos = layouts.local_positions(layout, n, t, jax.lax.axis_index(axis_name))
  kv_pos = jnp.asarray(layouts.layout_positions(layout, n, n * t), jnp.int32)
  if segment_ids is not None:
    segment_ids = jnp.asarray(segment_ids)
  q = query.reshape(b, t, kh, nh // kh, h)
  with jax.named_scope("all_gather_attention"):
    result = local_attention(cfg, q, key, value, q_pos, kv_pos, segment_ids, segment_ids)
  return with_sinks(heads_last(result, nh), sinks, options.return_lse)


def _check(where: global_arrays.Placement, length, kv_len, heads, kv_heads, options):
  del kv_len, heads, kv_heads  # any head count; equal lengths are the wrapper's check
  # a pair (outer, inner): one gather over both axes
  validation.check_split(options.layout, math.prod(where.seq_sizes), length)


STRATEGY = global_arrays.Strategy(name="all_gather", local=_local, check=_check,
                                  one_ring_over_pair=True)
