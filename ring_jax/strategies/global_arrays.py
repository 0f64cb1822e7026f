"""One wrapper that runs any strategy on global ``[B, L, N, H]`` arrays over a mesh.

It owns what every strategy needs around its ``shard_map``: the mesh (given or
set with ``jax.set_mesh``), the mesh axes of the sequence, batch and heads
(:func:`attention_axes`, also what ``models/`` and ``training/`` use), the
checks on global shapes, the reorder into the layout and back (shard by shard
with collectives when the layout allows, else on the global arrays), and
placing the inputs on a mesh with Explicit axes. A strategy supplies its
function inside ``shard_map`` and its own checks (:class:`Strategy`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ring_jax import kernels
from ring_jax import layouts
from ring_jax import topology
from ring_jax import validation
from ring_jax.hop import takes_block
from ring_jax.ring import platform_defaults
from ring_jax.strategies.options import AttentionOptions

#: Default axis names: a mesh without them leaves that dimension unsharded.
DEFAULT_AXES = {"batch_axis": "data", "head_axis": "tensor"}


class AttentionAxes(NamedTuple):
  """Mesh axes attention shards the batch, the query heads and the key/value heads over."""
  batch: str | None
  heads: str | None
  kv_heads: str | None


def attention_axes(axis_sizes, *, batch: int, heads: int, kv_heads: int,
                   batch_axis: str | None, head_axis: str | None, drop: bool = False,
                   names: tuple[str, str, str] | None = None) -> AttentionAxes:
  """Which mesh axes attention uses for the batch and the (query, key/value) heads.

  The batch goes over ``batch_axis``, the query and key/value heads over
  ``head_axis``, except a single key/value head (MQA), which every head shard
  needs: it is replicated (``kv_heads=None``). An axis that does not divide its
  dimension raises ValueError naming the fix, or with ``drop=True`` is
  dropped (that dimension stays whole on every device).

  Args:
    axis_sizes: mesh axis name -> size (``mesh.shape``, or a config's sizes).
    batch, heads, kv_heads: the global batch and head counts.
    batch_axis, head_axis: the axes to shard over, or None.
    drop: drop axes that do not divide instead of raising.
    names: how the message names batch, heads and kv_heads (e.g. config fields);
      default the arguments of :func:`ring_jax.ring_attention_sharded`.
  """
  hint = lambda arg: "" if names else f", or {arg}=None"
  batch_name, heads_name, kv_name = names or ("batch", "query heads", "key/value heads")

  def split(dim, value, axis, fix):
    if axis is None or value % axis_sizes[axis] == 0:
      return axis
    if drop:
      return None
    raise ValueError(f"{dim}={value} is not divisible by the mesh {axis!r} axis "
                     f"({axis_sizes[axis]}); {fix}.")

  batch_axis = split(batch_name, batch, batch_axis,
                     f"use a multiple of {axis_sizes.get(batch_axis)}{hint('batch_axis')}")
  head_axis = split(heads_name, heads, head_axis,
                    f"use a multiple of {axis_sizes.get(head_axis)}{hint('head_axis')}")
  if head_axis is None or (kv_heads == 1 and axis_sizes[head_axis] > 1):
    return AttentionAxes(batch_axis, head_axis, None)  # MQA: the one K/V head everywhere
  kv_axis = split(kv_name, kv_heads, head_axis,
                  f"use a multiple of {axis_sizes[head_axis]} or a single key/value head "
                  f"(MQA, replicated over {head_axis!r}){hint('head_axis')}")
  return AttentionAxes(batch_axis, kv_axis and head_axis, kv_axis)


@dataclasses.dataclass(frozen=True)
class Placement:
  """Where a call's arrays live: the mesh, the sequence axes and the batch/head axes."""
  mesh: object
  seq: tuple[str, ...]      # one axis, or the hybrid's (ring_axis, ulysses_axis)
  axes: AttentionAxes

  @property
  def seq_sizes(self) -> tuple[int, ...]:
    return tuple(self.mesh.shape[a] for a in self.seq)

  @property
  def axis_name(self):
    """What the strategy inside ``shard_map`` takes as ``axis_name`` (and the specs hold)."""
    return self.seq if len(self.seq) > 1 else self.seq[0]

  def per_device(self, heads: int, kv_heads: int) -> tuple[int, int]:
    """Query and key/value heads on one device after the head axis."""
    size = lambda axis: self.mesh.shape[axis] if axis else 1
    return heads // size(self.axes.heads), kv_heads // size(self.axes.kv_heads)


@dataclasses.dataclass(frozen=True)
class Strategy:
  """What one strategy adds to the wrapper.

  Attributes:
    name: its name in :data:`ring_jax.STRATEGIES`.
    local: ``local(q, k, v, segment_ids, *, axis_name, options, sinks)`` on the local
      shards inside ``shard_map`` (inputs in ``options.layout`` order; ``sinks``: the
      device's query heads' ``[N]`` sink logits or None, applied once to its result); with
      ``reorders_itself``, also ``natural=`` (inputs in natural order: it reorders them).
    check: ``check(placement, q_len, kv_len, heads, kv_heads, options)`` on global
      lengths and per-device heads; raises ValueError naming the fix.
    two_axes: ``seq_axis`` is a pair ``(ring_axis, ulysses_axis)``.
    one_ring_over_pair: ``seq_axis`` is one axis or a pair ``(outer, inner)`` that the
      sequence is split over outer-major, as one ring of their product's size (layouts
      and the reorder into them span both axes): the two-level ring.
    cross_attention: query and key/value lengths may differ.
    whole_sequence: every device attends over the whole sequence, so natural-order
      inputs stay in natural order (run as ``"contiguous"``, never reordered).
    reorders_itself: natural-order shards are reordered inside ``local``.
  """
  name: str
  local: Callable
  check: Callable
  two_axes: bool = False
  one_ring_over_pair: bool = False
  cross_attention: bool = False
  whole_sequence: bool = False
  reorders_itself: bool = False


def current_mesh(mesh):
  """``mesh``, or the one set with ``jax.set_mesh``."""
  if mesh is None:
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or not mesh.axis_names:
      raise ValueError("no mesh given and none set: pass mesh= or call under jax.set_mesh(mesh).")
  return mesh


def seq_axes(mesh, seq_axis) -> tuple[str, ...]:
  """``seq_axis`` as a tuple of mesh axes: one axis or a pair (ring_axis, ulysses_axis)."""
  names = tuple(seq_axis) if isinstance(seq_axis, (tuple, list)) else (seq_axis,)
  if len(names) not in (1, 2):
    raise ValueError(f"seq_axis must be one mesh axis or a pair (ring_axis, ulysses_axis), "
                     f"got {seq_axis!r}.")
  for name in names:
    if name not in mesh.axis_names:
      raise ValueError(f"seq_axis={seq_axis!r}: {name!r} is not an axis of the mesh (axes: "
                       f"{tuple(mesh.axis_names)}).")
  return names


def resolve_axis(mesh, name, arg: str) -> str | None:
  """Mesh axis to shard over, or None. A default name the mesh lacks means "not sharded"."""
  if name is None:
    return None
  if name in mesh.axis_names:
    return name
  if name == DEFAULT_AXES[arg]:
    return None
  raise ValueError(
      f"{arg}={name!r} is not an axis of the mesh (axes: {tuple(mesh.axis_names)}); pass one "
      f"of those or {arg}=None.")


def has_explicit_axes(mesh) -> bool:
  types = getattr(mesh, "axis_types", ()) or ()
  return any(t == jax.sharding.AxisType.Explicit for t in types)


def place(mesh, x, spec):
  """On a mesh with Explicit axes, ``x`` resharded to ``spec`` (shard_map wants them equal)."""
  if not has_explicit_axes(mesh):
    return x
  if isinstance(mesh, jax.sharding.Mesh):
    return jax.reshard(x, jax.sharding.NamedSharding(mesh, spec))
  return jax.reshard(x, spec)  # abstract mesh: the one set with jax.set_mesh


def platform(mesh) -> str:
  """Platform of the mesh's devices; the default backend's for an abstract mesh."""
  if isinstance(mesh, jax.sharding.Mesh) and mesh.devices.size:
    return mesh.devices.flat[0].platform
  return topology.target_platform()  # an AbstractMesh has no devices


def device_kind(mesh) -> str:
  """``device_kind`` of the mesh's devices (of the default devices for an abstract mesh)."""
  if isinstance(mesh, jax.sharding.Mesh) and mesh.devices.size:
    return mesh.devices.flat[0].device_kind
  return jax.devices()[0].device_kind


def placement(mesh, seq_axis, batch_axis, head_axis, *, batch: int, heads: int,
              kv_heads: int) -> Placement:
  """Resolves and checks the axes of a call on ``mesh`` (ValueError naming the fix)."""
  seq = seq_axes(mesh, seq_axis)
  batch_axis = resolve_axis(mesh, batch_axis, "batch_axis")
  head_axis = resolve_axis(mesh, head_axis, "head_axis")
  named = [a for a in (*seq, batch_axis, head_axis) if a is not None]
  if len(set(named)) != len(named):
    raise ValueError(f"seq_axis, batch_axis and head_axis must name different mesh axes, got "
                     f"{seq_axis!r}, {batch_axis!r}, {head_axis!r}.")
  axes = attention_axes(mesh.shape, batch=batch, heads=heads, kv_heads=kv_heads,
                        batch_axis=batch_axis, head_axis=head_axis)
  return Placement(mesh=mesh, seq=seq, axes=axes)


def run(strategy: Strategy, query, key, value, segment_ids, *, mesh, seq_axis, batch_axis,
        head_axis, inputs_in_layout: bool, options: AttentionOptions, sinks=None):
  """``strategy`` on global arrays: checks, reorders, places, runs its ``shard_map``.

  Inputs and output are in natural token order unless ``inputs_in_layout``
  (then in ``options.layout`` order for a ring of the first sequence axis's
  size, or of both axes' product for ``strategy.one_ring_over_pair``). With
  ``options.return_lse`` the result is ``(out, lse)``. ``sinks``: ``[N]`` sink logits
  (one per query head, or None), split over the devices with their query heads and
  applied by the strategy once to its result (:func:`ring_jax.hop.add_sinks`).
  """
  mesh = current_mesh(mesh)
  pair = len(seq_axes(mesh, seq_axis)) == 2
  if pair != strategy.two_axes and not (pair and strategy.one_ring_over_pair):
    raise ValueError(
        "strategy='hybrid' needs seq_axis=(ring_axis, ulysses_axis), a pair of mesh axes; "
        "strategy='ring' takes one axis or a pair (outer, inner) (the two-level ring); the "
        f"other strategies take a single axis (got strategy={strategy.name!r}, "
        f"seq_axis={seq_axis!r}).")
  validation.check_qkv(query, key, value, is_causal=options.masked, segment_ids=segment_ids)
  sinks = validation.check_sinks(sinks, query.shape[2])
  if options.layout == layouts.DOCUMENT:
    if not inputs_in_layout:
      raise ValueError(
          "layout='document' is a per-row permutation built from the segment ids on the host: "
          "reorder with ring_jax.document_layout + to_layout(..., permutation=) and pass "
          "inputs_in_layout=True.")
    options = options.with_attention_layout(segment_ids)
  b, length, n, _ = query.shape
  kv_len, kh = key.shape[1], key.shape[2]
  where = placement(mesh, seq_axis, batch_axis, head_axis, batch=b, heads=n, kv_heads=kh)
  if kv_len != length and not strategy.cross_attention:
    raise ValueError(f"strategy={strategy.name!r} needs equal query and key/value lengths, got "
                     f"{length}, {kv_len}; use strategy='ring'.")
  options = dataclasses.replace(
      options, hop_kernel=kernels.get_hop_kernel(options.hop_kernel, platform(mesh)),
      **platform_defaults(platform(mesh), causal_routing=options.causal_routing,
                          overlap_dkv=options.overlap_dkv))
  natural = not inputs_in_layout
  if natural and strategy.whole_sequence:
    options, natural = dataclasses.replace(options, layout="contiguous"), False
  padded = padded_length(strategy, where, options, length) if not inputs_in_layout else length
  if padded != length:
    if kv_len != length:
      raise ValueError(
          f"query length {length} does not split over the sequence devices and differs from "
          f"the key/value length {kv_len}: padding is automatic for equal lengths only; pad "
          f"both yourself (to {padded} tokens, say) and mask the padding.")
    return _padded_run(strategy, query, key, value, segment_ids, padded, mesh=mesh,
                       seq_axis=seq_axis, batch_axis=batch_axis, head_axis=head_axis,
                       options=options, sinks=sinks)
  strategy.check(where, length, kv_len, *where.per_device(n, kh), options)
  if segment_ids is not None:
    segment_ids = jnp.asarray(segment_ids)  # ids keep their dtype (0 = padding, see masking)

  # Natural-order inputs are reordered shard by shard with collectives inside the shard_map
  # (O(L/n) memory) when the layout allows, else as global arrays.
  layout, ring = options.layout, where.seq_sizes[0]
  layout_axis = where.seq[0]
  if pair and strategy.one_ring_over_pair:  # one ring over both axes, outer-major
    ring, layout_axis = math.prod(where.seq_sizes), where.seq
  in_shards = natural and all(layouts.can_reorder_shards(layout, ring, size // ring)
                              for size in (length, kv_len))
  if natural and not in_shards:
    reorder = functools.partial(layouts.to_layout, layout=layout, ring_size=ring, axis=1)
    query, key, value = reorder(query), reorder(key), reorder(value)
    segment_ids = None if segment_ids is None else reorder(segment_ids)

  local = functools.partial(strategy.local, axis_name=where.axis_name, options=options)
  if strategy.reorders_itself:
    local = functools.partial(local, natural=in_shards)
  elif in_shards:
    local = functools.partial(_in_layout, local, layout=layout, axis_name=layout_axis)
  out = _shard_map(local, where, query, key, value, segment_ids, sinks, options.return_lse)
  if natural and not in_shards:
    out = jax.tree.map(lambda x: layouts.from_layout(x, layout, ring, axis=1), out)
  return out


def padded_length(strategy: Strategy, where: Placement, options: AttentionOptions,
                  length: int) -> int:
  """The length ``strategy`` runs a natural-order sequence of ``length`` tokens at: the
  smallest multiple of what its split needs (:func:`ring_jax.layouts.length_multiple` of
  its ring, times the Ulysses axis for the hybrid, and for the ring its hop kernel's
  smallest block per layout chunk: 128 for splash) that is ``>= length``. Blocks the
  caller names must divide the padded shards (as they must divide any length)."""
  sizes = where.seq_sizes
  if strategy.two_axes:  # hybrid: the layout over the ring axis, each shard over Ulysses
    ring, extra = sizes[0], sizes[1]
  else:
    ring, extra = (math.prod(sizes) if strategy.one_ring_over_pair else sizes[0]), 1
  multiple = validation.split_multiple(options.layout, ring, ulysses=extra)
  if strategy.name == "ring":  # the kernel's blocks tile each layout chunk of the shards
    chunks = ring * (2 if layouts.mask_layout(options.layout) == "zigzag" else 1)
    grain = next((b for b in range(1, 1025) if takes_block(options.hop_kernel, b)), 1)
    multiple = math.lcm(multiple, chunks * grain)
  return -(-length // multiple) * multiple


def _padded_run(strategy, query, key, value, segment_ids, padded: int, *, options, sinks,
                **where):
  """:func:`run` on the sequence padded to ``padded`` tokens at its end: the padding's
  segment id is 0 (padding: it attends nothing and is never attended; real tokens get id 1
  when the call had no ids), the result sliced back to the call's length (on a mesh with
  Explicit axes with its sequence dimension unsharded: an uneven length cannot be split)."""
  b, length = query.shape[:2]
  pad = lambda x: jnp.pad(x, [(0, 0), (0, padded - length)] + [(0, 0)] * (x.ndim - 2))  # noqa: E731
  ids = (jnp.ones((b, length), jnp.int32) if segment_ids is None
         else jnp.asarray(segment_ids))
  out = run(strategy, pad(query), pad(key), pad(value), pad(ids), inputs_in_layout=False,
            options=options, sinks=sinks, **where)
  mesh = current_mesh(where["mesh"])

  def cut(x):
    if has_explicit_axes(mesh):  # an uneven length cannot stay split over the sequence axes
      spec = jax.typeof(x).sharding.spec
      x = place(mesh, x, P(spec[0], None, *spec[2:]))
    return x[:, :length]

  return jax.tree.map(cut, out)


def _in_layout(local, q, k, v, seg, *, layout, axis_name, sinks=None):
  """``local`` on natural-order shards: reordered into ``layout`` and back with collectives."""
  q, k, v, seg = layouts.shard_to_layout((q, k, v, seg), layout, axis_name)
  return layouts.shard_from_layout(local(q, k, v, seg, sinks=sinks), layout, axis_name)


def _shard_map(local, where: Placement, query, key, value, segment_ids, sinks,
               return_lse: bool):
  """``local(q, k, v, seg, sinks=)`` under ``jax.shard_map`` with the placement's specs (the
  optional ``segment_ids`` and ``sinks`` are operands only when given; sinks split with
  the query heads)."""
  seq, (batch, heads, kv_heads) = where.axis_name, where.axes
  q_spec = P(batch, seq, heads, None)
  kv_spec = P(batch, seq, kv_heads, None)
  seg_spec = P(batch, seq)
  out_spec = (q_spec, P(batch, seq, heads)) if return_lse else q_spec
  put = functools.partial(place, where.mesh)
  args = [put(query, q_spec), put(key, kv_spec), put(value, kv_spec)]
  specs = [q_spec, kv_spec, kv_spec]
  optional = [(x, spec) for x, spec in ((segment_ids, seg_spec), (sinks, P(heads)))
              if x is not None]
  args += [put(x, spec) for x, spec in optional]
  specs += [spec for _, spec in optional]

  def fn(q, k, v, *rest):
    rest = list(rest)
    seg = rest.pop(0) if segment_ids is not None else None
    return local(q, k, v, seg, sinks=rest.pop(0) if sinks is not None else None)

  mapped = jax.shard_map(fn, mesh=where.mesh, in_specs=tuple(specs), out_specs=out_spec)
  # Under jit: one compiled program (inside a caller's jit it is inlined). Called eagerly,
  # a bare shard_map runs its body op by op, each operation compiled on its own (the four
  # strategies of docs/performance.md: 1361 programs, 59 s of compiling on CPU).
  return jax.jit(mapped)(*args)
