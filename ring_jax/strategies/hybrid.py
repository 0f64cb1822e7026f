"""The hybrid (USP): Ulysses inside the inner axis, the ring across the outer one.

Fang & Zhao, "USP" (2024). ``axis_name=(ring_axis, ulysses_axis)``: the
Ulysses ``all_to_all`` over the inner axis gathers the sequence of the ring
position's shard for ``N/u`` heads, :func:`ring_jax.ring_attention` runs over
the ring axis on it, and a second ``all_to_all`` restores the sequence shards.
"""

from __future__ import annotations


import jax

from ring_jax import layouts
from ring_jax import validation
from ring_jax.hop import HopKernel
from ring_jax.ring import ring_attention
from ring_jax.strategies import global_arrays
from ring_jax.strategies.options import AttentionOptions
from ring_jax.strategies.ulysses import gather_heads, local_heads, to_sequence


def hybrid_attention(query, key, value, *, axis_name, is_causal: bool = False,
                     segment_ids=None, scale: float | None = None, local_window_size=None,
                     layout: str = "contiguous", block_q: int | None = None,
                     block_kv: int | None = None, precision=None,
                     hop_kernel: str | HopKernel = "auto", return_lse: bool = False,
                     overlap_dkv: bool | None = None, causal_routing: bool | None = None,
                     sinks=None, logits_soft_cap: float | None = None):
  """Exact attention over a sequence sharded over two mesh axes, Ulysses inside
  ``ulysses_axis`` and a ring across ``ring_axis`` (USP). Call inside ``jax.shard_map`` on
  the local shards, with ``axis_name=(ring_axis, ulysses_axis)``.

  The sequence is sharded over both axes
  (``P(..., (ring_axis, ulysses_axis), ...)``: device ``(i, j)`` holds piece
  ``j`` of ring position ``i``'s shard). The inputs are in ``layout`` order for
  a ring of size ``r = size(ring_axis)`` (:func:`ring_jax.to_layout` with
  ``ring_size=r``). An ``all_to_all`` over ``ulysses_axis`` gathers ring
  position ``i``'s shard for ``N/u`` heads, :func:`ring_jax.ring_attention`
  runs over ``ring_axis`` on it, and a second ``all_to_all`` restores the
  sequence shards. Head rules as in :func:`ring_jax.ulysses_attention`;
  ``block_q`` / ``block_kv`` must divide the ring's local length ``u*T``. ``sinks``:
  ``[N]`` of this device's query heads; the ring over ``ring_axis`` applies those of the
  ``N/u`` heads it attends once to its result. Other arguments (``return_lse``,
  ``logits_soft_cap``, ``overlap_dkv``, ``causal_routing``) as in
  :func:`ring_jax.ring_attention`.
  """
  options = AttentionOptions.from_keywords(locals()).with_attention_layout(segment_ids)
  return _local(query, key, value, segment_ids, axis_name=axis_name, options=options,
                sinks=sinks)


def _split_pair(axis_name):
  if not (isinstance(axis_name, (tuple, list)) and len(axis_name) == 2):
    raise ValueError(
        f"hybrid attention needs axis_name=(ring_axis, ulysses_axis), a pair of mesh axes, got "
        f"{axis_name!r}.")
  return tuple(axis_name)


def _local(query, key, value, segment_ids, *, axis_name, options: AttentionOptions,
           natural: bool = False, sinks=None):
  """``natural``: the shards are in natural order; the ring's shards are reordered into
  the layout (and back) with collectives over the ring axis after the Ulysses exchange."""
  ring_axis, uly_axis = _split_pair(axis_name)
  validation.check_qkv(query, key, value, is_causal=options.masked, segment_ids=segment_ids)
  validation.axis_size(ring_axis, "hybrid_attention")
  validation.axis_size(uly_axis, "hybrid_attention")
  sinks = validation.check_sinks(sinks, query.shape[2])
  q, k, v, seg = gather_heads(query, key, value, segment_ids, uly_axis)
  if natural:
    q, k, v, seg = layouts.shard_to_layout((q, k, v, seg), options.layout, ring_axis)
  result = ring_attention(q, k, v, axis_name=ring_axis, segment_ids=seg,
                          sinks=local_heads(sinks, uly_axis), **options.ring_kwargs())
  if natural:
    result = layouts.shard_from_layout(result, options.layout, ring_axis)
  return jax.tree.map(lambda x: to_sequence(x, uly_axis), result)


def _check(where: global_arrays.Placement, length, kv_len, heads, kv_heads, options):
  del kv_len  # equal lengths are the wrapper's check
  (r, u), uly_axis = where.seq_sizes, where.seq[1]
  validation.ulysses_repeat(heads, kv_heads, u, uly_axis)
  validation.check_split(options.layout, r, length, ulysses=u,
                         what="sequence length (over the ring axis)")


STRATEGY = global_arrays.Strategy(name="hybrid", local=_local, check=_check, two_axes=True,
                                  reorders_itself=True)
