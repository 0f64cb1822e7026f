"""``ring_attention_sharded``: ring attention on global arrays over a mesh.

The global-array work (axes, checks, reordering, Explicit meshes, the
``shard_map``) is :mod:`ring_jax.strategies.global_arrays`'s, shared with the
other strategies; the ring itself is :func:`ring_jax.ring_attention`.
"""

from __future__ import annotations

from ring_jax.strategies import global_arrays
from ring_jax.strategies import ring as ring_strategy
from ring_jax.strategies.options import AttentionOptions


def ring_attention_sharded(query, key, value, *, mesh=None, seq_axis="sequence",
                           batch_axis: str | None = "data", head_axis: str | None = "tensor",
                           is_causal: bool = False, segment_ids=None, scale: float | None = None,
                           local_window_size=None, layout: str = "contiguous",
                           inputs_in_layout: bool = False, block_q: int | None = None,
                           block_kv: int | None = None, precision=None, hop_kernel="auto",
                           return_lse: bool = False, overlap_dkv: bool | None = None,
                           causal_routing: bool | None = None, sinks=None,
                           logits_soft_cap: float | None = None):
  """Ring attention on global ``[B, L, N, H]`` arrays: builds the ``shard_map`` for you.

  The sequence axis is sharded over ``seq_axis`` (the ring; a pair ``(outer,
  inner)`` of mesh axes runs the two-level ring, :func:`ring_jax.two_level_ring_attention`,
  with the layout over both axes' product); the batch over
  ``batch_axis`` and the heads over ``head_axis`` at the same time (tensor x
  sequence parallelism). ``batch_axis="data"`` and ``head_axis="tensor"`` are
  defaults that mean "not sharded" when the mesh has no such axis; any other
  name must be a mesh axis. Key/value heads are sharded over ``head_axis``
  too, or replicated when there is a single one (MQA).

  Args:
    query, key, value, segment_ids, is_causal, scale, local_window_size,
    block_q, block_kv, precision, hop_kernel, overlap_dkv, causal_routing,
    logits_soft_cap: as in
      :func:`ring_jax.ring_attention`, but global (natural token order unless
      ``inputs_in_layout``). A ``hop_kernel`` name is resolved for the
      platform of the mesh's devices.
    mesh: a ``jax.sharding.Mesh`` (Auto or Explicit axes) or ``AbstractMesh``;
      default: the mesh set with ``jax.set_mesh``.
    layout: sequence layout across the ring.
    inputs_in_layout: the inputs are already in ``layout`` order (e.g. a model
      that reorders once per batch with :func:`ring_jax.to_layout`); the output
      is then left in layout order too. Otherwise inputs are reordered on the
      way in and the output restored to natural order.
    return_lse: also return the float32 log-sum-exp ``[B, L, N]`` (as
      :func:`ring_jax.ring_attention`), sharded and ordered like the output.
    sinks: ``[N]`` attention sinks (global: one per query head), as in
      :func:`ring_jax.ring_attention`: split with the query heads, each device's applied
      once to its ring's result (:func:`ring_jax.hop.add_sinks`), differentiable.

  Returns:
    ``[B, L, N, H]`` in ``query.dtype``, or ``(out, lse)`` with ``return_lse``.
  """
  options = AttentionOptions.from_keywords(locals())
  return global_arrays.run(ring_strategy.STRATEGY, query, key, value, segment_ids, mesh=mesh,
                           seq_axis=seq_axis, batch_axis=batch_axis, head_axis=head_axis,
                           inputs_in_layout=inputs_in_layout, options=options, sinks=sinks)
