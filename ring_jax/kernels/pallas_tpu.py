"""Fused per-hop attention kernel for TPU: Mosaic Pallas, forward and backward.

``PallasTpuHopKernel`` implements the hop-kernel seam (:mod:`ring_jax.hop`):

  forward(q, k, v, masks, spec)                -> (out_h, lse_h)
  backward(q, k, v, masks, spec, res, acc)     -> acc + this hop's (dq, dk, dv)

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
* Block skipping: the hop's :class:`ring_jax.masking.BlockTable`
  (``masks.blocks``, built once per hop by the ring) gives one range of kv
  blocks per (batch row, q block) and of q blocks per (batch row, kv block),
  with its fully visible run. The ranges are scalar-prefetched (SMEM, one flat
  int32 array per direction); grid steps outside them do no work, and their
  index maps repeat a block already in VMEM so no DMA is issued for them.

On a non-TPU backend the kernels run in Pallas interpret mode (slow; for tests).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ring_jax import hop
from ring_jax import masking
from ring_jax import topology

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


def _pair_flags(ranges, r, step):
  """(run, full) of the current grid step from the scalar-prefetched block table.

  ``ranges``: a :class:`ring_jax.masking.BlockTable` direction flattened to int32
  ``[rows * 4]`` (row ``r`` = ``(lo, full_lo, full_hi, hi)``): ``run`` when ``step`` is
  in the row's range, ``full`` when in its fully visible run (no element mask needed).
  """
  lo, flo, fhi, hi = (ranges[4 * r + c] for c in range(4))
  return (step >= lo) & (step < hi), (step >= flo) & (step < fhi)


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


def _fwd_kernel(ranges, *refs, may_mask, specialize, has_seg, scale, causal, window, nq, nk,
                precision, guard_v):
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

  run, full = _pair_flags(ranges, b * nq + i, j)
  _when_run(run, full, may_mask, specialize, body)

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


def _dq_kernel(ranges, *refs, may_mask, specialize, has_seg, scale, causal, window, nq, nk,
               precision):
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

  run, full = _pair_flags(ranges, b * nq + i, j)
  _when_run(run, full, may_mask, specialize, body)

  @pl.when(j == nk - 1)
  def _store():
    dq_ref[...] = dq_sc[...]


def _dkv_kernel(ranges, *refs, may_mask, specialize, has_seg, scale, causal, window, nk, num_g,
                nq, precision):
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

  run, full = _pair_flags(ranges, b * nk + j, i)
  _when_run(run, full, may_mask, specialize, body)

  @pl.when((g == num_g - 1) & (i == nq - 1))
  def _store():
    dk_ref[...] = dk_sc[...]
    dv_ref[...] = dv_sc[...]


def _flat_ranges(ranges, batch: int):
  """A :class:`~ring_jax.masking.BlockTable` direction ``[R, n, 4]`` as the int32
  ``[B * n * 4]`` scalar-prefetch operand (row ``b * n + x``; SMEM holds 1-D arrays best)."""
  return jnp.broadcast_to(ranges, (batch, *ranges.shape[1:])).reshape(-1).astype(jnp.int32)


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
      interpret exactly when the platform compiled for is not a TPU, so the kernel
      runs (slowly) on CPU for tests.
    specialize: compile, besides the masked body, an unmasked one for block pairs
      visible everywhere, and a forward without the non-finite-V guard chosen at run
      time when V is finite. Same results, less work per step, about twice the code.
      ``None`` (default): on a TPU only (interpret mode compiles much faster without).
  """
  name: ClassVar[str] = "pallas_tpu"
  interpret: bool | None = None
  specialize: bool | None = None

  # ---- shapes -------------------------------------------------------------------------

  def takes_block(self, block: int) -> bool:
    """Multiples of 128 (:func:`takes_tpu_block`); the ring's default blocks are such."""
    return takes_tpu_block(block)

  def check(self, q_shape, kv_shape, dtype, spec) -> None:
    """Raises ``ValueError`` naming the fix when the TPU kernel cannot run these shapes."""
    check_tpu_shapes("pallas_tpu", "the TPU kernel", q_shape, kv_shape, dtype, spec)
    h = q_shape[4]
    if h > NUM_LANES and h % NUM_LANES:
      raise ValueError(
          f"head_dim={h}: the TPU kernel needs head_dim <= {NUM_LANES} or a multiple of "
          f"{NUM_LANES}; pad the head dim or use hop_kernel='xla'.")

  def _interpret(self) -> bool:
    if self.interpret is None:
      return topology.target_platform() != "tpu"
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
    return interpret_mode(self._interpret(), *arrays)

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
      qs, ks = masking.segment_ids_int32(masks.q_segment_ids, masks.kv_segment_ids)
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
    bsz, t, kh, g, h = q.shape
    s = k.shape[1]
    bq, bk = spec.block_q, spec.block_kv
    nq, nk = t // bq, s // bk
    table = masks.table()
    may_mask = table.may_mask
    mask_arrays, has_seg = self._mask_inputs(masks, bsz)
    window = None if spec.window is None else _window(spec)
    interpret = self._interpret_mode(q, k, v, *mask_arrays)
    specialize = self._specialize()

    q_t = jnp.transpose(q, (0, 2, 3, 1, 4))               # [B, K, G, T, H]
    k_t, v_t = jnp.transpose(k, (0, 2, 1, 3)), jnp.transpose(v, (0, 2, 1, 3))  # [B, K, S, H]

    def qmap(b, n, gi, i, j, *m):
      return b, i

    def kmap(b, n, gi, i, j, ranges):
      r = b * nq + i
      return b, _clamp(j, ranges[4 * r], ranges[4 * r + 3])

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
    operands, mat = _same_varying([_flat_ranges(table.q_ranges, bsz), *mask_arrays, q_t, k_t,
                                   v_t])
    out_shape = [_struct((bsz, kh, g, t, h), jnp.float32, mat),
                 _struct((bsz, kh, g, t, NUM_LANES), jnp.float32, mat)]

    def call(guard_v: bool):
      kernel = functools.partial(_fwd_kernel, may_mask=may_mask, specialize=specialize,
                                 has_seg=has_seg,
                                 scale=float(spec.scale), causal=spec.is_causal,
                                 window=window, nq=nq, nk=nk, precision=spec.precision,
                                 guard_v=guard_v)
      return pl.pallas_call(
          kernel,
          grid_spec=pltpu.PrefetchScalarGridSpec(
              num_scalar_prefetch=1, grid=(bsz, kh, g, nq, nk), in_specs=in_specs,
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
        o_t, lse_t = jax.lax.cond(hop.v_is_finite(masks, v), lambda: call(False),
                                  lambda: call(True))
    out_h = jnp.transpose(o_t, (0, 3, 1, 2, 4))
    lse_h = jnp.transpose(lse_t[..., 0], (0, 3, 1, 2))
    return out_h, lse_h

  # ---- backward -----------------------------------------------------------------------

  def backward(self, q, k, v, masks, spec, res: hop.HopResiduals,
               acc: hop.HopGrads) -> hop.HopGrads:
    """Returns the float32 accumulators ``acc`` plus this hop's ``(dq [B,T,K,G,H],
    dk [B,S,K,H], dv [B,S,K,H])`` given the ring's final ``res.out`` / ``res.lse``
    (``+inf`` on rows that saw no key anywhere) and the lse cotangent ``res.dlse``
    (or None)."""
    bsz, t, kh, g, h = q.shape
    s = k.shape[1]
    bq, bk = spec.block_q, spec.block_kv
    nq, nk = t // bq, s // bk
    table = masks.table()
    out, lse, do, dlse = res
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
    operands, mat = _same_varying([_flat_ranges(table.q_ranges, bsz),
                                   _flat_ranges(table.kv_ranges, bsz), *mask_arrays,
                                   q_t, k_t, v_t, do_t, lse_r, delta_r])
    q_meta, kv_meta, *rest = operands
    common = dict(may_mask=table.may_mask, specialize=specialize, has_seg=has_seg,
                  scale=float(spec.scale), causal=spec.is_causal, window=window,
                  precision=spec.precision)

    # dQ: grid (B, K, G, nq, nk), kv blocks sequential.
    def qmap(b, n, gi, i, j, *m):
      return b, i

    def kmap(b, n, gi, i, j, ranges):
      r = b * nq + i
      return b, _clamp(j, ranges[4 * r], ranges[4 * r + 3])

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
          functools.partial(_dq_kernel, nq=nq, nk=nk, **common),
          grid_spec=pltpu.PrefetchScalarGridSpec(
              num_scalar_prefetch=1, grid=(bsz, kh, g, nq, nk),
              in_specs=in_specs, out_specs=pl.BlockSpec((None, None, None, bq, h), qrow),
              scratch_shapes=[pltpu.VMEM((bq, h), jnp.float32)]),
          out_shape=_struct((bsz, kh, g, t, h), jnp.float32, mat),
          compiler_params=pltpu.CompilerParams(
              dimension_semantics=("parallel",) * 4 + ("arbitrary",)),
          interpret=interpret,
      )(q_meta, *rest)

    # dK, dV: grid (B, K, nk, G, nq); the G query heads of a kv head and all q blocks
    # are sequential, accumulated in VMEM.
    def qmap2(b, n, j, gi, i, ranges):
      r = b * nk + j
      return b, _clamp(i, ranges[4 * r], ranges[4 * r + 3])

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
          functools.partial(_dkv_kernel, nk=nk, num_g=g, nq=nq, **common),
          grid_spec=pltpu.PrefetchScalarGridSpec(
              num_scalar_prefetch=1, grid=(bsz, kh, nk, g, nq),
              in_specs=in_specs2,
              out_specs=[pl.BlockSpec((None, None, bk, h), kvblk2),
                         pl.BlockSpec((None, None, bk, h), kvblk2)],
              scratch_shapes=[pltpu.VMEM((bk, h), jnp.float32),
                              pltpu.VMEM((bk, h), jnp.float32)]),
          out_shape=[_struct((bsz, kh, s, h), jnp.float32, mat)] * 2,
          compiler_params=pltpu.CompilerParams(
              dimension_semantics=("parallel",) * 3 + ("arbitrary",) * 2),
          interpret=interpret,
      )(kv_meta, *rest)

    dq = jnp.transpose(dq_t, (0, 3, 1, 2, 4))
    dk = jnp.transpose(dk_t, (0, 2, 1, 3))
    dv = jnp.transpose(dv_t, (0, 2, 1, 3))
    # Fresh per-hop buffers added to the accumulators here (XLA fuses the adds); the
    # kernels could alias them instead (input_output_aliases) to save one buffer each.
    return hop.HopGrads(acc.dq + dq, acc.dk + dk, acc.dv + dv)


def takes_tpu_block(block: int) -> bool:
  """The blocks every TPU hop kernel here takes: multiples of 128 (the lane width)."""
  return block > 0 and block % NUM_LANES == 0


def check_tpu_shapes(name: str, who: str, q_shape, kv_shape, dtype, spec) -> None:
  """The shape rules every TPU hop kernel here shares (``name``: the kernel's registry name,
  ``who``: how messages call it): q ``[B, T, K, G, H]`` against k/v ``[B, S, K, H]``, blocks
  that are multiples of 128 (the lane width) dividing the shard, float32 or bfloat16.
  Raises ``ValueError`` naming the fix."""
  if len(q_shape) != 5 or len(kv_shape) != 4:
    raise ValueError(f"{name}: expected q [B, T, K, G, H] and k/v [B, S, K, H], got "
                     f"{tuple(q_shape)} and {tuple(kv_shape)}.")
  _, t, k, _, h = q_shape
  _, s, kk, hh = kv_shape
  if (kk, hh) != (k, h):
    raise ValueError(f"{name}: k/v {tuple(kv_shape)} do not match q {tuple(q_shape)} "
                     "(kv heads and head dim must agree).")
  for what_block, blk, length, what in (("block_q", spec.block_q, t, "T (local query length)"),
                                        ("block_kv", spec.block_kv, s, "S (local key length)")):
    if not takes_tpu_block(blk):
      raise ValueError(
          f"{what_block}={blk}: {who} needs multiples of {NUM_LANES}; pass "
          f"{what_block}={max(NUM_LANES, -(-max(blk, 1) // NUM_LANES) * NUM_LANES)} or "
          "hop_kernel='xla'.")
    if length % blk:
      raise ValueError(
          f"{what_block}={blk} does not divide {what}={length}; pick a {what_block} that "
          f"divides it (a multiple of {NUM_LANES}) or hop_kernel='xla'.")
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
    raise ValueError(f"{name}: dtype {jnp.dtype(dtype)} is not supported (float32 or "
                     "bfloat16); cast the inputs or use hop_kernel='xla'.")


def interpret_mode(interpret: bool, *arrays):
  """The ``interpret`` argument of a TPU ``pallas_call`` whose operands are ``arrays``:
  False on a TPU (``interpret=False``); off it the generic interpreter (``True``), or the
  TPU interpreter (``pltpu.InterpretParams()``) when some operand varies over a manual mesh
  axis (see :meth:`PallasTpuHopKernel._interpret_mode`)."""
  if not interpret:
    return False
  if frozenset().union(*(hop.varying_axes(a) for a in arrays)):
    return pltpu.InterpretParams()
  return True


def make_kernel(platform: str) -> PallasTpuHopKernel:
  """Registry factory (:data:`ring_jax.kernels.HOP_KERNELS`): the Mosaic kernel on a TPU,
  Pallas interpret mode on any other platform (slow; for tests)."""
  return PallasTpuHopKernel(interpret=platform != "tpu")
