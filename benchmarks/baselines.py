"""Context-parallel baselines the ring is measured against.

All-gather context parallelism (what MaxText's ``context`` axis and
TransformerEngine's ``cp_comm_type="all_gather"`` default to): every device
keeps its local queries, gathers the *whole* key/value sequence with
``jax.lax.all_gather`` over the sequence axis, and runs local blockwise
attention of its queries against the full K/V. The backward pass computes
dK/dV for the full sequence on every device and reduce-scatters them back
(the transpose of ``all_gather``, inserted by autodiff).

The local attention reuses ring_jax's blockwise machinery so that the only
difference to the ring is the communication pattern and what is resident:

* the gathered K/V is attended shard by shard with the ring's masks (the
  ring's hops without the transfers, merged in float32), so masked block
  pairs are skipped exactly as in the ring;
* each shard is attended with :class:`ring_jax.XlaHopKernel` (online
  softmax forward, FlashAttention-2 backward, float32 accumulation);
* a ``custom_vjp`` stores only ``(q, K_full, V_full, out, lse)``: memory is
  linear in the *global* length (the full K/V and its float32 gradients live
  on every device), against linear in the *local* length for the ring.

Call :func:`allgather_attention` inside ``jax.shard_map`` on local shards in
``layout`` order (like :func:`ring_jax.ring_attention`), or
:func:`allgather_attention_sharded` on global arrays. For the LLaMA of
``models/``, :func:`register_attention_backend` adds :func:`allgather_backend`
to :data:`models.attention.ATTENTION_BACKENDS` as ``"allgather"``, so
``LlamaConfig(attention="allgather")`` runs the shipped model and train step
with this attention (``benchmarks/train_throughput.py`` does).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ring_jax import layouts
from ring_jax.hop import HopMasks, HopSpec, empty_result, lse_for_backward, merge
from ring_jax.kernels import XlaHopKernel
from ring_jax.ring import default_block


@dataclasses.dataclass(frozen=True)
class _Config:
  axis_name: object
  ring_size: int
  layout: str
  spec: HopSpec


def _masks(cfg: _Config, t: int, device, src, q_seg, kv_seg_full):
  """Masks of the local queries against the gathered shard that started on device ``src``."""
  n = cfg.ring_size
  kv_seg = None
  if kv_seg_full is not None:
    kv_seg = jax.lax.dynamic_slice_in_dim(kv_seg_full, src * t, t, axis=1)
  return HopMasks(
      q_positions=layouts.local_positions(cfg.layout, n, t, device),
      kv_positions=layouts.local_positions(cfg.layout, n, t, src),
      q_segment_ids=q_seg, kv_segment_ids=kv_seg)


def _shard(x, src, t):
  return jax.lax.dynamic_slice_in_dim(x, src * t, t, axis=1)


def _forward(cfg: _Config, q, k_full, v_full, q_seg, kv_seg_full):
  """The gathered K/V, shard by shard (the ring's hops without the transfers), merged in
  float32: the same block pairs as the ring computes."""
  device = jax.lax.axis_index(cfg.axis_name)
  t = q.shape[1]

  def body(src, acc):
    masks = _masks(cfg, t, device, src, q_seg, kv_seg_full)
    out_h, lse_h = XlaHopKernel().forward(q, _shard(k_full, src, t), _shard(v_full, src, t),
                                          masks, cfg.spec)
    return merge(*acc, out_h, lse_h)

  out, lse = jax.lax.fori_loop(0, cfg.ring_size, body, empty_result(q))
  return out.astype(q.dtype), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _local_attention(cfg: _Config, q, k_full, v_full, q_seg, kv_seg_full):
  return _forward(cfg, q, k_full, v_full, q_seg, kv_seg_full)[0]


def _local_fwd(cfg, q, k_full, v_full, q_seg, kv_seg_full):
  out, lse = _forward(cfg, q, k_full, v_full, q_seg, kv_seg_full)
  return out, (q, k_full, v_full, q_seg, kv_seg_full, out, lse)


def _local_bwd(cfg, res, do):
  q, k_full, v_full, q_seg, kv_seg_full, out, lse = res
  device = jax.lax.axis_index(cfg.axis_name)
  t = q.shape[1]
  lse = lse_for_backward(lse)

  def body(src, acc):
    dq, dk, dv = acc
    masks = _masks(cfg, t, device, src, q_seg, kv_seg_full)
    dq_h, dk_h, dv_h = XlaHopKernel().backward(q, _shard(k_full, src, t), _shard(v_full, src, t),
                                               out, lse, do, None, masks, cfg.spec)
    dk = jax.lax.dynamic_update_slice_in_dim(dk, dk_h, src * t, axis=1)
    dv = jax.lax.dynamic_update_slice_in_dim(dv, dv_h, src * t, axis=1)
    return dq + dq_h, dk, dv

  init = (jnp.zeros(q.shape, jnp.float32), jnp.zeros(k_full.shape, jnp.float32),
          jnp.zeros(v_full.shape, jnp.float32))
  dq, dk, dv = jax.lax.fori_loop(0, cfg.ring_size, body, init)
  # Segment ids are integers: no cotangent (None).
  return dq.astype(q.dtype), dk.astype(k_full.dtype), dv.astype(v_full.dtype), None, None


_local_attention.defvjp(_local_fwd, _local_bwd)


def allgather_attention(query, key, value, *, axis_name, is_causal: bool = False,
                        segment_ids=None, layout: str = "contiguous",
                        block_q: int | None = None, block_kv: int | None = None,
                        scale: float | None = None, precision=None):
  """All-gather context-parallel attention on local shards (inside ``shard_map``).

  Same arguments and result as :func:`ring_jax.ring_attention` (without
  windows); ``segment_ids`` are the local ``[B, T]`` ids (0 = padding),
  gathered like K/V. Run the enclosing ``shard_map`` with ``check_vma=False``
  (the custom_vjp creates its accumulators from zeros).
  """
  n = jax.lax.axis_size(axis_name)
  b, t, nh, h = query.shape
  kh = key.shape[2]
  layouts.check_length(layout, n, n * t, "query length")
  if key.shape[1] != t:
    raise ValueError("the all-gather baseline needs equal local query and key lengths.")
  block_q = default_block(layout, t) if block_q is None else block_q
  block_kv = default_block(layout, t) if block_kv is None else block_kv
  spec = HopSpec(scale=float(h ** -0.5 if scale is None else scale), is_causal=bool(is_causal),
                 window=None, block_q=int(block_q), block_kv=int(block_kv), precision=precision)
  cfg = _Config(axis_name=axis_name, ring_size=n, layout=layout, spec=spec)
  k_full = jax.lax.all_gather(key, axis_name, axis=1, tiled=True)    # [B, L, K, H]
  v_full = jax.lax.all_gather(value, axis_name, axis=1, tiled=True)
  q_seg = kv_seg_full = None
  if segment_ids is not None:
    q_seg = segment_ids.astype(jnp.int32)
    kv_seg_full = jax.lax.all_gather(q_seg, axis_name, axis=1, tiled=True)  # [B, L]
  q = query.reshape(b, t, kh, nh // kh, h)
  return _local_attention(cfg, q, k_full, v_full, q_seg, kv_seg_full).reshape(b, t, nh, h)


def allgather_attention_sharded(query, key, value, *, mesh, seq_axis: str = "sequence",
                                is_causal: bool = False, segment_ids=None,
                                layout: str = "contiguous", inputs_in_layout: bool = False,
                                block_q=None, block_kv=None):
  """:func:`allgather_attention` on global ``[B, L, N, H]`` arrays sharded over ``seq_axis``."""
  ring = mesh.shape[seq_axis]
  if not inputs_in_layout:
    query, key, value = (layouts.to_layout(x, layout, ring) for x in (query, key, value))
    if segment_ids is not None:
      segment_ids = layouts.to_layout(segment_ids, layout, ring)
  spec, row = P(None, seq_axis, None, None), P(None, seq_axis)
  out = _shard_mapped(mesh, spec, spec, row, segment_ids is not None, axis_name=seq_axis,
                      is_causal=is_causal, layout=layout, block_q=block_q,
                      block_kv=block_kv)(query, key, value, segment_ids)
  return out if inputs_in_layout else layouts.from_layout(out, layout, ring)


def _shard_mapped(mesh, q_spec, kv_spec, row_spec, has_segments: bool, **kwargs):
  """``fn(q, k, v, segment_ids)``: :func:`allgather_attention` under ``shard_map``."""
  if has_segments:
    return jax.shard_map(
        lambda q, k, v, seg: allgather_attention(q, k, v, segment_ids=seg, **kwargs), mesh=mesh,
        in_specs=(q_spec, kv_spec, kv_spec, row_spec), out_specs=q_spec, check_vma=False)

  def no_segments(q, k, v, segment_ids):
    del segment_ids  # None
    return jax.shard_map(functools.partial(allgather_attention, **kwargs), mesh=mesh,
                         in_specs=(q_spec, kv_spec, kv_spec), out_specs=q_spec,
                         check_vma=False)(q, k, v)
  return no_segments


def allgather_backend(cfg, q_BLNH, k_BLKH, v_BLKH, positions_BL, segment_ids_BL):
  """The all-gather baseline as a :mod:`models.attention` backend (same contract as ``"ring"``).

  Shards the sequence over the mesh axis the ``length`` rule names, batch and
  heads per the rules, as the ring backend does; without such an axis it
  falls back to the dense backend, as the ring does. Masks come from the
  layout's positions and the segment ids (documents are contiguous, so this
  equals causal masking by per-document ``positions_BL``).
  """
  from models import attention as attn_lib  # Local: the kernel above needs no models/.
  from models import sharding as shd

  mesh = shd.current_mesh()
  seq_axis = attn_lib.sequence_axis(mesh)
  if seq_axis is None:
    return attn_lib.dense(cfg, q_BLNH, k_BLKH, v_BLKH, positions_BL, segment_ids_BL)
  batch_axis, head_axis = attn_lib.sharded_axes(mesh, q_BLNH, k_BLKH)
  kv_head_axis = head_axis if head_axis and k_BLKH.shape[2] % mesh.shape[head_axis] == 0 else None
  q_spec = P(batch_axis, seq_axis, head_axis, None)
  kv_spec = P(batch_axis, seq_axis, kv_head_axis, None)
  fn = _shard_mapped(mesh, q_spec, kv_spec, P(batch_axis, seq_axis), segment_ids_BL is not None,
                     axis_name=seq_axis, is_causal=True, layout=cfg.layout, block_q=cfg.block_q,
                     block_kv=cfg.block_kv)
  return fn(q_BLNH, k_BLKH, v_BLKH, segment_ids_BL)


ALLGATHER = "allgather"


def register_attention_backend() -> str:
  """Registers :func:`allgather_backend` in :data:`models.attention.ATTENTION_BACKENDS`.

  Idempotent; returns the backend's name, ``"allgather"``.
  """
  from models import attention as attn_lib

  attn_lib.register_attention(ALLGATHER, allgather_backend)
  return ALLGATHER
