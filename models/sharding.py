"""The one table of logical axis -> mesh axis rules, and helpers that apply it.

Every parameter of :mod:`models.llama` records the *logical* names of its
dimensions (Variable metadata ``logical_axes``, e.g. ``("layers", "embed",
"heads", "head_dim")``) and every constrained activation names its dimensions
the same way. :data:`LOGICAL_RULES` maps those names to the mesh axes
``data``, ``pipeline``, ``sequence_outer``, ``sequence`` and ``tensor``; nothing else in the
model mentions a mesh axis. :func:`rules` gives the table of a model's settings (tensor sequence
parallelism on or off: the ``residual_length`` rule), and :func:`use_rules`
makes it the table the helpers here use while a model traces. (The same idea as
``ShardingRules`` in jax-llm-examples' llama3 and
``logical_axis_rules`` in Flax/MaxText.)

Mesh axes a rule names but the current mesh lacks are dropped, as are axes
that do not divide the dimension (e.g. 1 key/value head over ``tensor=2``
stays replicated), and, of a rule naming several axes, those of
size 1 (they split nothing: with ``sequence_outer=1`` the sequence is over
``sequence`` alone, exactly as on a mesh without that axis), so the same model runs on a
1-device mesh, on a ``(data, sequence)`` mesh, or with no mesh at all.

Both kinds of mesh axis work: ``AxisType.Explicit`` (the default of
``jax.make_mesh``), where shardings are part of array types and changes need
``jax.sharding.reshard``, and ``AxisType.Auto`` (GSPMD), where
``with_sharding_constraint`` is the hint.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Any, Iterator, Mapping, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

# A rule maps a logical name to one mesh axis, a tuple of mesh axes, or None (replicated).
Rules = tuple[tuple[str, str | tuple[str, ...] | None], ...]

#: The mesh axes the rules name, in the order train.py builds its mesh: ``tensor`` last, so
#: ``jax.make_mesh`` puts tensor-parallel peers (the most traffic per step) on the nearest
#: devices, then the ring's ``sequence`` neighbours, then ``sequence_outer``: groups of
#: ``sequence`` devices on slower links (nodes over InfiniBand, slices over DCN), the outer
#: level of the two-level ring (:mod:`ring_jax.two_level`; size 1: no such level);
#: ``pipeline`` (one activation per microbatch and stage boundary) and ``data`` (one
#: gradient reduction per step) go outermost.
MESH_AXES: tuple[str, ...] = ("data", "pipeline", "sequence_outer", "sequence", "tensor")

LOGICAL_RULES: Rules = (
    # Activations.
    ("batch", "data"),
    # The sequence where tokens meet (attention, and the q/k/v and MLP activations between the
    # column- and row-parallel projections): split over the ring, outer-major over
    # (sequence_outer, sequence) (device (g, r) holds shard g * sequence + r of the combined
    # ring, as ring_jax.two_level expects); with sequence_outer=1 over "sequence" alone.
    ("length", ("sequence_outer", "sequence")),
    # The sequence of the residual stream between those regions (embedding output, norms,
    # residual adds, final norm): Megatron-style sequence parallelism also splits it over the
    # tensor peers (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
    # Transformer Models", Sec. 4.2.2), so each device holds L / (sequence * tensor) tokens;
    # gathered over tensor before the column-parallel projections, reduce-scattered after the
    # row-parallel ones. rules(tensor_sequence_parallel=False) maps it to the "length" rule's
    # axes alone.
    ("residual_length", ("sequence_outer", "sequence", "tensor")),
    # Weights and activations alike: tensor parallelism (Megatron split of heads and MLP hidden).
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
    # The model dimension stays whole: it is contracted by every matmul.
    ("embed", None),
    # The model dimension of weights when LlamaConfig.fsdp is set: sharded (ZeRO-3 style) over
    # every device that holds a different slice of the tokens, data-major: the data replicas
    # and the ring's devices (as MaxText shards its weights over "fsdp" and "context"), and
    # gathered by the model just before each use. Weights replicated over the ring would cost
    # each ring device the whole model and its optimizer state.
    ("embed_fsdp", ("data", "sequence_outer", "sequence")),
    ("head_dim", None),
    # The stacked-layer axis: contiguous blocks of layers per 'pipeline' device, so stage s
    # holds layers [s L/S, (s+1) L/S) and the stage view [stages, L/S] (models/pipeline.py)
    # is a reshape that moves nothing; with pipeline=1 (or no such axis) it is replicated.
    ("layers", "pipeline"),
    ("stages", "pipeline"),  # the stage axis of that view (and of the activations in flight)
    ("norm", None),  # RMSNorm scales: tiny, replicated
)

#: Metadata key under which parameters store their logical axis names.
LOGICAL_AXES_KEY = "logical_axes"


def rules(tensor_sequence_parallel: bool | None = None) -> Rules:
  """The rules table of a model whose ``LlamaConfig.tensor_sequence_parallel`` is given.

  None or True: :data:`LOGICAL_RULES` (``residual_length`` over ``(sequence_outer,
  sequence, tensor)``; on a mesh whose ``tensor`` axis is 1 or missing that is
  the ``length`` rule's axes alone, so "on when tensor > 1" needs no case of its own).
  False: ``residual_length`` over the ``length`` rule's axes only: the residual stream is
  replicated on the tensor peers and the row-parallel outputs are all-reduced.
  """
  if tensor_sequence_parallel is None or tensor_sequence_parallel is True:
    return LOGICAL_RULES
  if tensor_sequence_parallel is not False:
    raise ValueError(f"tensor_sequence_parallel must be None (auto), True or False, got "
                     f"{tensor_sequence_parallel!r}.")
  length = dict(LOGICAL_RULES)["length"]
  return tuple((name, length if name == "residual_length" else target)
               for name, target in LOGICAL_RULES)


def length_axes() -> tuple[str, ...]:
  """The mesh axes the ``length`` rule in force splits the sequence over, outer-major
  (``("sequence_outer", "sequence")`` under :data:`LOGICAL_RULES`)."""
  return _lookup("length", dict(active_rules()))


def ring_size(axis_sizes: Mapping[str, int]) -> int:
  """Devices the ``length`` rule splits the sequence over, on a mesh of these axis sizes
  (``mesh.shape`` or a config's sizes; axes it lacks count 1): ``sequence_outer *
  sequence``, the combined ring the layouts span (the two-level ring's, or the flat
  ring's when ``sequence_outer`` is 1)."""
  return math.prod(int(axis_sizes.get(a, 1)) for a in length_axes())


# The table in force where a call passes no rules= (None: LOGICAL_RULES); set by use_rules.
_ACTIVE_RULES: contextvars.ContextVar[Rules | None] = contextvars.ContextVar(
    "ring_jax_logical_rules", default=None)


@contextlib.contextmanager
def use_rules(table: Rules) -> Iterator[Rules]:
  """Makes ``table`` the rules of every helper here called without ``rules=`` (while tracing
  inside the ``with``), as Flax's ``logical_axis_rules`` context does: a model sets its
  table once at its entry points, and its layers only name their dimensions."""
  token = _ACTIVE_RULES.set(tuple(table))
  try:
    yield table
  finally:
    _ACTIVE_RULES.reset(token)


def active_rules() -> Rules:
  """The table :func:`use_rules` set, or :data:`LOGICAL_RULES` outside any."""
  table = _ACTIVE_RULES.get()
  return LOGICAL_RULES if table is None else table


def current_mesh():
  """The mesh set with ``jax.set_mesh`` (abstract inside ``jit``), or None when there is none."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is None or mesh.empty or not mesh.axis_names:
    return None
  return mesh


def _lookup(name: str, rules: Mapping[str, Any]):
  if name not in rules:
    raise ValueError(f"logical axis {name!r} has no rule; known: {sorted(rules)}.")
  target = rules[name]
  if target is None:
    return ()
  return (target,) if isinstance(target, str) else tuple(target)


def logical_to_spec(names: Sequence[str | None], rules: Rules | None = None, *, mesh=None,
                    shape: Sequence[int] | None = None) -> P:
  """Maps logical dimension names to a ``PartitionSpec`` over mesh axes.

  Args:
    names: one logical name (or None: replicated) per dimension.
    rules: the table, default :func:`active_rules` (:data:`LOGICAL_RULES` unless a
      :func:`use_rules` context is active).
    mesh: ``Mesh``/``AbstractMesh`` whose axes are kept (others dropped); default
      the context mesh; with neither, every rule target is kept.
    shape: if given, a mesh axis is dropped from a dimension it does not divide.

  A name mapped to several mesh axes splits its dimension outer-major over them;
  axes of size 1 among them split nothing and are dropped (the last is kept if all are 1),
  so with ``sequence_outer=1`` ``length`` is ``"sequence"`` as on a mesh without that axis.
  Each mesh axis is used at most once per spec (first dimension wins), as
  ``PartitionSpec`` requires. Axes that are ``Manual`` on ``mesh`` (inside a
  ``shard_map`` over them, e.g. the pipeline schedule's) are dropped: there each
  device already holds its own block.
  """
  table = dict(rules if rules is not None else active_rules())
  if mesh is None:
    mesh = current_mesh()
  if shape is not None and len(shape) != len(names):
    raise ValueError(f"{len(names)} logical names {tuple(names)} for a {len(shape)}-d shape "
                     f"{tuple(shape)}.")
  used: set[str] = set()
  manual = set() if mesh is None else {
      a for a, t in zip(mesh.axis_names, getattr(mesh, "axis_types", ()) or ())
      if t == AxisType.Manual}
  spec = []
  for i, name in enumerate(names):
    axes = () if name is None else _lookup(name, table)
    kept = []
    size = 1
    for axis in axes:
      if axis in used:
        continue
      if mesh is not None:
        if axis not in mesh.axis_names or axis in manual:
          continue
        axis_size = mesh.shape[axis]
        if shape is not None and shape[i] % (size * axis_size):
          continue
        size *= axis_size
      kept.append(axis)
    if mesh is not None and len(kept) > 1:  # an axis of size 1 splits nothing: drop it,
      kept = [a for a in kept if mesh.shape[a] > 1] or kept[-1:]  # keep one if all are 1
    used.update(kept)
    spec.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
  return P(*spec)


def rule_shards(name: str, mesh=None) -> int:
  """How many devices the rule of logical axis ``name`` shards over (1 without a mesh)."""
  mesh = current_mesh() if mesh is None else mesh
  if mesh is None:
    return 1
  entry = logical_to_spec((name,), mesh=mesh)[0]
  axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
  return int(math.prod(mesh.shape[a] for a in axes))


def _all_explicit(mesh, spec: P) -> bool:
  """True if the spec's mesh axes are Explicit (change with reshard), False if Auto (use wsc)."""
  axes = [a for entry in spec if entry is not None
          for a in ((entry,) if isinstance(entry, str) else entry)]
  types = dict(zip(mesh.axis_names, mesh.axis_types))
  if axes:
    return all(types[a] == AxisType.Explicit for a in axes)
  return is_explicit_mesh(mesh)


def is_explicit_mesh(mesh=None) -> bool:
  """Whether every axis of ``mesh`` (default: the context mesh) is ``AxisType.Explicit``;
  axes made ``Manual`` by an enclosing ``shard_map`` (the pipeline's) do not count."""
  mesh = current_mesh() if mesh is None else mesh
  if mesh is None:
    return False
  types = [t for t in mesh.axis_types if t != AxisType.Manual]
  return bool(types) and all(t == AxisType.Explicit for t in types)


def with_logical_constraint(x, names: Sequence[str | None], rules: Rules | None = None):
  """Constrains ``x`` to the sharding its logical ``names`` map to on the context mesh.

  A no-op without a mesh. On Explicit axes this is ``jax.sharding.reshard``
  (a real layout change), on Auto axes ``jax.lax.with_sharding_constraint``.
  """
  mesh = current_mesh()
  if mesh is None:
    return x
  spec = logical_to_spec(names, rules, mesh=mesh, shape=x.shape)
  if _all_explicit(mesh, spec):
    return jax.sharding.reshard(x, spec)
  return jax.lax.with_sharding_constraint(x, spec)


def _einsum_out_shape(equation: str, a_shape, b_shape) -> tuple[int, ...]:
  """Output shape of a two-operand einsum, from the equation (no tracing: on Explicit meshes
  tracing the einsum without ``out_sharding`` is exactly what fails)."""
  inputs, out = equation.replace(" ", "").split("->")
  sizes: dict[str, int] = {}
  ellipsis: tuple[int, ...] = ()
  for term, shape in zip(inputs.split(","), (a_shape, b_shape)):
    if "..." in term:
      head, tail = term.split("...")
      n_ell = len(shape) - len(head) - len(tail)
      if not ellipsis:
        ellipsis = tuple(shape[len(head):len(head) + n_ell])
      term = head + tail
      shape = tuple(shape[:len(head)]) + tuple(shape[len(head) + n_ell:])
    sizes.update(zip(term, shape))
  result: list[int] = []
  head, _, tail = out.partition("...")
  result += [sizes[c] for c in head]
  if "..." in out:
    result += list(ellipsis)
  result += [sizes[c] for c in tail]
  return tuple(result)


def logical_einsum(equation: str, a, b, out_names: Sequence[str | None],
                   rules: Rules | None = None, **kwargs):
  """``jnp.einsum`` whose output is sharded as ``out_names`` say.

  Needed when the contracted dimension is sharded (e.g. heads over
  ``tensor`` in the attention output projection): on Explicit axes the output
  sharding is ambiguous unless given (``out_sharding``), which makes XLA emit
  the reduce(-scatter); on Auto axes it is a sharding hint after the fact.
  """
  mesh = current_mesh()
  if mesh is None:
    return jnp.einsum(equation, a, b, **kwargs)
  out_shape = _einsum_out_shape(equation, a.shape, b.shape)
  spec = logical_to_spec(out_names, rules, mesh=mesh, shape=out_shape)
  if is_explicit_mesh(mesh):
    return jnp.einsum(equation, a, b, out_sharding=spec, **kwargs)
  return jax.lax.with_sharding_constraint(jnp.einsum(equation, a, b, **kwargs), spec)


def logical_take(table, indices, out_names: Sequence[str | None], rules: Rules | None = None):
  """``table[indices]`` (embedding lookup) with the output sharded as ``out_names`` say.

  On Explicit axes a gather from a sharded table needs its output sharding
  spelled out (``.at[].get(out_sharding=)``).
  """
  mesh = current_mesh()
  if mesh is None:
    return jnp.take(table, indices, axis=0)
  out_shape = tuple(indices.shape) + tuple(table.shape[1:])
  spec = logical_to_spec(out_names, rules, mesh=mesh, shape=out_shape)
  if is_explicit_mesh(mesh):
    return table.at[indices].get(out_sharding=spec)
  return jax.lax.with_sharding_constraint(jnp.take(table, indices, axis=0), spec)


def _is_variable(x) -> bool:
  from flax import nnx  # local: sharding rules are usable without Flax

  return isinstance(x, nnx.Variable)


def _leaf_spec(x, mesh, rules) -> P:
  if _is_variable(x):
    names = x.get_metadata().get(LOGICAL_AXES_KEY)
    value = x.get_value()
    if names is None:
      return P()
    return logical_to_spec(names, rules, mesh=mesh, shape=value.shape)
  return P()


def param_specs(tree, mesh, rules: Rules | None = None):
  """``PartitionSpec`` per array of ``tree`` (a Module, State or pytree of Variables).

  Variables carrying ``logical_axes`` metadata get their rule-table spec;
  anything else (optimizer step counters, untagged arrays) is replicated. The
  result has the structure of ``tree``'s state: for a Module, of
  ``nnx.state(module)`` (equal to ``nnx.split(model, nnx.Param, ...)[1]`` for
  :class:`models.llama.Llama`, which holds only Params).
  """
  from flax import nnx

  if isinstance(tree, nnx.Module):
    tree = nnx.state(tree)

  def one(x):
    spec = _leaf_spec(x, mesh, rules)
    return x.replace(spec) if _is_variable(x) else spec

  return jax.tree.map(one, tree, is_leaf=_is_variable)


def param_shardings(tree, mesh, rules: Rules | None = None):
  """Like :func:`param_specs` but ``NamedSharding(mesh, spec)`` leaves: jit in/out shardings."""
  specs = param_specs(tree, mesh, rules)
  return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                      is_leaf=lambda s: isinstance(s, P))


def shard_params(tree, mesh, rules: Rules | None = None):
  """``jax.device_put`` of a Module/State onto ``mesh`` per the rules (returns the same kind)."""
  from flax import nnx

  if isinstance(tree, nnx.Module):
    graphdef, state = nnx.split(tree)
    return nnx.merge(graphdef, jax.device_put(state, param_shardings(state, mesh, rules)))
  return jax.device_put(tree, param_shardings(tree, mesh, rules))
