"""The hop-kernel seam: one hop of ring attention (:class:`HopKernel`), and how hops merge.

A kernel computes the local queries against the K/V shard held at one hop and returns that
hop's own normalised output and log-sum-exp; the ring merges hops in float32 with
:func:`merge` (ring-flash-attention's per-hop merge). Kernels are chosen by name
(:mod:`ring_jax.kernels`) or passed as any object implementing :class:`HopKernel`.

Shapes (local; ``N = K * G`` query heads in ``K`` groups of ``G``, query head ``n`` reads
K/V head ``n // G``):

  q       ``[B, T, K, G, H]``  input dtype, NOT scaled (``spec.scale`` applies inside)
  k, v    ``[B, S, K, H]``     the shard held at this hop, input dtype
  out_h   ``[B, T, K, G, H]``  float32; 0 in rows with no visible key
  lse_h   ``[B, T, K, G]``     float32 natural-log lse of the visible scaled scores; ``-inf``
                               in rows with no visible key
  backward (:class:`HopResiduals`, :class:`HopGrads`): the whole ring's final ``out`` and
  ``lse`` (``+inf`` in rows that saw no key, :func:`lse_for_backward`), ``do``, ``dlse``
  (or None), and float32 accumulators ``dq`` ``[B, T, K, G, H]``, ``dk``/``dv``
  ``[B, S, K, H]`` to which the hop's gradients are added.

Backward: FlashAttention-2 (Dao 2023, Alg. 2) with the global ``out``/``lse``:
``P = exp(s - lse)`` at visible pairs, ``dP = dO V^T``, ``dS = P * (dP - delta)`` with
``delta = rowsum(dO * out) - dlse``, ``dQ = scale dS K``, ``dK = scale dS^T Q``,
``dV = P^T dO``. With ``spec.logits_soft_cap = c`` the scores are ``s = c tanh(r / c)`` of
the scaled raw scores ``r``, and ``dS`` is multiplied by ``ds/dr = 1 - tanh(r / c)^2``.

Visibility of (query ``i``, key ``j``) (:class:`HopMasks`): equal nonzero segment ids (when
given; 0 is padding), ``kv_pos[j] <= q_pos[i]`` when causal, ``q_pos[i] - left <= kv_pos[j]
<= q_pos[i] + right`` with a window. Positions increase within every shard, so a query's
causal/window-visible keys are one contiguous index range. Which block pairs to compute is
decided once per hop in :func:`ring_jax.masking.block_table` (``HopMasks.blocks``); kernels
loop over it (:func:`fold_blocks`) and hold at most per-block metadata, never ``[T, S]``.

Non-finite inputs: masked scores are ``-inf`` (never a finite floor), a row whose max is
``-inf`` subtracts 0, only ``l == 0`` means "no visible key", and values at masked pairs
never reach an output (``0 * NaN`` is NaN), so a NaN reaches exactly the rows that see it;
kernels pay for that guard only on hops whose V holds a non-finite value
(``HopMasks.v_finite``).

References: Dao, FlashAttention-2 (2023); Liu et al., Ring Attention (2023) Alg. 1; Zhu,
ring-flash-attention (2024).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar, NamedTuple, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
from jax._src import config as jax_config

from ring_jax import masking


class HopMasks(NamedTuple):
  """What decides which scores of this hop are visible (built once per hop by :meth:`build`).

  q_positions / kv_positions: int32 ``[T]`` / ``[S]`` global positions, increasing.
  q_segment_ids / kv_segment_ids: integer ``[B, T]`` / ``[B, S]`` or None (0 = padding).
  blocks: the hop's :class:`ring_jax.masking.BlockTable`, which block pairs to compute and
    which need the elementwise mask; kernels decide nothing else about blocks.
  v_finite: bool scalar (this hop's V shard is all finite, computed where the shard is born)
    or None (the kernel checks V itself, :func:`v_is_finite`).
  """
  q_positions: jax.Array
  kv_positions: jax.Array
  q_segment_ids: jax.Array | None = None
  kv_segment_ids: jax.Array | None = None
  blocks: masking.BlockTable | None = None
  v_finite: jax.Array | None = None

  @classmethod
  def build(cls, spec: "HopSpec", q_positions, kv_positions, q_segment_ids=None,
            kv_segment_ids=None, v_finite=None, may_mask: bool = True) -> "HopMasks":
    """Masks with their block table (:func:`ring_jax.masking.block_table`) for ``spec``;
    ``may_mask=False``: every pair in the table's ranges is known to be visible everywhere
    (:func:`ring_jax.masking.partly_masked`)."""
    blocks = masking.block_table(q_positions, kv_positions, q_segment_ids, kv_segment_ids,
                                 spec.block_q, spec.block_kv, spec.is_causal, spec.window,
                                 may_mask)
    return cls(q_positions, kv_positions, q_segment_ids, kv_segment_ids, blocks, v_finite)

  def table(self) -> masking.BlockTable:
    """``blocks``, or a ``ValueError`` naming the fix when the masks were built without it."""
    if self.blocks is None:
      raise ValueError("HopMasks.blocks is None: build hop masks with "
                       "ring_jax.HopMasks.build(spec, q_positions, kv_positions, ...).")
    return self.blocks


class HopResiduals(NamedTuple):
  """What a hop's backward reads besides q, k, v: the whole ring's final ``out``, ``lse``
  (:func:`lse_for_backward`), the output cotangent ``do`` and the lse cotangent ``dlse`` or
  None (shapes in the module docstring)."""
  out: jax.Array
  lse: jax.Array
  do: jax.Array
  dlse: jax.Array | None = None


class HopGrads(NamedTuple):
  """float32 gradient accumulators: dq ``[B, T, K, G, H]``, dk / dv ``[B, S, K, H]``."""
  dq: jax.Array
  dk: jax.Array
  dv: jax.Array


@dataclasses.dataclass(frozen=True)
class HopSpec:
  """Static parameters of one hop's computation, fixed at trace time: score scale, causal
  mask, window, block sizes, matmul precision, ``logits_soft_cap`` (``c``: scores
  become ``c * tanh(s / c)`` before masking and softmax, Gemma 2's attention; None: off)
  and ``value_head_dim`` (V's head size ``Hv`` when it differs from Q/K's ``H``, as in MLA;
  None: equal; kernels that cannot refuse it in ``check``)."""
  scale: float
  is_causal: bool
  window: tuple[int, int] | None
  block_q: int
  block_kv: int
  precision: jax.lax.Precision | None = None
  logits_soft_cap: float | None = None
  value_head_dim: int | None = None  # V's head size where it differs from Q/K's (MLA)


@runtime_checkable
class HopKernel(Protocol):
  """Interface of a per-hop attention kernel: the local queries against the K/V shard held
  at one hop (``forward``: that hop's output and lse; ``backward``: its gradients). Pass an
  instance as ``hop_kernel=``; shapes in the :mod:`ring_jax.hop` docstring. Instances must
  be hashable (static configuration of the ring's ``custom_vjp``; frozen dataclasses are);
  ``name`` (a ``ClassVar``) is the kernel's key in :data:`ring_jax.kernels.HOP_KERNELS`.
  Optional: ``takes_block(block: int) -> bool``, the block sizes the kernel takes whatever
  length they tile (the TPU kernels: multiples of 128); default blocks are chosen among them
  (:func:`ring_jax.ring.default_block`), so ``check`` refuses only a caller's explicit block.
  Optional: ``prepare_backward(q, k, v, seg, spec) -> (kernel, k, v)``, what the backward's
  hops read of the K/V shard (``seg``: its segment ids or None), made once where the pass
  starts (it travels so), and the kernel that reads it so (:func:`prepare_backward`).
  """

  name: ClassVar[str]

  def check(self, q_shape, kv_shape, dtype, spec: HopSpec) -> None:
    """Raises ``ValueError`` (saying what to change) if this kernel cannot run these shapes
    (``[B, T, K, G, H]``, ``[B, S, K, H]``), dtype and spec; called once at trace time."""

  def forward(self, q, k, v, masks: HopMasks, spec: HopSpec) -> tuple[jax.Array, jax.Array]:
    """This hop's ``(out_h [B,T,K,G,H] f32, lse_h [B,T,K,G] f32)``."""

  def backward(self, q, k, v, masks: HopMasks, spec: HopSpec, res: HopResiduals,
               acc: HopGrads) -> HopGrads:
    """The float32 accumulators ``acc`` plus this hop's gradients, given the ring's final
    ``out`` and ``lse`` in ``res``; ``acc`` is not read afterwards (may be updated in place)."""


def prepare_backward(kernel, q, parts, spec):
  """``(kernel, parts)`` the backward's hops run: where ``kernel`` has ``prepare_backward``
  (:class:`HopKernel`) and one ``(k, v, seg)`` part is the whole shard, that part as it
  prepares it and the kernel it returns; else both as they are. The preparation is
  elementwise, so it commutes with the ring's transfers: made once, it equals making it at
  every hop."""
  prepare = getattr(kernel, "prepare_backward", None)
  if prepare is None or len(parts) != 1:
    return kernel, parts
  (k, v, seg), = parts
  kernel, k, v = prepare(q, k, v, seg, spec)
  return kernel, [(k, v, seg)]


def takes_block(kernel, block: int) -> bool:
  """Whether ``kernel`` takes blocks of ``block`` tokens (dividing the length aside): its
  optional ``takes_block`` method (see :class:`HopKernel`), else True."""
  takes = getattr(kernel, "takes_block", None)
  return True if takes is None else bool(takes(block))


def v_is_finite(masks: HopMasks, v):
  """bool scalar: this hop's V holds no NaN/inf (``masks.v_finite``, else one pass over ``v``)."""
  return jnp.isfinite(v).all() if masks.v_finite is None else masks.v_finite


def fold_blocks(row, step, carry, may_mask: bool = True, num_blocks: int | None = None,
                mask_all: bool = False):
  """Folds ``step(j, carry, masked)`` over the blocks ``lo <= j < hi`` of one range row.

  ``row`` = ``(lo, full_lo, full_hi, hi)`` of a :class:`ring_jax.masking.BlockTable`
  (scalars, or an array/ref of 4): ``masked=False`` on ``[full_lo, full_hi)``, ``True`` on
  the rest, each body compiled with its masking static (the masked blocks on both sides of
  the full run in one loop, then the full run). ``may_mask=False``: one unmasked loop over
  ``[lo, hi)``; ``mask_all``: one masked loop over ``[lo, hi)``.

  ``num_blocks`` (static, optional): how many blocks the row ranges over. With one block
  the row's three cases (skipped, unmasked, masked) are a ``lax.switch``: XLA would turn a
  loop of at most one trip into an unconditional body behind a select, computing the pair
  even when it is out of range (docs/performance.md, "Block sizes").
  """
  lo, full_lo, full_hi, hi = (row[i] for i in range(4))
  if not may_mask or mask_all:
    body = functools.partial(step, masked=may_mask)
    if num_blocks == 1:
      return jax.lax.cond(lo < hi, lambda c: body(0, c), lambda c: c, carry)
    return jax.lax.fori_loop(lo, hi, body, carry)
  if num_blocks == 1:
    case = jnp.where(lo >= hi, 0, jnp.where(full_lo < full_hi, 1, 2))
    return jax.lax.switch(case, [lambda c: c, lambda c: step(0, c, masked=False),
                                 lambda c: step(0, c, masked=True)], carry)
  before = full_lo - lo  # masked blocks [lo, full_lo), then [full_hi, hi), in one loop

  def masked_step(i, c):
    return step(jnp.where(i < before, lo + i, full_hi + (i - before)), c, masked=True)

  carry = jax.lax.fori_loop(0, before + (hi - full_hi), masked_step, carry)
  return jax.lax.fori_loop(full_lo, full_hi, functools.partial(step, masked=False), carry)


def add_sinks(out, lse, sinks):
  """``(out', lse')``: attention with one more logit per query head that has no value
  (attention sinks, as in GPT-OSS), from the attention ``(out, lse)`` over the keys:
  ``lse' = logaddexp(lse, z_n)``, ``out' = out * exp(lse - lse')`` (a row with no visible key
  stays 0, its ``lse'`` is ``z_n``). ``out`` ``[..., N, H]`` (any float dtype, kept),
  ``lse`` ``[..., N]`` float32 (``-inf``: no key), ``sinks`` ``[N]``. Applied once to the
  whole ring's result, so the sink is in the global softmax denominator once; its
  gradient, by autodiff, is ``dz_n = -sum over rows of exp(z_n - lse') * (rowsum(dO * out')
  - dlse')``, summed over every device's rows."""
  z = sinks.astype(jnp.float32)
  total = jnp.logaddexp(lse, z)
  weight = jnp.exp(lse - total)
  return (out.astype(jnp.float32) * weight[..., None]).astype(out.dtype), total


def empty_result(q, value_head_dim: int | None = None):
  """``(out, lse)`` of attention over no key: zeros ``[B, T, K, G, Hv]`` (``Hv`` V's head
  size, default Q's) and ``-inf`` (float32)."""
  b, t, k, g, h = q.shape
  hv = h if value_head_dim is None else value_head_dim
  return (jnp.zeros((b, t, k, g, hv), jnp.float32),
          jnp.full((b, t, k, g), -jnp.inf, jnp.float32))


def zero_grads(q, k, v) -> HopGrads:
  """float32 zero gradient accumulators shaped like ``q``, ``k``, ``v`` (varying over the
  manual mesh axes of all three), for :meth:`HopKernel.backward`."""
  return HopGrads(*(varying_like(jnp.zeros(x.shape, jnp.float32), q, k, v) for x in (q, k, v)))


def merge(out, lse, out_h, lse_h):
  """Merges a hop's ``(out_h, lse_h)`` into the running ``(out, lse)`` (all float32):
  ``lse' = logaddexp(lse, lse_h)``, ``out' = out e^(lse - lse') + out_h e^(lse_h - lse')``;
  a row empty in both stays ``(0, -inf)``, a NaN in either input stays NaN."""
  with jax.named_scope("merge"):
    new = jnp.logaddexp(lse, lse_h)
    ref = jnp.where(new == -jnp.inf, 0.0, new)
    w, w_h = jnp.exp(lse - ref), jnp.exp(lse_h - ref)
    return out * w[..., None] + out_h * w_h[..., None], new


def lse_for_backward(lse):
  """The final lse as kernels' backward take it: ``+inf`` (not ``-inf``) for rows that saw
  no key, so ``p = exp(s - lse)`` is 0 there rather than ``exp(s + inf)``."""
  return jnp.where(lse == -jnp.inf, jnp.inf, lse)


def backward_delta(out, do, dlse):
  """float32 ``rowsum(dO * out) - dlse`` ``[B, T, K, G]`` (``dlse`` may be None)."""
  delta = jnp.sum(do.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
  return delta if dlse is None else delta - dlse.astype(jnp.float32)


def varying_axes(x) -> frozenset:
  """Manual mesh axes ``x`` varies over inside ``shard_map`` (empty outside)."""
  return frozenset(jax.typeof(x).manual_axis_type.varying)


def varying_like(x, *refs):
  """``x`` (e.g. fresh ``jnp.zeros``) marked as varying over the manual mesh axes of ``refs``,
  as ``shard_map(check_vma=True)`` needs of loop carries that start from constants."""
  want = frozenset().union(*(varying_axes(r) for r in refs))
  missing = tuple(sorted(want - varying_axes(x), key=str))
  if not missing:
    return x
  return jax.lax.pcast(x, missing, to="varying")


# ----------------------------------------------------------------------------
# For kernels that take per-query key ranges (splash's element mask, tokamax's k_start/k_end)
# ----------------------------------------------------------------------------

def key_ranges(q_positions, kv_positions, is_causal: bool, window):
  """int32 ``([T], [T])``: per query, the key indices ``[start, end)`` of this hop that the
  causal mask and the window ``(left, right)`` let it see (segment ids aside); exact since
  key positions increase within a shard."""
  q = q_positions.astype(jnp.int32)
  kv = kv_positions.astype(jnp.int32)
  s = kv.shape[0]
  start = jnp.zeros_like(q)
  end = jnp.full_like(q, s)
  if window is not None:
    left, right = window
    start = jnp.searchsorted(kv, q - left, side="left").astype(jnp.int32)
    end = jnp.searchsorted(kv, q + right, side="right").astype(jnp.int32)
  if is_causal:
    end = jnp.minimum(end, jnp.searchsorted(kv, q, side="right").astype(jnp.int32))
  return start, jnp.maximum(end, start)


def query_ranges(q_positions, kv_positions, is_causal: bool, window):
  """int32 ``([S], [S])``: per key, the query indices ``[start, end)`` of this hop whose
  causal mask and window ``(left, right)`` let them see it (segment ids aside); exact since
  query positions increase within a shard (the transpose of :func:`key_ranges`)."""
  q = q_positions.astype(jnp.int32)
  kv = kv_positions.astype(jnp.int32)
  start = jnp.zeros_like(kv)
  end = jnp.full_like(kv, q.shape[0])
  if window is not None:
    left, right = window
    start = jnp.searchsorted(q, kv - right, side="left").astype(jnp.int32)
    end = jnp.searchsorted(q, kv + left, side="right").astype(jnp.int32)
  if is_causal:
    start = jnp.maximum(start, jnp.searchsorted(q, kv, side="left").astype(jnp.int32))
  return start, jnp.maximum(end, start)


def flagged_in_ranges(flags, start, end):
  """bool ``[B, Y, ...]``: per ``y``, whether ``flags[b, x, ...]`` holds for some ``x`` in
  ``[start[y], end[y])``. ``flags`` bool ``[B, X, ...]``; ``start``, ``end`` int32 ``[Y]``,
  one of them may be None: ranges open at that side (``start`` 0, ``end`` ``X``).

  Which outputs see a flagged input through a visible pair (``y`` a query and ``x`` a key,
  or the reverse; ranges from :func:`key_ranges` / :func:`query_ranges`) without any
  ``[Y, X]`` array. A range open at one side needs only the first (or last) flagged index,
  one reduction over ``x`` (the causal ranges without a window); a range bounded at both
  sides, one reverse running minimum of the next flagged index, read once per ``y``.
  """
  b, nx = flags.shape[:2]
  index = jnp.int16 if nx < jnp.iinfo(jnp.int16).max else jnp.int32
  here = jnp.arange(nx, dtype=index).reshape(1, nx, *(1,) * (flags.ndim - 2))
  per_y = lambda x: x.reshape(1, -1, *(1,) * (flags.ndim - 2))  # noqa: E731
  if start is None:  # [0, end): the first flagged index lies before end
    first = jnp.where(flags, here, jnp.asarray(nx, index)).min(axis=1, keepdims=True)
    return first.astype(jnp.int32) < per_y(end)
  if end is None:  # [start, X): the last flagged index lies at or after start
    last = jnp.where(flags, here, jnp.asarray(-1, index)).max(axis=1, keepdims=True)
    return last.astype(jnp.int32) >= per_y(start)
  nxt = jnp.where(flags, here, jnp.asarray(nx, index))
  nxt = jnp.concatenate([nxt, jnp.full((b, 1, *flags.shape[2:]), nx, index)], axis=1)
  nxt = jax.lax.cummin(nxt, axis=1, reverse=True)                              # [B, X + 1, ...]
  at = jnp.broadcast_to(start, (b, start.shape[-1])).reshape(b, -1, *(1,) * (flags.ndim - 2))
  found = jnp.take_along_axis(nxt, jnp.minimum(at, nx), axis=1,
                              mode="promise_in_bounds")                        # [B, Y, ...]
  return found.astype(jnp.int32) < per_y(end)


def segment_key_ranges(q_segment_ids, kv_segment_ids):
  """int32 ``(start [B, T], end [B, T])`` and a bool scalar ``exact``: per query, the key
  indices ``[first, last + 1)`` of the keys with its segment id (empty for padding and for
  an id absent from the shard); ``exact``: every such range holds only keys of that id
  (each id one run of the key shard, as for documents packed in position order; not
  always for repeated ids or the ``document`` layout: kernels then take the XLA path).
  One sort of the ``S`` key ids per batch row.
  """
  s = kv_segment_ids.shape[-1]

  def one_row(q_ids, kv_ids):
    order = jnp.argsort(kv_ids, stable=True)       # equal ids keep index order
    ids = kv_ids[order]
    lo = jnp.searchsorted(ids, q_ids, side="left")
    hi = jnp.searchsorted(ids, q_ids, side="right")
    first = order[jnp.clip(lo, 0, s - 1)].astype(jnp.int32)
    last = order[jnp.clip(hi - 1, 0, s - 1)].astype(jnp.int32)
    present = (hi > lo) & (q_ids != 0)
    exact = jnp.all(~present | (last + 1 - first == hi - lo))
    return jnp.where(present, first, 0), jnp.where(present, last + 1, 0), exact

  start, end, exact = jax.vmap(one_row)(q_segment_ids, kv_segment_ids)
  return start, end, jnp.all(exact)


def call_unchecked_vma(fn, *args):
  """``fn(*args)`` with shard_map's varying-axes check off, its outputs then marked varying
  over every manual axis an input varies over: ``pallas_call`` out-shapes (splash, tokamax,
  jax 0.10-0.12) carry no ``manual_axis_type``, which ``shard_map(check_vma=True)`` refuses.
  """
  leaves = jax.tree.leaves(args)
  with jax_config._check_vma(False):
    out = fn(*args)
  return jax.tree.map(lambda x: varying_like(x, *leaves), out)
