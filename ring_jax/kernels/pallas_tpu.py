"""Fused per-hop attention kernel for TPU: Mosaic Pallas, forward and backward.

``PallasTpuHopKernel`` implements the hop-kernel seam (SEAM.md / :mod:`ring_jax.hop`):

  forward(q, k, v, masks, spec)                 -> (out_h, lse_h)
  backward(q, k, v, out, lse, do, dlse, masks, spec, dq, dk, dv)  -> (dq, dk, dv) + this hop

with q ``[B, T, K, G, H]``, k/v ``[B, S, K, H]``; ``out_h`` float32 (rows with no
visible key in this hop: 0), ``lse_h`` float32 natural-log (those rows: ``-inf``);
the backward takes the ring's FINAL ``out``/``lse`` (``lse = +inf`` on rows that
saw no key anywhere) and float32 accumulators, and returns them plus this hop's gradients.

Structure (as jax's ``pallas/ops/tpu/flash_attention.py``, plus what ring
attention needs):

* Grid ``(B, K, G, q blocks, kv blocks)`` for the forward and dQ kernels, the kv
  block axis ``"arbitrary"`` (sequential, the float32 ``(o, m, l)`` / dQ
  accumulator lives in VMEM scratch), the rest ``"parallel"``. The dK/dV kernel
  runs ``(B, K, kv blocks, G, q blocks)`` and accumulates over the G query heads
  of a kv head and all q blocks. GQA/MQA: K and V are indexed by the kv head of
  the grid, never repeated.
* Masks come from global positions and segment ids, per element, inside the
  kernel: ``q_pos`` ``[T, 128]`` / ``kv_pos`` ``[8, S]`` (lane/sublane
  broadcasts, the layout splash and flash attention use for segment ids).
  Nothing of size ``T x S`` exists.
* Block skipping: per hop, a ``[B, nq, nk]`` block-visibility table (positions'
  block ranges, document-id ranges, all-padding blocks) is reduced to one
  contiguous range of kv blocks per (batch row, q block) and of q blocks per
  (batch row, kv block). The ranges are scalar-prefetched (SMEM); grid steps
  outside them do no work, and their index maps repeat a block already in VMEM
  so no DMA is issued for them. In every layout positions increase within a
  shard, so causal/window visibility of a q block is one contiguous kv range.

On a non-TPU backend the kernels run in Pallas interpret mode (slow; for tests).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ring_jax import hop

NUM_LANES = 128
NUM_SUBLANES = 8
_I32_MAX = int(np.iinfo(np.int32).max)
_TRANS_B = (((1,), (1,)), ((), ()))  # contract the last dims: x @ y^T


def _lanes(x_bq128, n: int):
  """A lane-replicated ``[bq, 128]`` row value as ``[bq, n]`` (n <= 128 or a multiple)."""
  if n <= NUM_LANES:
    return x_bq128[:, :n]
  return jnp.tile(x_bq128, (1, n // NUM_LANES))


def _visible(qpos_ref, kpos_ref, qseg_ref, kseg_ref, *, causal, window, bk):
  """bool ``[bq, bk]`` visibility of one block pair, or None when everything is visible."""
  mask = None

  def conj(a, b):
    return b if a is None else a & b

  if causal or window is not None:
    qpos = jnp.tile(qpos_ref[...], (1, bk // NUM_LANES))   # [bq, bk]
    kpos = kpos_ref[:1, :]                                # [1, bk]
    diff = kpos - qpos  # > 0: key in the future. Positions are int32 >= 0: no overflow.
    if causal:
      mask = conj(mask, diff <= 0)
    if window is not None:
      left, right = window
      mask = conj(mask, (diff >= -left) & (diff <= right))
  if qseg_ref is not None:
    qseg = jnp.tile(qseg_ref[...], (1, bk // NUM_LANES))
    kseg = kseg_ref[:1, :]
    mask = conj(mask, (qseg == kseg) & (qseg != 0))
  return mask


def _finite_part(x):
  """``(x with non-finite entries set to 0, float32 1.0 where x was non-finite)``.

  ``abs(x) < inf`` (false for NaN and +-inf) instead of ``isfinite``, computed in
  float32: plain compares and selects are what Mosaic lowers on every TPU generation.
  """
  x32 = x.astype(jnp.float32)
  ok = jnp.abs(x32) < jnp.inf
  return jnp.where(ok, x32, 0.0).astype(x.dtype), jnp.where(ok, 0.0, 1.0)


def _split_refs(refs, has_seg: bool, n_in: int):
  """(qpos, kpos, qseg, kseg, rest...) with qseg/kseg None when there are no segment ids."""
  qpos, kpos = refs[0], refs[1]
  if has_seg:
    qseg, kseg, rest = refs[2], refs[3], refs[4:]
  else:
    qseg, kseg, rest = None, None, refs[2:]
  return qpos, kpos, qseg, kseg, rest[:n_in], rest[n_in:]


def _pair_flags(meta, r, r_other, step, has_seg):
  """(run, full) of the current grid step from the scalar-prefetched block metadata.

  ``meta`` = (lo, hi, full_lo, full_hi[, uniform_own, uniform_other]): ``run`` when
  ``step`` is in this row's range of possibly visible blocks, ``full`` when the pair
  is visible everywhere (no element mask needed): inside the position-full range and,
  with segment ids, both blocks hold one and the same document id.
  """
  lo, hi, flo, fhi = meta[:4]
  run = (step >= lo[r]) & (step < hi[r])
  full = (step >= flo[r]) & (step < fhi[r])
  if has_seg:
    own, other = meta[4], meta[5]
    full = full & (own[r] != 0) & (own[r] == other[r_other])
  return run, full


def _when_run(run, full, may_mask, specialize, body):
  """Runs ``body(masked)`` on possibly visible pairs: with ``specialize``, unmasked on
  pairs visible everywhere and masked on the others; without, masked on all."""
  if not may_mask:
    pl.when(run)(lambda: body(False))
    return
  if not specialize:
    pl.when(run)(lambda: body(True))
    return
  pl.when(run & full)(lambda: body(False))
  pl.when(run & jnp.logical_not(full))(lambda: body(True))


def _fwd_kernel(*refs, n_meta, specialize, has_seg, scale, causal, window, nq, nk, precision,
                guard_v):
  meta, refs = refs[:n_meta], refs[n_meta:]
  qpos, kpos, qseg, kseg, (q_ref, k_ref, v_ref), rest = _split_refs(refs, has_seg, 3)
  o_ref, lse_ref, m_sc, l_sc, acc_sc = rest
  b, i, j = pl.program_id(0), pl.program_id(3), pl.program_id(4)
  bk, h = k_ref.shape[0], q_ref.shape[-1]

  @pl.when(j == 0)
  def _init():
    m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
    l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
    acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

  def body(masked):
    q, k, v = q_ref[...], k_ref[...], v_ref[...]
    s = jax.lax.dot_general(q, k, _TRANS_B, precision=precision,
                            preferred_element_type=jnp.float32) * scale   # [bq, bk]
    if masked:
      mask = _visible(qpos, kpos, qseg, kseg, causal=causal, window=window, bk=bk)
      s = jnp.where(mask, s, -jnp.inf)
    m_prev, l_prev = m_sc[...], l_sc[...]                                 # [bq, 128]
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1)[:, None])
    # A row with no visible key so far has m = -inf: subtract 0 instead (exp(-inf) = 0,
    # never exp(-inf + inf) = NaN).
    m_ref = jnp.where(m_next == -jnp.inf, 0.0, m_next)
    p = jnp.exp(s - jnp.tile(m_ref, (1, bk // NUM_LANES)))              # masked -> 0
    alpha = jnp.exp(m_prev - m_ref)
    l_sc[...] = alpha * l_prev + jnp.sum(p, axis=1)[:, None]
    m_sc[...] = m_next
    if masked and guard_v:
      # A masked pair has p = 0, but 0 * NaN is NaN: read the finite part of V and mark
      # NaN exactly the outputs that see (through a visible pair) a non-finite value.
      v_fin, v_bad = _finite_part(v)
      pv = jax.lax.dot(p.astype(v.dtype), v_fin, precision=precision,
                       preferred_element_type=jnp.float32)
      reads_bad = jax.lax.dot(jnp.where(mask, 1.0, 0.0), v_bad,
                              preferred_element_type=jnp.float32) > 0
      pv = jnp.where(reads_bad, jnp.nan, pv)
    else:
      pv = jax.lax.dot(p.astype(v.dtype), v, precision=precision,
                       preferred_element_type=jnp.float32)
    acc_sc[...] = _lanes(alpha, h) * acc_sc[...] + pv

  run, full = _pair_flags(meta, b * nq + i, b * nk + j, j, has_seg)
  _when_run(run, full, causal or window is not None or has_seg, specialize, body)

  @pl.when(j == nk - 1)
  def _store():
    l = l_sc[...]
    empty = l == 0.0                       # no visible key in this hop
    inv = jnp.where(empty, 0.0, 1.0 / jnp.where(empty, 1.0, l))
    o_ref[...] = acc_sc[...] * _lanes(inv, h)
    lse_ref[...] = jnp.where(empty, -jnp.inf, m_sc[...] + jnp.log(jnp.where(empty, 1.0, l)))


def _probs_and_ds(q, k, v, do, lse, delta, mask, *, scale, precision, bk):
  """(p, ds) ``[bq, bk]`` float32 of one block pair: softmax probabilities under the
  final lse, and ``dS = p * (dO V^T - delta) * scale``. Callers cast ``ds`` to the input
  dtype for the matmuls (as the XLA kernel), after any transpose: Mosaic transposes
  32-bit tiles."""
  s = jax.lax.dot_general(q, k, _TRANS_B, precision=precision,
                          preferred_element_type=jnp.float32) * scale
  p = jnp.exp(s - jnp.tile(lse, (1, bk // NUM_LANES)))   # lse = +inf (padding row) -> 0
  if mask is not None:
    p = jnp.where(mask, p, 0.0)
  if mask is not None:  # dO V^T at masked pairs would spread 0 * NaN: finite part of V
    v = _finite_part(v)[0]
  dp = jax.lax.dot_general(do, v, _TRANS_B, precision=precision,
                           preferred_element_type=jnp.float32)
  ds = p * (dp - jnp.tile(delta, (1, bk // NUM_LANES))) * scale
  return p, ds


def _dq_kernel(*refs, n_meta, specialize, has_seg, scale, causal, window, nq, nk, precision):
  meta, refs = refs[:n_meta], refs[n_meta:]
  qpos, kpos, qseg, kseg, ins, rest = _split_refs(refs, has_seg, 6)
  q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = ins
  dq_ref, dq_sc = rest
  b, i, j = pl.program_id(0), pl.program_id(3), pl.program_id(4)
  bk = k_ref.shape[0]

  @pl.when(j == 0)
  def _init():
    dq_sc[...] = jnp.zeros(dq_sc.shape, jnp.float32)

  def body(masked):
    q, k, v = q_ref[...], k_ref[...], v_ref[...]
    mask = None
    if masked:
      mask = _visible(qpos, kpos, qseg, kseg, causal=causal, window=window, bk=bk)
    _, ds = _probs_and_ds(q, k, v, do_ref[...], lse_ref[...], delta_ref[...], mask,
                          scale=scale, precision=precision, bk=bk)
    if masked:  # as the XLA kernel: dS K reads only the finite part of K at masked pairs
      k = _finite_part(k)[0]
    dq_sc[...] += jax.lax.dot(ds.astype(k.dtype), k, precision=precision,
                              preferred_element_type=jnp.float32)

  run, full = _pair_flags(meta, b * nq + i, b * nk + j, j, has_seg)
  _when_run(run, full, causal or window is not None or has_seg, specialize, body)

  @pl.when(j == nk - 1)
  def _store():
    dq_ref[...] = dq_sc[...]


def _dkv_kernel(*refs, n_meta, specialize, has_seg, scale, causal, window, nk, num_g, nq, precision):
  meta, refs = refs[:n_meta], refs[n_meta:]
  qpos, kpos, qseg, kseg, ins, rest = _split_refs(refs, has_seg, 6)
  q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = ins
  dk_ref, dv_ref, dk_sc, dv_sc = rest
  b, j, g, i = pl.program_id(0), pl.program_id(2), pl.program_id(3), pl.program_id(4)
  bk = k_ref.shape[0]

  @pl.when((g == 0) & (i == 0))
  def _init():
    dk_sc[...] = jnp.zeros(dk_sc.shape, jnp.float32)
    dv_sc[...] = jnp.zeros(dv_sc.shape, jnp.float32)

  def body(masked):
    q, do = q_ref[...], do_ref[...]
    mask = None
    if masked:
      mask = _visible(qpos, kpos, qseg, kseg, causal=causal, window=window, bk=bk)
    p, ds = _probs_and_ds(q, k_ref[...], v_ref[...], do, lse_ref[...], delta_ref[...], mask,
                          scale=scale, precision=precision, bk=bk)
    if masked:  # dS^T Q reads only the finite part of Q at masked pairs
      q = _finite_part(q)[0]
    dv_sc[...] += jax.lax.dot(p.T.astype(do.dtype), do, precision=precision,
                              preferred_element_type=jnp.float32)
    dk_sc[...] += jax.lax.dot(ds.T.astype(q.dtype), q, precision=precision,
                              preferred_element_type=jnp.float32)

  run, full = _pair_flags(meta, b * nk + j, b * nq + i, i, has_seg)
  _when_run(run, full, causal or window is not None or has_seg, specialize, body)

  @pl.when((g == num_g - 1) & (i == nq - 1))
  def _store():
    dk_ref[...] = dk_sc[...]
    dv_ref[...] = dv_sc[...]


class BlockMeta(NamedTuple):
  """Per-hop block metadata (int32, scalar-prefetched into SMEM), rows flattened ``b * n + x``.

  q_lo/q_hi ``[B*nq]``: kv blocks ``[q_lo, q_hi)`` may be visible from q block ``i`` of
    batch row ``b`` (empty: ``[0, 0)``); q_full_lo/q_full_hi: the sub-range whose pairs
    are visible everywhere by position (causal/window).
  kv_lo/kv_hi, kv_full_lo/kv_full_hi ``[B*nk]``: the same over q blocks for kv block ``j``.
  q_uniform ``[B*nq]`` / kv_uniform ``[B*nk]`` (None without segment ids): the block's
    document id when every token of the block holds that same non-padding id, else 0.
  """
  q_lo: jax.Array
  q_hi: jax.Array
  q_full_lo: jax.Array
  q_full_hi: jax.Array
  kv_lo: jax.Array
  kv_hi: jax.Array
  kv_full_lo: jax.Array
  kv_full_hi: jax.Array
  q_uniform: jax.Array | None
  kv_uniform: jax.Array | None

  def for_q_blocks(self):
    """Scalar-prefetch operands of the forward and dQ kernels."""
    extra = () if self.q_uniform is None else (self.q_uniform, self.kv_uniform)
    return (self.q_lo, self.q_hi, self.q_full_lo, self.q_full_hi, *extra)

  def for_kv_blocks(self):
    """Scalar-prefetch operands of the dK/dV kernel."""
    extra = () if self.q_uniform is None else (self.kv_uniform, self.q_uniform)
    return (self.kv_lo, self.kv_hi, self.kv_full_lo, self.kv_full_hi, *extra)


def block_meta(masks, spec, batch: int, t: int, s: int) -> BlockMeta:
  """Per-hop block metadata from positions and segment ids (see :class:`BlockMeta`).

  Built from ``[B, nq, nk]`` block tables (at most one entry per block pair, never
  per token pair). Visibility is conservative (a pair inside a range may still be
  fully masked element by element, never the reverse); fullness is exact. Both
  ranges are contiguous because positions increase within a shard, so a block's
  position range is monotone in its index.
  """
  bq, bk = spec.block_q, spec.block_kv
  nq, nk = t // bq, s // bk
  qp = masks.q_positions.astype(jnp.int32).reshape(nq, bq)
  kp = masks.kv_positions.astype(jnp.int32).reshape(nk, bk)
  q_min, q_max = qp.min(1)[:, None], qp.max(1)[:, None]
  k_min, k_max = kp.min(1)[None, :], kp.max(1)[None, :]
  vis = jnp.ones((nq, nk), bool)
  full = jnp.ones((nq, nk), bool)
  if spec.is_causal:
    vis &= k_min <= q_max
    full &= k_max <= q_min
  if spec.window is not None:
    left, right = _window(spec)
    # In difference form (kv - q), which int32 positions cannot overflow.
    vis &= (k_max - q_min >= -left) & (k_min - q_max <= right)
    full &= (k_min - q_max >= -left) & (k_max - q_min <= right)
  vis = jnp.broadcast_to(vis[None], (batch, nq, nk))
  full = jnp.broadcast_to(full[None], (batch, nq, nk))
  q_uni = kv_uni = None
  if masks.q_segment_ids is not None:
    qs, ks = _segment_ids_int32(masks.q_segment_ids, masks.kv_segment_ids)
    vis &= _segment_blocks(qs, ks, bq, bk)
    q_uni, kv_uni = _uniform(qs, bq), _uniform(ks, bk)

  def ranges(v):  # v [B, n, m] -> first / one-past-last true index along m, flattened
    m = v.shape[-1]
    any_ = v.any(-1)
    lo = jnp.argmax(v, axis=-1)
    hi = m - jnp.argmax(v[..., ::-1], axis=-1)
    return (jnp.where(any_, lo, 0).astype(jnp.int32).reshape(-1),
            jnp.where(any_, hi, 0).astype(jnp.int32).reshape(-1))

  return BlockMeta(*ranges(vis), *ranges(full), *ranges(jnp.swapaxes(vis, 1, 2)),
                   *ranges(jnp.swapaxes(full, 1, 2)), q_uni, kv_uni)


def _uniform(seg, block):
  """int32 ``[B * n]``: the block's id when all its ids are that one non-zero id, else 0."""
  seg = seg.reshape(seg.shape[0], -1, block)
  first = seg[..., 0]
  same = jnp.all(seg == first[..., None], axis=-1)
  return jnp.where(same, first, 0).astype(jnp.int32).reshape(-1)


def _segment_blocks(q_seg, kv_seg, bq, bk):
  """bool ``[B, nq, nk]``: the blocks' ranges of non-padding document ids overlap."""
  info = jnp.iinfo(q_seg.dtype)
  big, small = jnp.asarray(info.max, q_seg.dtype), jnp.asarray(info.min, q_seg.dtype)

  def ranges(seg, block):
    seg = seg.reshape(seg.shape[0], -1, block)
    real = seg != 0
    return (jnp.min(jnp.where(real, seg, big), -1), jnp.max(jnp.where(real, seg, small), -1))

  q_lo, q_hi = ranges(q_seg, bq)
  k_lo, k_hi = ranges(kv_seg, bk)
  return (q_lo[:, :, None] <= k_hi[:, None, :]) & (k_lo[:, None, :] <= q_hi[:, :, None])


def _window(spec):
  left, right = spec.window
  return min(int(left), _I32_MAX), min(int(right), _I32_MAX)


def _same_varying(args):
  """``(args, mat)``: inside ``shard_map(check_vma=True)`` every operand marked varying over
  the union of the operands' manual mesh axes, and that ``ManualAxisType`` for the
  kernel's output shapes (Pallas asks for it there); outside, the args and an empty one."""
  args = [hop.varying_like(jnp.asarray(a), *args) for a in args]
  return args, jax.typeof(args[0]).manual_axis_type


def _struct(shape, dtype, mat):
  """``jax.ShapeDtypeStruct`` carrying ``mat`` (how a kernel output varies over mesh axes)."""
  try:
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mat)
  except TypeError:  # a jax whose ShapeDtypeStruct spells it `vma`
    return jax.ShapeDtypeStruct(shape, dtype, vma=mat.varying)


def _clamp(x, lo, hi):
  """x clamped into [lo, hi - 1] (to lo when the range is empty): index maps of skipped
  steps repeat a block that is already resident, so no copy is issued for them."""
  return jnp.maximum(jnp.minimum(x, hi - 1), lo)


@dataclasses.dataclass(frozen=True)
class PallasTpuHopKernel:
  """The fused TPU hop kernel (Mosaic Pallas), ``hop_kernel="pallas_tpu"``.

  Attributes:
    interpret: run the kernels in Pallas interpret mode. ``None`` (default):
      interpret exactly when the default backend is not a TPU, so the kernel
      runs (slowly) on CPU for tests.
    specialize: compile, besides the masked body, an unmasked one for block pairs
      visible everywhere, and a forward without the non-finite-V guard chosen at run
      time when V is finite. Same results, less work per step, about twice the code.
      ``None`` (default): on a TPU only (interpret mode compiles much faster without).
  """
  interpret: bool | None = None
  specialize: bool | None = None
  name: str = "pallas_tpu"

  # ---- shapes -------------------------------------------------------------------------

  def check(self, q_shape, kv_shape, dtype, spec) -> None:
    """Raises ``ValueError`` naming the fix when the TPU kernel cannot run these shapes."""
    if len(q_shape) != 5 or len(kv_shape) != 4:
      raise ValueError(f"pallas_tpu: expected q [B, T, K, G, H] and k/v [B, S, K, H], got "
                       f"{tuple(q_shape)} and {tuple(kv_shape)}.")
    b, t, k, g, h = q_shape
    _, s, kk, hh = kv_shape
    if (kk, hh) != (k, h):
      raise ValueError(f"pallas_tpu: k/v {tuple(kv_shape)} do not match q {tuple(q_shape)} "
                       "(kv heads and head dim must agree).")
    for name, blk, length, what in (("block_q", spec.block_q, t, "T (local query length)"),
                                    ("block_kv", spec.block_kv, s, "S (local key length)")):
      if blk <= 0 or blk % NUM_LANES:
        raise ValueError(
            f"{name}={blk}: the TPU kernel needs multiples of {NUM_LANES}; pass "
            f"{name}={max(NUM_LANES, -(-max(blk, 1) // NUM_LANES) * NUM_LANES)} or "
            "hop_kernel='xla'.")
      if length % blk:
        raise ValueError(
            f"{name}={blk} does not divide {what}={length}; pick a {name} that divides it "
            f"(a multiple of {NUM_LANES}) or hop_kernel='xla'.")
    if h > NUM_LANES and h % NUM_LANES:
      raise ValueError(
          f"head_dim={h}: the TPU kernel needs head_dim <= {NUM_LANES} or a multiple of "
          f"{NUM_LANES}; pad the head dim or use hop_kernel='xla'.")
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
      raise ValueError(f"pallas_tpu: dtype {jnp.dtype(dtype)} is not supported (float32 or "
                       "bfloat16); cast the inputs or use hop_kernel='xla'.")

  def _interpret(self) -> bool:
    if self.interpret is None:
      return jax.default_backend() != "tpu"
    return bool(self.interpret)

  def _interpret_mode(self, *arrays):
    """The ``interpret`` argument of ``pallas_call``.

    Off a TPU the kernels run in a Pallas interpreter. Outside ``shard_map`` (or with
    ``check_vma=False``) that is the generic one (``interpret=True``, fast to run). Inside
    ``shard_map(check_vma=True)`` the block metadata varies over the mesh axes while grid
    indices do not, and the generic interpreter rejects their mix (jax 0.10.2: "dynamic_slice
    requires varying manual axes to match"): there the TPU interpreter
    (``pltpu.InterpretParams()``, slower) runs the kernels.
    """
    if not self._interpret():
      return False
    if frozenset().union(*(hop._varying_axes(a) for a in arrays)):
      return pltpu.InterpretParams()
    return True

  def _specialize(self) -> bool:
    if self.specialize is None:
      return not self._interpret()
    return bool(self.specialize)

  # ---- shared input plumbing ----------------------------------------------------------

  def _mask_inputs(self, masks, batch):
    """Position / segment-id operands (lane- or sublane-broadcast) and their BlockSpec
    factories; ``qmap(b, i)`` / ``kmap(b, j)`` give the block coordinates."""
    t, s = masks.q_positions.shape[0], masks.kv_positions.shape[0]
    qpos = jax.lax.broadcast_in_dim(masks.q_positions.astype(jnp.int32), (t, NUM_LANES), (0,))
    kpos = jax.lax.broadcast_in_dim(masks.kv_positions.astype(jnp.int32),
                                    (NUM_SUBLANES, s), (1,))
    arrays = [qpos, kpos]
    has_seg = masks.q_segment_ids is not None
    if has_seg:
      qs, ks = _segment_ids_int32(masks.q_segment_ids, masks.kv_segment_ids)
      arrays += [jax.lax.broadcast_in_dim(qs, (batch, t, NUM_LANES), (0, 1)),
                 jax.lax.broadcast_in_dim(ks, (batch, NUM_SUBLANES, s), (0, 2))]
    return arrays, has_seg

  @staticmethod
  def _mask_specs(has_seg, bq, bk, qmap, kmap):
    """BlockSpecs for the mask operands; ``qmap(*grid, *meta) -> (b, i)`` etc."""
    specs = [pl.BlockSpec((bq, NUM_LANES), lambda *a: (qmap(*a)[1], 0)),
             pl.BlockSpec((NUM_SUBLANES, bk), lambda *a: (0, kmap(*a)[1]))]
    if has_seg:
      specs += [pl.BlockSpec((None, bq, NUM_LANES), lambda *a: (*qmap(*a), 0)),
                pl.BlockSpec((None, NUM_SUBLANES, bk), lambda *a: (kmap(*a)[0], 0,
                                                                   kmap(*a)[1]))]
    return specs

  # ---- forward ------------------------------------------------------------------------

  def forward(self, q, k, v, masks, spec):
    """Returns ``(out_h [B,T,K,G,H] f32, lse_h [B,T,K,G] f32)`` of this hop."""
    self.check(q.shape, k.shape, q.dtype, spec)
    bsz, t, kh, g, h = q.shape
    s = k.shape[1]
    bq, bk = spec.block_q, spec.block_kv
    nq, nk = t // bq, s // bk
    meta = block_meta(masks, spec, bsz, t, s).for_q_blocks()
    mask_arrays, has_seg = self._mask_inputs(masks, bsz)
    window = None if spec.window is None else _window(spec)
    interpret = self._interpret_mode(q, k, v, *mask_arrays)
    specialize = self._specialize()

    q_t = jnp.transpose(q, (0, 2, 3, 1, 4))               # [B, K, G, T, H]
    k_t, v_t = jnp.transpose(k, (0, 2, 1, 3)), jnp.transpose(v, (0, 2, 1, 3))  # [B, K, S, H]

    def qmap(b, n, gi, i, j, *m):
      return b, i

    def kmap(b, n, gi, i, j, *m):
      r = b * nq + i
      return b, _clamp(j, m[0][r], m[1][r])

    in_specs = self._mask_specs(has_seg, bq, bk, qmap, kmap) + [
        pl.BlockSpec((None, None, None, bq, h), lambda b, n, gi, i, j, *m: (b, n, gi, i, 0)),
        pl.BlockSpec((None, None, bk, h), lambda *a: (a[0], a[1], kmap(*a)[1], 0)),
        pl.BlockSpec((None, None, bk, h), lambda *a: (a[0], a[1], kmap(*a)[1], 0)),
    ]
    out_specs = [
        pl.BlockSpec((None, None, None, bq, h), lambda b, n, gi, i, j, *m: (b, n, gi, i, 0)),
        pl.BlockSpec((None, None, None, bq, NUM_LANES),
                     lambda b, n, gi, i, j, *m: (b, n, gi, i, 0)),
    ]
    operands, mat = _same_varying([*meta, *mask_arrays, q_t, k_t, v_t])
    out_shape = [_struct((bsz, kh, g, t, h), jnp.float32, mat),
                 _struct((bsz, kh, g, t, NUM_LANES), jnp.float32, mat)]
    may_mask = spec.is_causal or spec.window is not None or has_seg

    def call(guard_v: bool):
      kernel = functools.partial(_fwd_kernel, n_meta=len(meta), specialize=specialize,
                                 has_seg=has_seg,
                                 scale=float(spec.scale), causal=spec.is_causal,
                                 window=window, nq=nq, nk=nk, precision=spec.precision,
                                 guard_v=guard_v)
      return pl.pallas_call(
          kernel,
          grid_spec=pltpu.PrefetchScalarGridSpec(
              num_scalar_prefetch=len(meta), grid=(bsz, kh, g, nq, nk), in_specs=in_specs,
              out_specs=out_specs,
              scratch_shapes=[pltpu.VMEM((bq, NUM_LANES), jnp.float32),
                              pltpu.VMEM((bq, NUM_LANES), jnp.float32),
                              pltpu.VMEM((bq, h), jnp.float32)]),
          out_shape=out_shape,
          compiler_params=pltpu.CompilerParams(
              dimension_semantics=("parallel",) * 4 + ("arbitrary",)),
          interpret=interpret,
      )(*operands)

    with jax.named_scope("pallas_tpu_hop_fwd"):
      if not may_mask:  # every computed pair is visible: p @ v may read all of V
        o_t, lse_t = call(guard_v=False)
      elif not specialize:
        o_t, lse_t = call(guard_v=True)
      else:  # only a hop whose V shard holds a non-finite value pays for the guard
        o_t, lse_t = jax.lax.cond(jnp.isfinite(v).all(), lambda: call(False),
                                  lambda: call(True))
    out_h = jnp.transpose(o_t, (0, 3, 1, 2, 4))
    lse_h = jnp.transpose(lse_t[..., 0], (0, 3, 1, 2))
    return out_h, lse_h

  # ---- backward -----------------------------------------------------------------------

  def backward(self, q, k, v, out, lse, do, dlse, masks, spec, dq_acc, dk_acc, dv_acc):
    """Returns the float32 accumulators plus this hop's ``(dq [B,T,K,G,H], dk [B,S,K,H],
    dv [B,S,K,H])`` given the ring's final ``out`` / ``lse`` (``+inf`` on rows that saw no key anywhere) and
    the lse cotangent ``dlse`` (or None)."""
    self.check(q.shape, k.shape, q.dtype, spec)
    bsz, t, kh, g, h = q.shape
    s = k.shape[1]
    bq, bk = spec.block_q, spec.block_kv
    nq, nk = t // bq, s // bk
    bm = block_meta(masks, spec, bsz, t, s)
    mask_arrays, has_seg = self._mask_inputs(masks, bsz)
    window = None if spec.window is None else _window(spec)
    interpret = self._interpret_mode(q, k, v, *mask_arrays)
    specialize = self._specialize()

    # delta = rowsum(dO * O) - dlse (FlashAttention-2 + the lse cotangent), float32 [B,T,K,G].
    delta = hop.backward_delta(out, do, dlse)

    def rows(x):  # [B, T, K, G] -> lane-broadcast [B, K, G, T, 128]
      x = jnp.transpose(x.astype(jnp.float32), (0, 2, 3, 1))
      return jax.lax.broadcast_in_dim(x, (*x.shape, NUM_LANES), (0, 1, 2, 3))

    q_t = jnp.transpose(q, (0, 2, 3, 1, 4))
    do_t = jnp.transpose(do.astype(q.dtype), (0, 2, 3, 1, 4))
    k_t, v_t = jnp.transpose(k, (0, 2, 1, 3)), jnp.transpose(v, (0, 2, 1, 3))
    lse_r, delta_r = rows(hop.lse_for_backward(lse)), rows(delta)  # +inf: p = 0
    n_q, n_kv = len(bm.for_q_blocks()), len(bm.for_kv_blocks())
    operands, mat = _same_varying([*bm.for_q_blocks(), *bm.for_kv_blocks(), *mask_arrays,
                                   q_t, k_t, v_t, do_t, lse_r, delta_r])
    q_meta, kv_meta = operands[:n_q], operands[n_q:n_q + n_kv]
    rest = operands[n_q + n_kv:]
    common = dict(has_seg=has_seg, scale=float(spec.scale), causal=spec.is_causal,
                  window=window, precision=spec.precision)

    # dQ: grid (B, K, G, nq, nk), kv blocks sequential.
    def qmap(b, n, gi, i, j, *m):
      return b, i

    def kmap(b, n, gi, i, j, *m):
      r = b * nq + i
      return b, _clamp(j, m[0][r], m[1][r])

    qrow = lambda b, n, gi, i, j, *m: (b, n, gi, i, 0)
    kvblk = lambda *a: (a[0], a[1], kmap(*a)[1], 0)
    in_specs = self._mask_specs(has_seg, bq, bk, qmap, kmap) + [
        pl.BlockSpec((None, None, None, bq, h), qrow),
        pl.BlockSpec((None, None, bk, h), kvblk),
        pl.BlockSpec((None, None, bk, h), kvblk),
        pl.BlockSpec((None, None, None, bq, h), qrow),
        pl.BlockSpec((None, None, None, bq, NUM_LANES), qrow),
        pl.BlockSpec((None, None, None, bq, NUM_LANES), qrow),
    ]
    with jax.named_scope("pallas_tpu_hop_bwd_dq"):
      dq_t = pl.pallas_call(
          functools.partial(_dq_kernel, n_meta=len(bm.for_q_blocks()), specialize=specialize,
                            nq=nq, nk=nk,
                            **common),
          grid_spec=pltpu.PrefetchScalarGridSpec(
              num_scalar_prefetch=len(bm.for_q_blocks()), grid=(bsz, kh, g, nq, nk),
              in_specs=in_specs, out_specs=pl.BlockSpec((None, None, None, bq, h), qrow),
              scratch_shapes=[pltpu.VMEM((bq, h), jnp.float32)]),
          out_shape=_struct((bsz, kh, g, t, h), jnp.float32, mat),
          compiler_params=pltpu.CompilerParams(
              dimension_semantics=("parallel",) * 4 + ("arbitrary",)),
          interpret=interpret,
      )(*q_meta, *rest)

    # dK, dV: grid (B, K, nk, G, nq); the G query heads of a kv head and all q blocks
    # are sequential, accumulated in VMEM.
    def qmap2(b, n, j, gi, i, *m):
      r = b * nk + j
      return b, _clamp(i, m[0][r], m[1][r])

    def kmap2(b, n, j, gi, i, *m):
      return b, j

    qrow2 = lambda *a: (a[0], a[1], a[3], qmap2(*a)[1], 0)
    kvblk2 = lambda b, n, j, gi, i, *m: (b, n, j, 0)
    in_specs2 = self._mask_specs(has_seg, bq, bk, qmap2, kmap2) + [
        pl.BlockSpec((None, None, None, bq, h), qrow2),
        pl.BlockSpec((None, None, bk, h), kvblk2),
        pl.BlockSpec((None, None, bk, h), kvblk2),
        pl.BlockSpec((None, None, None, bq, h), qrow2),
        pl.BlockSpec((None, None, None, bq, NUM_LANES), qrow2),
        pl.BlockSpec((None, None, None, bq, NUM_LANES), qrow2),
    ]
    with jax.named_scope("pallas_tpu_hop_bwd_dkv"):
      dk_t, dv_t = pl.pallas_call(
          functools.partial(_dkv_kernel, n_meta=len(bm.for_kv_blocks()),
                            specialize=specialize,
                            nk=nk, num_g=g, nq=nq,
                            **common),
          grid_spec=pltpu.PrefetchScalarGridSpec(
              num_scalar_prefetch=len(bm.for_kv_blocks()), grid=(bsz, kh, nk, g, nq),
              in_specs=in_specs2,
              out_specs=[pl.BlockSpec((None, None, bk, h), kvblk2),
                         pl.BlockSpec((None, None, bk, h), kvblk2)],
              scratch_shapes=[pltpu.VMEM((bk, h), jnp.float32),
                              pltpu.VMEM((bk, h), jnp.float32)]),
          out_shape=[_struct((bsz, kh, s, h), jnp.float32, mat)] * 2,
          compiler_params=pltpu.CompilerParams(
              dimension_semantics=("parallel",) * 3 + ("arbitrary",) * 2),
          interpret=interpret,
      )(*kv_meta, *rest)

    dq = jnp.transpose(dq_t, (0, 3, 1, 2, 4))
    dk = jnp.transpose(dk_t, (0, 2, 1, 3))
    dv = jnp.transpose(dv_t, (0, 2, 1, 3))
    # Fresh per-hop buffers added to the accumulators here (XLA fuses the adds); the
    # kernels could alias them instead (input_output_aliases) to save one buffer each.
    return dq_acc + dq, dk_acc + dk, dv_acc + dv


def _segment_ids_int32(q_seg, kv_seg):
  """Segment ids as int32 for the kernel, keeping equality and the 0 = padding rule.

  Ids that already fit int32 are cast. Wider ids (int64 / uint32 / uint64 values
  outside int32) are remapped to dense int32 codes by rank over the union of both
  arrays (0 stays 0), which preserves exactly which pairs are equal.
  """
  q_seg, kv_seg = jnp.asarray(q_seg), jnp.asarray(kv_seg)
  dt = jnp.promote_types(q_seg.dtype, kv_seg.dtype)
  if jnp.iinfo(dt).bits <= 32 and jnp.iinfo(dt).max <= _I32_MAX:
    return q_seg.astype(jnp.int32), kv_seg.astype(jnp.int32)
  both = jnp.concatenate([q_seg.reshape(-1), kv_seg.reshape(-1)]).astype(dt)
  # Padded with the largest id so that `uniq` stays sorted for searchsorted.
  uniq = jnp.unique(both, size=both.size, fill_value=both.max())
  # 0 maps to 0; any other id to 1 + its rank among the distinct ids (ids can be negative).
  def code(x):
    rank = jnp.searchsorted(uniq, x.astype(dt)).astype(jnp.int32)
    return jnp.where(x == 0, 0, rank + 1)
  return code(q_seg), code(kv_seg)


def make_kernel(platform: str) -> PallasTpuHopKernel:
  """Registry factory (:data:`ring_jax.kernels.HOP_KERNELS`): the Mosaic kernel on a TPU,
  Pallas interpret mode on any other platform (slow; for tests)."""
  return PallasTpuHopKernel(interpret=platform != "tpu")
