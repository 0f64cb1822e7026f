"""Fused per-hop attention kernel for TPU: Mosaic Pallas, forward and backward.

``PallasTpuHopKernel`` implements the hop-kernel seam (SEAM.md / :mod:`ring_jax.hop`):

  forward(q, k, v, masks, spec)                 -> (out_h, lse_h)
  backward(q, k, v, out, lse, do, masks, spec)  -> (dq, dk, dv)

with q ``[B, T, K, G, H]``, k/v ``[B, S, K, H]``; ``out_h`` float32 (rows with no
visible key in this hop: 0), ``lse_h`` float32 natural-log (those rows: ``-inf``);
the backward takes the ring's FINAL ``out``/``lse`` (``lse = +inf`` on rows that
saw no key anywhere) and returns float32 gradients of this hop.

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

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

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


def _split_refs(refs, has_seg: bool, n_in: int):
  """(qpos, kpos, qseg, kseg, rest...) with qseg/kseg None when there are no segment ids."""
  qpos, kpos = refs[0], refs[1]
  if has_seg:
    qseg, kseg, rest = refs[2], refs[3], refs[4:]
  else:
    qseg, kseg, rest = None, None, refs[2:]
  return qpos, kpos, qseg, kseg, rest[:n_in], rest[n_in:]


def _fwd_kernel(lo_ref, hi_ref, *refs, has_seg, scale, causal, window, nq, nk, precision):
  qpos, kpos, qseg, kseg, (q_ref, k_ref, v_ref), rest = _split_refs(refs, has_seg, 3)
  o_ref, lse_ref, m_sc, l_sc, acc_sc = rest
  b, i, j = pl.program_id(0), pl.program_id(3), pl.program_id(4)
  bk, h = k_ref.shape[0], q_ref.shape[-1]

  @pl.when(j == 0)
  def _init():
    m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
    l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
    acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

  r = b * nq + i

  @pl.when((j >= lo_ref[r]) & (j < hi_ref[r]))
  def _run():
    q, k, v = q_ref[...], k_ref[...], v_ref[...]
    s = jax.lax.dot_general(q, k, _TRANS_B, precision=precision,
                            preferred_element_type=jnp.float32) * scale   # [bq, bk]
    mask = _visible(qpos, kpos, qseg, kseg, causal=causal, window=window, bk=bk)
    if mask is not None:
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
    pv = jax.lax.dot(p.astype(v.dtype), v, precision=precision,
                     preferred_element_type=jnp.float32)
    acc_sc[...] = _lanes(alpha, h) * acc_sc[...] + pv

  @pl.when(j == nk - 1)
  def _store():
    l = l_sc[...]
    empty = l == 0.0                       # no visible key in this hop
    inv = jnp.where(empty, 0.0, 1.0 / jnp.where(empty, 1.0, l))
    o_ref[...] = acc_sc[...] * _lanes(inv, h)
    lse_ref[...] = jnp.where(empty, -jnp.inf, m_sc[...] + jnp.log(jnp.where(empty, 1.0, l)))


def _probs_and_ds(q, k, v, do, lse, delta, mask, *, scale, precision, bk):
  """(p, ds) ``[bq, bk]`` of one block pair: softmax probabilities under the final
  lse, and ``dS = p * (dO V^T - delta) * scale`` in the input dtype (as the XLA kernel)."""
  s = jax.lax.dot_general(q, k, _TRANS_B, precision=precision,
                          preferred_element_type=jnp.float32) * scale
  p = jnp.exp(s - jnp.tile(lse, (1, bk // NUM_LANES)))   # lse = +inf (padding row) -> 0
  if mask is not None:
    p = jnp.where(mask, p, 0.0)
  dp = jax.lax.dot_general(do, v, _TRANS_B, precision=precision,
                           preferred_element_type=jnp.float32)
  ds = (p * (dp - jnp.tile(delta, (1, bk // NUM_LANES))) * scale).astype(q.dtype)
  return p, ds


def _dq_kernel(lo_ref, hi_ref, *refs, has_seg, scale, causal, window, nq, nk, precision):
  qpos, kpos, qseg, kseg, ins, rest = _split_refs(refs, has_seg, 6)
  q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = ins
  dq_ref, dq_sc = rest
  b, i, j = pl.program_id(0), pl.program_id(3), pl.program_id(4)
  bk = k_ref.shape[0]

  @pl.when(j == 0)
  def _init():
    dq_sc[...] = jnp.zeros(dq_sc.shape, jnp.float32)

  r = b * nq + i

  @pl.when((j >= lo_ref[r]) & (j < hi_ref[r]))
  def _run():
    k = k_ref[...]
    mask = _visible(qpos, kpos, qseg, kseg, causal=causal, window=window, bk=bk)
    _, ds = _probs_and_ds(q_ref[...], k, v_ref[...], do_ref[...], lse_ref[...],
                          delta_ref[...], mask, scale=scale, precision=precision, bk=bk)
    dq_sc[...] += jax.lax.dot(ds, k, precision=precision, preferred_element_type=jnp.float32)

  @pl.when(j == nk - 1)
  def _store():
    dq_ref[...] = dq_sc[...]


def _dkv_kernel(lo_ref, hi_ref, *refs, has_seg, scale, causal, window, nk, num_g, nq,
                precision):
  qpos, kpos, qseg, kseg, ins, rest = _split_refs(refs, has_seg, 6)
  q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = ins
  dk_ref, dv_ref, dk_sc, dv_sc = rest
  b, j, g, i = pl.program_id(0), pl.program_id(2), pl.program_id(3), pl.program_id(4)
  bk = k_ref.shape[0]

  @pl.when((g == 0) & (i == 0))
  def _init():
    dk_sc[...] = jnp.zeros(dk_sc.shape, jnp.float32)
    dv_sc[...] = jnp.zeros(dv_sc.shape, jnp.float32)

  r = b * nk + j

  @pl.when((i >= lo_ref[r]) & (i < hi_ref[r]))
  def _run():
    q, do = q_ref[...], do_ref[...]
    mask = _visible(qpos, kpos, qseg, kseg, causal=causal, window=window, bk=bk)
    p, ds = _probs_and_ds(q, k_ref[...], v_ref[...], do, lse_ref[...], delta_ref[...], mask,
                          scale=scale, precision=precision, bk=bk)
    dv_sc[...] += jax.lax.dot(p.T.astype(do.dtype), do, precision=precision,
                              preferred_element_type=jnp.float32)
    dk_sc[...] += jax.lax.dot(ds.T, q, precision=precision, preferred_element_type=jnp.float32)

  @pl.when((g == num_g - 1) & (i == nq - 1))
  def _store():
    dk_ref[...] = dk_sc[...]
    dv_ref[...] = dv_sc[...]


def block_ranges(masks, spec, batch: int, t: int, s: int):
  """Per-hop block metadata: ``(q_lo, q_hi, kv_lo, kv_hi)``, int32 ``[B * nq]`` / ``[B * nk]``.

  ``[q_lo[b*nq+i], q_hi[...])`` is the range of kv blocks q block ``i`` of batch
  row ``b`` may see; ``[kv_lo[b*nk+j], kv_hi[...])`` the range of q blocks that may
  see kv block ``j``. Empty ranges are ``[0, 0)``. Built from a ``[B, nq, nk]``
  block-visibility table (conservative: a pair inside a range may still be fully
  masked element-wise, never the reverse).
  """
  bq, bk = spec.block_q, spec.block_kv
  nq, nk = t // bq, s // bk
  qp = masks.q_positions.astype(jnp.int32).reshape(nq, bq)
  kp = masks.kv_positions.astype(jnp.int32).reshape(nk, bk)
  q_min, q_max = qp.min(1)[:, None], qp.max(1)[:, None]
  k_min, k_max = kp.min(1)[None, :], kp.max(1)[None, :]
  vis = jnp.ones((nq, nk), bool)
  if spec.is_causal:
    vis &= k_min <= q_max
  if spec.window is not None:
    left, right = _window(spec)
    # Differences in int64-free form: k_max - q_min >= -left, k_min - q_max <= right.
    vis &= (k_max - q_min >= -left) & (k_min - q_max <= right)
  vis = jnp.broadcast_to(vis[None], (batch, nq, nk))
  if masks.q_segment_ids is not None:
    vis &= _segment_blocks(*_segment_ids_int32(masks.q_segment_ids, masks.kv_segment_ids),
                           bq, bk)

  def ranges(v):  # v [B, n, m] -> first / one-past-last true index along m, flattened
    m = v.shape[-1]
    any_ = v.any(-1)
    lo = jnp.argmax(v, axis=-1)
    hi = m - jnp.argmax(v[..., ::-1], axis=-1)
    return (jnp.where(any_, lo, 0).astype(jnp.int32).reshape(-1),
            jnp.where(any_, hi, 0).astype(jnp.int32).reshape(-1))

  q_lo, q_hi = ranges(vis)
  kv_lo, kv_hi = ranges(jnp.swapaxes(vis, 1, 2))
  return q_lo, q_hi, kv_lo, kv_hi


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
  """
  interpret: bool | None = None
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
    """BlockSpecs for the mask operands; ``qmap(*grid, lo, hi) -> (b, i)`` etc."""
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
    q_lo, q_hi, _, _ = block_ranges(masks, spec, bsz, t, s)
    mask_arrays, has_seg = self._mask_inputs(masks, bsz)
    window = None if spec.window is None else _window(spec)

    q_t = jnp.transpose(q, (0, 2, 3, 1, 4))               # [B, K, G, T, H]
    k_t, v_t = jnp.transpose(k, (0, 2, 1, 3)), jnp.transpose(v, (0, 2, 1, 3))  # [B, K, S, H]

    def qmap(b, n, gi, i, j, lo, hi):
      return b, i

    def kmap(b, n, gi, i, j, lo, hi):
      r = b * nq + i
      return b, _clamp(j, lo[r], hi[r])

    in_specs = self._mask_specs(has_seg, bq, bk, qmap, kmap) + [
        pl.BlockSpec((None, None, None, bq, h), lambda b, n, gi, i, j, lo, hi: (b, n, gi, i, 0)),
        pl.BlockSpec((None, None, bk, h), lambda *a: (a[0], a[1], kmap(*a)[1], 0)),
        pl.BlockSpec((None, None, bk, h), lambda *a: (a[0], a[1], kmap(*a)[1], 0)),
    ]
    out_specs = [
        pl.BlockSpec((None, None, None, bq, h), lambda b, n, gi, i, j, lo, hi: (b, n, gi, i, 0)),
        pl.BlockSpec((None, None, None, bq, NUM_LANES),
                     lambda b, n, gi, i, j, lo, hi: (b, n, gi, i, 0)),
    ]
    out_shape = [jax.ShapeDtypeStruct((bsz, kh, g, t, h), jnp.float32),
                 jax.ShapeDtypeStruct((bsz, kh, g, t, NUM_LANES), jnp.float32)]
    kernel = functools.partial(_fwd_kernel, has_seg=has_seg, scale=float(spec.scale),
                               causal=spec.is_causal, window=window, nq=nq, nk=nk,
                               precision=spec.precision)
    with jax.named_scope("pallas_tpu_hop_fwd"):
      o_t, lse_t = pl.pallas_call(
          kernel,
          grid_spec=pltpu.PrefetchScalarGridSpec(
              num_scalar_prefetch=2, grid=(bsz, kh, g, nq, nk), in_specs=in_specs,
              out_specs=out_specs,
              scratch_shapes=[pltpu.VMEM((bq, NUM_LANES), jnp.float32),
                              pltpu.VMEM((bq, NUM_LANES), jnp.float32),
                              pltpu.VMEM((bq, h), jnp.float32)]),
          out_shape=out_shape,
          compiler_params=pltpu.CompilerParams(
              dimension_semantics=("parallel",) * 4 + ("arbitrary",)),
          interpret=self._interpret(),
      )(q_lo, q_hi, *mask_arrays, q_t, k_t, v_t)
    out_h = jnp.transpose(o_t, (0, 3, 1, 2, 4))
    lse_h = jnp.transpose(lse_t[..., 0], (0, 3, 1, 2))
    return out_h, lse_h

  # ---- backward -----------------------------------------------------------------------

  def backward(self, q, k, v, out, lse, do, masks, spec):
    """Returns this hop's float32 ``(dq [B,T,K,G,H], dk [B,S,K,H], dv [B,S,K,H])`` given
    the ring's final ``out`` / ``lse`` (``+inf`` on rows that saw no key anywhere)."""
    self.check(q.shape, k.shape, q.dtype, spec)
    bsz, t, kh, g, h = q.shape
    s = k.shape[1]
    bq, bk = spec.block_q, spec.block_kv
    nq, nk = t // bq, s // bk
    q_lo, q_hi, kv_lo, kv_hi = block_ranges(masks, spec, bsz, t, s)
    mask_arrays, has_seg = self._mask_inputs(masks, bsz)
    window = None if spec.window is None else _window(spec)
    interpret = self._interpret()

    # delta = rowsum(dO * O) (FlashAttention-2), in float32, from the final output.
    delta = jnp.sum(do.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # [B,T,K,G]

    def rows(x):  # [B, T, K, G] -> lane-broadcast [B, K, G, T, 128]
      x = jnp.transpose(x.astype(jnp.float32), (0, 2, 3, 1))
      return jax.lax.broadcast_in_dim(x, (*x.shape, NUM_LANES), (0, 1, 2, 3))

    q_t = jnp.transpose(q, (0, 2, 3, 1, 4))
    do_t = jnp.transpose(do.astype(q.dtype), (0, 2, 3, 1, 4))
    k_t, v_t = jnp.transpose(k, (0, 2, 1, 3)), jnp.transpose(v, (0, 2, 1, 3))
    lse_r, delta_r = rows(lse), rows(delta)
    common = dict(has_seg=has_seg, scale=float(spec.scale), causal=spec.is_causal,
                  window=window, precision=spec.precision)

    # dQ: grid (B, K, G, nq, nk), kv blocks sequential.
    def qmap(b, n, gi, i, j, lo, hi):
      return b, i

    def kmap(b, n, gi, i, j, lo, hi):
      r = b * nq + i
      return b, _clamp(j, lo[r], hi[r])

    qrow = lambda b, n, gi, i, j, lo, hi: (b, n, gi, i, 0)
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
              num_scalar_prefetch=2, grid=(bsz, kh, g, nq, nk), in_specs=in_specs,
              out_specs=pl.BlockSpec((None, None, None, bq, h), qrow),
              scratch_shapes=[pltpu.VMEM((bq, h), jnp.float32)]),
          out_shape=jax.ShapeDtypeStruct((bsz, kh, g, t, h), jnp.float32),
          compiler_params=pltpu.CompilerParams(
              dimension_semantics=("parallel",) * 4 + ("arbitrary",)),
          interpret=interpret,
      )(q_lo, q_hi, *mask_arrays, q_t, k_t, v_t, do_t, lse_r, delta_r)

    # dK, dV: grid (B, K, nk, G, nq); the G query heads of a kv head and all q blocks
    # are sequential, accumulated in VMEM.
    def qmap2(b, n, j, gi, i, lo, hi):
      r = b * nk + j
      return b, _clamp(i, lo[r], hi[r])

    def kmap2(b, n, j, gi, i, lo, hi):
      return b, j

    qrow2 = lambda *a: (a[0], a[1], a[3], qmap2(*a)[1], 0)
    kvblk2 = lambda b, n, j, gi, i, lo, hi: (b, n, j, 0)
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
              num_scalar_prefetch=2, grid=(bsz, kh, nk, g, nq), in_specs=in_specs2,
              out_specs=[pl.BlockSpec((None, None, bk, h), kvblk2),
                         pl.BlockSpec((None, None, bk, h), kvblk2)],
              scratch_shapes=[pltpu.VMEM((bk, h), jnp.float32),
                              pltpu.VMEM((bk, h), jnp.float32)]),
          out_shape=[jax.ShapeDtypeStruct((bsz, kh, s, h), jnp.float32)] * 2,
          compiler_params=pltpu.CompilerParams(
              dimension_semantics=("parallel",) * 3 + ("arbitrary",) * 2),
          interpret=interpret,
      )(kv_lo, kv_hi, *mask_arrays, q_t, k_t, v_t, do_t, lse_r, delta_r)

    dq = jnp.transpose(dq_t, (0, 3, 1, 2, 4))
    dk = jnp.transpose(dk_t, (0, 2, 1, 3))
    dv = jnp.transpose(dv_t, (0, 2, 1, 3))
    return dq, dk, dv


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
