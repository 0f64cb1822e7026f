"""Sequence-parallel attention strategies behind one call: ring, all-gather, Ulysses, hybrid.

Each strategy computes exact attention over a sequence sharded along a mesh
axis; they differ in what travels and what is resident on a device. One
module each:

* ``"ring"`` (:mod:`ring_jax.strategies.ring`, :func:`ring_jax.ring_attention`):
  K/V shards travel around the axis with ``ppermute``, overlapped with the
  hop's compute; memory linear in the *local* length. With ``seq_axis=(outer,
  inner)``: the two-level ring (:mod:`ring_jax.two_level`).
* ``"all_gather"`` (:mod:`ring_jax.strategies.all_gather`): every device
  gathers the whole K/V and attends its local queries to it; memory linear in
  the *global* length.
* ``"ulysses"`` (:mod:`ring_jax.strategies.ulysses`): ``all_to_all`` from
  sequence-sharded to head-sharded, full-sequence attention on ``N/u`` heads,
  ``all_to_all`` back.
* ``"hybrid"`` (:mod:`ring_jax.strategies.hybrid`): ``axis_name=(ring_axis,
  ulysses_axis)``: Ulysses inside the inner axis, the ring across the outer one.

All-gather and Ulysses attend with the ring's per-hop kernel over the whole
K/V in one call (:mod:`ring_jax.strategies.local`: the kernel skips hidden
block pairs from the tokens' global positions), the hybrid runs the ring
itself, so causal / window / document skipping, layouts and GQA behave the
same in every strategy. On global arrays one wrapper runs them all
(:mod:`ring_jax.strategies.global_arrays`); :func:`attention_sharded` picks
the strategy (or the one :func:`ring_jax.plan` predicts fastest).

Layouts inside ``shard_map``: as for :func:`ring_jax.ring_attention`, the
local shards are in ``layout`` order over the sequence axis (for the hybrid:
layout order for the *ring* axis's size, split further over the Ulysses axis
in device order).
"""

from __future__ import annotations

from ring_jax import planning
from ring_jax.hop import HopKernel
from ring_jax.strategies import all_gather, global_arrays, hybrid, ring, ulysses
from ring_jax.strategies.all_gather import all_gather_attention
from ring_jax.strategies.global_arrays import AttentionAxes, attention_axes
from ring_jax.strategies.hybrid import hybrid_attention
from ring_jax.strategies.options import AttentionOptions
from ring_jax.strategies.ulysses import ulysses_attention

#: The strategies :func:`attention_sharded` accepts; "auto" asks :func:`ring_jax.plan`.
STRATEGIES = planning.STRATEGIES

#: strategy name -> how the global-array wrapper runs it.
TABLE: dict[str, global_arrays.Strategy] = {
    m.STRATEGY.name: m.STRATEGY for m in (ring, all_gather, ulysses, hybrid)}
assert tuple(TABLE) == STRATEGIES


def attention_sharded(query, key, value, *, mesh=None, strategy: str = "auto",
                      seq_axis="sequence", batch_axis: str | None = "data",
                      head_axis: str | None = "tensor", is_causal: bool = False,
                      segment_ids=None, scale: float | None = None, local_window_size=None,
                      layout: str = "contiguous", inputs_in_layout: bool = False,
                      block_q: int | None = None, block_kv: int | None = None, precision=None,
                      hop_kernel: str | HopKernel = "auto", causal_routing: bool | None = None,
                      return_lse: bool = False, sinks=None,
                      logits_soft_cap: float | None = None):
  """Sequence-parallel attention on global ``[B, L, N, H]`` arrays, by any strategy.

  Args:
    strategy: ``"ring"`` (:func:`ring_jax.ring_attention_sharded`),
      ``"all_gather"``, ``"ulysses"``, ``"hybrid"`` (``seq_axis`` a pair
      ``(ring_axis, ulysses_axis)``; ``"ring"`` with a pair ``(outer, inner)`` is the
      two-level ring, :func:`ring_jax.two_level_ring_attention`), or ``"auto"``: the strategy
      :func:`ring_jax.plan` predicts fastest among those that fit in memory,
      for these shapes, this mesh and its device kind (``seq_axis`` a single
      axis: ring, all_gather or ulysses; a pair: the two-level ring, all_gather
      over both axes, or hybrid).
    seq_axis: mesh axis the sequence is sharded over, or for ``"hybrid"`` a
      pair of mesh axes ``(ring_axis, ulysses_axis)``; the sequence is then
      sharded over both, ring-major. For ``"ring"`` a pair ``(outer, inner)``
      (slow links, fast links) shards it over both outer-major, laid out as
      one ring of their product's size (``inputs_in_layout=True`` means
      :func:`ring_jax.to_layout` with that ``ring_size``).
    causal_routing: the ring's (``"ring"`` and ``"hybrid"``; see
      :func:`ring_jax.ring_attention`); the other strategies move no K/V around a ring.
    return_lse: also return the float32 log-sum-exp ``[B, L, N]``, sharded and ordered
      like the output, differentiable (every strategy; with ``sinks`` it includes them).
    sinks: ``[N]`` attention sinks (one float32 logit per query head, differentiable), in
      every strategy: each applies them once to its whole-sequence result
      (:func:`ring_jax.hop.add_sinks`; Ulysses and the hybrid to the ``N/u`` heads a
      device attends), so ``"auto"`` picks among all of them as without sinks.
    Everything else (``logits_soft_cap`` in every strategy): as in
    :func:`ring_jax.ring_attention_sharded`. Layouts
    balance causal work across the sequence devices for ring and all_gather;
    for the hybrid they apply to the ring axis (``inputs_in_layout=True``
    means :func:`ring_jax.to_layout` with ``ring_size`` = the ring axis's
    size); Ulysses attends over the whole sequence on every device, so
    natural-order inputs stay in natural order for it (no reordering at all).

  Returns:
    ``[B, L, N, H]`` in ``query.dtype`` (in layout order iff ``inputs_in_layout``), or
    ``(out, lse)`` with ``return_lse``.
  """
  options = AttentionOptions.from_keywords(locals())
  mesh = global_arrays.current_mesh(mesh)
  if strategy == "auto":
    strategy = _planned(mesh, global_arrays.seq_axes(mesh, seq_axis), batch_axis, head_axis,
                        query, key, value, options)
  if strategy not in TABLE:
    raise ValueError(f"strategy must be one of {STRATEGIES + ('auto',)}, got {strategy!r}.")
  return global_arrays.run(TABLE[strategy], query, key, value, segment_ids, mesh=mesh,
                           seq_axis=seq_axis, batch_axis=batch_axis, head_axis=head_axis,
                           inputs_in_layout=inputs_in_layout, options=options, sinks=sinks)


def _planned(mesh, seq, batch_axis, head_axis, query, key, value, options) -> str:
  """The strategy :func:`ring_jax.plan` picks for this call (a pair of axes: the two-level
  ring, all-gather over both or the hybrid; the flat ring over both is only compared, it
  is never faster than the two-level one in the model). A natural-order length a strategy
  does not split is costed at the length it pads to (:attr:`ring_jax.Estimate.padding`,
  :func:`ring_jax.strategies.global_arrays.padded_length`)."""
  b, length, n, h = query.shape
  size = lambda axis: mesh.shape[axis] if axis in mesh.axis_names else 1
  return planning.plan(
      batch=b, seq_len=length, heads=n, kv_heads=key.shape[2], head_dim=h,
      value_head_dim=value.shape[-1], dtype=query.dtype,
      is_causal=options.is_causal, local_window_size=options.local_window_size,
      layout=options.layout,
      sequence=tuple(mesh.shape[a] for a in seq) if len(seq) > 1 else mesh.shape[seq[0]],
      strategies=("ring", "all_gather", "hybrid") if len(seq) > 1 else
      ("ring", "all_gather", "ulysses"),
      tensor=size(head_axis), data=size(batch_axis),
      device=global_arrays.device_kind(mesh)).strategy


__all__ = ["STRATEGIES", "TABLE", "AttentionAxes", "AttentionOptions", "all_gather_attention",
           "attention_axes", "attention_sharded", "hybrid_attention", "ulysses_attention"]
