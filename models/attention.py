"""The attention backends of the LLaMA: one registry, name -> function.

``LlamaConfig.attention`` (so also ``config.model.attention`` of train.py) is a
key of :data:`ATTENTION_BACKENDS`; ``training/validation.py`` validates against the
same table. Every backend has the signature::

  backend(cfg, q_BLNH, k_BLKH, v_BLKH, positions_BL, segment_ids_BL) -> o_BLNH

on *layout-ordered* inputs (the caller applied :func:`ring_jax.to_layout`),
``N`` query heads and ``K`` key/value heads (GQA: query head ``n`` uses
key/value head ``n // (N // K)``), causal over ``positions_BL``, attending
only within equal ``segment_ids_BL`` (None: one document per row; 0 is
padding). ``cfg`` is the :class:`models.llama.LlamaConfig` (``layout``,
``block_q``, ``block_kv``). A layer with a sliding window calls its backend
with one more keyword, ``local_window_size=(w - 1, 0)`` (``ring_jax``'s
meaning, keys in ``[p - left, p + right]``; :func:`ring_window` converts
Hugging Face's ``sliding_window`` ``w``); the built-in backends take it, a
registered one without that keyword serves windowless models only. Likewise a model
with a query scale, a logit soft-cap or attention sinks (Gemma, GPT-OSS) passes
``scale=``, ``logits_soft_cap=`` and ``sinks=`` (:func:`score_options`), each only when
set. The mesh is the context mesh (``jax.set_mesh``), or none.

The registered backends: ``"ring"``, ``"all_gather"``, ``"ulysses"``,
``"hybrid"`` and ``"auto"``, each :func:`ring_jax.attention_sharded` with that
``strategy`` (the hybrid's two mesh axes are ``cfg.hybrid_axes``; ``"auto"``
is :func:`ring_jax.plan`'s pick, decided by :func:`plan_attention`), and
``"dense"``, the single-device reference. On a mesh with ``sequence_outer > 1``
the sequence axis is the pair ``(sequence_outer, sequence)`` (:func:`sequence_axis`):
``"ring"`` is then the two-level ring; the backends of :data:`PAIR_BACKENDS` run
there, the others raise (:func:`check_sequence_axes`). Adding a backend is one entry:
``register_attention("name", fn)``. Pure JAX: importing this module needs no Flax.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax

import ring_jax
from models import sharding as shd

AttentionBackend = Callable[..., jax.Array]

#: name -> backend function; the one list of what ``LlamaConfig.attention`` may be.
ATTENTION_BACKENDS: dict[str, AttentionBackend] = {}


def register_attention(name: str, backend: AttentionBackend, *, replace: bool = False
                       ) -> AttentionBackend:
  """Adds ``backend`` to :data:`ATTENTION_BACKENDS` under ``name``; returns it.

  Registering the same function again is a no-op; another function under a
  taken name needs ``replace=True`` (so two backends cannot silently swap).
  """
  if not isinstance(name, str) or not name:
    raise ValueError(f"an attention backend needs a non-empty str name, got {name!r}.")
  current = ATTENTION_BACKENDS.get(name)
  if current is not None and current is not backend and not replace:
    raise ValueError(f"attention backend {name!r} is already registered ({current}); pass "
                     "replace=True to replace it.")
  ATTENTION_BACKENDS[name] = backend
  return backend


def check_backend(name: Any) -> None:
  """Raises ValueError naming the registered backends unless ``name`` is one of them."""
  if name not in ATTENTION_BACKENDS:
    raise ValueError(f"attention must be one of {sorted(ATTENTION_BACKENDS)}, got {name!r} "
                     "(register new ones with models.attention.register_attention).")


def ring_window(sliding_window: int | None) -> tuple[int, int] | None:
  """Hugging Face's ``sliding_window`` ``w`` as ``ring_jax``'s ``local_window_size``.

  transformers' ``sliding_window_overlay`` keeps key ``k`` for query ``q`` iff
  ``k > q - w`` (with the causal mask: the query and the ``w - 1`` keys before
  it); ``ring_jax`` keeps keys in ``[q - left, q + right]``: ``(w - 1, 0)``.
  """
  if sliding_window is None:
    return None
  if sliding_window < 1:
    raise ValueError(f"sliding_window must be >= 1, got {sliding_window}.")
  return (int(sliding_window) - 1, 0)


def score_options(cfg, sinks=None) -> dict[str, Any]:
  """The keywords beyond the contract that ``cfg``'s attention passes its backend: ``scale``
  (``query_pre_attn_scalar ** -0.5``, Gemma), ``logits_soft_cap`` (``attn_logits_soft_cap``,
  Gemma 2) and ``sinks`` (the layer's ``[N]`` sink logits, GPT-OSS), each only when set, so a
  registered backend without them serves the models that do not use them."""
  extra: dict[str, Any] = {}
  if cfg.query_pre_attn_scalar is not None:
    extra["scale"] = float(cfg.query_pre_attn_scalar) ** -0.5
  if cfg.attn_logits_soft_cap is not None:
    extra["logits_soft_cap"] = float(cfg.attn_logits_soft_cap)
  if sinks is not None:
    extra["sinks"] = sinks
  return extra


def attention(cfg, q_BLNH, k_BLKH, v_BLKH, positions_BL, segment_ids_BL, window=None,
              sinks=None):
  """Runs the backend ``cfg.attention`` names (see the module docstring for the contract);
  ``window``: the layer's Hugging Face ``sliding_window`` (None: full causal attention);
  ``sinks``: the layer's ``[N]`` sink logits (``cfg.attn_sinks``), or None. The score
  options of ``cfg`` (:func:`score_options`) go to the backend as keywords."""
  check_backend(cfg.attention)
  extra = score_options(cfg, sinks)
  if window is not None:
    extra["local_window_size"] = ring_window(window)
  with jax.named_scope(cfg.attention):
    return ATTENTION_BACKENDS[cfg.attention](cfg, q_BLNH, k_BLKH, v_BLKH, positions_BL,
                                             segment_ids_BL, **extra)


def rule_axis(name: str, mesh) -> str | None:
  """The single mesh axis logical ``name`` maps to on ``mesh``, or None."""
  entry = shd.logical_to_spec((name,), mesh=mesh)[0]
  if entry is None:
    return None
  if not isinstance(entry, str):
    raise ValueError(f"attention shards {name!r} over one mesh axis, the rules give {entry}.")
  return entry


def sharded_axes(mesh, q_BLNH, k_BLKH) -> tuple[str | None, str | None]:
  """``(batch_axis, head_axis)`` for a sequence-parallel backend on ``mesh``, per the rules.

  :func:`ring_jax.attention_axes` with ``drop=True``: an axis that does not
  divide the batch, or the query and key/value heads (a single key/value head
  is replicated, MQA), is dropped: that dimension stays whole on every device.
  """
  axes = ring_jax.attention_axes(
      mesh.shape, batch=q_BLNH.shape[0], heads=q_BLNH.shape[2], kv_heads=k_BLKH.shape[2],
      batch_axis=rule_axis("batch", mesh), head_axis=rule_axis("heads", mesh), drop=True)
  return axes.batch, axes.heads


def sequence_axis(mesh) -> str | tuple[str, str] | None:
  """The mesh axis the ``length`` rule shards the sequence over, or the pair
  ``("sequence_outer", "sequence")`` of a mesh with ``sequence_outer > 1`` (the two-level
  ring's ``seq_axis=(outer, inner)``), or None (no mesh, no such axis)."""
  if mesh is None:
    return None
  entry = shd.logical_to_spec(("length",), mesh=mesh)[0]
  return entry if entry is None or isinstance(entry, str) else tuple(entry)


def check_sequence_axes(strategy: str, seq_axis) -> None:
  """ValueError naming the fix unless ``strategy`` runs on ``seq_axis`` (one axis, or the
  pair of a two-level mesh: ring (the two-level ring), all_gather, auto and dense do;
  ulysses and hybrid need one sequence axis)."""
  if isinstance(seq_axis, tuple) and strategy not in PAIR_BACKENDS:
    raise ValueError(
        f"model.attention={strategy!r} runs over one sequence axis, but the mesh splits the "
        f"sequence over {seq_axis} (mesh.sequence_outer > 1: the two-level ring); use "
        f"model.attention='ring' (or one of {PAIR_BACKENDS}), or mesh.sequence_outer=1.")


#: The sequence-parallel strategies of :func:`ring_jax.attention_sharded`, each a backend
#: under its own name ("auto": :func:`ring_jax.plan`'s pick, see :func:`plan_attention`).
STRATEGY_BACKENDS: tuple[str, ...] = ("ring", "all_gather", "ulysses", "hybrid", "auto")

#: What "auto" chooses among: the strategies that run on the one ``length`` axis (on a
#: two-level mesh, those of them that run on the pair: :data:`PAIR_BACKENDS`).
AUTO_CANDIDATES: tuple[str, ...] = ("ring", "all_gather", "ulysses")

#: The backends that run where the ``length`` rule gives a pair of axes (``sequence_outer >
#: 1``): the strategies :func:`ring_jax.attention_sharded` runs as one ring over a pair
#: (``"ring"``: the two-level ring), "auto" among them, and dense.
PAIR_BACKENDS: tuple[str, ...] = tuple(
    name for name in STRATEGY_BACKENDS
    if name == "auto" or ring_jax.strategies.TABLE[name].one_ring_over_pair) + ("dense",)


def hybrid_seq_axes(cfg, mesh) -> tuple[str, str]:
  """``cfg.hybrid_axes`` = ``(ring_axis, ulysses_axis)``, checked against ``mesh``.

  The ring axis must be the one the ``length`` rule names (the data arrive in
  ``cfg.layout`` order for a ring of its size); the Ulysses axis is any other
  axis of the mesh (default ``tensor``: heads are then split by the Ulysses
  all-to-all instead of over ``tensor`` inside attention).
  """
  ring_axis, uly_axis = cfg.hybrid_axes
  seq_axis = sequence_axis(mesh)
  if ring_axis != seq_axis:
    raise ValueError(f"hybrid_axes={cfg.hybrid_axes}: the ring axis must be the axis the "
                     f"sequence is sharded over ({seq_axis!r}); e.g. hybrid_axes=({seq_axis!r}, "
                     "'tensor').")
  if uly_axis not in mesh.axis_names:
    raise ValueError(f"hybrid_axes={cfg.hybrid_axes}: {uly_axis!r} is not an axis of the mesh "
                     f"{tuple(mesh.axis_names)}.")
  return ring_axis, uly_axis


def check_mesh(cfg, mesh) -> None:
  """ValueError naming the fix unless ``cfg.attention`` runs on ``mesh`` (a ``Mesh`` or an
  ``AbstractMesh`` of a config's sizes): one sequence axis where the strategy needs it
  (:func:`check_sequence_axes`), ``cfg.hybrid_axes`` (:func:`hybrid_seq_axes`), and the heads
  on each device over the Ulysses axis (:func:`ring_jax.validation.ulysses_repeat`; heads the
  rules shard over another axis count per shard, a single key/value head is replicated)."""
  seq_axis = sequence_axis(mesh)
  if seq_axis is None or cfg.attention not in ("ulysses", "hybrid"):
    return
  check_sequence_axes(cfg.attention, seq_axis)
  uly_axis = seq_axis if cfg.attention == "ulysses" else hybrid_seq_axes(cfg, mesh)[1]
  heads, kv_heads, head_axis = cfg.num_heads, cfg.num_kv_heads, rule_axis("heads", mesh)
  if head_axis not in (None, uly_axis):
    shards = mesh.shape[head_axis]
    heads, kv_heads = heads // shards, (kv_heads // shards if kv_heads % shards == 0
                                        else kv_heads)
  try:
    ring_jax.validation.ulysses_repeat(heads, kv_heads, mesh.shape[uly_axis], uly_axis)
  except ValueError as e:
    raise ValueError(f"model.attention={cfg.attention!r}: {e}") from None


def plan_attention(cfg, mesh, batch: int, seq_len: int):
  """:func:`ring_jax.plan` for ``cfg``'s attention on ``mesh``: a :class:`ring_jax.Plan`
  over :data:`AUTO_CANDIDATES` (``.strategy``, ``.reasons``), or None when ``mesh`` has no
  sequence axis (then every strategy falls back to :func:`dense`).

  The one place "auto" is decided: train.py calls it once at startup (and prints
  the choice), the ``"auto"`` backend calls it with the same numbers when traced.
  """
  seq_axis = sequence_axis(mesh)
  if seq_axis is None:
    return None
  batch_axis, head_axis = _axes_for_shapes(mesh, batch, cfg.num_heads, cfg.num_kv_heads)
  try:
    device = mesh.devices.flat[0].device_kind
  except (AttributeError, ValueError, IndexError):  # an AbstractMesh (inside jit): no devices
    device = jax.devices()[0].device_kind
  pair = isinstance(seq_axis, tuple)
  return ring_jax.plan(
      batch=batch, seq_len=seq_len, heads=cfg.num_heads, kv_heads=cfg.num_kv_heads,
      head_dim=cfg.resolved_head_dim, dtype=cfg.dtype, is_causal=True, layout=cfg.layout,
      sequence=tuple(mesh.shape[a] for a in seq_axis) if pair else mesh.shape[seq_axis],
      strategies=[s for s in AUTO_CANDIDATES if not pair or s in PAIR_BACKENDS],
      tensor=mesh.shape[head_axis] if head_axis else 1,
      data=mesh.shape[batch_axis] if batch_axis else 1, device=device,
      causal_routing=cfg.causal_routing)


def describe_routing(cfg, mesh) -> str:
  """One line for train.py: whether the model's ring routes its K/V under the causal mask
  (``cfg.causal_routing`` resolved for ``cfg.layout``; the two-level ring routes its outer
  transfers by the same rule)."""
  seq_axis = sequence_axis(mesh)
  if cfg.attention not in ("ring", "hybrid") or seq_axis is None:
    return f"ring K/V routing: n/a (attention {cfg.attention!r}, no ring over the sequence)"
  two_level = cfg.attention == "ring" and isinstance(seq_axis, tuple)
  routed = ring_jax.routing.check_routing(cfg.causal_routing, cfg.layout)
  how = ("routed under the causal mask (each K/V part only to the "
         + ("groups that see it, over the two-level ring's outer axis)" if two_level
            else "devices that see it)")
         if routed else "full rotation")
  return (f"ring K/V routing: {how}; model.causal_routing={cfg.causal_routing}, "
          f"layout {cfg.layout!r}")


def resolve_attention(cfg, mesh, batch: int, seq_len: int):
  """``(cfg, plan)``: ``cfg`` with ``attention="auto"`` replaced by the strategy
  :func:`plan_attention` picks (``plan`` says why), so it is decided once; any other
  ``cfg`` comes back unchanged with ``plan=None``."""
  if cfg.attention != "auto":
    return cfg, None
  chosen = plan_attention(cfg, mesh, batch, seq_len)
  strategy = "ring" if chosen is None else chosen.strategy
  return dataclasses.replace(cfg, attention=strategy), chosen


def _axes_for_shapes(mesh, batch: int, heads: int, kv_heads: int):
  shape = jax.ShapeDtypeStruct
  return sharded_axes(mesh, shape((batch, 1, heads, 1), "float32"),
                      shape((batch, 1, kv_heads, 1), "float32"))


def _sharded_strategy(strategy: str) -> AttentionBackend:
  """The backend running ``ring_jax.attention_sharded(..., strategy=strategy)``."""

  def backend(cfg, q_BLNH, k_BLKH, v_BLKH, positions_BL, segment_ids_BL,
              local_window_size=None, scale=None, logits_soft_cap=None, sinks=None):
    mesh = shd.current_mesh()
    seq_axis = sequence_axis(mesh)
    if seq_axis is None:  # no ring to run on: the same values, densely
      return dense(cfg, q_BLNH, k_BLKH, v_BLKH, positions_BL, segment_ids_BL,
                   local_window_size=local_window_size, scale=scale,
                   logits_soft_cap=logits_soft_cap, sinks=sinks)
    name = strategy
    if name == "auto":
      name = plan_attention(cfg, mesh, q_BLNH.shape[0], q_BLNH.shape[1]).strategy
    check_sequence_axes(name, seq_axis)
    batch_axis, head_axis = sharded_axes(mesh, q_BLNH, k_BLKH)
    seq = seq_axis
    if name == "hybrid":
      seq = hybrid_seq_axes(cfg, mesh)
      # The Ulysses axis splits the heads itself; a batch axis used for the sequence is
      # not also a batch split.
      head_axis = None if head_axis in seq else head_axis
      batch_axis = None if batch_axis in seq else batch_axis
    return ring_jax.attention_sharded(
        q_BLNH, k_BLKH, v_BLKH, mesh=mesh, strategy=name, seq_axis=seq,
        batch_axis=batch_axis, head_axis=head_axis, is_causal=True, segment_ids=segment_ids_BL,
        layout=cfg.layout, inputs_in_layout=True, block_q=cfg.block_q, block_kv=cfg.block_kv,
        hop_kernel=cfg.hop_kernel, causal_routing=cfg.causal_routing,
        local_window_size=local_window_size, scale=scale, logits_soft_cap=logits_soft_cap,
        sinks=sinks)

  backend.__name__ = strategy
  backend.__qualname__ = strategy
  backend.__doc__ = (
      f":func:`ring_jax.attention_sharded` with ``strategy={strategy!r}`` over the mesh axis "
      "the ``length`` rule names, or its pair ``(sequence_outer, sequence)`` (ring: the "
      "two-level ring; see :func:`sequence_axis`; ``hybrid``: ``cfg.hybrid_axes``), "
      "``layout=cfg.layout, "
      "inputs_in_layout=True``, batch and heads sharded per the rules. Without a context "
      "mesh, or when the mesh has no such axis, it falls back to :func:`dense` (same values; "
      "O(L^2) memory), since there is no sequence axis to run on.")
  return backend


def dense(cfg, q_BLNH, k_BLKH, v_BLKH, positions_BL, segment_ids_BL, local_window_size=None,
          scale=None, logits_soft_cap=None, sinks=None):
  """:func:`ring_jax.reference_attention`, causal over ``positions`` (so any layout order),
  within ``local_window_size`` if given, with the ``scale``, ``logits_soft_cap`` and
  ``sinks`` given (:func:`score_options`).

  On a mesh it runs under ``shard_map`` per (batch, head) shard with the
  whole sequence gathered: a reference, not a long-context path.
  """
  del cfg  # Masks come from the positions: the layout order needs no special case.

  def local(q, k, v, pos, seg, sinks=sinks):
    return ring_jax.reference_attention(q, k, v, is_causal=True, segment_ids=seg,
                                        q_positions=pos, kv_positions=pos,
                                        local_window_size=local_window_size, scale=scale,
                                        logits_soft_cap=logits_soft_cap, sinks=sinks)

  mesh = shd.current_mesh()
  if mesh is None:
    return local(q_BLNH, k_BLKH, v_BLKH, positions_BL, segment_ids_BL)
  # Shard batch and heads only; the sequence axis is gathered (heads shard consistently for
  # GQA: a block of N/t query heads uses the matching block of K/t key/value heads).
  q_names = ("batch", None, "heads", None)
  kv_names = ("batch", None, "kv_heads", None)
  q_spec = shd.logical_to_spec(q_names, mesh=mesh, shape=q_BLNH.shape)
  kv_spec = shd.logical_to_spec(kv_names, mesh=mesh, shape=k_BLKH.shape)
  if q_spec[2] != kv_spec[2]:  # e.g. 1 kv head: replicate heads rather than mismatch groups
    q_names = kv_names = ("batch", None, None, None)
    q_spec = kv_spec = shd.logical_to_spec(q_names, mesh=mesh, shape=q_BLNH.shape)
  row_spec = jax.sharding.PartitionSpec(q_spec[0], None)
  q = shd.with_logical_constraint(q_BLNH, q_names)
  k = shd.with_logical_constraint(k_BLKH, kv_names)
  v = shd.with_logical_constraint(v_BLKH, kv_names)
  pos = shd.with_logical_constraint(positions_BL, ("batch", None))
  # Optional operands travel as shard_map arguments (sinks split with their query heads).
  extra, extra_specs = [], []
  if segment_ids_BL is not None:
    extra.append(shd.with_logical_constraint(segment_ids_BL, ("batch", None)))
    extra_specs.append(row_spec)
  if sinks is not None:
    extra.append(sinks)
    extra_specs.append(jax.sharding.PartitionSpec(q_spec[2]))

  def shard(q, k, v, p, *rest):
    rest = list(rest)
    seg = rest.pop(0) if segment_ids_BL is not None else None
    return local(q, k, v, p, seg, sinks=rest.pop(0) if sinks is not None else None)

  fn = jax.shard_map(shard, mesh=mesh,
                     in_specs=(q_spec, kv_spec, kv_spec, row_spec, *extra_specs),
                     out_specs=q_spec)
  out = fn(q, k, v, pos, *extra)
  return shd.with_logical_constraint(out, ("batch", "length", "heads", "head_dim"))


for _strategy in STRATEGY_BACKENDS:
  register_attention(_strategy, _sharded_strategy(_strategy))
register_attention("dense", dense)
