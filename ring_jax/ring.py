"""The ring: K/V shards travel around a named mesh axis with ``ppermute``.

Liu, Zaharia & Abbeel, "Ring Attention with Blockwise Transformers for
Near-Infinite Context" (2023), Alg. 1. Device ``i`` of an ``n``-device ring
starts with its own K/V shard and, at hop ``h``, holds the shard of device
``(i - h) mod n``. Each hop folds blockwise attention against that shard into
a float32 online-softmax carry (:mod:`ring_jax.hop`); the next shard's
transfer is issued before the hop's compute and read after it, so the two
overlap (:func:`in_flight_during`). Only the hops ``first..last`` of
:func:`ring_jax.routing.hop_range` run (a local window on the contiguous layout
needs a few neighbouring shards; the whole ring is ``0..n-1``).

One loop runs every ring: :func:`forward_loop` and :func:`backward_loop` run a route plan
(:class:`ring_jax.routing.Routes`: per stream of a shard's parts and per hop, the pairs
that deliver them and where each accumulator goes home), the full rotation
(:func:`ring_jax.routing.rotation`) or, with causal routing (the default for causal
contiguous rings, ``causal_routing=True`` for the others), the routes of
:func:`ring_jax.routing.routes`, where each part travels only to the devices that can see
it and each dK/dV accumulator goes home from the last device that uses it. The
two-level ring (:mod:`ring_jax.two_level`) runs the same loops as its inner rings.

The backward pass is a hand-written ``custom_vjp`` that goes around the ring
again: K, V and their float32 gradient accumulators dK, dV travel together,
each device adding its queries' contribution; after the last hop every dK/dV
goes home to the device that owns the shard. Nothing per hop is stored, so memory
is linear in the local length (autodiff through the loop would keep every
hop's scores).
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
from ring_jax.hop import (HopGrads, HopKernel, HopMasks, HopResiduals, HopSpec, add_sinks,
                          varying_axes, empty_result, lse_for_backward, merge,
                          prepare_backward, takes_block, varying_like)

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
# flight; the full rotation also takes less temp memory there. ``one_loop``: the hop kernels
# whose flat full-rotation rings run every hop of a pass in one loop (one compiled hop per
# pass, :func:`one_loop`) rather than peeling the hops with nothing to send or receive: a
# smaller program with splash on TPU (its temp memory falls on some libtpu versions and rises
# on others: docs/performance.md, "Against tokamax's TPU ring"), for one unused transfer per
# peeled hop, hidden behind a hop's compute; the xla hop keeps the peeled hops, which take
# less temp memory there under a causal mask. ``unroll_hops``: passes of at most this many hops
# run every hop outside a loop (:func:`over_hops`), one loop and peeling aside: on TPU a
# transfer in flight across the hop's own loops inside the ring's loop takes temp memory
# beside the compiler's heap plan, so a small ring unrolled takes less (docs/performance.md,
# "Against tokamax's TPU ring"); a longer ring unrolled took more, and a larger program.
PLATFORM_DEFAULTS = {"tpu": {"causal_routing": False, "overlap_dkv": True,
                             "one_loop": ("splash",), "unroll_hops": 4}}


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
  one_loop: bool = False  # every hop of a full rotation in the loop (PLATFORM_DEFAULTS)
  unroll_hops: int = 0  # passes of at most this many hops run unrolled (PLATFORM_DEFAULTS)
  routes: routing.Routes | None = None  # the route plan the loop runs (make_config sets it)
  # the backward's plan: routing.backward_rotation where routes is the whole ring's rotation
  backward_routes: routing.Routes | None = None


def platform_defaults(platform: str | None = None, *, causal_routing=None,
                      overlap_dkv=None) -> dict:
  """``{"causal_routing", "overlap_dkv"}`` with ``None`` resolved for ``platform`` (default:
  the one compiled for, :func:`ring_jax.topology.target_platform`) by
  :data:`PLATFORM_DEFAULTS`: ``overlap_dkv`` becomes a bool (``False`` where the table says
  nothing), ``causal_routing`` stays ``None`` (the layout rule of
  :func:`ring_jax.routing.check_routing`) where the table says nothing."""
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
                   overlap_dkv: bool | None = None, causal_routing: bool | None = None,
                   sinks=None, logits_soft_cap: float | None = None):
  """Exact attention over a sequence sharded along mesh axis ``axis_name``.

  Call inside ``jax.shard_map`` (or any context where ``axis_name`` is bound)
  on the local shards. The local shards must be in ``layout`` order: shard
  ``i`` holds the tokens :func:`ring_jax.local_positions` gives for device
  ``i`` (use :func:`ring_jax.to_layout` on the global array before sharding,
  or :func:`ring_jax.ring_attention_sharded`, which does it for you).

  Args:
    query: local ``[B, T, N, H]``.
    key, value: local ``[B, S, K, H]`` and ``[B, S, K, Hv]``; ``N % K == 0``. Only the
      ``K`` heads travel around the ring (GQA/MQA without repeating K/V), K and V as two
      buffers. V's head size ``Hv`` may differ from ``H`` (MLA: 192 / 128): the output is
      ``[B, T, N, Hv]`` (the xla hop kernel; the fused ones refuse it in ``check``).
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
    sinks: attention sinks, ``[N]`` floats (this device's query heads): one more logit
      per query head with no value, in every row's softmax denominator once (GPT-OSS;
      :func:`ring_jax.hop.add_sinks`); differentiable. ``lse`` (``return_lse``) then
      includes it, and a row with no visible key has output 0 and ``lse = sinks[n]``.
    logits_soft_cap: ``c > 0``: scores become ``c * tanh(score / c)`` before masking and
      softmax (Gemma 2), forward and backward, in every hop kernel that can (xla,
      splash; the others refuse it in ``check``).

  Returns:
    local ``[B, T, N, Hv]`` in ``query.dtype``, equal to dense attention over
    the global sequence, or ``(out, lse)`` with ``return_lse``. Rows that
    attend nothing (padding, or a window and mask that leave no key) are 0.
    A non-finite value in q, k or v makes the outputs that read it (through a
    visible query-key pair) non-finite, as in
    :func:`ring_jax.reference_attention`; everything else stays exact.
  """
  layout = layouts.check_attention_layout(layout, segment_ids, local_window_size)
  sinks = validation.check_sinks(sinks, query.shape[2])
  cfg = make_config(query, key, value, axis_name=axis_name, is_causal=is_causal,
                    segment_ids=segment_ids, scale=scale, local_window_size=local_window_size,
                    layout=layout, block_q=block_q, block_kv=block_kv, precision=precision,
                    hop_kernel=hop_kernel, return_lse=return_lse or sinks is not None,
                    overlap_dkv=overlap_dkv, causal_routing=causal_routing,
                    logits_soft_cap=logits_soft_cap)
  result = attend_grouped(_ring, cfg, query, key, value, segment_ids, cfg.return_lse)
  return with_sinks(result, sinks, return_lse)


def with_sinks(result, sinks, return_lse: bool):
  """``result`` (``(out, lse)`` when ``sinks`` is given) with the sinks applied
  (:func:`ring_jax.hop.add_sinks`), as ``(out, lse)`` with ``return_lse``, else ``out``."""
  if sinks is None:
    return result
  out, lse = add_sinks(*result, sinks)
  return (out, lse) if return_lse else out


def attend_grouped(attend, cfg, query, key, value, segment_ids, return_lse: bool):
  """``attend(cfg, q, k, v, seg)`` (a ring's ``custom_vjp``) on the query heads grouped by
  their key/value head (``[B, T, K, N/K, H]``: GQA/MQA without repeating K/V), the result
  back as ``[B, T, N, Hv]`` (and the lse ``[B, T, N]`` with ``return_lse``)."""
  b, t, n, h = query.shape
  kh, hv = key.shape[2], value.shape[-1]
  q = query.reshape(b, t, kh, n // kh, h)
  if not return_lse:
    return attend(cfg, q, key, value, segment_ids).reshape(b, t, n, hv)
  out, lse = attend(cfg, q, key, value, segment_ids)
  return out.reshape(b, t, n, hv), lse.reshape(b, t, n)


def make_config(query, key, value, *, axis_name, is_causal, segment_ids, scale,
                local_window_size, layout, block_q, block_kv, precision,
                hop_kernel, return_lse=False, overlap_dkv=None,
                causal_routing=None, logits_soft_cap=None) -> RingConfig:
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
                 block_kv=int(block_kv), precision=precision,
                 logits_soft_cap=validation.check_soft_cap(logits_soft_cap),
                 value_head_dim=value.shape[-1] if value.shape[-1] != key.shape[-1] else None)
  b, _, n, h = query.shape
  kh = key.shape[2]
  kernel.check((b, t, kh, n // kh, h), tuple(key.shape), query.dtype, spec)
  hops = routing.hop_range(layout, ring_size, s, bool(is_causal), window)
  routes = routing.rotation(layout, ring_size, s, hops)
  if routing.check_routing(causal_routing, layout, is_causal) and t == s and ring_size > 1:
    routed = routing.routes(layout, ring_size, s, bool(is_causal), window)
    routes = routed if routed.routed else routes
  backward_routes = (routing.backward_rotation(layout, ring_size, s)
                     if not routes.routed and routes.hops == (0, ring_size - 1) else routes)
  rule = PLATFORM_DEFAULTS.get(topology.target_platform(), {})
  one_loop = getattr(kernel, "name", None) in rule.get("one_loop", ())
  return RingConfig(axis_name=axis_name, ring_size=ring_size, layout=layout, spec=spec,
                    kernel=kernel, return_lse=bool(return_lse),
                    hops=hops,
                    overlap_dkv=bool(overlap_dkv), one_loop=bool(one_loop),
                    unroll_hops=int(rule.get("unroll_hops", 0)), routes=routes,
                    backward_routes=backward_routes)


# ----------------------------------------------------------------------------
# The loop: one forward and one backward over a route plan (also ring_jax.two_level's)
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


def loop_span(count: int, peel_first: bool) -> tuple[int, int]:
  """The steps ``(lo, hi)`` that :func:`over_hops` runs in its loop (the rest are peeled)."""
  return (1 if peel_first else 0), count - 1


def over_hops(count: int, step, state, *, peel_first: bool, peel: bool = True,
              unroll: bool = False):
  """Runs ``step(i, state, name=, first=, last=)`` for the steps ``i = 0..count-1`` of a ring.

  The last step (nothing left to send) is peeled off the loop, with ``peel_first`` the first
  too (nothing has arrived yet); peeled steps get ``i`` as a Python int (static transfers),
  the ones between (:func:`loop_span`) run in one ``fori_loop`` with ``i`` traced (inline,
  ``i`` an int, when there is one), named ``hop``; profiles name the peeled ones ``hop_0``
  and ``last_hop``. ``first=`` / ``last=`` say whether ``i`` is the first / last step.
  ``peel=False``: every step runs in the loop as a middle one (``first=last=False``), so
  the step is compiled once; the caller makes its transfers at the ends harmless
  (:func:`one_loop`). ``unroll``: the steps between run one after another, ``i`` an int
  (no loop: :attr:`RingConfig.unroll_hops`).
  """
  if not peel:
    body = lambda i, state: step(i, state, name="hop", first=False, last=False)  # noqa: E731
    return jax.lax.fori_loop(0, count, body, state)
  lo, hi = loop_span(count, peel_first)
  if peel_first and count > 1:
    state = step(0, state, name="hop_0", first=True, last=False)
  body = lambda i, state: step(i, state, name="hop", first=False, last=False)  # noqa: E731
  if hi - lo == 1 or unroll:
    for i in range(lo, hi):
      state = body(i, state)
  elif hi - lo > 1:
    state = jax.lax.fori_loop(lo, hi, body, state)
  return step(count - 1, state, name="last_hop", first=count == 1, last=True)


def one_loop(cfg: RingConfig, routes: routing.Routes, home: bool = False) -> bool:
  """Whether :func:`forward_loop` / :func:`backward_loop` run every hop of ``routes`` in one
  loop (:func:`over_hops` with ``peel=False``): ``cfg.one_loop`` is set (the hop kernel is
  one of :data:`PLATFORM_DEFAULTS`' ``one_loop`` on its platform), there are two hops
  or more and more than ``cfg.unroll_hops``, and one stream moves the same pairs at every hop
  after the first (the full rotation), so every step can send them; with ``home``, also
  every accumulator ends the last hop on its owner
  (:func:`ring_jax.routing.backward_rotation`: nothing goes home).
  The first hop's transfers then move what nothing reads (the backward's zero dK/dV) and
  the last hop's send the K/V shard once more: one more transfer per peeled hop."""
  count = routes.hops[1] - routes.hops[0] + 1
  if not cfg.one_loop or count < 2 or count <= cfg.unroll_hops or len(routes.streams) != 1:
    return False
  s = routes.streams[0]
  if not s.arrive[1] or len(set(s.arrive[1:])) != 1:
    return False
  return not home or (not any(s.home) and not any(s.done_home[:-1])
                      and len(s.done_home[-1]) == routes.ring_size)


def send(pairs, axis_name, *xs):
  """``ppermute`` of each array (or pytree of arrays) over the ``(source, destination)``
  ``pairs`` (devices that receive nothing get zeros)."""
  if not pairs:
    return tuple(None if x is None else jax.tree.map(jnp.zeros_like, x) for x in xs)
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

  ``i`` a Python int: static sends. ``i`` traced (a loop over the steps ``span = (lo,
  hi)``): when every step of the span moves the same pairs (the full rotation), one static
  send; else a ``lax.switch`` on ``i - lo`` with one branch per step, each its step's static
  ppermutes, so only that step's pairs move and the loop keeps one step's parts in flight
  (unrolled steps let XLA:CPU issue every transfer up front, holding them all)."""
  def branch(row):
    return lambda parts: [send(p, axis_name, *x) for p, x in zip(row, parts)]
  if isinstance(i, int):
    return branch(rows[i])(parts)
  lo, hi = span
  if all(rows[h] == rows[lo] for h in range(lo, hi)):
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
  """The steps ``i`` may be: ``(i,)`` for a Python int, else the loop's ``span``."""
  return (i,) if isinstance(i, int) else range(*span)


def v_finite_flags(routes: routing.Routes, axis_name, v):
  """bool ``[n, streams]`` (``[n]`` when one stream is the whole shard): device ``d``'s
  part of each stream of its V shard holds no NaN/inf. One pass over the local V and one
  gather per forward, instead of a pass over V at every hop (the kernels' non-finite-V guard
  reads the flag of the part they hold)."""
  finite = jnp.isfinite(v)
  if len(routes.streams) == 1 and routes.streams[0].stop - routes.streams[0].start == v.shape[1]:
    return jax.lax.all_gather(finite.all(), axis_name)  # [n]: one stream, the whole shard
  return jax.lax.all_gather(
      jnp.stack([finite[:, s.start:s.stop].all() for s in routes.streams]), axis_name)


def _masks(cfg: RingConfig, device, hop, q_pos, seg, kv_seg, hops=(), v_finite=None):
  """Masks of the parts held at ``hop`` (stream ``i``'s part from device ``source``): their
  positions and ids side by side, and (forward) the AND of their non-finite-V flags.
  ``hops``: the Python ints ``hop`` may be (a loop's steps); the block table masks nothing
  where none of them has a partly masked pair on any device (:func:`hop_partly_masked`)."""
  routes, n = cfg.routes, cfg.ring_size
  pos, flags = [], []
  for i, stream in enumerate(routes.streams):
    src = stream.source(device, hop, n)
    pos.append(
        layouts.local_positions(cfg.layout, n, routes.local_len, src)[stream.start:stream.stop])
    if v_finite is not None:
      flags.append(v_finite[src] if v_finite.ndim == 1 else v_finite[src, i])
  finite = None if v_finite is None else functools.reduce(jnp.logical_and, flags)
  kv_pos = pos[0] if len(pos) == 1 else jnp.concatenate(pos)
  may_mask = seg is not None or not hops or any(
      hop_partly_masked(cfg, q_pos.shape[0], lambda s, d: s.source(d, h, n)) for h in hops)
  return HopMasks.build(cfg.spec, q_pos, kv_pos, seg, kv_seg, v_finite=finite,
                        may_mask=may_mask)


def hop_partly_masked(cfg: RingConfig, q_len: int, source) -> bool:
  """Whether some device computes a partly masked block pair at a hop known at trace time
  (:func:`ring_jax.masking.partly_masked` over every device's positions); ``source(stream,
  d)``: the owner of the part of ``stream`` that device ``d`` holds (a Python int). False:
  the hop's kernel compiles only its unmasked blocks (a causal zigzag or contiguous ring's
  hops on other devices' shards: whole chunks meet whole chunks)."""
  n, spec, routes = cfg.ring_size, cfg.spec, cfg.routes

  def positions(d):
    kv = [layouts.local_positions(cfg.layout, n, routes.local_len,
                                  source(s, d))[s.start:s.stop] for s in routes.streams]
    return (layouts.local_positions(cfg.layout, n, q_len, d),
            kv[0] if len(kv) == 1 else np.concatenate(kv))

  return masking.partly_masked([positions(d) for d in range(n)], spec.block_q, spec.block_kv,
                               spec.is_causal, spec.window)


def forward_loop(cfg: RingConfig, q, held, acc, masks_at, *, also=None):
  """The forward over the hops of ``cfg.routes``: ``(acc, also, held)`` after folding every
  hop (``held``: the parts held at the last hop, as the argument).

  ``held``: per stream of the routes, this device's ``(k, v, seg)`` parts before the first
  hop's transfer; ``acc``: the float32 ``(out, lse)`` carry, merged with each hop's result
  (:func:`ring_jax.hop.merge`); ``masks_at(hop, kv_seg, hops)``: the :class:`HopMasks` of
  the parts held at ``hop`` (``kv_seg``: their segment ids; ``hops``: the ints ``hop`` may
  be). Each hop issues the transfer of the next hop's parts (:func:`hop_send`, named
  ``send_kv``) before its block compute and reads it after (:func:`in_flight_during`);
  ``also`` (transfers the caller issued, or None) is tied to the last hop's compute in the
  same way. The hops run in one loop (:func:`over_hops`): the last peeled, or
  (:func:`one_loop`) in the loop too, its send unused and ``also`` tied to the whole loop.
  """
  routes, axis = cfg.routes, cfg.axis_name
  first, last = routes.hops
  count = last - first + 1
  if first != 0:
    with jax.named_scope("send_kv"):
      held = [send(s.arrive[0], axis, *p) for s, p in zip(routes.streams, held)]
  peel = not one_loop(cfg, routes)
  rows = [[s.arrive[i + 1] if i + 1 < count else () if peel else s.arrive[1]
           for s in routes.streams] for i in range(count)]
  span = loop_span(count, peel_first=False) if peel else (0, count)

  tied = {"also": also}  # read at the last hop only, which runs outside the loop

  def step(i, state, *, name, first, last):
    del first  # the forward's first hop needs nothing the others do not
    held, acc = state[:2]
    nxt = tied["also"] if last else None
    if not last:
      with jax.named_scope("send_kv"):
        nxt = hop_send(i, rows, span, axis, held)
    kh, vh, segh = (join_streams(x) for x in zip(*held))
    with jax.named_scope(name):
      masks = masks_at(routes.hops[0] + i, segh, [routes.hops[0] + h for h in hops_of(i, span)])
      hop = cfg.kernel.forward(q, kh, vh, masks, cfg.spec)
      if nxt is not None:
        nxt, hop = in_flight_during(nxt, hop)
      acc = merge(*acc, *hop)
    if last:
      tied["also"] = nxt
      return held, acc
    # one loop: the last step's parts are carried out beside the next ones (its send unused)
    return (nxt, acc) if peel else (nxt, acc, held)

  state = over_hops(count, step, (held, acc) if peel else (held, acc, held),
                    peel_first=False, peel=peel, unroll=count <= cfg.unroll_hops)
  if peel:
    return state[1], tied["also"], state[0]
  if also is not None:
    also, state = in_flight_during(also, state)
  return state[1], also, state[2]


def backward_loop(cfg: RingConfig, q, held, res, dq, masks_at, *, also=None,
                  home: bool = True, arrived: bool = False, prepare: bool = False):
  """The backward over the hops of ``cfg.routes``: ``(dq, dk, dv, also)``, float32.

  dQ stays here (``dq``: the accumulator to add to). Each part's float32 dK/dV accumulator
  follows the part along its route (``send_dkv``: it arrives with the part, updated at the
  hop before) and goes home from the last device that uses it (``dkv_home``,
  :attr:`ring_jax.routing.Stream.home`); ``dk, dv`` are this device's own shard's.
  ``home=False`` (the full rotation only): the accumulators stay where the last hop left
  them, ``dk, dv`` are those of the parts held at the last hop. ``held``, ``masks_at`` and
  ``also`` as in :func:`forward_loop`; ``arrived``: ``held`` are already the parts of the
  first hop (its transfer is not sent). The first and last hops are peeled
  (:func:`over_hops`); with ``prepare``, where every hop is compiled apart (unrolled), the
  hop kernel's :func:`ring_jax.hop.prepare_backward` runs once on ``held``. A routed plan's
  transfers are :func:`send_distinct` (its K/V ones equal the forward's, whose received
  parts XLA would otherwise keep alive into the backward); the full rotation's are plain
  sends, so a K/V transfer outside the loops that equals the forward's (a ring of 2) is one
  transfer for both passes.
  """
  routes, axis = cfg.routes, cfg.axis_name
  first, last = routes.hops
  count = last - first + 1
  device = jax.lax.axis_index(axis)
  streams = routes.streams

  def zeros(x):
    return varying_like(jnp.zeros(x.shape, jnp.float32), q, x)

  move = send_distinct if routes.routed else send
  if first != 0 and not arrived:
    with jax.named_scope("send_kv"):
      held = [move(s.arrive[0], axis, *p) for s, p in zip(streams, held)]
  acc = [(zeros(p[0]), zeros(p[1])) for p in held]
  if one_loop(cfg, routes, home=home):
    return _backward_one_loop(cfg, q, held, res, dq, masks_at, acc, also)
  if prepare and count <= cfg.unroll_hops:  # every hop compiled apart: prepared once
    kernel, held = prepare_backward(cfg.kernel, q, held, cfg.spec)
    cfg = dataclasses.replace(cfg, kernel=kernel)
  span = loop_span(count, peel_first=True)
  arrive_next = [[s.arrive[i + 1] if i + 1 < count else () for s in streams]
                 for i in range(count)]
  arrive_now = [[s.arrive[i] for s in streams] for i in range(count)]
  go_home = [[s.home[i] for s in streams] for i in range(count)]
  # kept_home[j][i, d]: device d's own part of stream j has its last use on itself at hop i
  kept_home = [np.array([np.isin(np.arange(cfg.ring_size), d) for d in s.done_home])
               for s in streams]
  if not home and any(s.home[i] or s.done_home[i] for s in streams for i in range(count - 1)):
    raise ValueError("backward_loop(home=False) needs a route whose parts all end at the "
                     "last hop (the full rotation).")
  # dkv[j]: stream j's finished accumulators of this device's own part, None until one can
  # arrive (zigzag's early chunks come home only at the last hop: no buffer before it).
  dkv = [None] * len(streams)
  # The streams with something coming home at a hop of the loop: their buffers enter it.
  home_in_loop = [home and any(s.home[h] or s.done_home[h] for h in range(*span))
                  for s in streams]

  tied = {"also": also}  # read at the last hop only, which runs outside the loop

  def step(i, state, *, name, first, last):
    held, acc, dkv, dq = state
    nxt = tied["also"] if last else None
    if not last:
      with jax.named_scope("send_kv"):
        nxt = hop_send(i, arrive_next, span, axis, held, send=move)
    if not first:  # the parts held now arrive with their accumulators
      with jax.named_scope("send_dkv"):
        acc = hop_send(i, arrive_now, span, axis, acc, send=move)
    kh, vh, segh = (join_streams(x) for x in zip(*held))
    dk, dv = join_streams([a[0] for a in acc]), join_streams([a[1] for a in acc])
    with jax.named_scope(name):
      masks = masks_at(routes.hops[0] + i, segh, [routes.hops[0] + h for h in hops_of(i, span)])
      nxt, (dq, dk, dv) = backward_hop(cfg, q, kh, vh, masks, res, (dq, dk, dv), nxt,
                                       arriving=not first)
    acc = split_streams(routes, dk, dv)
    if home:
      with jax.named_scope("dkv_home"):  # accumulators whose last use was this hop
        sent = (hop_send(i, go_home, span, axis, acc, send=move)
                if any(s.home[h] for s in streams for h in hops_of(i, span))
                else [None] * len(streams))
        dkv = list(dkv)
        for j, s in enumerate(streams):
          if not any(s.home[h] or s.done_home[h] for h in hops_of(i, span)):
            continue  # nothing of this stream comes home at this hop
          got = sent[j]
          if isinstance(i, int) and kept_home[j][i].all():  # every device holds its own
            kept = acc[j]
          elif any(s.done_home):
            mine = jnp.asarray(kept_home[j])[i, device]
            kept = tuple(jnp.where(mine, a, 0.0) for a in acc[j])
          else:
            kept = None
          if kept is not None:
            got = kept if got is None else tuple(x + y for x, y in zip(got, kept))
          dkv[j] = got if dkv[j] is None else tuple(x + y for x, y in zip(dkv[j], got))
    if last:
      tied["also"] = nxt
      return held, acc, dkv, dq
    if first:  # a loop carry needs a buffer from its start
      dkv = [(zeros(a[0]), zeros(a[1])) if d is None and in_loop else d
             for d, a, in_loop in zip(dkv, acc, home_in_loop)]
    return nxt, acc, dkv, dq

  _, acc, dkv, dq = over_hops(count, step, (held, acc, dkv, dq), peel_first=True,
                              unroll=count <= cfg.unroll_hops)
  out = dkv if home else acc
  return dq, join_streams([x[0] for x in out]), join_streams([x[1] for x in out]), tied["also"]


def _backward_one_loop(cfg: RingConfig, q, held, res, dq, masks_at, acc, also):
  """:func:`backward_loop` with every hop in one loop (:func:`one_loop`): each step sends
  the K/V parts on and receives the accumulators of the parts it holds (the first step's
  are zeros, the last step's K/V send is unused), and the accumulators the last step leaves
  are this device's own shard's. ``also`` is tied to the whole loop."""
  routes, axis = cfg.routes, cfg.axis_name
  pairs = [routes.streams[0].arrive[1]]
  move = send_distinct if routes.routed else send

  count = routes.hops[1] - routes.hops[0] + 1

  def step(i, state):
    held, acc, dq = state
    with jax.named_scope("send_kv"):
      nxt = [move(p, axis, *x) for p, x in zip(pairs, held)]
    with jax.named_scope("send_dkv"):
      acc = [move(p, axis, *a) for p, a in zip(pairs, acc)]
    kh, vh, segh = (join_streams(x) for x in zip(*held))
    dk, dv = join_streams([a[0] for a in acc]), join_streams([a[1] for a in acc])
    with jax.named_scope("hop"):
      masks = masks_at(routes.hops[0] + i, segh, range(routes.hops[0], routes.hops[1] + 1))
      nxt, (dq, dk, dv) = backward_hop(cfg, q, kh, vh, masks, res, (dq, dk, dv), nxt,
                                       arriving=True)
    return nxt, split_streams(routes, dk, dv), dq

  _, acc, dq = jax.lax.fori_loop(0, count, step, (held, acc, dq))
  if also is not None:
    also, (acc, dq) = in_flight_during(also, (acc, dq))
  return dq, acc[0][0], acc[0][1], also


def backward_hop(cfg: RingConfig, q, k, v, masks, res, grads, nxt, *, arriving: bool):
  """One hop of the backward: ``(nxt, (dq, dk, dv))`` after the kernel's backward on the
  shard ``k, v`` held now; ``nxt`` (transfers in flight, or None) tied to the hop's compute.

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
  if nxt is not None:
    nxt, g = in_flight_during(nxt, g)
  return nxt, tuple(g)


def finish_grads(q, k_own, v_own, dq, dk, dv):
  extra = tuple(sorted(varying_axes(dk) - varying_axes(k_own), key=str))
  if extra:  # K/V replicated over axes the queries are split over: add the parts
    dk, dv = jax.lax.psum((dk, dv), extra)
  return dq.astype(q.dtype), dk.astype(k_own.dtype), dv.astype(v_own.dtype)


# ----------------------------------------------------------------------------
# The flat ring
# ----------------------------------------------------------------------------

def _hands_over(cfg: RingConfig) -> bool:
  """Whether the backward starts on the parts the forward ends on: the full rotation forward
  (device ``d`` holds shard ``d + 1`` at its last hop) and
  :func:`ring_jax.routing.backward_rotation` backward (shard ``d + 1`` at its first hop)."""
  bwd = cfg.backward_routes
  return bwd is not None and bwd is not cfg.routes and bwd.hops == (1, cfg.ring_size)


def _forward(cfg: RingConfig, q, k, v, seg):
  """Returns ``(out [B,T,K,G,H] input dtype, lse [B,T,K,G] f32, -inf where no key was seen,
  held)``: :func:`forward_loop` over the ring's routes; ``held``: the ``(k, v, seg)`` parts of
  its last hop. Profiles name the parts ``ring_fwd/hop`` (the loop body),
  ``ring_fwd/last_hop`` (peeled, unless :func:`one_loop`) and ``ring_fwd/send_kv`` (the K/V
  transfer)."""
  device = jax.lax.axis_index(cfg.axis_name)
  q_pos = layouts.local_positions(cfg.layout, cfg.ring_size, q.shape[1], device)
  v_finite = v_finite_flags(cfg.routes, cfg.axis_name, v)
  # The gather of the flags must run before the first K/V transfer on every device: XLA:CPU
  # may start independent collectives in a different order per device, and an all-gather on
  # some devices waiting for a ppermute on the others deadlocks (seen under jax.profiler).
  v_finite, k, v, seg = jax.lax.optimization_barrier((v_finite, k, v, seg))
  acc = tuple(varying_like(x, q, k, v) for x in empty_result(q, v.shape[-1]))
  def masks_at(hop, kv_seg, hops):
    return _masks(cfg, device, hop, q_pos, seg, kv_seg, hops, v_finite)

  (out, lse), _, held = forward_loop(cfg, q, split_streams(cfg.routes, k, v, seg), acc,
                                     masks_at)
  return out.astype(q.dtype), lse, held


def _backward(cfg: RingConfig, q, k, v, seg, out, lse, do, dlse, held=None):
  """``(dq, dk, dv)`` in the inputs' dtypes: :func:`backward_loop` over the ring's backward
  routes (``cfg.backward_routes``: the whole ring's rotation runs own shard last,
  :func:`ring_jax.routing.backward_rotation`; a routed or windowed plan runs as forward).
  ``held``: the forward's last parts where :func:`_hands_over` (the first hop's, not sent
  again), else None. Profiles name the parts ``ring_bwd/hop_0``, ``ring_bwd/hop`` (the loop
  body), ``ring_bwd/last_hop`` (the first and last peeled, unless :func:`one_loop`), and the
  transfers ``ring_bwd/send_kv``,
  ``ring_bwd/send_dkv`` and ``ring_bwd/dkv_home``."""
  cfg = dataclasses.replace(cfg, routes=cfg.backward_routes or cfg.routes)
  device = jax.lax.axis_index(cfg.axis_name)
  q_pos = layouts.local_positions(cfg.layout, cfg.ring_size, q.shape[1], device)
  res = HopResiduals(out=out, lse=lse_for_backward(lse), do=do, dlse=dlse)
  def masks_at(hop, kv_seg, hops):
    return _masks(cfg, device, hop, q_pos, seg, kv_seg, hops)

  dq = varying_like(jnp.zeros(q.shape, jnp.float32), q, k, v)
  first = split_streams(cfg.routes, k, v, seg) if held is None else held
  dq, dk, dv, _ = backward_loop(cfg, q, first, res, dq, masks_at, arrived=held is not None,
                                prepare=True)
  return finish_grads(q, k, v, dq, dk, dv)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(cfg: RingConfig, q, k, v, seg):
  """``out``, or ``(out, lse)`` when ``cfg.return_lse``."""
  with jax.named_scope("ring_fwd"):
    out, lse, _ = _forward(cfg, q, k, v, seg)
  return (out, lse) if cfg.return_lse else out


def _ring_fwd(cfg: RingConfig, q, k, v, seg):
  with jax.named_scope("ring_fwd"):
    out, lse, held = _forward(cfg, q, k, v, seg)
  held = held if _hands_over(cfg) else None
  return ((out, lse) if cfg.return_lse else out), (q, k, v, seg, out, lse, held)


def _ring_bwd(cfg: RingConfig, res, cotangent):
  q, k, v, seg, out, lse, held = res
  do, dlse = cotangent if cfg.return_lse else (cotangent, None)
  with jax.named_scope("ring_bwd"):
    dq, dk, dv = _backward(cfg, q, k, v, seg, out, lse, do, dlse, held)
  return dq, dk, dv, None


_ring.defvjp(_ring_fwd, _ring_bwd)
