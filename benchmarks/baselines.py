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

* the block pairs come from :func:`ring_jax.schedule` (the ring's hops,
  concatenated: device ``d`` meets every K/V shard once), so masked block
  pairs are skipped exactly as in the ring;
* each block pair is computed by :class:`ring_jax.XlaHopKernel` (online
  softmax forward, FlashAttention-2 backward, float32 accumulation);
* a ``custom_vjp`` stores only ``(q, K_full, V_full, out, lse)``: memory is
  linear in the *global* length (the full K/V and its float32 gradients live
  on every device), against linear in the *local* length for the ring.

Call :func:`allgather_attention` inside ``jax.shard_map`` on local shards in
``layout`` order (like :func:`ring_jax.ring_attention`), or
:func:`allgather_attention_sharded` on global arrays.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import ring_jax
from ring_jax import layouts
from ring_jax.hop import HopMasks, HopSpec, XlaHopKernel, finalize, init_carry
from ring_jax.ring import default_block


@dataclasses.dataclass(frozen=True)
class _Config:
  axis_name: object
  ring_size: int
  layout: str
  spec: HopSpec


@functools.lru_cache(maxsize=64)
def allgather_pairs(layout: str, ring_size: int, local_len: int, block_q: int, block_kv: int,
                    is_causal: bool):
  """Block pairs of local queries x *gathered* K/V, per device.

  Returns numpy ``pairs [n, P, 2]`` (q block, global kv block of the gathered,
  layout-ordered K/V) and ``num_pairs [n]``; built from the ring's schedule:
  at hop ``h`` device ``d`` meets the shard of device ``(d - h) mod n``, whose
  blocks sit at offset ``src * local_len / block_kv`` in the gathered array.
  """
  sched = ring_jax.schedule(layout, ring_size, local_len, block_q, block_kv, is_causal)
  nk = local_len // block_kv
  per_dev = []
  for d in range(ring_size):
    rows = []
    for h in range(ring_size):
      src = (d - h) % ring_size
      pr = np.array(sched.pairs[d, h, :sched.num_pairs[d, h]], np.int32)
      pr[:, 1] += src * nk
      rows.append(pr)
    rows = np.concatenate(rows, 0)
    per_dev.append(rows[np.lexsort((rows[:, 1], rows[:, 0]))])  # q-block-major order
  num = np.array([len(r) for r in per_dev], np.int32)
  pairs = np.zeros((ring_size, max(1, num.max()), 2), np.int32)
  for d, r in enumerate(per_dev):
    pairs[d, :len(r)] = r
  return pairs, num


def _masks(cfg: _Config, t: int, device):
  n = cfg.ring_size
  pairs, num = allgather_pairs(cfg.layout, n, t, cfg.spec.block_q, cfg.spec.block_kv,
                               cfg.spec.is_causal)
  return HopMasks(
      q_positions=layouts.local_positions(cfg.layout, n, t, device),
      kv_positions=jnp.asarray(layouts.layout_positions(cfg.layout, n, t * n), jnp.int32),
      q_segment_ids=None, kv_segment_ids=None,
      pairs=jnp.asarray(pairs)[device], num_pairs=jnp.asarray(num)[device])


def _forward(cfg: _Config, q, k_full, v_full):
  device = jax.lax.axis_index(cfg.axis_name)
  masks = _masks(cfg, q.shape[1], device)
  carry = XlaHopKernel().forward(q, k_full, v_full, init_carry(q), masks, cfg.spec)
  return finalize(carry, q.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _local_attention(cfg: _Config, q, k_full, v_full):
  return _forward(cfg, q, k_full, v_full)[0]


def _local_fwd(cfg, q, k_full, v_full):
  out, lse = _forward(cfg, q, k_full, v_full)
  return out, (q, k_full, v_full, out, lse)


def _local_bwd(cfg, res, do):
  q, k_full, v_full, out, lse = res
  device = jax.lax.axis_index(cfg.axis_name)
  masks = _masks(cfg, q.shape[1], device)
  delta = jnp.sum(do.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
  dq = jnp.zeros(q.shape, jnp.float32)
  dk = jnp.zeros(k_full.shape, jnp.float32)
  dv = jnp.zeros(v_full.shape, jnp.float32)
  dq, dk, dv = XlaHopKernel().backward(q, k_full, v_full, do, lse, delta, masks, cfg.spec,
                                       dq, dk, dv)
  return dq.astype(q.dtype), dk.astype(k_full.dtype), dv.astype(v_full.dtype)


_local_attention.defvjp(_local_fwd, _local_bwd)


def allgather_attention(query, key, value, *, axis_name, is_causal: bool = False,
                        layout: str = "contiguous", block_q: int | None = None,
                        block_kv: int | None = None, scale: float | None = None,
                        precision=None):
  """All-gather context-parallel attention on local shards (inside ``shard_map``).

  Same arguments and result as :func:`ring_jax.ring_attention` (without
  segment ids / windows). Run the enclosing ``shard_map`` with
  ``check_vma=False`` (the custom_vjp creates its accumulators from zeros).
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
  q = query.reshape(b, t, kh, nh // kh, h)
  return _local_attention(cfg, q, k_full, v_full).reshape(b, t, nh, h)


def allgather_attention_sharded(query, key, value, *, mesh, seq_axis: str = "sequence",
                                is_causal: bool = False, layout: str = "contiguous",
                                inputs_in_layout: bool = False, block_q=None, block_kv=None):
  """:func:`allgather_attention` on global ``[B, L, N, H]`` arrays sharded over ``seq_axis``."""
  ring = mesh.shape[seq_axis]
  if not inputs_in_layout:
    query, key, value = (layouts.to_layout(x, layout, ring) for x in (query, key, value))
  spec = P(None, seq_axis, None, None)
  fn = jax.shard_map(
      functools.partial(allgather_attention, axis_name=seq_axis, is_causal=is_causal,
                        layout=layout, block_q=block_q, block_kv=block_kv),
      mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec, check_vma=False)
  out = fn(query, key, value)
  return out if inputs_in_layout else layouts.from_layout(out, layout, ring)
