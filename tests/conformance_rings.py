"""A small ring attention of the kit's calling convention, and five deliberately broken ones.

``simple_ring`` is the textbook ring (Liu et al., "Ring Attention", 2023, Sec. 3): each device
keeps its query shard, K/V shards (with their segment ids) travel one device per hop, and the
softmax is summed across hops (no max subtraction: the kit's inputs keep scores small), with
the sink logit added once to the denominator. Gradients come from autodiff through the hops.
Each ``BUGS`` entry is the same ring with one known bug class of context-parallel attention;
``tests/ring_jax/test_conformance.py`` checks the kit catches each one and names the case.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

#: bug -> the kit case that must catch it (and fail with its name).
BUGS = {
    "drop-last-hop": "causal",              # the loop runs n - 1 hops
    "causal-off-by-one-block": "causal",    # the diagonal block taken as fully in the past
    "sink-per-hop": "sinks+10",             # the sink in every hop's denominator
    "dkdv-not-sent-home": "first-last-hop",  # dK/dV left one device short of home
    "segments-by-value": "segments-crossing",  # ids renumbered per shard, compared by value
}


def _renumber(seg):
  """Per-shard document ids 1, 2, ... (0 stays padding): equal values on two shards are then
  unrelated documents -- the bug of comparing such ids across shards."""
  start = jnp.concatenate([jnp.ones_like(seg[:, :1]), (seg[:, 1:] != seg[:, :-1])], axis=1)
  return jnp.where(seg == 0, 0, jnp.cumsum(start.astype(jnp.int32), axis=1))


def _local_ring(q, k, v, seg, z, *, n, is_causal, scale, has_sinks, bug):
  i = jax.lax.axis_index("sequence")
  b, length, heads, _ = q.shape
  k, v = (jnp.repeat(x, heads // k.shape[2], axis=2) for x in (k, v))
  if bug == "segments-by-value":
    seg = _renumber(seg)
  q_seg, kv_seg = seg, seg
  local_pos = jnp.arange(length)
  qf = q.astype(jnp.float32)
  denom = jnp.zeros((b, heads, length), jnp.float32)
  acc = jnp.zeros((b, length, heads, v.shape[-1]), jnp.float32)
  shift = [(j, (j + 1) % n) for j in range(n)]
  for hop in range(n - 1 if bug == "drop-last-hop" else n):
    src = (i - hop) % n
    s = jnp.einsum("btnh,bsnh->bnts", qf, k.astype(jnp.float32)) * scale
    vis = (q_seg[:, :, None] == kv_seg[:, None, :]) & (q_seg != 0)[:, :, None]
    if is_causal:
      past = src <= i if bug == "causal-off-by-one-block" else src < i
      diag = (src == i) & (local_pos[:, None] >= local_pos[None, :])
      vis = vis & (past | diag)[None]
    p = jnp.where(vis[:, None], jnp.exp(jnp.where(vis[:, None], s, 0.0)), 0.0)
    denom = denom + p.sum(-1)
    if has_sinks and bug == "sink-per-hop":
      denom = denom + jnp.exp(z)[None, :, None]
    acc = acc + jnp.einsum("bnts,bsnh->btnh", p, v.astype(jnp.float32))
    if n > 1:
      k, v, kv_seg = (jax.lax.ppermute(x, "sequence", shift) for x in (k, v, kv_seg))
  if has_sinks and bug != "sink-per-hop":
    denom = denom + jnp.exp(z)[None, :, None]
  denom = jnp.where(denom > 0, denom, 1.0).transpose(0, 2, 1)[..., None]
  return (acc / denom).astype(q.dtype)


def _not_sent_home(local, n):
  """``local`` whose dK/dV land one device further round the ring than home."""

  @jax.custom_vjp
  def f(q, k, v, seg, z):
    return local(q, k, v, seg, z)

  def fwd(q, k, v, seg, z):
    out, vjp = jax.vjp(lambda q, k, v, z: local(q, k, v, seg, z), q, k, v, z)
    return out, (vjp, seg)

  def bwd(res, g):
    vjp, seg = res
    dq, dk, dv, dz = vjp(g)
    shift = [(j, (j + 1) % n) for j in range(n)]
    dk, dv = (jax.lax.ppermute(x, "sequence", shift) for x in (dk, dv))
    return dq, dk, dv, None, dz

  f.defvjp(fwd, bwd)
  return f


def simple_ring(query, key, value, *, is_causal=False, segment_ids=None, scale=None, mesh=None,
                sinks=None, bug: str | None = None):
  """Ring attention on global ``[B, L, N, H]`` arrays over ``mesh``'s "sequence" axis
  (contiguous shards), with segment ids and sinks; ``bug`` (a ``BUGS`` key) breaks it."""
  if bug is not None and bug not in BUGS:
    raise ValueError(f"bug must be one of {list(BUGS)}, got {bug!r}")
  n = mesh.shape["sequence"]
  scale = query.shape[-1] ** -0.5 if scale is None else scale
  seg = (jnp.ones(query.shape[:2], jnp.int32) if segment_ids is None
         else jnp.asarray(segment_ids, jnp.int32))
  z = jnp.zeros(query.shape[2], jnp.float32) if sinks is None else sinks
  local = functools.partial(_local_ring, n=n, is_causal=is_causal, scale=scale,
                            has_sinks=sinks is not None, bug=bug)
  if bug == "dkdv-not-sent-home":
    local = _not_sent_home(local, n)
  spec = P(None, "sequence")
  return jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec, spec, P()),
                       out_specs=spec)(query, key, value, seg, z)


def broken(bug: str):
  """``simple_ring`` with ``bug``."""
  return functools.partial(simple_ring, bug=bug)


drop_last_hop = broken("drop-last-hop")
causal_off_by_one_block = broken("causal-off-by-one-block")
sink_per_hop = broken("sink-per-hop")
dkdv_not_sent_home = broken("dkdv-not-sent-home")
segments_by_value = broken("segments-by-value")
