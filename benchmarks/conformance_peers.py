"""Adapters: peer ring attentions in the conformance kit's calling convention.

Each adapter only translates the call (global arrays -> ``jax.shard_map`` over the kit's
"sequence" axis, keyword names); the peers' code is not edited. What each adapter does
besides, stated here because it decides what the kit measures:

* ``paper_ringattention`` -- ``ringattention`` 0.1.2 (Liu et al., the paper's package),
  ``ringattention_jax``. Imports on jax 0.10 only after aliasing
  ``jax.lib.xla_bridge.get_backend`` (JAX-NOTES); runs under ``shard_map(check_vma=False)``.
  It has no scale argument and scales scores by ``1/sqrt(H)``, so the adapter multiplies
  ``q`` by ``scale * sqrt(H)`` first; it needs as many K/V heads as query heads, so the
  adapter repeats K/V heads for GQA (``jnp.repeat``; autodiff sums their gradients). Causal
  = ``causal_block_size=1``. Segment ids are passed as it takes them.
* ``ejkernel_ring`` -- ejkernel 0.0.80.3, ``ejkernel.kernels._xla.ring_attention``
  (the XLA backend: CPU). Called inside ``shard_map(check_vma=False)`` with
  ``axis_name="sequence"``; the kit's keywords map one to one (``causal``,
  ``q_segment_ids``/``kv_segment_ids``, ``sliding_window``, ``softmax_aux`` for sinks,
  ``logits_soft_cap``, ``softmax_scale``). Its signature takes fewer K/V heads than query
  heads, but under grad it raises a reshape ``TypeError`` whenever they differ
  (``-native-gqa``: as is), so ``ejkernel_ring`` repeats K/V heads like the paper's adapter.

Both adapters place global arrays on an Explicit-axes mesh (``jax.reshard``) before their
``shard_map``.

Run them with ``python benchmarks/conformance.py --peers`` in an environment that has them
(``pip install ringattention==0.1.2 ejkernel==0.0.80.3``; docs/conformance.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

SEQ = P(None, "sequence")


def _place(mesh, args, specs):
  """On a mesh with Explicit axes, the arrays resharded to their shard_map specs (the
  adapter's job: the peers take local shards)."""
  if not any(t == AxisType.Explicit for t in mesh.axis_types):
    return args
  return [jax.reshard(x, NamedSharding(mesh, s)) for x, s in zip(args, specs)]


def _import_ringattention():
  import jax.extend.backend  # noqa: PLC0415
  import jax.lib  # noqa: PLC0415
  if not hasattr(jax.lib, "xla_bridge"):
    import types  # noqa: PLC0415
    jax.lib.xla_bridge = types.SimpleNamespace(get_backend=jax.extend.backend.get_backend)
  from ringattention import ringattention_jax  # noqa: PLC0415 -- the function, not the module
  return ringattention_jax


def paper_ringattention(query, key, value, *, is_causal=False, segment_ids=None, scale=None,
                        mesh=None):
  """``ringattention`` 0.1.2's ``ring_attention`` (the JAX path) over ``mesh``'s sequence axis."""
  ring_attention = _import_ringattention()
  h = query.shape[-1]
  scale = h ** -0.5 if scale is None else scale
  group = query.shape[2] // key.shape[2]
  local = query.shape[1] // mesh.shape["sequence"]
  chunk = min(local, 64)
  blockwise = dict(causal_block_size=1 if is_causal else None, query_chunk_size=chunk,
                   key_chunk_size=chunk, deterministic=True, dropout_rng=None, attn_pdrop=0.0,
                   dtype=jnp.float32, policy=jax.checkpoint_policies.nothing_saveable,
                   precision=None, prevent_cse=True)

  def body(q, k, v, *seg):
    return ring_attention(q, k, v, None, seg[0] if seg else None, None, "sequence", True,
                             blockwise)

  q = query * jnp.asarray(scale * h ** 0.5, query.dtype)
  k, v = (jnp.repeat(x, group, axis=2) for x in (key, value))
  args = (q, k, v) + (() if segment_ids is None else (segment_ids,))
  args = _place(mesh, args, (SEQ,) * len(args))
  return jax.shard_map(body, mesh=mesh, in_specs=(SEQ,) * len(args), out_specs=SEQ,
                       check_vma=False)(*args)


def ejkernel_ring(query, key, value, *, is_causal=False, segment_ids=None, scale=None,
                  mesh=None, local_window_size=None, sinks=None, logits_soft_cap=None,
                  repeat_kv=True):
  """ejkernel 0.0.80.3's XLA ring attention over ``mesh``'s sequence axis (K/V heads
  repeated to the query heads by the adapter unless ``repeat_kv=False``)."""
  from ejkernel.kernels._xla.ring_attention import _interface  # noqa: PLC0415
  if repeat_kv:
    group = query.shape[2] // key.shape[2]
    key, value = (jnp.repeat(x, group, axis=2) for x in (key, value))
  kw = dict(causal=is_causal, softmax_scale=scale, axis_name="sequence",
            sliding_window=None if local_window_size is None else tuple(local_window_size),
            logits_soft_cap=logits_soft_cap)

  has_seg, has_sinks = segment_ids is not None, sinks is not None
  args, specs = [query, key, value], [SEQ, SEQ, SEQ]
  if has_seg:
    args.append(segment_ids)
    specs.append(SEQ)
  if has_sinks:
    args.append(sinks)
    specs.append(P())

  args = _place(mesh, args, specs)

  def call(q, k, v, *rest):
    seg = rest[0] if has_seg else None
    aux = rest[-1] if has_sinks else None
    return _interface.ring_attention(q, k, v, q_segment_ids=seg, kv_segment_ids=seg,
                                     softmax_aux=aux, **kw)

  return jax.shard_map(call, mesh=mesh, in_specs=tuple(specs), out_specs=SEQ,
                       check_vma=False)(*args)


PEERS = {
    "ringattention-0.1.2": paper_ringattention,
    "ejkernel-0.0.80.3-xla": ejkernel_ring,
    "ejkernel-0.0.80.3-xla-native-gqa": functools.partial(ejkernel_ring, repeat_kv=False),
}


def available() -> dict:
  """The peers importable here, by name."""
  found = {}
  for name, fn in PEERS.items():
    try:
      if name.startswith("ringattention"):
        _import_ringattention()
      else:
        import ejkernel.kernels._xla.ring_attention  # noqa: F401, PLC0415
    except Exception:  # noqa: BLE001 -- not installed or not importable: not run
      continue
    found[name] = fn
  return found

