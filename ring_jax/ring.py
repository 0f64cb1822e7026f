"""The ring: K/V shards travel around a named mesh axis with ``ppermute``.

Liu, Zaharia & Abbeel, "Ring Attention with Blockwise Transformers for
Near-Infinite Context" (2023), Alg. 1. Device ``i`` of an ``n``-device ring
starts with its own K/V shard and, at hop ``h``, holds the shard of device
``(i - h) mod n``. Each hop folds blockwise attention against that shard into
a float32 online-softmax carry (:mod:`ring_jax.hop`); the next shard's
transfer is issued before the hop's compute so XLA can overlap the two. Only
the hops ``first..last`` of :func:`ring_jax.routing.hop_range` run (a
local window on the contiguous layout needs a few neighbouring shards; the
whole ring is ``0..n-1``), both passes in one loop (:func:`over_hops`).

The backward pass is a hand-written ``custom_vjp`` that goes around the ring
again: K, V and their float32 gradient accumulators dK, dV travel together,
each device adding its queries' contribution; after ``n`` transfers every dK/dV
is back on the device that owns the shard. Nothing per hop is stored, so memory
is linear in the local length (autodiff through the loop would keep every
hop's scores).

With causal routing (:func:`_forward_routed`, :func:`_backward_routed`; the
default for causal contiguous rings, ``causal_routing=True`` for the others)
each part of a shard travels only to the devices that can see it, along the
routes of :func:`ring_jax.routing.routes` (zigzag: both chunks backward, the
late ones only as far as they are seen), and each dK/dV accumulator goes home
from the last device that uses it; each hop's own transfers are picked in the
hop loop by a ``lax.switch`` (:func:`hop_send`).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from ring_jax import kernels
from ring_jax import layouts
from ring_jax import masking
from ring_jax import routing
from ring_jax import topology
from ring_jax import validation
from ring_jax.hop import (HopGrads, HopKernel, HopMasks, HopResiduals, HopSpec, varying_axes,
                          empty_result, lse_for_backward, merge, takes_block, varying_like)

# The largest block default_block picks, per platform (topology.target_platform()): a block size,
# or ((up to this local length, block), ..., (None, block)) steps. Each hop holds a few
# [B, N, block, block] float32 score blocks, so a block is also a memory choice. cpu: from the
# block sweep (docs/performance.md, "Block sizes"); gpu, tpu: the maintained fused kernels'
# tiles (128; splash on TPU: multiples of 128, 512 in MaxText), until a hardware sweep.
BLOCK_TARGETS = {"cpu": ((512, 64), (None, 128)), "gpu": 128, "tpu": 512}
DEFAULT_BLOCK = 256  # platforms the table does not name

# What ``causal_routing=None`` and ``overlap_dkv=None`` mean per platform where it differs from
# the layout rule (:func:`ring_jax.routing.check_routing`) and in-place dK/dV
# (docs/performance.md, "Ring transfers on the TPU compiler"). tpu: its compiler runs each
# transfer asynchronously beside the block compute, so the full rotation (a routed hop picks
# its transfers in a ``lax.switch``, whose branches start and finish them) and fresh dK/dV
# buffers (the hop need not wait for the arriving accumulators) keep every ring transfer in
# flight; the full rotation also takes less temp memory there.
PLATFORM_DEFAULTS = {"tpu": {"causal_routing": False, "overlap_dkv": True}}


@dataclasses.dataclass(frozen=True)
class RingConfig:
  axis_name: object
  ring_size: int
  layout: str
  spec: HopSpec
  kernel: HopKernel
  return_lse: bool = False
  hops: tuple[int, int] = (0, 0)  # (first, last) hops run (routing.hop_range)
  overlap_dkv: bool = False
  routes: routing.Routes | None = None  # None: every shard goes all the way round


def platform_defaults(platform: str | None = None, *, causal_routing=None,
                      overlap_dkv=None) -> dict:
  """``{"causal_routing", "overlap_dkv"}`` with ``None`` resolved for ``platform`` (default:
  the one compiled for, :func:`ring_jax.topology.target_platform`) by :data:`PLATFORM_DEFAULTS`: ``overlap_dkv`` becomes a bool
  (``False`` where the table says nothing), ``causal_routing`` stays ``None`` (the layout
  rule of :func:`ring_jax.routing.check_routing`) where the table says nothing."""
  rule = PLATFORM_DEFAULTS.get(platform or topology.target_platform(), {})
  if causal_routing is None:
    causal_routing = rule.get("causal_routing")
  if overlap_dkv is None:
    overlap_dkv = rule.get("overlap_dkv", False)
  if not isinstance(overlap_dkv, (bool, np.bool_)):
    raise TypeError(f"overlap_dkv must be None (the platform's default), True or False, got "
                    f"{overlap_dkv!r}.")
  return {"causal_routing": causal_routing, "overlap_dkv": bool(overlap_dkv)}


def block_target(platform: str | None = None, local_len: int | None = None) -> int:
  """The largest default block on ``platform`` (default: the one compiled for,
  :func:`ring_jax.topology.target_platform`) for shards
  of ``local_len`` tokens (None: the longest): :data:`BLOCK_TARGETS`, else
  :data:`DEFAULT_BLOCK`."""
  rule = BLOCK_TARGETS.get(platform or topology.target_platform(), DEFAULT_BLOCK)
  if isinstance(rule, int):
    return rule
  for up_to, block in rule:
    if up_to is None or (local_len is not None and local_len <= up_to):
      return block
  raise ValueError(f"BLOCK_TARGETS[{platform!r}] must end with a (None, block) step: {rule}.")


def default_block(layout: str, local_len: int, target: int | None = None, *,
                  platform: str | None = None, kernel: HopKernel | None = None) -> int:
  """The largest divisor of the layout's chunk (local length, or half for zigzag) that is
  <= ``target`` and that ``kernel`` takes (:func:`ring_jax.hop.takes_block`); when the
  kernel takes none of those, the smallest divisor it takes (the one nearest the target).

  ``target`` defaults to the platform's :func:`block_target`; ``kernel`` None: any block.
  Blocks that do not straddle the zigzag chunk boundary let the schedule skip whole
  masked chunks.

  Raises:
    ValueError: ``kernel`` takes no divisor of the chunk (naming the fix).
  """
  target = block_target(platform, local_len) if target is None else target
  chunk = local_len // 2 if layout == "zigzag" else local_len
  if kernel is None:
    for size in range(min(target, chunk), 0, -1):
      if chunk % size == 0:
        return size
    return 1
  small = [d for d in range(1, math.isqrt(chunk) + 1) if chunk % d == 0]
  taken = [d for d in sorted(set(small + [chunk // d for d in small]))
           if takes_block(kernel, d)]
  if not taken:
    raise ValueError(
        f"hop kernel {getattr(kernel, 'name', kernel)!r} takes no block size that divides the "
        f"{'zigzag chunk (half the local length)' if layout == 'zigzag' else 'local length'} "
        f"of {chunk} tokens; pad the sequence so that one of its blocks divides it, or use "
        "hop_kernel='xla'.")
  below = [d for d in taken if d <= target]
  return below[-1] if below else taken[0]


def ring_attention(query, key, value, *, axis_name, is_causal: bool = False, segment_ids=None,
                   scale: float | None = None, local_window_size=None,
                   layout: str = "contiguous", block_q: int | None = None,
                   block_kv: int | None = None, precision=None,
                   hop_kernel: str | HopKernel = "auto", return_lse: bool = False,
                   overlap_dkv: bool | None = None, causal_routing: bool | None = None):
  """Exact attention over a sequence sharded along mesh axis ``axis_name``.

  Call inside ``jax.shard_map`` (or any context where ``axis_name`` is bound)
  on the local shards. The local shards must be in ``layout`` order: shard
  ``i`` holds the tokens :func:`ring_jax.local_positions` gives for device
  ``i`` (use :func:`ring_jax.to_layout` on the global array before sharding,
  or :func:`ring_jax.ring_attention_sharded`, which does it for you).

  Args:
    query: local ``[B, T, N, H]``.
    key, value: local ``[B, S, K, H]``; ``N % K == 0``. Only the ``K`` heads
      travel around the ring (GQA/MQA without repeating K/V).
    axis_name: mesh axis the sequence is sharded over (the ring).
    is_causal: causal mask over global positions.
    segment_ids: local integer ``[B, T]`` (any integer dtype, compared as
      given): attention only within equal ids; 0 is padding (pad queries
      output 0; pad keys are never attended); every other value, negative ones
      included, is a document id. Travels around the ring with K/V.
    scale: score scale, default ``1/sqrt(H)``; must be finite in float32 (the
      scores are float32).
    local_window_size: ``int`` or ``(left, right)`` sliding window over
      global positions (as in ``jax.nn.dot_product_attention``).
    layout: ``"contiguous"``, ``"zigzag"`` or ``"striped"`` (see
      :mod:`ring_jax.layouts`); with a causal mask zigzag and striped balance
      the work across devices. ``"document"`` (rows packed with documents,
      reordered by :func:`ring_jax.document_layout`) balances it per document;
      it needs ``segment_ids`` (the layout's) and no window, and runs as zigzag
      (its mask positions, see :mod:`ring_jax.documents`).
    block_q, block_kv: query / key block sizes of the blockwise computation;
      must divide the local length. Default: the largest divisor of the layout's chunk
      up to the platform's :func:`block_target` (CPU 64 up to 512-token shards, else
      128; GPU 128; TPU 512) that the hop kernel takes (its ``takes_block``: splash
      multiples of 128), else the smallest divisor it takes (:func:`default_block`).
    precision: matmul precision (e.g. ``jax.lax.Precision.HIGHEST`` for
      float32 on TPU).
    hop_kernel: the per-hop kernel: a name from
      :data:`ring_jax.kernels.HOP_KERNELS` (``"xla"``; fused kernels by their
      names) or ``"auto"`` (the platform's maintained fused kernel once it
      passed its self-check on the device, else XLA; see
      :mod:`ring_jax.kernels`), or an object
      implementing :class:`ring_jax.hop.HopKernel`. The platform is the one
      compiled for (:func:`ring_jax.topology.target_platform`: the current mesh's
      devices', else ``jax.default_backend()``).
    return_lse: also return the float32 log-sum-exp of each query row's
      scaled visible scores, ``[B, T, N]`` (``-inf`` for rows that attend
      nothing), differentiable like the output: with it, ring attention can
      be merged exactly with other attention over other keys.
    overlap_dkv: backward only. ``False``: each hop adds its dK/dV
      into the float32 accumulator that arrives with the K/V shard, in place
      (as the paper's code does): leanest, but the hop waits for that
      accumulator's transfer. ``True``: each hop computes dK/dV into fresh
      float32 buffers and adds the arriving accumulator afterwards, so the
      transfer overlaps the hop's compute, for two more K/V-sized float32
      buffers per device. ``None`` (default): ``True`` on TPU, ``False``
      elsewhere (:data:`PLATFORM_DEFAULTS`; the platform is
      ``jax.default_backend()``, a mesh's devices' for
      :func:`ring_jax.ring_attention_sharded`).
    causal_routing: move each K/V part only to the devices that can see it
      (:func:`ring_jax.routing.routes`), forward and backward (dK/dV then
      go home straight from the last device that uses them). Contiguous
      causal: half the K/V bytes; zigzag (and document): 0.75x, both chunks
      going backward; both with the same work at every hop as the full
      rotation; striped: nothing to drop (every device sees every shard).
      Exact in every case. ``None`` (default): off on TPU
      (:data:`PLATFORM_DEFAULTS`: there the full rotation keeps every transfer
      in flight and takes less memory), elsewhere on for causal contiguous
      rings and off otherwise (:func:`ring_jax.routing.check_routing`,
      docs/performance.md); ``True`` / ``False`` force it.

  Returns:
    local ``[B, T, N, H]`` in ``query.dtype``, equal to dense attention over
    the global sequence, or ``(out, lse)`` with ``return_lse``. Rows that
    attend nothing (padding, or a window and mask that leave no key) are 0.
    A non-finite value in q, k or v makes the outputs that read it (through a
    visible query-key pair) non-finite, as in
    :func:`ring_jax.reference_attention`; everything else stays exact.
  """
  layout = layouts.check_attention_layout(layout, segment_ids, local_window_size)
  cfg = make_config(query, key, value, axis_name=axis_name, is_causal=is_causal,
                    segment_ids=segment_ids, scale=scale, local_window_size=local_window_size,
                    layout=layout, block_q=block_q, block_kv=block_kv, precision=precision,
                    hop_kernel=hop_kernel, return_lse=return_lse, overlap_dkv=overlap_dkv,
                    causal_routing=causal_routing)
  return attend_grouped(_ring, cfg, query, key, value, segment_ids, return_lse)


def attend_grouped(attend, cfg, query, key, value, segment_ids, return_lse: bool):
  """``attend(cfg, q, k, v, seg)`` (a ring's ``custom_vjp``) on the query heads grouped by
  their key/value head (``[B, T, K, N/K, H]``: GQA/MQA without repeating K/V), the result
  back as ``[B, T, N, H]`` (and the lse ``[B, T, N]`` with ``return_lse``)."""
  b, t, n, h = query.shape
  kh = key.shape[2]
  q = query.reshape(b, t, kh, n // kh, h)
  if not return_lse:
    return attend(cfg, q, key, value, segment_ids).reshape(b, t, n, h)
  out, lse = attend(cfg, q, key, value, segment_ids)
  return out.reshape(b, t, n, h), lse.reshape(b, t, n)


def make_config(query, key, value, *, axis_name, is_causal, segment_ids, scale,
                local_window_size, layout, block_q, block_kv, precision,
                hop_kernel, return_lse=False, overlap_dkv=None,
                causal_routing=None) -> RingConfig:
  layouts.check_layout(layout)
  defaults = platform_defaults(causal_routing=causal_routing, overlap_dkv=overlap_dkv)
  causal_routing, overlap_dkv = defaults["causal_routing"], defaults["overlap_dkv"]
  window = masking.normalize_window(local_window_size)
  validation.check_qkv(query, key, value, is_causal=is_causal or window is not None,
                       segment_ids=segment_ids)
  scale = validation.check_scale(scale, query.shape[-1], "float32")
  ring_size = validation.axis_size(axis_name, "ring_attention", "ring_attention_sharded")
  t, s = query.shape[1], key.shape[1]
  layouts.check_length(layout, ring_size, t * ring_size, "query length")
  layouts.check_length(layout, ring_size, s * ring_size, "key/value length")
  if layout != "contiguous" and t != s:
    raise ValueError(f"layout={layout!r} needs equal local query and key lengths, got {t}, {s}.")
  kernel = kernels.get_hop_kernel(hop_kernel)
  block_q = default_block(layout, t, kernel=kernel) if block_q is None else block_q
  block_kv = default_block(layout, s, kernel=kernel) if block_kv is None else block_kv
  validation.check_block("block_q", block_q, t)
  validation.check_block("block_kv", block_kv, s)
  spec = HopSpec(scale=scale,
                 is_causal=bool(is_causal), window=window, block_q=int(block_q),
                 block_kv=int(block_kv), precision=precision)
  b, _, n, h = query.shape
  kh = key.shape[2]
  kernel.check((b, t, kh, n // kh, h), tuple(key.shape), query.dtype, spec)
  hops = routing.hop_range(layout, ring_size, s, bool(is_causal), window)
  routes = None
  if routing.check_routing(causal_routing, layout, is_causal) and t == s and ring_size > 1:
    routes = routing.routes(layout, ring_size, s, bool(is_causal), window)
    routes = routes if routes.routed else None
  return RingConfig(axis_name=axis_name, ring_size=ring_size, layout=layout, spec=spec,
                    kernel=kernel, return_lse=bool(return_lse),
                    hops=hops,
                    overlap_dkv=bool(overlap_dkv), routes=routes)


def _hop_masks(cfg: RingConfig, device, hop, q_pos, s, q_seg, kv_seg,
               v_finite=None) -> HopMasks:
  """Masks and block table of the K/V shard held at ``hop`` (it started on device
  ``device - hop``); ``v_finite``: the per-device flags of :func:`_v_finite`, or None."""
  src = (device - hop) % cfg.ring_size
  kv_pos = layouts.local_positions(cfg.layout, cfg.ring_size, s, src)
  return HopMasks.build(cfg.spec, q_pos, kv_pos, q_seg, kv_seg,
                        v_finite=None if v_finite is None else v_finite[src])


def _v_finite(cfg: RingConfig, v):
  """bool ``[n]``: device ``i``'s V shard holds no NaN/inf. One pass over the local V and one
  gather of ``n`` flags per forward, instead of a pass over V at every hop (the kernels'
  non-finite-V guard reads the flag of the shard they hold)."""
  return jax.lax.all_gather(jnp.isfinite(v).all(), cfg.axis_name)


# ----------------------------------------------------------------------------
# Shared with ring_jax.two_level (package-internal: not exported from ring_jax)
# ----------------------------------------------------------------------------

def shift(cfg: RingConfig, by: int, *xs):
  """Every device sends to device ``j + by`` (one ppermute per array; ``by = 0``: none)."""
  n = cfg.ring_size
  if by % n == 0:
    return xs
  perm = [(j, (j + by) % n) for j in range(n)]
  return tuple(None if x is None else jax.lax.ppermute(x, cfg.axis_name, perm) for x in xs)


def in_flight_during(transfers, compute):
  """``(transfers, compute)`` unchanged, with nothing reading a transfer's result before
  ``compute`` is done (one ``lax.optimization_barrier`` over both).

  Each hop issues its transfers (the next shard, arriving accumulators) before its block
  compute and reads them only after. A latency-hiding scheduler (the TPU compiler's) places
  a transfer's start just far enough before its done to cover the latency it estimates, and
  fills that span with whatever is independent of it: the hop's small merge or accumulator
  additions rather than its block loops. Tied to the hop's results, a transfer's done can
  only come after the block compute, so the start goes before it and the transfer is in
  flight while the blocks compute (the paper's double buffering: Liu et al. 2023, Sec. 3).
  The receive buffers are then live during the compute, which overlapping needs anyway.

  Inside ``shard_map`` a barrier makes its operands vary over the union of their mesh axes,
  so arrays are tied only to results that vary over the same axes (one barrier per set of
  axes); a transfer with no such result (K/V replicated over an axis the queries are split
  over) is left untied rather than changed.
  """
  t_leaves, t_tree = jax.tree.flatten(transfers)
  c_leaves, c_tree = jax.tree.flatten(compute)
  groups: dict = {}
  for side, leaves in enumerate((t_leaves, c_leaves)):
    for i, x in enumerate(leaves):
      groups.setdefault(varying_axes(x), ([], []))[side].append(i)
  for t_idx, c_idx in groups.values():
    if t_idx and c_idx:
      tied = jax.lax.optimization_barrier(([t_leaves[i] for i in t_idx],
                                           [c_leaves[i] for i in c_idx]))
      for i, x in zip(t_idx, tied[0]):
        t_leaves[i] = x
      for i, x in zip(c_idx, tied[1]):
        c_leaves[i] = x
  return jax.tree.unflatten(t_tree, t_leaves), jax.tree.unflatten(c_tree, c_leaves)


def over_hops(cfg: RingConfig, step, state, *, peel_first: bool):
  """Runs ``step(h, state, name=, last=)`` for the hops ``first..last`` the ring runs.

  The whole ring is ``(0, n - 1)``; a window on the contiguous layout runs fewer
  (:func:`ring_jax.routing.hop_range`). ``last`` (nothing left to send) is
  peeled off the loop; with ``peel_first`` the first hop too, and every call then also
  gets ``first=`` (True: nothing has arrived yet). The hops between run in one
  ``fori_loop`` (inline when there is one), named ``hop``. Profiles name the peeled ones
  ``hop_0`` and ``last_hop``.
  """
  first, last = cfg.hops

  def flag(is_first):  # first= only for the steps of a ring that peels its first hop
    return {"first": is_first} if peel_first else {}

  start = first
  if peel_first and first < last:
    state = step(first, state, name="hop_0", last=False, **flag(True))
    start += 1
  body = lambda h, state: step(h, state, name="hop", last=False, **flag(False))  # noqa: E731
  if last - start == 1:
    state = body(start, state)
  elif last - start > 1:
    state = jax.lax.fori_loop(start, last, body, state)
  return step(last, state, name="last_hop", last=True, **flag(first == last))


def send(pairs, axis_name, *xs):
  """``ppermute`` of each array over the ``(source, destination)`` ``pairs`` (devices that
  receive nothing get zeros)."""
  if not pairs:
    return tuple(None if x is None else jnp.zeros_like(x) for x in xs)
  return tuple(None if x is None else jax.lax.ppermute(x, axis_name, list(pairs)) for x in xs)


def send_distinct(pairs, axis_name, *xs):
  """:func:`send`, the same transfer, with ``pairs`` listed in reverse order, so that XLA
  does not merge it with an equal :func:`send` elsewhere in the program (the backward's
  K/V transfers equal the forward's: merged, the received K/V of every hop would stay
  alive from the forward to the backward)."""
  return send(list(pairs)[::-1], axis_name, *xs)


def hop_send(i, rows, span, axis_name, parts, send=send):
  """``parts`` (per stream, a tuple of arrays) sent over ``rows[i][stream]``'s pairs by
  ``send`` (:func:`send` or :func:`send_distinct`).

  ``i`` a Python int: static sends. ``i`` traced (a loop over the hops ``span = (lo, hi)``):
  a ``lax.switch`` on ``i - lo`` with one branch per hop ``lo..hi-1``, each its hop's
  static ppermutes, so only that hop's pairs move and the loop keeps one hop's parts in
  flight (unrolled hops let XLA:CPU issue every transfer up front, holding them all)."""
  def branch(row):
    return lambda parts: [send(p, axis_name, *x) for p, x in zip(row, parts)]
  if isinstance(i, int):
    return branch(rows[i])(parts)
  lo, hi = span
  if hi - lo == 1:
    return branch(rows[lo])(parts)
  return jax.lax.switch(i - lo, [branch(rows[h]) for h in range(lo, hi)], parts)


def split_streams(routes: routing.Routes, *xs):
  """Per stream of ``routes``, each array's slice ``[:, start:stop]`` of the local shard."""
  return [tuple(None if x is None else x[:, s.start:s.stop] for x in xs) for s in routes.streams]


def join_streams(xs):
  """The streams' parts of one array (:func:`split_streams`), back in one shard (axis 1)."""
  if xs[0] is None:
    return None
  return xs[0] if len(xs) == 1 else jnp.concatenate(xs, axis=1)


def hops_of(i, span):
  """The hops step ``i`` may be: ``(i,)`` for a Python int, else the loop's ``span``."""
  return (i,) if isinstance(i, int) else range(*span)


def _routed_masks(cfg: RingConfig, device, hop, q_pos, seg, kv_seg, v_finite=None):
  """Masks of the parts held at ``hop`` (stream ``i``'s part from device ``source``): their
  positions and ids side by side, and (forward) the AND of their non-finite-V flags."""
  routes, n = cfg.routes, cfg.ring_size
  pos, flags = [], []
  for i, stream in enumerate(routes.streams):
    src = stream.source(device, hop, n)
    pos.append(layouts.local_positions(cfg.layout, n, routes.local_len, src)[stream.start:stream.stop])
    if v_finite is not None:
      flags.append(v_finite[src, i])
  finite = None if v_finite is None else functools.reduce(jnp.logical_and, flags)
  kv_pos = pos[0] if len(pos) == 1 else jnp.concatenate(pos)
  return HopMasks.build(cfg.spec, q_pos, kv_pos, seg, kv_seg, v_finite=finite)


def _forward_routed(cfg: RingConfig, q, k, v, seg):
  """:func:`_forward` on the routes of :func:`ring_jax.routing.routes`: the hops in one
  ``fori_loop`` (the last peeled; inline when one is left), each hop's own transfers
  (:attr:`ring_jax.routing.Stream.arrive`) picked by :func:`hop_send`."""
  routes = cfg.routes
  first, last = cfg.hops
  hops = list(range(first, last + 1))
  device = jax.lax.axis_index(cfg.axis_name)
  q_pos = layouts.local_positions(cfg.layout, cfg.ring_size, q.shape[1], device)
  finite = jnp.isfinite(v)  # one pass over V; a flag per stream's part
  v_finite = jax.lax.all_gather(
      jnp.stack([finite[:, s.start:s.stop].all() for s in routes.streams]), cfg.axis_name)
  # As in _forward: the gather runs before the first K/V transfer on every device.
  v_finite, k, v, seg = jax.lax.optimization_barrier((v_finite, k, v, seg))
  acc = tuple(varying_like(x, q, k, v) for x in empty_result(q))
  held = split_streams(routes, k, v, seg)
  if first != 0:
    with jax.named_scope("send_kv"):
      held = [send(s.arrive[0], cfg.axis_name, *p) for s, p in zip(routes.streams, held)]
  def compute(i, held, acc, name, nxt=None):
    # The parts side by side, one kernel call (docs/performance.md): the block table skips
    # what the causal mask hides in either part.
    kh, vh, segh = (join_streams(x) for x in zip(*held))
    with jax.named_scope(name):
      masks = _routed_masks(cfg, device, first + i, q_pos, seg, segh, v_finite)
      hop = cfg.kernel.forward(q, kh, vh, masks, cfg.spec)
      if nxt is not None:
        nxt, hop = in_flight_during(nxt, hop)
      return nxt, merge(*acc, *hop)

  # rows[i]: per stream, the pairs that deliver hop i + 1's parts
  rows = [[s.arrive[i + 1] for s in routes.streams] for i in range(len(hops) - 1)]

  def body(i, state):  # hop i; sends the parts of hop i + 1
    held, acc = state
    with jax.named_scope("send_kv"):
      nxt = hop_send(i, rows, (0, len(hops) - 1), cfg.axis_name, held)
    return compute(i, held, acc, "hop", nxt)

  if len(hops) == 2:  # one trip: inline, as over_hops does
    held, acc = body(0, (held, acc))
  elif len(hops) > 2:
    held, acc = jax.lax.fori_loop(0, len(hops) - 1, body, (held, acc))
  _, (out, lse) = compute(len(hops) - 1, held, acc, "last_hop")
  return out.astype(q.dtype), lse


def _backward_routed(cfg: RingConfig, q, k, v, seg, res):
  """:func:`_backward` on the routes: each part's float32 dK/dV accumulator follows the part
  along its path and goes home from the last device that uses it
  (:attr:`ring_jax.routing.Stream.home`); returns float32 ``(dq, dk, dv)``."""
  routes, axis = cfg.routes, cfg.axis_name
  first, last = cfg.hops
  hops = list(range(first, last + 1))
  device = jax.lax.axis_index(axis)
  q_pos = layouts.local_positions(cfg.layout, cfg.ring_size, q.shape[1], device)

  def zeros(x):
    return varying_like(jnp.zeros(x.shape, jnp.float32), q, k, v)

  # Every transfer here is a send_distinct: the K/V ones equal the forward's.
  held = split_streams(routes, k, v, seg)
  if first != 0:
    with jax.named_scope("send_kv"):
      held = [send_distinct(s.arrive[0], axis, *p) for s, p in zip(routes.streams, held)]
  acc = [(zeros(p[0]), zeros(p[1])) for p in held]
  # home[j]: stream j's finished accumulators of this device's own part, None until one can
  # arrive (zigzag's early chunks come home only at the last hop: no buffer before it).
  home = [None] * len(held)
  dq = zeros(q)
  count = len(hops)
  span = (1, count - 1)  # the hops the loop runs (0 and the last are peeled)
  arrive_next = [[s.arrive[i + 1] if i + 1 < count else () for s in routes.streams]
                 for i in range(count)]
  arrive_now = [[s.arrive[i] for s in routes.streams] for i in range(count)]
  go_home = [[s.home[i] for s in routes.streams] for i in range(count)]
  # kept_home[j][i, d]: device d's own part of stream j has its last use on itself at hop i
  kept_home = [np.array([np.isin(np.arange(cfg.ring_size), d) for d in s.done_home])
               for s in routes.streams]

  def step(i, state, name):  # i: a Python int (peeled hops) or traced (the loop)
    held, acc, home, dq = state
    nxt = held
    if not (isinstance(i, int) and i + 1 == count):
      with jax.named_scope("send_kv"):
        nxt = hop_send(i, arrive_next, span, axis, held, send=send_distinct)
    if not (isinstance(i, int) and i == 0):  # the parts held now arrive with their accumulators
      with jax.named_scope("send_dkv"):
        acc = hop_send(i, arrive_now, span, axis, acc, send=send_distinct)
    kh, vh, segh = (join_streams(x) for x in zip(*held))
    dk, dv = join_streams([a[0] for a in acc]), join_streams([a[1] for a in acc])
    with jax.named_scope(name):
      masks = _routed_masks(cfg, device, first + i, q_pos, seg, segh)
      nxt, (dq, dk, dv) = backward_hop(cfg, q, kh, vh, masks, res, (dq, dk, dv), nxt,
                                       arriving=not (isinstance(i, int) and i == 0),
                                       last=isinstance(i, int) and i + 1 == count)
    acc = split_streams(routes, dk, dv)
    with jax.named_scope("dkv_home"):  # accumulators whose last use was this hop
      sent = hop_send(i, go_home, span, axis, acc, send=send_distinct)
      new_home = list(home)
      for j, s in enumerate(routes.streams):
        if not any(s.home[h] or s.done_home[h] for h in hops_of(i, span)):
          continue  # nothing of this stream comes home at this hop
        got = sent[j]
        if any(s.done_home):
          mine = jnp.asarray(kept_home[j])[i, device]
          got = tuple(x + jnp.where(mine, a, 0.0) for x, a in zip(got, acc[j]))
        new_home[j] = got if home[j] is None else tuple(x + y for x, y in zip(home[j], got))
    return nxt, acc, new_home, dq

  state = step(0, (held, acc, home, dq), "hop_0" if count > 1 else "last_hop")
  if count > 2:
    held, acc, home, dq = state
    home = [h if h is not None or not any(s.home[i] or s.done_home[i] for i in range(*span))
            else (zeros(p[0]), zeros(p[1])) for h, s, p in zip(home, routes.streams, held)]
    state = jax.lax.fori_loop(1, count - 1, lambda i, st: step(i, st, "hop"),
                              (held, acc, home, dq))
  if count > 1:
    state = step(count - 1, state, "last_hop")
  _, _, home, dq = state
  return dq, join_streams([x[0] for x in home]), join_streams([x[1] for x in home])


def _forward(cfg: RingConfig, q, k, v, seg):
  """Returns ``(out [B,T,K,G,H] input dtype, lse [B,T,K,G] f32, -inf where no key was seen)``.

  Each hop's ``(out_h, lse_h)`` is merged into a float32 ``(out, lse)`` with
  :func:`ring_jax.hop.merge`; the next shard's transfer is issued before the
  hop's compute. Profiles name the parts ``ring_fwd/hop`` (the loop body),
  ``ring_fwd/last_hop`` and ``ring_fwd/send_kv`` (the K/V transfer).
  """
  if cfg.routes is not None:
    return _forward_routed(cfg, q, k, v, seg)
  first = cfg.hops[0]
  device = jax.lax.axis_index(cfg.axis_name)
  s = k.shape[1]
  q_pos = layouts.local_positions(cfg.layout, cfg.ring_size, q.shape[1], device)
  v_finite = _v_finite(cfg, v)
  # The gather of the flags must run before the first K/V transfer on every device: XLA:CPU
  # may start independent collectives in a different order per device, and an all-gather on
  # some devices waiting for a ppermute on the others deadlocks (seen under jax.profiler).
  v_finite, k, v, seg = jax.lax.optimization_barrier((v_finite, k, v, seg))
  acc = tuple(varying_like(x, q, k, v) for x in empty_result(q))
  with jax.named_scope("send_kv"):
    k, v, kv_seg = shift(cfg, first, k, v, seg)  # device d now holds shard d - first

  def step(h, state, *, name, last):
    k, v, kv_seg, acc = state
    nxt = (k, v, kv_seg)
    if not last:
      with jax.named_scope("send_kv"):
        nxt = shift(cfg, 1, k, v, kv_seg)
    with jax.named_scope(name):
      masks = _hop_masks(cfg, device, h, q_pos, s, seg, kv_seg, v_finite)
      hop = cfg.kernel.forward(q, k, v, masks, cfg.spec)
      if not last:
        nxt, hop = in_flight_during(nxt, hop)
      acc = merge(*acc, *hop)
    return (*nxt, acc)

  *_, (out, lse) = over_hops(cfg, step, (k, v, kv_seg, acc), peel_first=False)
  return out.astype(q.dtype), lse


def _backward(cfg: RingConfig, q, k, v, seg, out, lse, do, dlse):
  """dQ stays home; each shard's float32 dK/dV accumulator follows the shard around the ring.

  The kernel adds every hop's dQ into one float32 accumulator in place. By
  default it adds the hop's dK/dV in place too, into the accumulator of the
  shard held now, which arrives from the previous device (updated there at
  the previous hop): two K/V-sized float32 buffers fewer than fresh
  per-hop buffers, but the hop waits for that transfer. With
  ``cfg.overlap_dkv`` the hop computes dK/dV into fresh buffers while the
  accumulator is still in flight and adds the two afterwards, so neither the
  K/V transfer for the next hop nor the accumulator transfer sits on the
  critical path in front of the hop's compute. After the last hop each
  accumulator goes home to its shard's owner (one transfer).

  Profiles name the parts ``ring_bwd/hop_0``, ``ring_bwd/hop`` (the loop
  body), ``ring_bwd/last_hop``, and the transfers ``ring_bwd/send_kv``,
  ``ring_bwd/send_dkv`` and ``ring_bwd/dkv_home``.
  """
  first, last = cfg.hops
  device = jax.lax.axis_index(cfg.axis_name)
  s = k.shape[1]
  q_pos = layouts.local_positions(cfg.layout, cfg.ring_size, q.shape[1], device)
  res = HopResiduals(out=out, lse=lse_for_backward(lse), do=do, dlse=dlse)
  k_own, v_own = k, v
  if cfg.routes is not None:
    dq, dk, dv = _backward_routed(cfg, q, k, v, seg, res)
    return finish_grads(q, k_own, v_own, dq, dk, dv)

  def zeros(x):
    return varying_like(jnp.zeros(x.shape, jnp.float32), q, k, v)

  with jax.named_scope("send_kv"):
    k, v, kv_seg = shift(cfg, first, k, v, seg)

  def step(h, state, *, name, first, last):
    # dk/dv: at the first hop the zero accumulators of the shard held now; later the
    # accumulators of the shard this device held at hop h-1, which travel on.
    k, v, kv_seg, dq, dk, dv = state
    nxt = (k, v, kv_seg)
    if not last:
      with jax.named_scope("send_kv"):
        nxt = shift(cfg, 1, k, v, kv_seg)
    if not first:  # the shard held now arrives with its own accumulators
      with jax.named_scope("send_dkv"):
        dk, dv = shift(cfg, 1, dk, dv)
    with jax.named_scope(name):
      masks = _hop_masks(cfg, device, h, q_pos, s, seg, kv_seg)
      nxt, (dq, dk, dv) = backward_hop(cfg, q, k, v, masks, res, (dq, dk, dv), nxt,
                                       arriving=not first, last=last)
    return (*nxt, dq, dk, dv)

  *_, dq, dk, dv = over_hops(cfg, step, (k, v, kv_seg, zeros(q), zeros(k), zeros(v)),
                             peel_first=True)
  with jax.named_scope("dkv_home"):
    dk, dv = shift(cfg, -last, dk, dv)  # the accumulator of shard d - last goes home
  return finish_grads(q, k_own, v_own, dq, dk, dv)


def backward_hop(cfg: RingConfig, q, k, v, masks, res, grads, nxt, *, arriving: bool,
                  last: bool):
  """One hop of the backward: ``(nxt, (dq, dk, dv))`` after the kernel's backward on the
  shard ``k, v`` held now; ``nxt`` (the next shard, in flight) tied to the hop's compute.

  ``grads = (dq, dk, dv)``: ``dk, dv`` are the accumulators of the shard held now, still in
  flight when ``arriving``. By default the kernel adds into them in place, so it waits for
  them; with ``cfg.overlap_dkv`` it computes the hop's dK/dV into fresh buffers while they
  are in flight too, and adds them after."""
  dq, dk, dv = grads
  zeros = lambda x: varying_like(jnp.zeros(x.shape, jnp.float32), q, k, v)  # noqa: E731
  if cfg.overlap_dkv and arriving:
    g = cfg.kernel.backward(q, k, v, masks, cfg.spec, res, HopGrads(dq, zeros(k), zeros(v)))
    (nxt, dk, dv), g = in_flight_during((nxt, dk, dv), g)
    return nxt, (g.dq, dk + g.dk, dv + g.dv)
  g = cfg.kernel.backward(q, k, v, masks, cfg.spec, res, HopGrads(dq, dk, dv))
  if not last:
    nxt, g = in_flight_during(nxt, g)
  return nxt, tuple(g)


def finish_grads(q, k_own, v_own, dq, dk, dv):
  extra = tuple(sorted(varying_axes(dk) - varying_axes(k_own), key=str))
  if extra:  # K/V replicated over axes the queries are split over: add the parts
    dk, dv = jax.lax.psum((dk, dv), extra)
  return dq.astype(q.dtype), dk.astype(k_own.dtype), dv.astype(v_own.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(cfg: RingConfig, q, k, v, seg):
  """``out``, or ``(out, lse)`` when ``cfg.return_lse``."""
  with jax.named_scope("ring_fwd"):
    out, lse = _forward(cfg, q, k, v, seg)
  return (out, lse) if cfg.return_lse else out


def _ring_fwd(cfg: RingConfig, q, k, v, seg):
  with jax.named_scope("ring_fwd"):
    out, lse = _forward(cfg, q, k, v, seg)
  return ((out, lse) if cfg.return_lse else out), (q, k, v, seg, out, lse)


def _ring_bwd(cfg: RingConfig, res, cotangent):
  q, k, v, seg, out, lse = res
  do, dlse = cotangent if cfg.return_lse else (cotangent, None)
  with jax.named_scope("ring_bwd"):
    dq, dk, dv = _backward(cfg, q, k, v, seg, out, lse, do, dlse)
  return dq, dk, dv, None


_ring.defvjp(_ring_fwd, _ring_bwd)
