"""``ring_attention_sharded``: ring attention on global arrays over a mesh."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ring_jax import kernels
from ring_jax import layouts
from ring_jax import validation
from ring_jax.ring import ring_attention

_DEFAULT_AXES = {"batch_axis": "data", "head_axis": "tensor"}


def _resolve_axis(mesh, name, arg: str, default: str | None):
  """Mesh axis to shard over, or None. A default name the mesh lacks means "not sharded"."""
  if name is None:
    return None
  if name in mesh.axis_names:
    return name
  if name == default:
    return None
  raise ValueError(
      f"{arg}={name!r} is not an axis of the mesh (axes: {tuple(mesh.axis_names)}); pass one "
      f"of those or {arg}=None.")


def _has_explicit_axes(mesh) -> bool:
  types = getattr(mesh, "axis_types", ()) or ()
  return any(t == jax.sharding.AxisType.Explicit for t in types)


def _platform(mesh) -> str:
  """Platform of the mesh's devices; the default backend's for an abstract mesh."""
  if isinstance(mesh, jax.sharding.Mesh) and mesh.devices.size:
    return mesh.devices.flat[0].platform
  return jax.default_backend()  # an AbstractMesh has no devices


def _reshard(mesh, x, spec):
  if isinstance(mesh, jax.sharding.Mesh):
    return jax.reshard(x, jax.sharding.NamedSharding(mesh, spec))
  return jax.reshard(x, spec)  # abstract mesh: the one set with jax.set_mesh



def check_batch_and_heads(mesh, batch_axis, head_axis, batch: int, heads: int,
                          kv_heads: int) -> str | None:
  """Checks that the batch splits over ``batch_axis`` and the heads over ``head_axis``.

  Returns the mesh axis the K/V heads are sharded over: ``head_axis``, or None for MQA (a
  single K/V head that every tensor shard needs). Raises ValueError naming the fix.
  """
  if batch_axis is not None and batch % mesh.shape[batch_axis]:
    raise ValueError(
        f"batch {batch} is not divisible by {batch_axis}={mesh.shape[batch_axis]}; use a batch "
        f"that is a multiple of it or batch_axis=None.")
  if head_axis is None:
    return None
  tp = mesh.shape[head_axis]
  if heads % tp:
    raise ValueError(f"query heads {heads} are not divisible by {head_axis}={tp}.")
  if kv_heads % tp:
    if kv_heads != 1:
      raise ValueError(
          f"key/value heads {kv_heads} are not divisible by {head_axis}={tp}; use a number of "
          "key/value heads divisible by the tensor axis (or a single one, MQA).")
    return None
  return head_axis


def ring_attention_sharded(query, key, value, *, mesh=None, seq_axis: str = "sequence",
                           batch_axis: str | None = "data", head_axis: str | None = "tensor",
                           is_causal: bool = False, segment_ids=None, scale: float | None = None,
                           local_window_size=None, layout: str = "contiguous",
                           inputs_in_layout: bool = False, block_q: int | None = None,
                           block_kv: int | None = None, precision=None, hop_kernel="auto",
                           return_lse: bool = False, overlap_dkv: bool = False):
  """Ring attention on global ``[B, L, N, H]`` arrays: builds the ``shard_map`` for you.

  The sequence axis is sharded over ``seq_axis`` (the ring); the batch over
  ``batch_axis`` and the heads over ``head_axis`` at the same time (tensor x
  sequence parallelism). ``batch_axis="data"`` and ``head_axis="tensor"`` are
  defaults that mean "not sharded" when the mesh has no such axis; any other
  name must be a mesh axis. Key/value heads are sharded over ``head_axis``
  too, or replicated when there is a single one (MQA).

  Args:
    query, key, value, segment_ids, is_causal, scale, local_window_size,
    block_q, block_kv, precision, hop_kernel, overlap_dkv: as in
      :func:`ring_jax.ring_attention`, but global (natural token order unless
      ``inputs_in_layout``). A ``hop_kernel`` name is resolved for the
      platform of the mesh's devices.
    mesh: a ``jax.sharding.Mesh`` (Auto or Explicit axes) or ``AbstractMesh``;
      default: the mesh set with ``jax.set_mesh``.
    layout: sequence layout across the ring.
    inputs_in_layout: the inputs are already in ``layout`` order (e.g. a model
      that reorders once per batch with :func:`ring_jax.to_layout`); the output
      is then left in layout order too. Otherwise inputs are reordered on the
      way in and the output restored to natural order.
    return_lse: also return the float32 log-sum-exp ``[B, L, N]`` (as
      :func:`ring_jax.ring_attention`), sharded and ordered like the output.

  Returns:
    ``[B, L, N, H]`` in ``query.dtype``, or ``(out, lse)`` with ``return_lse``.
  """
  if mesh is None:
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or not mesh.axis_names:
      raise ValueError("no mesh given and none set: pass mesh= or call under jax.set_mesh(mesh).")
  if seq_axis not in mesh.axis_names:
    raise ValueError(
        f"seq_axis={seq_axis!r} is not an axis of the mesh (axes: {tuple(mesh.axis_names)}).")
  batch_axis = _resolve_axis(mesh, batch_axis, "batch_axis", _DEFAULT_AXES["batch_axis"])
  head_axis = _resolve_axis(mesh, head_axis, "head_axis", _DEFAULT_AXES["head_axis"])
  named = [a for a in (seq_axis, batch_axis, head_axis) if a is not None]
  if len(set(named)) != len(named):
    raise ValueError(f"seq_axis, batch_axis and head_axis must differ, got {seq_axis!r}, "
                     f"{batch_axis!r}, {head_axis!r}.")
  layouts.check_layout(layout)
  hop_kernel = kernels.get_hop_kernel(hop_kernel, _platform(mesh))
  validation.check_qkv(query, key, value, is_causal=is_causal or local_window_size is not None,
                       segment_ids=segment_ids)
  if segment_ids is not None:
    segment_ids = jnp.asarray(segment_ids)  # ids keep their dtype (0 = padding, see scheduling)

  b, length, n, _ = query.shape
  kv_len, kh = key.shape[1], key.shape[2]
  ring = mesh.shape[seq_axis]
  for what, size in (("query length", length), ("key/value length", kv_len)):
    layouts.check_length(layout, ring, size, what)
  kv_head_axis = check_batch_and_heads(mesh, batch_axis, head_axis, b, n, kh)

  # Natural-order inputs are reordered shard by shard with collectives inside the
  # shard_map (O(L/n) memory) when the layout allows, else as global arrays.
  reorder_in_shards = not inputs_in_layout and all(
      layouts.can_reorder_shards(layout, ring, size // ring) for size in (length, kv_len))
  if not inputs_in_layout and not reorder_in_shards:
    reorder = functools.partial(layouts.to_layout, layout=layout, ring_size=ring, axis=1)
    query, key, value = reorder(query), reorder(key), reorder(value)
    if segment_ids is not None:
      segment_ids = reorder(segment_ids)

  attend = functools.partial(
      ring_attention, axis_name=seq_axis, is_causal=is_causal, scale=scale,
      local_window_size=local_window_size, layout=layout, block_q=block_q, block_kv=block_kv,
      precision=precision, hop_kernel=hop_kernel, return_lse=return_lse,
      overlap_dkv=overlap_dkv)

  def kernel(q, k, v, segment_ids=None):
    if not reorder_in_shards:
      return attend(q, k, v, segment_ids=segment_ids)
    to = functools.partial(layouts.shard_to_layout, layout=layout, axis_name=seq_axis)
    if segment_ids is not None:
      segment_ids = to(segment_ids)
    result = attend(to(q), to(k), to(v), segment_ids=segment_ids)
    return jax.tree.map(lambda x: layouts.shard_from_layout(x, layout, seq_axis), result)
  q_spec = P(batch_axis, seq_axis, head_axis, None)
  out_spec = (q_spec, P(batch_axis, seq_axis, head_axis)) if return_lse else q_spec
  kv_spec = P(batch_axis, seq_axis, kv_head_axis, None)
  seg_spec = P(batch_axis, seq_axis)
  if _has_explicit_axes(mesh):
    # Explicit-axis meshes carry shardings in the types; shard_map wants them
    # to match in_specs exactly, so move the data first.
    place = functools.partial(_reshard, mesh)
    query, key, value = place(query, q_spec), place(key, kv_spec), place(value, kv_spec)
    if segment_ids is not None:
      segment_ids = place(segment_ids, seg_spec)
  if segment_ids is None:
    fn = jax.shard_map(lambda q, k, v: kernel(q, k, v), mesh=mesh,
                       in_specs=(q_spec, kv_spec, kv_spec), out_specs=out_spec)
    out = fn(query, key, value)
  else:
    fn = jax.shard_map(lambda q, k, v, s: kernel(q, k, v, segment_ids=s), mesh=mesh,
                       in_specs=(q_spec, kv_spec, kv_spec, seg_spec), out_specs=out_spec)
    out = fn(query, key, value, segment_ids)
  if not inputs_in_layout and not reorder_in_shards:
    out = jax.tree.map(lambda x: layouts.from_layout(x, layout, ring, axis=1), out)
  return out
