"""Sequence-parallel attention strategies behind one call: ring, all-gather, Ulysses, hybrid.

Each strategy computes exact attention over a sequence sharded along a mesh
axis; they differ in what travels and what is resident on a device:

* ``"ring"`` (:func:`ring_jax.ring_attention`): K/V shards travel around the
  axis with ``ppermute``, overlapped with the hop's compute; memory linear in
  the *local* length.
* ``"all_gather"`` (:func:`all_gather_attention`): every device gathers the
  whole K/V (and key segment ids) with ``all_gather`` and attends its local
  queries to it; the backward gathers K/V again and ``psum_scatter`` s the
  float32 dK/dV home (MaxText's ``context`` axis, TransformerEngine's
  ``cp_comm_type="all_gather"``). Memory linear in the *global* length (full
  K/V and, in the backward, its float32 gradients on every device).
* ``"ulysses"`` (:func:`ulysses_attention`): ``all_to_all`` from
  sequence-sharded to head-sharded, full-sequence attention on ``N/u`` heads
  per device, ``all_to_all`` back (Jacobs et al., "DeepSpeed Ulysses", 2023).
  Needs the query heads divisible by the axis size ``u``; key/value heads are
  either divisible by ``u`` or divide it, in which case they are repeated up to
  ``u`` heads first (as USP does; Fang & Zhao, "USP", 2024).
* ``"hybrid"`` (:func:`hybrid_attention`): ``axis_name=(ring_axis,
  ulysses_axis)``: Ulysses inside the inner axis (its ``all_to_all`` gathers
  the sequence of the ring position's shard), the ring across the outer one.

All local attention reuses the ring's blockwise machinery (a
:class:`ring_jax.HopKernel`, the XLA one by default, with the block pairs of
:class:`ring_jax.scheduling.BlockTable` computed from global token positions),
so causal / window / document skipping, layouts and GQA behave the same in
every strategy. :func:`attention_sharded` runs any of them (or the one
:func:`ring_jax.plan` picks) on global arrays.

Layouts inside ``shard_map``: as for :func:`ring_jax.ring_attention`, the
local shards are in ``layout`` order over the sequence axis (for the hybrid:
layout order for the *ring* axis's size, split further over the Ulysses axis
in device order).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ring_jax import kernels
from ring_jax import layouts
from ring_jax import planning
from ring_jax import scheduling
from ring_jax import validation
from ring_jax import hop as hop_lib
from ring_jax.hop import HopKernel, HopMasks, HopSpec
from ring_jax.ring import default_block, ring_attention
from ring_jax import sharded
from ring_jax.sharded import ring_attention_sharded

#: The strategies :func:`attention_sharded` accepts; "auto" asks :func:`ring_jax.plan`.
STRATEGIES = planning.STRATEGIES


# ------------------------------------------------------------------------------------------
# Local blockwise attention against a whole (gathered) K/V, as one custom_vjp
# ------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _LocalConfig:
  spec: HopSpec
  kernel: HopKernel
  gather_axis: object = None  # all_gather: K/V (and kv ids) are gathered over this axis


def _varying_axes(x) -> frozenset:
  return frozenset(jax.typeof(x).manual_axis_type.varying)


def _kernel(hop_kernel) -> HopKernel:
  """The hop kernel to run (a name from the registry or an instance; None: the default)."""
  return kernels.get_hop_kernel("auto" if hop_kernel is None else hop_kernel)


def _masks(cfg: _LocalConfig, q_pos, kv_pos, q_seg, kv_seg) -> HopMasks:
  """Positions and ids of (queries at ``q_pos``) x (keys at ``kv_pos``)."""
  return HopMasks.build(cfg.spec, q_pos, kv_pos, q_seg, kv_seg)


def _gather(cfg: _LocalConfig, k, v, kv_seg):
  if cfg.gather_axis is None:
    return k, v, kv_seg
  with jax.named_scope("gather_kv"):
    g = functools.partial(jax.lax.all_gather, axis_name=cfg.gather_axis, axis=1, tiled=True)
    return g(k), g(v), None if kv_seg is None else g(kv_seg)


def _local_forward(cfg: _LocalConfig, q, k, v, q_pos, kv_pos, q_seg, kv_seg):
  """``(out [B,T,K,G,H], lse [B,T,K,G])``; K/V gathered first when ``cfg.gather_axis``."""
  k, v, kv_seg = _gather(cfg, k, v, kv_seg)
  masks = _masks(cfg, q_pos, kv_pos, q_seg, kv_seg)
  cfg.kernel.check(q.shape, k.shape, q.dtype, cfg.spec)
  out, lse = cfg.kernel.forward(q, k, v, masks, cfg.spec)  # empty rows: (0, -inf)
  return out.astype(q.dtype), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _local_attention(cfg: _LocalConfig, q, k, v, q_pos, kv_pos, q_seg, kv_seg):
  return _local_forward(cfg, q, k, v, q_pos, kv_pos, q_seg, kv_seg)[0]


def _local_fwd(cfg, q, k, v, q_pos, kv_pos, q_seg, kv_seg):
  out, lse = _local_forward(cfg, q, k, v, q_pos, kv_pos, q_seg, kv_seg)
  # Residuals hold the *local* K/V: the all-gather variant gathers again in the backward
  # rather than keeping the whole sequence's K/V alive between the passes.
  return out, (q, k, v, q_pos, kv_pos, q_seg, kv_seg, out, lse)


def _local_bwd(cfg, res, do):
  q, k_local, v_local, q_pos, kv_pos, q_seg, kv_seg_local, out, lse = res
  k, v, kv_seg = _gather(cfg, k_local, v_local, kv_seg_local)
  masks = _masks(cfg, q_pos, kv_pos, q_seg, kv_seg)
  dq, dk, dv = cfg.kernel.backward(q, k, v, masks, cfg.spec,
                                   hop_lib.HopResiduals(out, hop_lib.lse_for_backward(lse), do),
                                   hop_lib.zero_grads(q, k, v))
  if cfg.gather_axis is not None:
    with jax.named_scope("scatter_dkv"):  # transpose of the all_gather: sum, keep own shard
      dk, dv = (jax.lax.psum_scatter(x, cfg.gather_axis, scatter_dimension=1, tiled=True)
                for x in (dk, dv))
  extra = tuple(sorted(_varying_axes(dk) - _varying_axes(k_local), key=str))
  if extra:  # K/V replicated over axes the queries are split over (MQA on a tensor axis)
    dk, dv = jax.lax.psum((dk, dv), extra)
  return (dq.astype(q.dtype), dk.astype(k_local.dtype), dv.astype(v_local.dtype), None, None,
          None, None)


_local_attention.defvjp(_local_fwd, _local_bwd)


def _hop_spec(query, *, is_causal, scale, local_window_size, block_q, block_kv, precision,
              length, layout, local_len) -> HopSpec:
  window = scheduling.normalize_window(local_window_size)
  scale = validation.check_scale(scale, query.shape[-1], "float32")
  # Blocks dividing a device's (layout) chunk never straddle two chunks of the sequence.
  block_q = default_block(layout, local_len) if block_q is None else block_q
  block_kv = default_block(layout, local_len) if block_kv is None else block_kv
  validation.check_block("block_q", block_q, length)
  validation.check_block("block_kv", block_kv, length)
  return HopSpec(scale=scale, is_causal=bool(is_causal), window=window, block_q=int(block_q),
                 block_kv=int(block_kv), precision=precision)


def _axis_size(axis_name, who: str) -> int:
  try:
    return jax.lax.axis_size(axis_name)
  except NameError as e:
    raise ValueError(
        f"axis_name={axis_name!r} is not a mesh axis bound here: call {who} inside "
        "jax.shard_map over a mesh with that axis (or use ring_jax.attention_sharded).") from e


# ------------------------------------------------------------------------------------------
# Strategies inside shard_map
# ------------------------------------------------------------------------------------------


def all_gather_attention(query, key, value, *, axis_name, is_causal: bool = False,
                         segment_ids=None, scale: float | None = None, local_window_size=None,
                         layout: str = "contiguous", block_q: int | None = None,
                         block_kv: int | None = None, precision=None,
                         hop_kernel: HopKernel | None = None):
  """All-gather context parallelism on local shards (inside ``jax.shard_map``).

  Same arguments and result as :func:`ring_jax.ring_attention`: local
  ``[B, T, N, H]`` queries and ``[B, T, K, H]`` keys/values in ``layout`` order
  over ``axis_name``. K, V and the key segment ids are gathered over the axis
  (``[B, n*T, ...]``); the local queries attend to them blockwise, block pairs
  that the causal mask, window or documents hide are skipped (from the
  tokens' global positions, as in the ring). The backward gathers K/V again
  and reduce-scatters (``psum_scatter``) their float32 gradients; only local
  arrays are kept between the passes. ``block_q``/``block_kv`` must divide
  the local length.
  """
  layouts.check_layout(layout)
  validation.check_qkv(query, key, value,
                       is_causal=is_causal or local_window_size is not None,
                       segment_ids=segment_ids)
  n = _axis_size(axis_name, "all_gather_attention")
  b, t, nh, h = query.shape
  s, kh = key.shape[1], key.shape[2]
  if s != t:
    raise ValueError(f"all_gather_attention needs equal local query and key lengths, got {t}, "
                     f"{s}; use strategy='ring' for cross-attention over a sequence axis.")
  layouts.check_length(layout, n, n * t, "query length")
  spec = _hop_spec(query, is_causal=is_causal, scale=scale,
                   local_window_size=local_window_size, block_q=block_q, block_kv=block_kv,
                   precision=precision, length=t, layout=layout, local_len=t)
  cfg = _LocalConfig(spec=spec, kernel=_kernel(hop_kernel),
                     gather_axis=axis_name)
  q_pos = layouts.local_positions(layout, n, t, jax.lax.axis_index(axis_name))
  kv_pos = jnp.asarray(layouts.layout_positions(layout, n, n * t), jnp.int32)
  if segment_ids is not None:
    segment_ids = jnp.asarray(segment_ids)
  q = query.reshape(b, t, kh, nh // kh, h)
  with jax.named_scope("all_gather_attention"):
    out = _local_attention(cfg, q, key, value, q_pos, kv_pos, segment_ids, segment_ids)
  return out.reshape(b, t, nh, h)


def _ulysses_heads(nh: int, kh: int, u: int, axis_name) -> int:
  """How often each key/value head is repeated before the all_to_all (1: not at all)."""
  if nh % u:
    raise ValueError(
        f"ulysses needs the query heads on each device ({nh}) divisible by the size of axis "
        f"{axis_name!r} ({u}); use a head count that is a multiple of {u}, a smaller Ulysses "
        "axis (strategy='hybrid' with the rest of the sequence on a ring axis), or "
        "strategy='ring'/'all_gather'.")
  if kh % u == 0:
    return 1
  if u % kh == 0:
    return u // kh  # USP: replicate the K/V heads up to one per device
  raise ValueError(
      f"ulysses needs the key/value heads on each device ({kh}) divisible by the size of axis "
      f"{axis_name!r} ({u}), or dividing it (then they are replicated); use a number of "
      "key/value heads that is a multiple or a divisor of it, or strategy='ring'/'all_gather'.")


def _to_heads(x, axis_name):
  """``[B, T, N, H]`` sequence-sharded -> ``[B, u*T, N/u, H]`` head-sharded (all_to_all)."""
  return jax.lax.all_to_all(x, axis_name, split_axis=2, concat_axis=1, tiled=True)


def _to_sequence(x, axis_name):
  return jax.lax.all_to_all(x, axis_name, split_axis=1, concat_axis=2, tiled=True)


def _gather_heads(query, key, value, segment_ids, axis_name):
  """The Ulysses exchange: local sequence / all heads -> whole (group) sequence / N/u heads."""
  u = jax.lax.axis_size(axis_name)
  repeat = _ulysses_heads(query.shape[2], key.shape[2], u, axis_name)
  if repeat > 1:
    key, value = (jnp.repeat(x, repeat, axis=2) for x in (key, value))
  with jax.named_scope("ulysses_to_heads"):
    q, k, v = (_to_heads(x, axis_name) for x in (query, key, value))
    seg = None
    if segment_ids is not None:
      seg = jax.lax.all_gather(jnp.asarray(segment_ids), axis_name, axis=1, tiled=True)
  return q, k, v, seg


def ulysses_attention(query, key, value, *, axis_name, is_causal: bool = False,
                      segment_ids=None, scale: float | None = None, local_window_size=None,
                      layout: str = "contiguous", block_q: int | None = None,
                      block_kv: int | None = None, precision=None,
                      hop_kernel: HopKernel | None = None):
  """DeepSpeed-Ulysses attention on local shards (inside ``jax.shard_map``).

  Same arguments and result as :func:`ring_jax.ring_attention`. One
  ``all_to_all`` turns the local ``[B, T, N, H]`` shards into the whole
  sequence for ``N/u`` heads (``u`` = size of ``axis_name``), each device
  attends over the whole sequence (block pairs skipped from the tokens'
  positions in ``layout`` order), and a second ``all_to_all`` returns the
  output to sequence shards; the backward is the same exchange reversed.
  Query heads must be divisible by ``u``; key/value heads divisible by ``u``
  or dividing it (repeated up to ``u``: MQA/GQA as in USP). ``block_q`` and
  ``block_kv`` must divide the whole length ``u*T``.
  """
  layouts.check_layout(layout)
  validation.check_qkv(query, key, value,
                       is_causal=is_causal or local_window_size is not None,
                       segment_ids=segment_ids)
  u = _axis_size(axis_name, "ulysses_attention")
  b, t, nh, h = query.shape
  if key.shape[1] != t:
    raise ValueError(f"ulysses_attention needs equal local query and key lengths, got {t}, "
                     f"{key.shape[1]}.")
  layouts.check_length(layout, u, u * t, "query length")
  spec = _hop_spec(query, is_causal=is_causal, scale=scale,
                   local_window_size=local_window_size, block_q=block_q, block_kv=block_kv,
                   precision=precision, length=u * t, layout=layout, local_len=t)
  cfg = _LocalConfig(spec=spec, kernel=_kernel(hop_kernel))
  q, k, v, seg = _gather_heads(query, key, value, segment_ids, axis_name)
  pos = jnp.asarray(layouts.layout_positions(layout, u, u * t), jnp.int32)
  nq, nk = q.shape[2], k.shape[2]
  with jax.named_scope("ulysses_attention"):
    out = _local_attention(cfg, q.reshape(b, u * t, nk, nq // nk, h), k, v, pos, pos, seg, seg)
  with jax.named_scope("ulysses_to_sequence"):
    return _to_sequence(out.reshape(b, u * t, nq, h), axis_name)


def _split_pair(axis_name):
  if not (isinstance(axis_name, (tuple, list)) and len(axis_name) == 2):
    raise ValueError(
        f"hybrid attention needs axis_name=(ring_axis, ulysses_axis), a pair of mesh axes, got "
        f"{axis_name!r}.")
  return tuple(axis_name)


def hybrid_attention(query, key, value, *, axis_name, is_causal: bool = False,
                     segment_ids=None, scale: float | None = None, local_window_size=None,
                     layout: str = "contiguous", block_q: int | None = None,
                     block_kv: int | None = None, precision=None,
                     hop_kernel: HopKernel | None = None):
  """Ulysses inside ``ulysses_axis``, the ring across ``ring_axis`` (USP), inside shard_map.

  ``axis_name=(ring_axis, ulysses_axis)``; the sequence is sharded over both
  (``P(..., (ring_axis, ulysses_axis), ...)``: device ``(i, j)`` holds piece
  ``j`` of ring position ``i``'s shard). The inputs are in ``layout`` order for
  a ring of size ``r = size(ring_axis)`` (:func:`ring_jax.to_layout` with
  ``ring_size=r``). An ``all_to_all`` over ``ulysses_axis`` gathers ring
  position ``i``'s shard for ``N/u`` heads, :func:`ring_jax.ring_attention`
  runs over ``ring_axis`` on it, and a second ``all_to_all`` restores the
  sequence shards. Head rules as in :func:`ulysses_attention`; ``block_q`` /
  ``block_kv`` must divide the ring's local length ``u*T``. Other arguments
  as in :func:`ring_jax.ring_attention`.
  """
  return _hybrid(query, key, value, axis_name=axis_name, is_causal=is_causal,
                 segment_ids=segment_ids, scale=scale, local_window_size=local_window_size,
                 layout=layout, block_q=block_q, block_kv=block_kv, precision=precision,
                 hop_kernel=hop_kernel, reorder=False)


def _hybrid(query, key, value, *, axis_name, reorder: bool, segment_ids, layout, **ring_kw):
  """``reorder``: the inputs are in natural order; the ring's shards are reordered into
  ``layout`` (and back) with collectives over the ring axis after the Ulysses exchange."""
  ring_axis, uly_axis = _split_pair(axis_name)
  validation.check_qkv(query, key, value,
                       is_causal=ring_kw["is_causal"] or ring_kw["local_window_size"] is not None,
                       segment_ids=segment_ids)
  _axis_size(ring_axis, "hybrid_attention")
  _axis_size(uly_axis, "hybrid_attention")
  q, k, v, seg = _gather_heads(query, key, value, segment_ids, uly_axis)
  if reorder:
    to = functools.partial(layouts.shard_to_layout, layout=layout, axis_name=ring_axis)
    q, k, v = to(q), to(k), to(v)
    seg = None if seg is None else to(seg)
  out = ring_attention(q, k, v, axis_name=ring_axis, segment_ids=seg, layout=layout, **ring_kw)
  if reorder:
    out = layouts.shard_from_layout(out, layout, ring_axis)
  with jax.named_scope("ulysses_to_sequence"):
    return _to_sequence(out, uly_axis)


#: strategy name -> its function inside ``shard_map``.
IN_SHARD_MAP = {"ring": ring_attention, "all_gather": all_gather_attention,
                "ulysses": ulysses_attention, "hybrid": hybrid_attention}
assert tuple(IN_SHARD_MAP) == STRATEGIES


# ------------------------------------------------------------------------------------------
# On global arrays
# ------------------------------------------------------------------------------------------

_DEFAULT_AXES = {"batch_axis": "data", "head_axis": "tensor"}


def _resolve_axis(mesh, name, arg: str):
  """Mesh axis to shard over, or None (the default name on a mesh without it: not sharded)."""
  if name is None:
    return None
  if name in mesh.axis_names:
    return name
  if name == _DEFAULT_AXES[arg]:
    return None
  raise ValueError(
      f"{arg}={name!r} is not an axis of the mesh (axes: {tuple(mesh.axis_names)}); pass one "
      f"of those or {arg}=None.")


def _place(mesh, x, spec):
  """On a mesh with Explicit axes, ``x`` resharded to ``spec`` (shard_map wants them equal)."""
  types = getattr(mesh, "axis_types", ()) or ()
  if not any(t == jax.sharding.AxisType.Explicit for t in types):
    return x
  if isinstance(mesh, jax.sharding.Mesh):
    return jax.reshard(x, jax.sharding.NamedSharding(mesh, spec))
  return jax.reshard(x, spec)


def _device_kind(mesh) -> str:
  devices = getattr(mesh, "devices", None)
  if devices is not None and getattr(devices, "size", 0):
    return devices.flat[0].device_kind
  return jax.devices()[0].device_kind


def attention_sharded(query, key, value, *, mesh=None, strategy: str = "auto",
                      seq_axis="sequence", batch_axis: str | None = "data",
                      head_axis: str | None = "tensor", is_causal: bool = False,
                      segment_ids=None, scale: float | None = None, local_window_size=None,
                      layout: str = "contiguous", inputs_in_layout: bool = False,
                      block_q: int | None = None, block_kv: int | None = None, precision=None,
                      hop_kernel: HopKernel | None = None):
  """Sequence-parallel attention on global ``[B, L, N, H]`` arrays, by any strategy.

  Args:
    strategy: ``"ring"`` (:func:`ring_jax.ring_attention_sharded`),
      ``"all_gather"``, ``"ulysses"``, ``"hybrid"`` (``seq_axis`` a pair
      ``(ring_axis, ulysses_axis)``), or ``"auto"``: the strategy
      :func:`ring_jax.plan` predicts fastest among those that fit in memory,
      for these shapes, this mesh and its device kind (``seq_axis`` a single
      axis: ring, all_gather or ulysses; a pair: hybrid).
    seq_axis: mesh axis the sequence is sharded over, or for ``"hybrid"`` a
      pair of mesh axes ``(ring_axis, ulysses_axis)``; the sequence is then
      sharded over both, ring-major.
    Everything else: as in :func:`ring_jax.ring_attention_sharded`. Layouts
    balance causal work across the sequence devices for ring and all_gather;
    for the hybrid they apply to the ring axis (``inputs_in_layout=True``
    means :func:`ring_jax.to_layout` with ``ring_size`` = the ring axis's
    size); Ulysses attends over the whole sequence on every device, so
    natural-order inputs stay in natural order for it (no reordering at all).

  Returns:
    ``[B, L, N, H]`` in ``query.dtype`` (in layout order iff ``inputs_in_layout``).
  """
  if mesh is None:
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or not mesh.axis_names:
      raise ValueError("no mesh given and none set: pass mesh= or call under jax.set_mesh(mesh).")
  pair = isinstance(seq_axis, (tuple, list))
  seq_names = tuple(seq_axis) if pair else (seq_axis,)
  if pair and len(seq_names) != 2:
    raise ValueError(f"seq_axis must be one mesh axis or a pair (ring_axis, ulysses_axis), "
                     f"got {seq_axis!r}.")
  for name in seq_names:
    if name not in mesh.axis_names:
      raise ValueError(f"seq_axis entry {name!r} is not an axis of the mesh (axes: "
                       f"{tuple(mesh.axis_names)}).")
  if strategy == "auto":
    b, length, n, h = query.shape
    chosen = planning.plan(
        batch=b, seq_len=length, heads=n, kv_heads=key.shape[2], head_dim=h,
        dtype=query.dtype, is_causal=is_causal, local_window_size=local_window_size,
        layout=layout,
        sequence=tuple(mesh.shape[a] for a in seq_names) if pair else mesh.shape[seq_axis],
        strategies=("hybrid",) if pair else ("ring", "all_gather", "ulysses"),
        tensor=mesh.shape[head_axis] if head_axis in mesh.axis_names else 1,
        data=mesh.shape[batch_axis] if batch_axis in mesh.axis_names else 1,
        device=_device_kind(mesh))
    strategy = chosen.strategy
  if strategy not in STRATEGIES:
    raise ValueError(f"strategy must be one of {STRATEGIES + ('auto',)}, got {strategy!r}.")
  if (strategy == "hybrid") != pair:
    raise ValueError(
        "strategy='hybrid' needs seq_axis=(ring_axis, ulysses_axis), a pair of mesh axes; the "
        f"other strategies take a single axis (got strategy={strategy!r}, seq_axis={seq_axis!r}).")
  common = dict(is_causal=is_causal, segment_ids=segment_ids, scale=scale,
                local_window_size=local_window_size, block_q=block_q, block_kv=block_kv,
                precision=precision, hop_kernel=hop_kernel)
  if strategy == "ring":
    return ring_attention_sharded(query, key, value, mesh=mesh, seq_axis=seq_axis,
                                  batch_axis=batch_axis, head_axis=head_axis, layout=layout,
                                  inputs_in_layout=inputs_in_layout, **common)

  batch_axis = _resolve_axis(mesh, batch_axis, "batch_axis")
  head_axis = _resolve_axis(mesh, head_axis, "head_axis")
  named = [*seq_names, batch_axis, head_axis]
  named = [a for a in named if a is not None]
  if len(set(named)) != len(named):
    raise ValueError(f"seq_axis, batch_axis and head_axis must name different mesh axes, got "
                     f"{seq_axis!r}, {batch_axis!r}, {head_axis!r}.")
  layouts.check_layout(layout)
  validation.check_qkv(query, key, value, is_causal=is_causal or local_window_size is not None,
                       segment_ids=segment_ids)
  b, length, n, _ = query.shape
  kh = key.shape[2]
  if key.shape[1] != length:
    raise ValueError(f"strategy={strategy!r} needs equal query and key/value lengths, got "
                     f"{length}, {key.shape[1]}; use strategy='ring'.")
  seq_size = 1
  for a in seq_names:
    seq_size *= mesh.shape[a]
  kv_head_axis = sharded.check_batch_and_heads(mesh, batch_axis, head_axis, b, n, kh)

  local_layout = layout
  reorder_global = reorder_in_shards = False
  if strategy == "ulysses":
    u = mesh.shape[seq_names[0]]
    heads_here = n // (mesh.shape[head_axis] if head_axis else 1)
    kv_here = kh // (mesh.shape[kv_head_axis] if kv_head_axis else 1)
    _ulysses_heads(heads_here, kv_here, u, seq_names[0])
    if not inputs_in_layout:
      local_layout = "contiguous"  # the whole sequence meets on every device: order is free
    layouts.check_length(local_layout, u, length, "sequence length")
  elif strategy == "all_gather":
    ring = mesh.shape[seq_names[0]]
    layouts.check_length(layout, ring, length, "sequence length")
    if not inputs_in_layout:
      reorder_in_shards = layouts.can_reorder_shards(layout, ring, length // ring)
      reorder_global = not reorder_in_shards
  else:  # hybrid
    r, u = (mesh.shape[a] for a in seq_names)
    heads_here = n // (mesh.shape[head_axis] if head_axis else 1)
    kv_here = kh // (mesh.shape[kv_head_axis] if kv_head_axis else 1)
    _ulysses_heads(heads_here, kv_here, u, seq_names[1])
    layouts.check_length(layout, r, length, "sequence length (over the ring axis)")
    if length % seq_size:
      raise ValueError(f"sequence length {length} is not divisible by the {seq_size} devices "
                       f"of seq_axis={seq_axis!r}; pad it to a multiple of "
                       f"{layouts.length_multiple(layout, r) * u}.")
    if not inputs_in_layout:
      reorder_in_shards = layouts.can_reorder_shards(layout, r, length // r)
      reorder_global = not reorder_in_shards

  if segment_ids is not None:
    segment_ids = jnp.asarray(segment_ids)
  if reorder_global:
    ring = mesh.shape[seq_names[0]]
    reorder = functools.partial(layouts.to_layout, layout=layout, ring_size=ring, axis=1)
    query, key, value = reorder(query), reorder(key), reorder(value)
    segment_ids = None if segment_ids is None else reorder(segment_ids)

  axis = seq_names if pair else seq_names[0]
  local_kw = dict(common, segment_ids=None)

  def kernel(q, k, v, seg):
    kw = dict(local_kw, segment_ids=seg)
    if strategy == "hybrid":
      return _hybrid(q, k, v, axis_name=axis, layout=layout, reorder=reorder_in_shards, **kw)
    fn = IN_SHARD_MAP[strategy]
    if not reorder_in_shards:
      return fn(q, k, v, axis_name=axis, layout=local_layout, **kw)
    to = functools.partial(layouts.shard_to_layout, layout=layout, axis_name=axis)
    kw["segment_ids"] = None if seg is None else to(seg)
    out = fn(to(q), to(k), to(v), axis_name=axis, layout=layout, **kw)
    return layouts.shard_from_layout(out, layout, axis)

  seq_spec = seq_names if pair else seq_names[0]
  q_spec = P(batch_axis, seq_spec, head_axis, None)
  kv_spec = P(batch_axis, seq_spec, kv_head_axis, None)
  seg_spec = P(batch_axis, seq_spec)
  query, key, value = (_place(mesh, query, q_spec), _place(mesh, key, kv_spec),
                       _place(mesh, value, kv_spec))
  if segment_ids is None:
    out = jax.shard_map(lambda q, k, v: kernel(q, k, v, None), mesh=mesh,
                        in_specs=(q_spec, kv_spec, kv_spec), out_specs=q_spec)(query, key, value)
  else:
    segment_ids = _place(mesh, segment_ids, seg_spec)
    out = jax.shard_map(kernel, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, seg_spec),
                        out_specs=q_spec)(query, key, value, segment_ids)
  if reorder_global:
    out = layouts.from_layout(out, layout, mesh.shape[seq_names[0]], axis=1)
  return out
