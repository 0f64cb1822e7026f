"""Fused hop kernel for GPUs: our own Pallas kernels (Triton lowering).

Pallas' Triton backend is deprecated upstream (JAX's Pallas changelog: "will be removed in a
future version of JAX ... migrate to the Mosaic GPU backend"), so ``hop_kernel="auto"`` never
picks this kernel: on sm90/sm100 it runs tokamax's Mosaic GPU attention
(:mod:`ring_jax.kernels.tokamax_gpu`), elsewhere the XLA kernel. ``hop_kernel="pallas_gpu"``
keeps working as long as JAX ships the backend.

One hop of ring attention as three Pallas calls, in the structure of
``jax.experimental.pallas.ops.gpu.attention`` (FlashAttention-2):

* forward: grid ``(query blocks, batch, query heads)``; each program keeps one
  query block and its float32 ``(o, m, l)`` in registers and loops
  (``lax.fori_loop``) over the key/value blocks it can see;
* dQ: the same grid and loop, with the FINAL ``lse`` and ``delta = rowsum(dO * O) - dlse``;
* dK/dV: grid ``(key/value blocks, batch, kv heads)``; each program keeps one
  key/value block and loops over the ``G`` query heads of its group and over
  the query blocks that can see it, so K/V are never repeated for GQA/MQA and
  dK/dV are reduced over the group inside the kernel.

Semantics are the hop seam's (:mod:`ring_jax.hop`): separate
query / key segment ids (0 = padding, others compared by equality), causal and
``(left, right)`` window visibility from global token positions, query head
``n`` reads kv head ``n // G``, float32 accumulation, natural-log float32
``lse``. A row with no visible key in this hop gets ``out_h = 0`` and
``lse_h = -inf``; the backward takes the ring's final ``out`` and ``lse``
(``+inf`` for rows that saw no key anywhere, which makes their ``p`` 0).

Which blocks are visited: the hop's :class:`ring_jax.scheduling.BlockTable`
(``masks.blocks``, built once per hop by the ring): each query-block program
loops (:func:`ring_jax.hop.fold_blocks`) over its batch row's ``[lo, hi)``
range of key blocks, without the element mask on the fully visible run inside
it, and each key-block program over the matching range of query blocks. The
table's int32 ``[B, blocks, 4]`` rows are the only metadata; element masks are
computed inside the kernel from positions and segment ids. Nothing of size
``T x S`` exists outside a block.

Non-finite inputs follow :class:`ring_jax.kernels.xla.XlaHopKernel`: masked scores are
``-inf``, rows whose running max is still ``-inf`` subtract 0, and a masked
pair never carries a NaN/inf of V (forward) or of Q/K/V (backward) into an
output (the gradient matmuls read the finite part of their right operand; a
hop whose V holds a non-finite value, by ``masks.v_finite``, runs a forward
variant that marks exactly the rows that see it).

Triton constraints (checked by :meth:`PallasGpuHopKernel.check`): ``block_q``,
``block_kv`` and the head dim must be powers of two >= 16 (Triton tensors have
power-of-two sizes and ``tl.dot`` needs every matmul dimension >= 16), head dim
<= 256, blocks must divide the local lengths, dtype float32/bfloat16/float16.
With ``precision=None`` a float32 matmul on the GPU runs in TF32 (as XLA's
default on GPU does); pass ``precision=jax.lax.Precision.HIGHEST`` for IEEE
float32.

Interpret mode (chosen by the registry on a CPU backend; slow, for tests):
``pl.pallas_call(..., interpret=True)``; inside ``shard_map(check_vma=True)``
with inputs that vary over a manual axis, Pallas' interpreter (jax 0.10) fails
its manual-axis type checks, so :func:`_interpret_grid` runs the same kernel
functions over the grid as plain JAX instead.

Status: verified in interpret mode on CPU against a float64 oracle (one hop:
``tests/test_pallas_gpu.py``; one hop and rings of 2 and 4:
``tests/test_hop.py``), and the Triton lowering (Pallas -> Triton IR) is
exercised on CPU by exporting for the ``cuda`` platform. Compiling the Triton
IR to PTX and running it has NOT been checked on a GPU: no speed or
correctness claim on hardware yet.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ring_jax import hop, scheduling, topology

_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
_MAX_HEAD_DIM = 256


def _pallas(kernel, *, out_shape, grid, in_specs, out_specs, interpret, **kwargs):
  """``pl.pallas_call(kernel, ...)`` that also runs inside ``shard_map(check_vma=True)``.

  There every output must say which mesh axes it varies over and the inputs
  must agree: inputs are marked varying over the union of their axes and the
  outputs declared so (outside ``shard_map`` the union is empty). In interpret
  mode with varying inputs, Pallas' own interpreter (jax 0.10) fails its
  manual-axis checks, so :func:`_interpret_grid` runs the same kernel instead.
  """
  def call(*args):
    args = [hop.varying_like(x, *args) for x in args]
    vary = frozenset().union(*(hop._varying_axes(x) for x in args))
    if interpret and vary:
      return _interpret_grid(kernel, grid, in_specs, out_specs, out_shape, args)
    mat = jax.sharding.ManualAxisType(varying=vary)
    shapes = jax.tree.map(
        lambda o: jax.ShapeDtypeStruct(o.shape, o.dtype, manual_axis_type=mat), out_shape)
    return pl.pallas_call(kernel, out_shape=shapes, grid=grid, in_specs=in_specs,
                          out_specs=out_specs, interpret=interpret, **kwargs)(*args)
  return call


class _BlockRef:
  """One block as :func:`_interpret_grid` hands it to a kernel: the ref reads and whole-block
  writes the kernels in this module use (``[...]``, ``pl.ds`` slices, full slices, scalar
  indices)."""

  def __init__(self, value, dtype=None):
    self.value = value
    self.dtype = value.dtype if dtype is None else dtype

  def __getitem__(self, idx):
    if idx is Ellipsis:
      return self.value
    idx = idx if isinstance(idx, tuple) else (idx,)
    idx = idx + (slice(None),) * (self.value.ndim - len(idx))
    starts, sizes, keep = [], [], []
    for dim, ix in zip(self.value.shape, idx):
      if isinstance(ix, slice):
        if ix != slice(None):
          raise NotImplementedError(f"_BlockRef: slice {ix}")
        starts.append(0), sizes.append(dim), keep.append(dim)
      elif hasattr(ix, "size") and hasattr(ix, "start") and not hasattr(ix, "shape"):  # pl.ds
        starts.append(ix.start), sizes.append(ix.size), keep.append(ix.size)
      else:  # a scalar index drops the dimension
        starts.append(ix), sizes.append(1)
    return lax.dynamic_slice(self.value, starts, sizes).reshape(keep)

  def __setitem__(self, idx, value):
    if idx is not Ellipsis:
      raise NotImplementedError("_BlockRef: only whole-block writes")
    self.value = value


def _interpret_grid(kernel, grid, in_specs, out_specs, out_shape, args):
  """Runs ``kernel`` over ``grid`` in plain JAX, reading and writing blocks by the BlockSpecs.

  The interpret path inside ``shard_map(check_vma=True)``: Pallas' interpreter
  traces the kernel without manual axes and then trips over varying inputs;
  here the kernel is traced as ordinary JAX code, so varying values are typed
  as such. Program order is row-major over the grid; every output block is
  written exactly once (as in the kernels here).
  """
  single = not isinstance(out_shape, (list, tuple))
  out_shape = [out_shape] if single else list(out_shape)
  out_specs = [out_specs] if single else list(out_specs)

  def window(spec, ids):
    block_idx = spec.index_map(*ids)
    starts = [i if b is None else i * b for i, b in zip(block_idx, spec.block_shape)]
    sizes = [1 if b is None else b for b in spec.block_shape]
    kept = [b for b in spec.block_shape if b is not None]
    return starts, sizes, kept

  def body(flat, outs):
    ids, rest = [], flat
    for extent in reversed(grid):
      ids.append(rest % extent)
      rest = rest // extent
    ids = ids[::-1]
    in_refs = []
    for spec, x in zip(in_specs, args):
      starts, sizes, kept = window(spec, ids)
      in_refs.append(_BlockRef(lax.dynamic_slice(x, starts, sizes).reshape(kept)))
    out_refs = [_BlockRef(None, o.dtype) for o in out_shape]
    kernel(*in_refs, *out_refs)
    new = []
    for spec, out, ref in zip(out_specs, outs, out_refs):
      starts, sizes, _ = window(spec, ids)
      new.append(lax.dynamic_update_slice(out, ref.value.astype(out.dtype).reshape(sizes),
                                          starts))
    return new

  outs = [hop.varying_like(jnp.zeros(o.shape, o.dtype), *args) for o in out_shape]
  outs = lax.fori_loop(0, math.prod(grid), body, outs)
  return outs[0] if single else outs


def _is_pow2_at_least_16(x: int) -> bool:
  return x >= 16 and (x & (x - 1)) == 0


def _dot(a, b, precision, *, trans_a=False, trans_b=False):
  """``a @ b`` (optionally transposed operands) accumulated in float32, 2-D only."""
  dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
  return lax.dot_general(a, b, dims, precision=precision,
                         preferred_element_type=jnp.float32)


def _exp(x, y):
  """``exp(x - y)``; ``x = -inf`` (masked) and ``y = +inf`` (padding lse) give 0.

  Natural ``exp`` as in the XLA kernel (Triton: libdevice ``__nv_expf``). The
  base-2 form ``exp2(x * log2(e) - y * log2(e))`` (one FMA + ``ex2``, what
  FlashAttention's Triton kernels use) measured ~1.3x the XLA kernel's lse
  error at float32 rounding level in interpret mode, so it is not used until a
  GPU measurement shows the speed is worth it.
  """
  return jnp.exp(x - y)


def _finite(x):
  return jnp.where(jnp.isfinite(x), x, jnp.zeros_like(x))


def _visibility(q_pos, kv_pos, q_seg, kv_seg, is_causal, window):
  """bool ``[bq, bk]`` (None: everything visible), one block pair, inside a kernel."""
  mask = None
  if is_causal or window is not None:
    mask = scheduling.position_mask(q_pos, kv_pos, is_causal, window)
  if q_seg is not None:
    seg = scheduling.segment_mask(q_seg, kv_seg)
    mask = seg if mask is None else mask & seg
  return mask


def _per_row(ranges, batch: int):
  """A :class:`~ring_jax.scheduling.BlockTable`'s ``[R, n, 4]`` ranges for every batch row
  ``[B, n, 4]`` (each program runs one row)."""
  return jnp.broadcast_to(ranges, (batch, *ranges.shape[1:]))


# ----------------------------------------------------------------------------- kernels


def _fwd_kernel(*refs, scale, is_causal, window, block_kv, precision, has_seg, may_mask,
                guard_v):
  """One (query block, batch row, query head): ``out_h`` and natural-log ``lse_h``."""
  if has_seg:
    (ranges_ref, qpos_ref, kpos_ref, qseg_ref, kseg_ref,
     q_ref, k_ref, v_ref, o_ref, lse_ref) = refs
  else:
    (ranges_ref, qpos_ref, kpos_ref, q_ref, k_ref, v_ref, o_ref, lse_ref) = refs
    qseg_ref = kseg_ref = None
  q = q_ref[...]                                    # [bq, H] input dtype
  bq, h = q.shape
  q_pos = qpos_ref[...]
  q_seg = qseg_ref[...] if has_seg else None

  def body(j, carry, masked):
    o, m, l = carry
    start = pl.multiple_of(j * block_kv, block_kv)
    ks = pl.ds(start, block_kv)
    k = k_ref[ks, :]
    v = v_ref[ks, :]
    s = _dot(q, k, precision, trans_b=True) * scale           # [bq, bk] f32
    mask = None
    if masked:
      mask = _visibility(q_pos, kpos_ref[ks], q_seg,
                         kseg_ref[ks] if has_seg else None, is_causal, window)
      s = jnp.where(mask, s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    # A row that has seen no visible key keeps m = -inf: subtract 0 instead (exp(-inf) = 0,
    # not exp(-inf + inf) = NaN).
    m_ref = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p = _exp(s, m_ref[:, None])
    alpha = _exp(m, m_ref)
    l_new = alpha * l + jnp.sum(p, axis=1)
    if guard_v and mask is not None:
      # p = 0 at masked pairs, but 0 * NaN is NaN: read the finite part of V and mark
      # the rows that see a non-finite value through a visible pair.
      bad = jnp.logical_not(jnp.isfinite(v))
      pv = _dot(p.astype(v.dtype), jnp.where(bad, jnp.zeros_like(v), v), precision)
      reads_bad = _dot(mask.astype(jnp.float32), bad.astype(jnp.float32), precision) > 0
      pv = jnp.where(reads_bad, jnp.nan, pv)
    else:
      pv = _dot(p.astype(v.dtype), v, precision)
    return alpha[:, None] * o + pv, m_new, l_new

  # (varying_like: a no-op in a Pallas kernel; in _interpret_grid under shard_map the carry
  # must vary like the data.)
  init = tuple(hop.varying_like(x, q) for x in (jnp.zeros((bq, h), jnp.float32),
                                                 jnp.full((bq,), -jnp.inf, jnp.float32),
                                                 jnp.zeros((bq,), jnp.float32)))
  o, m, l = hop.fold_blocks(ranges_ref, body, init, may_mask)
  empty = l == 0  # no visible key in this hop (a NaN l is not mistaken for empty)
  l_safe = jnp.where(empty, 1.0, l)
  o_ref[...] = jnp.where(empty[:, None], 0.0, o / l_safe[:, None]).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(empty, -jnp.inf, m + jnp.log(l_safe))


def _dq_kernel(*refs, scale, is_causal, window, block_kv, precision, has_seg, may_mask):
  """One (query block, batch row, query head): this hop's float32 dQ."""
  if has_seg:
    (ranges_ref, qpos_ref, kpos_ref, qseg_ref, kseg_ref,
     q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref) = refs
  else:
    (ranges_ref, qpos_ref, kpos_ref,
     q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref) = refs
    qseg_ref = kseg_ref = None
  q = q_ref[...]
  do = do_ref[...]
  bq, h = q.shape
  lse = lse_ref[...]                                # +inf (padding): p = 0
  delta = delta_ref[...]
  q_pos = qpos_ref[...]
  q_seg = qseg_ref[...] if has_seg else None

  def body(j, dq, masked):
    fin = _finite if masked else (lambda x: x)  # fully visible: the raw operands are right
    start = pl.multiple_of(j * block_kv, block_kv)
    ks = pl.ds(start, block_kv)
    k = k_ref[ks, :]
    v = v_ref[ks, :]
    s = _dot(q, k, precision, trans_b=True) * scale
    p = _exp(s, lse[:, None])
    if masked:
      mask = _visibility(q_pos, kpos_ref[ks], q_seg,
                         kseg_ref[ks] if has_seg else None, is_causal, window)
      p = jnp.where(mask, p, 0.0)
    dp = _dot(do, fin(v), precision, trans_b=True)
    ds = (p * (dp - delta[:, None]) * scale).astype(q.dtype)
    return dq + _dot(ds, fin(k), precision)

  dq = hop.fold_blocks(ranges_ref, body, hop.varying_like(jnp.zeros((bq, h), jnp.float32), q),
                       may_mask)
  dq_ref[...] = dq


def _dkv_kernel(*refs, scale, is_causal, window, block_q, groups, precision, has_seg,
                may_mask):
  """One (key block, batch row, kv head): this hop's float32 dK, dV, summed over the group."""
  if has_seg:
    (ranges_ref, qpos_ref, kpos_ref, qseg_ref, kseg_ref,
     q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref) = refs
  else:
    (ranges_ref, qpos_ref, kpos_ref,
     q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref) = refs
    qseg_ref = kseg_ref = None
  k = k_ref[...]                                    # [bk, H]
  v = v_ref[...]
  v_fin = _finite(v) if may_mask else v
  bk, h = k.shape
  kv_pos = kpos_ref[...]
  kv_seg = kseg_ref[...] if has_seg else None

  def head(g, carry):
    def body(i, carry, masked):
      fin = _finite if masked else (lambda x: x)  # fully visible: the raw operands are right
      dk, dv = carry
      start = pl.multiple_of(i * block_q, block_q)
      qs = pl.ds(start, block_q)
      q = q_ref[qs, g, :]                           # [bq, H]
      do = do_ref[qs, g, :]
      lse = lse_ref[qs, g]
      delta = delta_ref[qs, g]
      s = _dot(q, k, precision, trans_b=True) * scale
      p = _exp(s, lse[:, None])
      if masked:
        mask = _visibility(qpos_ref[qs], kv_pos, qseg_ref[qs] if has_seg else None, kv_seg,
                           is_causal, window)
        p = jnp.where(mask, p, 0.0)
      dv = dv + _dot(p.astype(do.dtype), do, precision, trans_a=True)
      dp = _dot(do, v_fin if masked else v, precision, trans_b=True)
      ds = (p * (dp - delta[:, None]) * scale).astype(q.dtype)
      dk = dk + _dot(ds, fin(q), precision, trans_a=True)
      return dk, dv

    return hop.fold_blocks(ranges_ref, body, carry, may_mask)

  zeros = hop.varying_like(jnp.zeros((bk, h), jnp.float32), k)
  dk, dv = lax.fori_loop(0, groups, head, (zeros, zeros))
  dk_ref[...] = dk
  dv_ref[...] = dv


# ----------------------------------------------------------------------------- the kernel


@dataclasses.dataclass(frozen=True)
class PallasGpuHopKernel:
  """Fused FlashAttention-2 style hop kernel for GPUs (Pallas, Triton lowering).

  Implements the hop-kernel protocol (``check`` / ``forward`` / ``backward``;
  shapes in :mod:`ring_jax.hop`). ``interpret=None`` runs the kernels in
  Pallas interpret mode on a CPU backend (slow; for tests) and compiles them
  with Triton otherwise. ``num_warps`` (default 4 for head dim <= 64, else 8)
  and ``num_stages`` are Triton tuning knobs. Not run on GPU hardware yet (see
  the module docstring).
  """

  name: ClassVar[str] = "pallas_gpu"
  interpret: bool | None = None
  num_warps: int | None = None
  num_stages: int = 2

  # --------------------------------------------------------------------------- checks

  def check(self, q_shape, kv_shape, dtype, spec) -> None:
    """Raises ``ValueError`` (naming the fix) for shapes Triton cannot take."""
    if len(q_shape) != 5 or len(kv_shape) != 4:
      raise ValueError(
          f"pallas_gpu hop kernel: expected q [B, T, K, G, H] and k/v [B, S, K, H], got "
          f"q {tuple(q_shape)} and k/v {tuple(kv_shape)}.")
    b, t, kh, _, h = q_shape
    bkv, s, kkv, hkv = kv_shape
    if (b, kh, h) != (bkv, kkv, hkv):
      raise ValueError(
          f"pallas_gpu hop kernel: q {tuple(q_shape)} and k/v {tuple(kv_shape)} disagree on "
          "batch, kv heads or head dim.")
    if jnp.dtype(dtype) not in [jnp.dtype(d) for d in _DTYPES]:
      raise ValueError(
          f"pallas_gpu hop kernel: dtype {jnp.dtype(dtype).name} is not supported (Triton "
          "matmuls take float32, bfloat16 or float16); cast the inputs or use "
          "hop_kernel='xla'.")
    if not _is_pow2_at_least_16(h) or h > _MAX_HEAD_DIM:
      raise ValueError(
          f"pallas_gpu hop kernel: head dim {h} must be a power of two in [16, "
          f"{_MAX_HEAD_DIM}] (Triton tensors have power-of-two sizes and tl.dot needs "
          "dimensions >= 16); pad the head dim or use hop_kernel='xla'.")
    for name, block, length, what in (("block_q", spec.block_q, t, "local query length"),
                                      ("block_kv", spec.block_kv, s, "local key length")):
      if not _is_pow2_at_least_16(block):
        raise ValueError(
            f"pallas_gpu hop kernel: {name}={block} must be a power of two >= 16 (Triton "
            f"tensor sizes are powers of two, tl.dot needs >= 16); e.g. {name}=64 or 128.")
      if length % block:
        raise ValueError(
            f"pallas_gpu hop kernel: {name}={block} must divide the {what} {length}; pick "
            f"a power-of-two block that divides {length}, or pad the sequence.")

  # --------------------------------------------------------------------------- helpers

  def _interpret(self) -> bool:
    if self.interpret is not None:
      return self.interpret
    return topology.target_platform() == "cpu"

  def _compiler_params(self, head_dim):
    num_warps = self.num_warps if self.num_warps is not None else (4 if head_dim <= 64 else 8)
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=self.num_stages)

  @staticmethod
  def _mask_operands(masks, has_seg):
    ops = [masks.q_positions.astype(jnp.int32), masks.kv_positions.astype(jnp.int32)]
    if has_seg:
      ops += [masks.q_segment_ids, masks.kv_segment_ids]
    return ops

  # --------------------------------------------------------------------------- forward

  def forward(self, q, k, v, masks, spec):
    """Returns ``(out_h [B,T,K,G,H] f32, lse_h [B,T,K,G] f32)`` of this hop."""
    b, t, kh, g, h = q.shape
    s = k.shape[1]
    n = kh * g
    bq = spec.block_q
    nq = t // bq
    has_seg = masks.q_segment_ids is not None
    table = masks.table()
    q_ranges = _per_row(table.q_ranges, b)
    q_BTNH = q.reshape(b, t, n, h)

    def call(guard_v: bool):
      kernel = functools.partial(
          _fwd_kernel, scale=float(spec.scale), is_causal=spec.is_causal, window=spec.window,
          block_kv=spec.block_kv, precision=spec.precision, has_seg=has_seg,
          may_mask=table.may_mask, guard_v=guard_v)
      in_specs = [pl.BlockSpec((None, None, 4), lambda i, bi, ni: (bi, i, 0)),  # kv block ranges
                  pl.BlockSpec((bq,), lambda i, bi, ni: (i,)),            # q positions
                  pl.BlockSpec((s,), lambda i, bi, ni: (0,))]             # kv positions
      if has_seg:
        in_specs += [pl.BlockSpec((None, bq), lambda i, bi, ni: (bi, i)),
                     pl.BlockSpec((None, s), lambda i, bi, ni: (bi, 0))]
      in_specs += [
          pl.BlockSpec((None, bq, None, h), lambda i, bi, ni: (bi, i, ni, 0)),
          pl.BlockSpec((None, s, None, h), lambda i, bi, ni: (bi, 0, lax.div(ni, g), 0)),
          pl.BlockSpec((None, s, None, h), lambda i, bi, ni: (bi, 0, lax.div(ni, g), 0)),
      ]
      out_specs = [pl.BlockSpec((None, bq, None, h), lambda i, bi, ni: (bi, i, ni, 0)),
                   pl.BlockSpec((None, bq, None), lambda i, bi, ni: (bi, i, ni))]
      out_shape = [jax.ShapeDtypeStruct((b, t, n, h), jnp.float32),
                   jax.ShapeDtypeStruct((b, t, n), jnp.float32)]
      return _pallas(
          kernel, grid=(nq, b, n), in_specs=in_specs, out_specs=out_specs,
          out_shape=out_shape, compiler_params=self._compiler_params(h),
          interpret=self._interpret(), name="pallas_gpu_hop_fwd",
      )(q_ranges, *self._mask_operands(masks, has_seg), q_BTNH, k, v)

    with jax.named_scope("pallas_gpu_hop_fwd"):
      if table.may_mask:
        # Only a hop whose V holds a non-finite value pays for the guarded matmul.
        out, lse = lax.cond(hop.v_is_finite(masks, v), lambda: call(False), lambda: call(True))
      else:
        out, lse = call(False)
    return out.reshape(b, t, kh, g, h), lse.reshape(b, t, kh, g)

  # --------------------------------------------------------------------------- backward

  def backward(self, q, k, v, masks, spec, res: hop.HopResiduals,
               acc: hop.HopGrads) -> hop.HopGrads:
    """Returns the float32 accumulators ``acc`` plus this hop's ``(dq [B,T,K,G,H],
    dk [B,S,K,H], dv [B,S,K,H])``.

    ``res.out`` / ``res.lse`` are the ring's FINAL output and log-sum-exp
    (``lse = +inf`` on rows that saw no key); ``res.dlse`` the lse cotangent or
    None. ``delta = rowsum(dO * O) - dlse`` (:func:`ring_jax.hop.backward_delta`)
    is computed here in XLA, one fused elementwise pass, and read by both kernels.
    """
    b, t, kh, g, h = q.shape
    s = k.shape[1]
    n = kh * g
    bq, bk = spec.block_q, spec.block_kv
    nq, nk = t // bq, s // bk
    has_seg = masks.q_segment_ids is not None
    table = masks.table()
    q_ranges, kv_ranges = _per_row(table.q_ranges, b), _per_row(table.kv_ranges, b)
    delta = hop.backward_delta(res.out, res.do, res.dlse)
    q_BTNH = q.reshape(b, t, n, h)
    do_BTNH = res.do.reshape(b, t, n, h)
    lse_BTN = res.lse.astype(jnp.float32).reshape(b, t, n)
    delta_BTN = delta.reshape(b, t, n)
    statics = dict(scale=float(spec.scale), is_causal=spec.is_causal, window=spec.window,
                   precision=spec.precision, has_seg=has_seg, may_mask=table.may_mask)
    params = self._compiler_params(h)
    mask_ops = self._mask_operands(masks, has_seg)

    # dQ: grid over (query blocks, batch, query heads), loop over visible kv blocks.
    dq_specs = [pl.BlockSpec((None, None, 4), lambda i, bi, ni: (bi, i, 0)),
                pl.BlockSpec((bq,), lambda i, bi, ni: (i,)),
                pl.BlockSpec((s,), lambda i, bi, ni: (0,))]
    if has_seg:
      dq_specs += [pl.BlockSpec((None, bq), lambda i, bi, ni: (bi, i)),
                   pl.BlockSpec((None, s), lambda i, bi, ni: (bi, 0))]
    q_blk = pl.BlockSpec((None, bq, None, h), lambda i, bi, ni: (bi, i, ni, 0))
    kv_all = pl.BlockSpec((None, s, None, h), lambda i, bi, ni: (bi, 0, lax.div(ni, g), 0))
    row_blk = pl.BlockSpec((None, bq, None), lambda i, bi, ni: (bi, i, ni))
    dq_specs += [q_blk, kv_all, kv_all, q_blk, row_blk, row_blk]
    with jax.named_scope("pallas_gpu_hop_bwd_dq"):
      dq = _pallas(
          functools.partial(_dq_kernel, block_kv=bk, **statics),
          grid=(nq, b, n), in_specs=dq_specs, out_specs=q_blk,
          out_shape=jax.ShapeDtypeStruct((b, t, n, h), jnp.float32),
          compiler_params=params, interpret=self._interpret(), name="pallas_gpu_hop_bwd_dq",
      )(q_ranges, *mask_ops, q_BTNH, k, v, do_BTNH, lse_BTN, delta_BTN)

    # dK/dV: grid over (kv blocks, batch, kv heads), loop over the group's G query heads
    # and the query blocks that can see this kv block.
    dkv_specs = [pl.BlockSpec((None, None, 4), lambda j, bi, ki: (bi, j, 0)),
                 pl.BlockSpec((t,), lambda j, bi, ki: (0,)),
                 pl.BlockSpec((bk,), lambda j, bi, ki: (j,))]
    if has_seg:
      dkv_specs += [pl.BlockSpec((None, t), lambda j, bi, ki: (bi, 0)),
                    pl.BlockSpec((None, bk), lambda j, bi, ki: (bi, j))]
    q_grp = pl.BlockSpec((None, t, g, h), lambda j, bi, ki: (bi, 0, ki, 0))
    kv_blk = pl.BlockSpec((None, bk, None, h), lambda j, bi, ki: (bi, j, ki, 0))
    row_grp = pl.BlockSpec((None, t, g), lambda j, bi, ki: (bi, 0, ki))
    dkv_specs += [q_grp, kv_blk, kv_blk, q_grp, row_grp, row_grp]
    with jax.named_scope("pallas_gpu_hop_bwd_dkv"):
      dk, dv = _pallas(
          functools.partial(_dkv_kernel, block_q=bq, groups=g, **statics),
          grid=(nk, b, kh), in_specs=dkv_specs, out_specs=[kv_blk, kv_blk],
          out_shape=[jax.ShapeDtypeStruct((b, s, kh, h), jnp.float32)] * 2,
          compiler_params=params, interpret=self._interpret(), name="pallas_gpu_hop_bwd_dkv",
      )(kv_ranges, *mask_ops, q_BTNH, k, v, do_BTNH, lse_BTN, delta_BTN)
    # Fresh per-hop buffers added to the accumulators here (XLA fuses the adds); the
    # kernels could alias them instead (input_output_aliases) to save one buffer each.
    return hop.HopGrads(acc.dq + dq.reshape(b, t, kh, g, h), acc.dk + dk, acc.dv + dv)


def make_kernel(platform: str) -> PallasGpuHopKernel:
  """The registry's factory: interpret mode on ``"cpu"`` (slow; for tests), Triton on ``"gpu"``.

  Raises ``ValueError`` on other platforms (Triton kernels run on GPUs only).
  """
  if platform == "cpu":
    return PallasGpuHopKernel(interpret=True)
  if platform in ("gpu", "cuda", "rocm"):
    return PallasGpuHopKernel(interpret=False)
  raise ValueError(
      f"hop_kernel='pallas_gpu' runs on GPUs (Triton) or in interpret mode on CPU, not on "
      f"{platform!r}; use hop_kernel='pallas_tpu' on TPU, or 'xla' anywhere.")
