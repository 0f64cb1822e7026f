"""The hop on JAX's splash attention (TPU): ``hop_kernel="splash"``.

Splash attention (``jax.experimental.pallas.ops.tpu.splash_attention``) is the TPU flash
kernel JAX maintains; MaxText's TPU ring attention calls it per hop the same way. This
module drives its private forward / dQ / dK-dV kernels (``_splash_attention_forward``,
``_splash_attention_bwd_dq``, ``_splash_attention_bwd_dkv``; their signatures are the same
at jax 0.10.0, 0.11.0 and 0.12.0.1, and both CI legs run this kernel's conformance tests)
under the hop-kernel seam (:mod:`ring_jax.hop`):

* **The hop's mask, block-sparse, built per hop from traced positions.** Splash's
  ``MaskInfo`` is arrays, not Python: ``block_mask`` ``[1, nq, nk]`` (0 empty, 1 partly
  visible, 2 visible everywhere) and ``data_next`` (the block each grid step fetches)
  come from the hop's :class:`ring_jax.masking.BlockTable`, so splash skips exactly
  the blocks the other kernels skip, whatever the hop's offset (causal diagonal, zigzag
  chunks, striped, windows). No dense ``[heads, T, S]`` mask exists: inside a block the
  element mask comes from splash's ``mask_function`` path, which compares each key's
  index with a per-query value (``q_sequence``); a hop known to hold no partly masked
  block pair (``BlockTable.may_mask`` False) runs the kernels without it. Positions
  increase within every shard the ring makes, so a query's visible keys at a hop are one
  index range ``[start, end)`` (:func:`ring_jax.hop.key_ranges`); ``q_sequence`` carries
  ``end`` (causal) or
  ``start * 2**16 + end`` (a window: needs S < 2**15, :meth:`SplashHopKernel.check`).
* **Segment ids** are splash's own ``SegmentIds(q, kv)`` (equality); our 0 = padding
  rule becomes two pad ids that match nothing (:func:`splash_segment_ids`).
* **GQA** as splash does it (query head ``n`` reads K/V head ``n // G``), no repeat.
* **V's own head size** (MLA: ``Hv != H``): splash's kernels size their output, dO and dV
  blocks by V's head size, so K and V go in as they are.
* **lse and empty rows.** Splash masks with a finite value (``mask_value``, -0.7 x
  float32 max), so a row with no visible key in this hop comes back with an lse near
  ``mask_value`` (or ``-inf`` and a NaN output when no block of it ran); those rows
  become ``(0, -inf)``, the seam's convention. Its lse is natural-log.
* **Backward** with the ring's final ``out``/``lse``: ``delta = rowsum(dO * out) -
  dlse`` is ours (:func:`ring_jax.hop.backward_delta`, so the lse cotangent counts)
  and goes to splash's dQ and dK/dV kernels as their ``di``. Splash takes queries
  pre-scaled (no scale argument): ``q * scale`` in, ``dQ * scale`` out.
* **Non-finite inputs.** ``0 * NaN`` inside splash's matmuls would leak a NaN held at a
  masked key into rows that do not see it. Without segment ids this is handled around the
  kernels, with no branch: splash reads V with its non-finite entries as 0 and the outputs
  that read one through a visible pair are set to NaN afterwards
  (:func:`ring_jax.hop.flagged_in_ranges` over the per-query key ranges: one pass over V,
  no ``[T, S]`` array); the forward's scores take Q and K as they are (masked scores are
  selected away); the backward reads Q and K with NaN as 0 and infinities as
  ``+-2**100`` (a ``-inf`` score keeps ``p = 0``), a NaN lse row as ``+inf`` (it adds
  nothing but its NaN ``delta``, which reaches dQ and dK as in the XLA kernel), and sets
  dV to NaN for the keys such a row sees (:func:`ring_jax.hop.query_ranges`); where the
  ring compiles every backward hop apart it cleans K and V once per pass instead
  (:meth:`SplashHopKernel.prepare_backward`). Given the
  forward's own ``out``/``lse`` the NaN/inf pattern is the XLA kernel's. With segment ids
  a hop whose V (forward) or Q/K/V (backward) holds a non-finite value runs the XLA kernel
  instead (``lax.cond``; :attr:`ring_jax.hop.HopMasks.v_finite` makes the forward test
  free): handled around the kernels, that program kept fewer ring transfers in flight on
  the TPU compiler (docs/performance.md, "Splash hop memory on the TPU compiler").
* Outputs come back in the input dtype (bf16 for bf16 inputs); they are merged and
  accumulated in float32.

Block sizes are the ring's ``block_q`` / ``block_kv`` (multiples of 128), each cut to its
largest divisor up to :data:`MAX_TILE` for splash's kernels (their VMEM). Off a TPU the
kernels run in Pallas interpret mode (slow; for tests). Not yet run on a TPU: see the
kernels table in docs/performance.md ("Hop kernels: which runs where").
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask_info as smi

from ring_jax import hop
from ring_jax import masking
from ring_jax import topology
from ring_jax.kernels.xla import XlaHopKernel

NUM_LANES = 128
MASK_VALUE = sk.DEFAULT_MASK_VALUE
# The largest splash tile (block_q, block_kv of its kernels): the largest that fits the scoped
# VMEM of every TPU generation compiled for (docs/performance.md, "Splash tiles and VMEM").
MAX_TILE = 1024
# A window's q_sequence packs (start, end) into one int32: end in the low 16 bits.
_RANGE_BITS = 16
_MAX_WINDOW_KV = (1 << (_RANGE_BITS - 1)) - 1
_I32_MIN = int(np.iinfo(np.int32).min)
# What an infinite Q or K entry becomes for splash's backward (:func:`_huge_part`): 2**100,
# finite in bfloat16 and float32, its square not.
_HUGE = 2.0 ** 100


def _over_rows(one_row):
  """``one_row`` (splash on one batch row: head-major ``[heads, len, ...]`` operands, then
  ``SegmentIds`` or None, then any more) over the batch.

  Without segment ids the rows fold into the head axis (``B * N`` query heads reading
  ``B * K`` K/V heads keeps the GQA map ``n // G``): one kernel call. With them (one
  ``SegmentIds`` per call) a ``lax.map`` over rows; not ``vmap``, whose extra grid axis
  Pallas's TPU interpreter (the tests, inside shard_map) does not take.
  """
  def run(q, k, v, seg, *rest):
    if seg is None:
      b = q.shape[0]
      fold = lambda x: x.reshape(b * x.shape[1], *x.shape[2:])
      out = one_row(fold(q), fold(k), fold(v), None, *map(fold, rest))
      return jax.tree.map(lambda x: x.reshape(b, -1, *x.shape[1:]), out)
    return jax.lax.map(lambda a: one_row(*a), (q, k, v, seg, *rest))
  return run


def _keys_before(end, k):
  """Splash ``mask_function``: key index ``k`` visible iff ``k < end`` (causal)."""
  return k < end


def _keys_within(code, k):
  """Splash ``mask_function``: ``code = start * 2**16 + end``; visible iff start <= k < end."""
  return (k >= (code >> _RANGE_BITS)) & (k < (code & ((1 << _RANGE_BITS) - 1)))


def splash_segment_ids(q_seg, kv_seg):
  """int32 ``(q [B, T], kv [B, S])`` for splash (which compares ids for equality only):
  our ids (any integer dtype; 0 = padding) with query padding and key padding mapped
  to two ids that no document uses and that differ, so padding sees nothing."""
  qs, ks = masking.segment_ids_int32(q_seg, kv_seg)  # 0 stays 0; equality kept
  low = jnp.minimum(jnp.minimum(qs.min(), ks.min()), 0)

  def below(codes):  # pads just below every id: low - 1 and low - 2
    q_codes, kv_codes = codes
    return (jnp.where(q_codes == 0, low - 1, q_codes),
            jnp.where(kv_codes == 0, low - 2, kv_codes))

  def ranked(codes):  # ids reach down to int32's minimum: rank-code them first (>= 1)
    q_codes, kv_codes = codes
    both = jnp.concatenate([q_codes.reshape(-1), kv_codes.reshape(-1)])
    uniq = jnp.unique(both, size=both.size, fill_value=both.max())
    rank = lambda x: jnp.searchsorted(uniq, x).astype(jnp.int32) + 1
    return (jnp.where(q_codes == 0, -1, rank(q_codes)),
            jnp.where(kv_codes == 0, -2, rank(kv_codes)))

  return jax.lax.cond(low > _I32_MIN + 1, below, ranked, (qs, ks))


def _finite_part(x):
  """``x`` with its non-finite entries 0."""
  return jnp.where(jnp.isfinite(x), x, jnp.zeros((), x.dtype))


def _huge_part(x):
  """``x`` with NaN as 0 and ``+-inf`` as ``+-`` :data:`_HUGE` (finite, so ``0 * x`` is 0 in
  splash's matmuls, while a score that was ``-inf`` stays far below any row's lse)."""
  huge = jnp.where(x > 0, jnp.asarray(_HUGE, x.dtype), jnp.asarray(-_HUGE, x.dtype))
  return jnp.where(jnp.isfinite(x), x, jnp.where(jnp.isnan(x), jnp.zeros((), x.dtype), huge))


@dataclasses.dataclass(frozen=True)
class SplashHopKernel:
  """The hop on JAX's splash attention kernels (module docstring), ``hop_kernel="splash"``.

  Attributes:
    interpret: run splash in Pallas interpret mode. ``None`` (default): exactly when
      the platform compiled for (:func:`ring_jax.topology.target_platform`) is not a TPU
      (tests on CPU).
    kv_prepared: the backward's K/V arrive as :meth:`prepare_backward` makes them (the ring
      sets it for its backward; K/V read as they are).
  """
  name: ClassVar[str] = "splash"
  interpret: bool | None = None
  kv_prepared: bool = False

  def takes_block(self, block: int) -> bool:
    """Multiples of 128 (the TPU lane width)."""
    return block > 0 and block % NUM_LANES == 0

  def check(self, q_shape, kv_shape, dtype, spec) -> None:
    """Raises ``ValueError`` naming the fix when splash cannot run this hop: q
    ``[B, T, K, G, H]`` against k/v ``[B, S, K, H]``, blocks that are multiples of 128
    dividing the shard, float32 or bfloat16, and a window's key shard below 2**15."""
    if len(q_shape) != 5 or len(kv_shape) != 4:
      raise ValueError(f"splash: expected q [B, T, K, G, H] and k/v [B, S, K, H], got "
                       f"{tuple(q_shape)} and {tuple(kv_shape)}.")
    _, t, k, _, h = q_shape
    _, s, kk, hh = kv_shape
    if (kk, hh) != (k, h):
      raise ValueError(f"splash: k/v {tuple(kv_shape)} do not match q {tuple(q_shape)} "
                       "(kv heads and head dim must agree).")
    for what_block, blk, length, what in (("block_q", spec.block_q, t, "T (local query length)"),
                                          ("block_kv", spec.block_kv, s, "S (local key length)")):
      if not self.takes_block(blk):
        raise ValueError(
            f"{what_block}={blk}: splash needs multiples of {NUM_LANES}; pass "
            f"{what_block}={max(NUM_LANES, -(-max(blk, 1) // NUM_LANES) * NUM_LANES)} or "
            "hop_kernel='xla'.")
      if length % blk:
        raise ValueError(
            f"{what_block}={blk} does not divide {what}={length}; pick a {what_block} that "
            f"divides it (a multiple of {NUM_LANES}) or hop_kernel='xla'.")
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
      raise ValueError(f"splash: dtype {jnp.dtype(dtype)} is not supported (float32 or "
                       "bfloat16); cast the inputs or use hop_kernel='xla'.")
    if spec.window is not None and s > _MAX_WINDOW_KV:
      raise ValueError(
          f"splash: a local window with a key shard of S={s} > {_MAX_WINDOW_KV} tokens does "
          "not fit its per-query key range in one int32; use more sequence devices (shorter "
          "shards) or hop_kernel='xla'.")

  def prepare_backward(self, q, k, v, seg, spec):
    """``(kernel, k, v)``: without segment ids, K with NaN as 0 and infinities as ``+-``
    :data:`_HUGE` and V with non-finite values as 0, as the backward reads them (module
    docstring), made once per pass (:func:`ring_jax.hop.prepare_backward`), and this
    kernel with ``kv_prepared``; with segment ids (the backward's guard tests the K/V it
    holds) all as they are."""
    del q, spec
    if seg is not None:
      return self, k, v
    return dataclasses.replace(self, kv_prepared=True), _huge_part(k), _finite_part(v)

  def _interpret(self) -> bool:
    if self.interpret is None:
      return topology.target_platform() != "tpu"
    return bool(self.interpret)

  # ---- the hop's mask as splash's MaskInfo ----------------------------------------------

  def _mask(self, masks: hop.HopMasks, spec: hop.HopSpec, t: int, s: int):
    """``(fwd/dq MaskInfo, dK/dV MaskInfo, mask_function)`` of this hop."""
    nq, nk = t // spec.block_q, s // spec.block_kv
    rows = masking.merge_rows(masks.table().q_ranges)  # [nq, 4], over the batch rows
    lo, full_lo, full_hi, hi = (rows[:, i:i + 1] for i in range(4))
    kv_block = jnp.arange(nk, dtype=jnp.int32)[None, :]
    q_block = jnp.arange(nq, dtype=jnp.int32)[:, None]
    some = (kv_block >= lo) & (kv_block < hi)
    everywhere = (kv_block >= full_lo) & (kv_block < full_hi)
    block_mask = jnp.where(everywhere, 2, jnp.where(some, 1, 0)).astype(jnp.int8)[None]
    # Grid steps of empty blocks fetch block 0 (as splash's own dynamic masks do).
    index_type = jnp.int16 if max(nq, nk) <= np.iinfo(np.int16).max else jnp.int32
    kv_next = jnp.where(block_mask[0] > 0, kv_block, 0).astype(index_type)[None]
    q_next = jnp.where(block_mask[0] > 0, q_block, 0).astype(index_type)[None]

    mask_function, q_sequence = None, None
    if masks.table().may_mask and (spec.is_causal or spec.window is not None):
      start, end = hop.key_ranges(masks.q_positions, masks.kv_positions, spec.is_causal,
                              spec.window)
      if spec.window is None:
        mask_function, q_sequence = _keys_before, end
      else:
        mask_function, q_sequence = _keys_within, (start << _RANGE_BITS) | end
    info = lambda data_next: smi.MaskInfo(data_next=data_next, mask_next=None,
                                          block_mask=block_mask, partial_mask_blocks=None,
                                          q_sequence=q_sequence)
    return info(kv_next), info(q_next), mask_function

  def _operands(self, q, k, v, masks, spec, finite_v: bool = False, finite_q: bool = False,
                finite_k: bool = False):
    """Splash's head-major operands: q ``[B, N, T, H]`` (scaled), k/v ``[B, K, S, H]`` and
    ``SegmentIds`` per batch row (or None). ``finite_v``: V's non-finite entries read as 0
    (:func:`_finite_part`); ``finite_q`` / ``finite_k``: Q's / K's NaN as 0 and infinities as
    ``+-`` :data:`_HUGE` (:func:`_huge_part`)."""
    b, t, kh, g, h = q.shape
    q_scaled = (q * spec.scale).astype(q.dtype)
    if finite_q:
      q_scaled = _huge_part(q_scaled)
    if finite_k:
      k = _huge_part(k)
    if finite_v:
      v = _finite_part(v)
    q_bnth = jnp.transpose(q_scaled.reshape(b, t, kh * g, h), (0, 2, 1, 3))
    k_bksh, v_bksh = (jnp.transpose(x, (0, 2, 1, 3)) for x in (k, v))
    seg = None
    if masks.q_segment_ids is not None:
      seg = sk.SegmentIds(*splash_segment_ids(masks.q_segment_ids, masks.kv_segment_ids))
    return q_bnth, k_bksh, v_bksh, seg

  def _interpret_mode(self, *arrays):
    """The ``interpret`` argument of a splash call on ``arrays``: False on a TPU. Off a TPU,
    outside ``shard_map`` (or with ``check_vma=False``), the generic interpreter (``True``,
    fast to run); where some operand varies over a manual mesh axis
    (``shard_map(check_vma=True)``) the mask metadata varies while grid indices do not, a mix
    the generic interpreter rejects ("dynamic_slice requires varying manual axes to match"),
    so the TPU interpreter (``pltpu.InterpretParams()``, slower) runs the kernels."""
    if not self._interpret():
      return False
    if frozenset().union(*(hop.varying_axes(a) for a in arrays)):
      return pltpu.InterpretParams()
    return True

  def _tiled(self, masks: hop.HopMasks, spec: hop.HopSpec):
    """``(masks, spec)`` at splash's tiles: the ring's blocks, each cut to its largest
    divisor that is a multiple of 128 and at most :data:`MAX_TILE` (the block table rebuilt
    at those tiles), so any block the ring takes fits the kernels' VMEM."""
    tq, tk = (max(d for d in range(NUM_LANES, min(b, MAX_TILE) + 1, NUM_LANES) if b % d == 0)
              for b in (spec.block_q, spec.block_kv))
    if (tq, tk) == (spec.block_q, spec.block_kv):
      return masks, spec
    spec = dataclasses.replace(spec, block_q=tq, block_kv=tk)
    return hop.HopMasks.build(spec, masks.q_positions, masks.kv_positions, masks.q_segment_ids,
                              masks.kv_segment_ids, v_finite=masks.v_finite), spec

  # ---- forward ----------------------------------------------------------------------------

  def forward(self, q, k, v, masks, spec):
    """``(out_h [B,T,K,G,Hv] f32, lse_h [B,T,K,G] f32)`` of this hop (``Hv``: V's head
    size, which splash takes apart from Q/K's)."""
    if masks.q_segment_ids is None:
      return self._forward(q, k, v, masks, spec, repair=True)
    fused = lambda q, k, v: self._forward(q, k, v, masks, spec, repair=False)  # noqa: E731
    guarded = lambda q, k, v: XlaHopKernel().forward(q, k, v, masks, spec)  # noqa: E731
    return jax.lax.cond(hop.v_is_finite(masks, v), fused, guarded, q, k, v)

  def _forward(self, q, k, v, masks, spec, repair: bool):
    """The forward on splash; ``repair``: V's non-finite values read as 0 and put back as NaN
    on the outputs that see them (module docstring), else V must be finite."""
    tmasks, tspec = self._tiled(masks, spec)
    b, t, kh, g, h = q.shape
    info, _, mask_function = self._mask(tmasks, tspec, t, k.shape[1])
    q_bnth, k_bksh, v_bksh, seg = self._operands(q, k, v, tmasks, tspec, finite_v=repair)
    sizes = sk.BlockSizes(block_q=tspec.block_q, block_kv=tspec.block_kv)
    interpret = self._interpret_mode(q_bnth, k_bksh, v_bksh, *jax.tree.leaves(info),
                                     *jax.tree.leaves(seg))

    def one_row(q1, k1, v1, seg1):
      return sk._splash_attention_forward(
          info, q1, k1, v1, seg1, None, MASK_VALUE, False, sizes, None, True,
          mask_function, tspec.logits_soft_cap, interpret)

    out, (lse,) = hop.call_unchecked_vma(_over_rows(one_row), q_bnth, k_bksh, v_bksh, seg)
    out = jnp.transpose(out.astype(jnp.float32), (0, 2, 1, 3)).reshape(*q.shape[:-1],
                                                                        v.shape[-1])
    lse = jnp.transpose(lse.astype(jnp.float32), (0, 2, 1)).reshape(q.shape[:-1])
    if repair:  # NaN where a visible pair reads a non-finite value of V
      start, end = hop.key_ranges(masks.q_positions, masks.kv_positions, spec.is_causal,
                                  spec.window)
      reads_bad = hop.flagged_in_ranges(  # [B, T, K, H]; without a window start is 0
          ~jnp.isfinite(v), None if spec.window is None else start, end)
      out = jnp.where(reads_bad[:, :, :, None, :], jnp.nan, out)
    # Rows that saw no key here: splash's finite mask value (or no block at all).
    empty = lse < 0.5 * MASK_VALUE
    return jnp.where(empty[..., None], 0.0, out), jnp.where(empty, -jnp.inf, lse)

  # ---- backward ---------------------------------------------------------------------------

  def backward(self, q, k, v, masks, spec, res: hop.HopResiduals,
               acc: hop.HopGrads) -> hop.HopGrads:
    """``acc`` plus this hop's (dq, dk, dv), from splash's dQ and dK/dV kernels."""
    if masks.q_segment_ids is None:
      return self._backward(q, k, v, masks, spec, res, acc, repair=True)
    fused = lambda q, k, v, res, acc: self._backward(  # noqa: E731
        q, k, v, masks, spec, res, acc, repair=False)
    guarded = lambda q, k, v, res, acc: XlaHopKernel().backward(  # noqa: E731
        q, k, v, masks, spec, res, acc)
    finite = hop.v_is_finite(masks, v) & jnp.isfinite(q).all() & jnp.isfinite(k).all()
    return jax.lax.cond(finite, fused, guarded, q, k, v, res, acc)

  def _backward(self, q, k, v, masks, spec, res, acc, repair: bool):
    """The backward on splash; ``repair``: non-finite inputs handled around the kernels
    (module docstring), else Q, K and V must be finite."""
    tmasks, tspec = self._tiled(masks, spec)
    b, t, kh, g, h = q.shape
    dq_info, dkv_info, mask_function = self._mask(tmasks, tspec, t, k.shape[1])
    clean_kv = repair and not self.kv_prepared
    q_bnth, k_bksh, v_bksh, seg = self._operands(q, k, v, tmasks, tspec, finite_v=clean_kv,
                                                 finite_q=repair, finite_k=clean_kv)
    heads_first = lambda x: jnp.transpose(x.reshape(b, t, kh * g, *x.shape[4:]),  # noqa: E731
                                          (0, 2, 1, *range(3, x.ndim - 1)))
    lse_nan = jnp.isnan(res.lse)
    lse = res.lse.astype(jnp.float32)
    if repair:  # a NaN lse row adds nothing (p = 0) but its NaN delta; dV gets NaN below
      lse = jnp.where(lse_nan, jnp.inf, lse)
    lse_bnt = heads_first(lse)
    do_bnth = heads_first(res.do.astype(q.dtype))
    di_bnt = heads_first(hop.backward_delta(res.out, res.do, res.dlse))
    interpret = self._interpret_mode(q_bnth, k_bksh, v_bksh, lse_bnt, do_bnth,
                                     *jax.tree.leaves(dq_info), *jax.tree.leaves(seg))
    layout = sk.QKVLayout.HEAD_DIM_MINOR
    bq, bk, cap = tspec.block_q, tspec.block_kv, tspec.logits_soft_cap

    def one_row(q1, k1, v1, seg1, lse1, do1, di1):
      dq1 = sk._splash_attention_bwd_dq(
          q1, k1, v1, seg1, None, lse1, do1, di1, bq=bq, bkv=bk, is_mqa=False,
          mask_info=dq_info, mask_value=MASK_VALUE, attn_logits_soft_cap=cap,
          q_layout=layout, k_layout=layout, v_layout=layout, mask_function=mask_function,
          interpret=interpret)
      _, dk1, dv1 = sk._splash_attention_bwd_dkv(
          q1, k1, v1, seg1, None, lse1, do1, di1, bq=bq, bkv=bk, bkv_compute=bk,
          is_mqa=False, mask_info=dkv_info, mask_value=MASK_VALUE,
          attn_logits_soft_cap=cap, use_fused_bwd_kernel=False, q_layout=layout,
          k_layout=layout, v_layout=layout, mask_function=mask_function,
          interpret=interpret)
      return dq1, dk1, dv1

    dq, dk, dv = hop.call_unchecked_vma(_over_rows(one_row), q_bnth, k_bksh, v_bksh, seg,
                                        lse_bnt, do_bnth, di_bnt)
    dq = jnp.transpose(dq.astype(jnp.float32), (0, 2, 1, 3)).reshape(q.shape) * tspec.scale
    dk, dv = (jnp.transpose(x.astype(jnp.float32), (0, 2, 1, 3)) for x in (dk, dv))
    if repair:  # dV is NaN where a visible pair has p = exp(s - NaN), as in the XLA kernel
      start, end = hop.query_ranges(masks.q_positions, masks.kv_positions, spec.is_causal,
                                    spec.window)
      sees_nan = hop.flagged_in_ranges(  # [B, S, K]; without a window end is T
          lse_nan.any(axis=-1), start, None if spec.window is None else end)
      dv = jnp.where(sees_nan[..., None], jnp.nan, dv)
    return hop.HopGrads(acc.dq + dq, acc.dk + dk, acc.dv + dv)


def make_kernel(platform: str) -> SplashHopKernel:
  """Registry factory (:data:`ring_jax.kernels.HOP_KERNELS`): splash on a TPU, Pallas
  interpret mode on any other platform (slow; for tests)."""
  return SplashHopKernel(interpret=platform != "tpu")
