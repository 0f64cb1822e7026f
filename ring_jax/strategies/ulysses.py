"""DeepSpeed-Ulysses: ``all_to_all`` from sequence shards to head shards and back.

Jacobs et al., "DeepSpeed Ulysses" (2023): one ``all_to_all`` turns the
local ``[B, T, N, H]`` shards into the whole sequence for ``N/u`` heads
(``u`` = the axis size), every device attends over the whole sequence, and a
second ``all_to_all`` returns the output to sequence shards. Query heads must
be divisible by ``u``; key/value heads divisible by ``u`` or dividing it, in
which case they are repeated up to ``u`` heads first (as USP does; Fang &
Zhao, "USP", 2024). The exchange is also the hybrid's inner half.
"""

from __future__ import annotations

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


def to_sequence(x, axis_name):
  """``[B, u*T, N/u, H]`` head-sharded -> ``[B, T, N, H]`` sequence-sharded (all_to_all)."""
  with jax.named_scope("ulysses_to_sequence"):
    return jax.lax.all_to_all(x, axis_name, split_axis=1, concat_axis=2, tiled=True)


def local_heads(x_N, axis_name):
  """This device's part of a per-query-head ``[N]`` array (sinks) after :func:`gather_heads`:
  the ``N/u`` heads it attends, ``[j*N/u, (j+1)*N/u)`` on device ``j`` of ``axis_name``."""
  if x_N is None:
    return None
  per = x_N.shape[0] // jax.lax.axis_size(axis_name)
  return jax.lax.dynamic_slice_in_dim(x_N, jax.lax.axis_index(axis_name) * per, per)


def gather_heads(query, key, value, segment_ids, axis_name):
  """The Ulysses exchange: local sequence / all heads -> whole (group) sequence / N/u heads."""
  u = jax.lax.axis_size(axis_name)
  repeat = validation.ulysses_repeat(query.shape[2], key.shape[2], u, axis_name)
  if repeat > 1:
    key, value = (jnp.repeat(x, repeat, axis=2) for x in (key, value))
  with jax.named_scope("ulysses_to_heads"):
    to_heads = lambda x: jax.lax.all_to_all(x, axis_name, split_axis=2, concat_axis=1,
                                            tiled=True)
    q, k, v = (to_heads(x) for x in (query, key, value))
    seg = None
    if segment_ids is not None:
      seg = jax.lax.all_gather(jnp.asarray(segment_ids), axis_name, axis=1, tiled=True)
  return q, k, v, seg


def ulysses_attention(query, key, value, *, axis_name, is_causal: bool = False,
                      segment_ids=None, scale: float | None = None, local_window_size=None,
                      layout: str = "contiguous", block_q: int | None = None,
                      block_kv: int | None = None, precision=None,
                      hop_kernel: str | HopKernel = "auto", return_lse: bool = False,
                      sinks=None, logits_soft_cap: float | None = None):
  """Exact attention over a sequence sharded along ``axis_name``, by DeepSpeed-Ulysses:
  all-to-alls trade the sequence shards for head shards, so each device attends over the
  whole sequence for a share of the heads. Call inside ``jax.shard_map`` on the local
  shards.

  Same arguments and result as :func:`ring_jax.ring_attention` (``return_lse``,
  ``logits_soft_cap``; ``sinks`` ``[N]`` of this device's query heads, each device applying
  those of the ``N/u`` heads it attends once to its whole-sequence result). One
  ``all_to_all`` turns the local ``[B, T, N, H]`` shards into the whole
  sequence for ``N/u`` heads (``u`` = size of ``axis_name``), each device
  attends over the whole sequence (block pairs skipped from the tokens'
  positions in ``layout`` order), and a second ``all_to_all`` returns the
  output to sequence shards; the backward is the same exchange reversed.
  Query heads must be divisible by ``u``; key/value heads divisible by ``u``
  or dividing it (repeated up to ``u``: MQA/GQA as in USP). ``block_q`` and
  ``block_kv`` must divide the whole length ``u*T``.
  """
  options = AttentionOptions.from_keywords(locals()).with_attention_layout(segment_ids)
  return _local(query, key, value, segment_ids, axis_name=axis_name, options=options,
                sinks=sinks)


def _local(query, key, value, segment_ids, *, axis_name, options: AttentionOptions,
           sinks=None):
  u = check_self_attention(query, key, value, segment_ids, axis_name, options,
                           "ulysses_attention")
  sinks = validation.check_sinks(sinks, query.shape[2])
  b, t, _, h = query.shape
  layout = options.layout
  validation.check_split(layout, u, u * t, what="query length")
  kernel = kernels.get_hop_kernel(options.hop_kernel)
  cfg = LocalConfig(spec=options.hop_spec(h, local_len=t, block_length=u * t, kernel=kernel,
                                          value_head_dim=value.shape[-1]),
                    kernel=kernel, return_lse=options.return_lse or sinks is not None)
  q, k, v, seg = gather_heads(query, key, value, segment_ids, axis_name)
  pos = jnp.asarray(layouts.layout_positions(layout, u, u * t), jnp.int32)
  nq, nk = q.shape[2], k.shape[2]
  with jax.named_scope("ulysses_attention"):
    result = local_attention(cfg, q.reshape(b, u * t, nk, nq // nk, h), k, v, pos, pos, seg,
                             seg)
  result = with_sinks(heads_last(result, nq), local_heads(sinks, axis_name),
                      options.return_lse)
  return jax.tree.map(lambda x: to_sequence(x, axis_name), result)


def _check(where: global_arrays.Placement, length, kv_len, heads, kv_heads, options):
  del kv_len  # equal lengths are the wrapper's check
  validation.ulysses_repeat(heads, kv_heads, where.seq_sizes[0], where.seq[0])
  validation.check_split(options.layout, where.seq_sizes[0], length)


STRATEGY = global_arrays.Strategy(name="ulysses", local=_local, check=_check,
                                  whole_sequence=True)
