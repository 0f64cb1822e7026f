"""ring_attention inside a user's shard_map: work skipping, memory, numerics."""

import dataclasses
import functools
import itertools
import re
from typing import ClassVar

import chex
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import ring_jax
from attn_utils import (assert_close, grads, make_mesh, may_mask_recorder, out_and_grads,
                        packed_segments, qkv)
from ring_jax import masking
from ring_jax.hop import fold_blocks, varying_like
from ring_jax.kernels.xla import XlaHopKernel


def shard_mapped(mesh, **kw):
  """ring_attention applied by hand: the pattern a user's own model follows."""
  spec = P(None, "sequence", None, None)
  return jax.shard_map(functools.partial(ring_jax.ring_attention, axis_name="sequence", **kw),
                       mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec)


def test_user_shard_map_with_layout_and_positions():
  """Reorder once with to_layout, run the kernel in shard_map, restore with from_layout."""
  mesh = make_mesh((4,), ("sequence",))
  q, k, v = qkv(0, 2, 32, 4, 2, 8)
  fn = shard_mapped(mesh, is_causal=True, layout="zigzag", block_q=4, block_kv=4)
  to = functools.partial(ring_jax.to_layout, layout="zigzag", ring_size=4)
  out = ring_jax.from_layout(jax.jit(fn)(to(q), to(k), to(v)), "zigzag", 4)
  assert_close(out, ring_jax.reference_attention(q, k, v, is_causal=True))
  # Same thing, oracle run directly in layout order with layout positions.
  pos = ring_jax.layout_positions("zigzag", 4, 32)
  ref = ring_jax.reference_attention(to(q), to(k), to(v), is_causal=True, q_positions=pos,
                                     kv_positions=pos)
  assert_close(jax.jit(fn)(to(q), to(k), to(v)), ref)


def test_unbound_axis_name_is_a_value_error():
  q, k, v = qkv(0, 1, 8, 2, 2, 8)
  with pytest.raises(ValueError, match="axis_name='sequence' is not a mesh axis"):
    ring_jax.ring_attention(q, k, v, axis_name="sequence")
  mesh = make_mesh((4,), ("sequence",))
  fn = jax.shard_map(functools.partial(ring_jax.ring_attention, axis_name="seq"), mesh=mesh,
                     in_specs=P(None, "sequence"), out_specs=P(None, "sequence"))
  with pytest.raises(ValueError, match="axis_name='seq'"):
    fn(q, k, v)


@dataclasses.dataclass(frozen=True)
class PairLogKernel:
  """A test hop kernel: the XLA kernel's results, and per hop a host callback that appends
  ``(phase, q_pos0, kv_pos0, pairs)`` to :attr:`log`: the block pairs ``(q block, kv block)``
  the hop's table (``masks.blocks``) makes the XLA kernel compute, visited as its loops visit
  them (:func:`ring_jax.hop.fold_blocks` over the batch rows' merged ranges; a masked pair
  that no row's range holds is skipped). The first query / key position of the hop name the
  device and the shard it holds. Read :attr:`log` after ``jax.effects_barrier()``."""
  name: ClassVar[str] = "pair_log"
  log: list = dataclasses.field(default_factory=list, compare=False)
  serial: int = dataclasses.field(default_factory=itertools.count().__next__)  # hash: unique

  def check(self, q_shape, kv_shape, dtype, spec):
    XlaHopKernel().check(q_shape, kv_shape, dtype, spec)

  @staticmethod
  def _visited(ranges, n_other: int, may_mask: bool):
    """bool ``[n, n_other]``: block ``i`` meets block ``j`` in the kernel's loops
    (``ranges`` ``[R, n, 4]``, one table direction)."""
    merged, skip = masking.merge_rows(ranges), ranges.shape[0] > 1
    vis = varying_like(jnp.zeros((ranges.shape[1], n_other), bool), ranges)
    for i in range(ranges.shape[1]):
      def step(j, vis, masked, i=i):
        mark = lambda vis: vis.at[i, j].set(True)  # noqa: E731
        if skip and masked:
          return jax.lax.cond(masking.rows_cover(ranges, i, j), mark, lambda vis: vis, vis)
        return mark(vis)
      vis = fold_blocks(merged[i], step, vis, may_mask, n_other)
    return vis

  def _record(self, phase, masks, vis):
    def append(qp, kp, vis):
      self.log.append((phase, int(qp), int(kp), [tuple(p) for p in np.argwhere(vis).tolist()]))
    jax.debug.callback(append, masks.q_positions[0], masks.kv_positions[0], vis)

  def forward(self, q, k, v, masks, spec):
    table = masks.table()
    self._record("fwd", masks, self._visited(table.q_ranges, k.shape[1] // spec.block_kv,
                                             table.may_mask))
    return XlaHopKernel().forward(q, k, v, masks, spec)

  def backward(self, q, k, v, masks, spec, res, acc):
    table = masks.table()
    self._record("bwd", masks, self._visited(table.kv_ranges, q.shape[1] // spec.block_q,
                                             table.may_mask).T)
    return XlaHopKernel().backward(q, k, v, masks, spec, res, acc)


def _pairs_by_hop(log, layout, n, local_len, sched=None):
  """``{(phase, device, hop): sorted block pairs}`` from a :class:`PairLogKernel`'s log: the
  pairs each hop's kernel computed (the first query / key position name device and shard).

  With a routed ``sched`` the kernel runs once per part (a zigzag chunk): the part's first
  position names its owner and stream, whose direction gives the hop, and its key blocks are
  numbered from the part's start in the shard, as the schedule numbers them."""
  pos = [np.asarray(ring_jax.local_positions(layout, n, local_len, d)) for d in range(n)]
  device_of = {int(p[0]): d for d, p in enumerate(pos)}
  streams = {}
  if sched is not None and sched.routes is not None:
    for st in sched.routes.streams:
      for d in range(n):
        streams[int(pos[d][st.start])] = (d, st.step, st.start // sched.block_kv)
  got = {}
  for phase, qp, kp, pairs in log:
    d = device_of[qp]
    src, step, offset = streams.get(kp, (device_of.get(kp), 1, 0))
    got.setdefault((phase, d, ((d - src) * step) % n), []).extend(
        (a, b + offset) for a, b in pairs)
  return {key: sorted(pairs) for key, pairs in got.items()}


@pytest.mark.parametrize("layout", ring_jax.LAYOUTS)
def test_computed_work_follows_the_schedule(layout):
  """Every hop's kernel computes exactly the scheduled block pairs, forward and backward (the
  pairs of the tables the ring hands it, visited as the XLA kernel's loops visit them:
  PairLogKernel); masked ones are skipped.

  With zigzag/striped every device does the same causal work; contiguous
  leaves device 0 idle after hop 0.
  """
  n, length, block = 4, 64, 4
  mesh = make_mesh((n,), ("sequence",))
  q, k, v = qkv(1, 1, length, 2, 2, 8)
  kernel = PairLogKernel()
  fn = shard_mapped(mesh, is_causal=True, layout=layout, block_q=block, block_kv=block,
                    hop_kernel=kernel)
  to = functools.partial(ring_jax.to_layout, layout=layout, ring_size=n)
  jax.block_until_ready(jax.jit(functools.partial(grads, fn))(
      to(q), to(k), to(v), jnp.ones_like(q)))
  jax.effects_barrier()
  sched = ring_jax.schedule(layout, n, length // n, block, block, True)
  got = _pairs_by_hop(kernel.log, layout, n, length // n, sched)
  for phase in ("fwd", "bwd"):
    work = np.zeros((n, n), int)
    for d in range(n):
      for h in range(n):
        pairs = got.get((phase, d, h), [])
        work[d, h] = len(pairs)
        want = sorted(map(tuple, sched.pairs[d, h, :sched.num_pairs[d, h]].tolist()))
        assert pairs == want, (phase, d, h)
    np.testing.assert_array_equal(work, sched.num_pairs, err_msg=phase)
  full = (length // n // block) ** 2
  per_device = sched.work_per_device()
  # About half the pairs are masked out (diagonal blocks are computed: 10 of 16 per hop).
  assert per_device.sum() <= n * n * full * 0.65
  if layout == "contiguous":
    assert per_device[-1] > 3 * per_device[0]
  else:
    assert per_device.max() == per_device.min()
    assert (sched.num_pairs.max(0) == sched.num_pairs.min(0)).all()  # balanced at every hop


def test_routed_work_follows_the_routed_schedule():
  """With causal routing (zigzag: both chunks of d + h at hop h, side by side in one kernel
  call) every hop's kernel computes exactly the pairs of schedule(..., causal_routing=True),
  forward and backward, and every device the same pairs in all as without routing."""
  n, length, block = 4, 32, 4
  mesh = make_mesh((n,), ("sequence",))
  q, k, v = qkv(1, 1, length, 2, 2, 8)
  kernel = PairLogKernel()
  fn = shard_mapped(mesh, is_causal=True, layout="zigzag", block_q=block, block_kv=block,
                    causal_routing=True, hop_kernel=kernel)
  to = functools.partial(ring_jax.to_layout, layout="zigzag", ring_size=n)
  jax.block_until_ready(jax.jit(functools.partial(grads, fn))(
      to(q), to(k), to(v), jnp.ones_like(q)))
  jax.effects_barrier()
  sched = ring_jax.schedule("zigzag", n, length // n, block, block, True, causal_routing=True)
  got = _pairs_by_hop(kernel.log, "zigzag", n, length // n, sched)
  for phase in ("fwd", "bwd"):
    for d in range(n):
      for h in range(n):
        want = sorted(map(tuple, sched.pairs[d, h, :sched.num_pairs[d, h]].tolist()))
        assert got.get((phase, d, h), []) == want, (phase, d, h)
  full = ring_jax.schedule("zigzag", n, length // n, block, block, True)
  np.testing.assert_array_equal(sched.work_per_device(), full.work_per_device())


def _fwd_bwd_temp_bytes(n, local_len, heads=4, head_dim=64, is_causal=True, **kw):
  mesh = make_mesh((n,), ("sequence",))
  fn = shard_mapped(mesh, is_causal=is_causal, **kw)
  shape = jax.ShapeDtypeStruct((1, n * local_len, heads, head_dim), jnp.float32)
  loss = lambda q, k, v: jnp.sum(fn(q, k, v))
  compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(shape, shape, shape).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def test_memory_is_linear_in_local_length():
  """fwd+bwd temp bytes per device roughly double when the local length doubles.

  An [L/n, L/n] float32 score matrix per head (what autodiff through the
  ring loop would keep per hop) would grow 4x; the per-hop block scores are
  fixed by the block size.
  """
  n, heads = 4, 4
  temps = {ll: _fwd_bwd_temp_bytes(n, ll, heads, layout="zigzag", block_q=256, block_kv=256)
           for ll in (512, 1024, 2048)}
  assert temps[1024] <= 2.2 * temps[512] and temps[2048] <= 2.2 * temps[1024], temps
  one_hop_scores = heads * 2048 * 2048 * 4
  assert temps[2048] < one_hop_scores / 2, temps


def test_bf16_error_does_not_grow_with_ring_size():
  """Merging hops in float32 keeps the bf16 error at ring size 8 at that of ring size 1."""
  length = 256
  q, k, v = qkv(2, 1, length, 4, 2, 32)
  q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
  seg = packed_segments(1, length, seed=3)
  with jax.enable_x64(True):
    q64, k64, v64 = (jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v))
    cot = jnp.asarray(np.random.default_rng(0).normal(size=q.shape))
    ref = lambda q, k, v: ring_jax.reference_attention(q, k, v, is_causal=True, segment_ids=seg)
    want = [np.asarray(ref(q64, k64, v64))] + [np.asarray(g) for g in grads(ref, q64, k64, v64,
                                                                             cot)]
  errors = {}
  for n in (1, 8):
    mesh = make_mesh((n,), ("sequence",))
    fn = functools.partial(ring_jax.ring_attention_sharded, mesh=mesh, is_causal=True,
                           segment_ids=seg, layout="striped", block_q=16, block_kv=16)
    out, dqkv = out_and_grads(fn, q, k, v, cot.astype(jnp.float32))  # one program
    got = [out, *dqkv]
    errors[n] = [float(np.abs(np.asarray(g, np.float64) - w).max() / np.abs(w).max())
                 for g, w in zip(got, want)]
  for e1, e8 in zip(errors[1], errors[8]):
    assert e8 <= 1.5 * e1 + 1e-3, errors
  assert max(errors[8]) < 3e-2, errors


def test_self_only_window_with_gqa_returns_own_value():
  """Window (0, 0): each query sees only its own key, so query head n outputs the value of
  K/V head n // G (GQA, G = 2), striped across the ring."""
  mesh = make_mesh((4,), ("sequence",))
  q, k, v = qkv(3, 1, 32, 4, 2, 8)
  fn = shard_mapped(mesh, is_causal=True, local_window_size=(0, 0), layout="striped",
                    block_q=2, block_kv=2)
  out = jax.jit(fn)(*(ring_jax.to_layout(x, "striped", 4) for x in (q, k, v)))
  out = ring_jax.from_layout(out, "striped", 4)
  chex.assert_shape(out, q.shape)
  assert_close(out, jnp.repeat(v, 2, axis=2))


def test_float64_inputs():
  """float64 inputs (under x64) run with the float32 carry: float64 out, float32-level error
  against the float64 oracle, and finite gradients."""
  mesh = make_mesh((4,), ("sequence",))
  seg = packed_segments(1, 32, seed=5)
  with jax.enable_x64(True):
    q, k, v = (x.astype(jnp.float64) for x in qkv(4, 1, 32, 4, 2, 8))
    fn = functools.partial(ring_jax.ring_attention_sharded, mesh=mesh, is_causal=True,
                           segment_ids=seg, layout="zigzag", block_q=4, block_kv=4)
    out = jax.jit(fn)(q, k, v)
    dq = jax.jit(jax.grad(lambda q: fn(q, k, v).sum()))(q)
    want = ring_jax.reference_attention(q, k, v, is_causal=True, segment_ids=seg)
    dq_want = jax.grad(lambda q: ring_jax.reference_attention(
        q, k, v, is_causal=True, segment_ids=seg).sum())(q)
  chex.assert_type([out, dq, want], jnp.float64)
  assert_close(out, want)
  assert_close(dq, dq_want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("routed", [False, True])
def test_hops_are_named_in_profiles(routed):
  """The ring's hops, transfers and block loops carry jax.named_scope names in the HLO; the
  full rotation's backward ends on each shard's owner (no ``dkv_home``), a routed one sends
  accumulators home."""
  mesh = make_mesh((4,), ("sequence",))
  q, k, v = qkv(0, 1, 32, 2, 2, 8)
  fn = shard_mapped(mesh, is_causal=True, layout="zigzag", block_q=4, block_kv=4,
                    causal_routing=routed)
  hlo = jax.jit(jax.grad(lambda q, k, v: fn(q, k, v).sum(), argnums=(0, 1, 2))).lower(
      q, k, v).as_text(debug_info=True)
  # Loop bodies carry names relative to their loop (a profile shows the whole path).
  scopes = {part for loc in re.findall(r'loc\("([^"]*)"', hlo) for part in loc.split("/")}
  for name in ("ring_fwd", "ring_bwd", "hop", "last_hop", "hop_0", "send_kv", "send_dkv",
               "xla_hop_fwd_blocks", "xla_hop_bwd_blocks"):
    assert name in scopes, name
  assert ("dkv_home" in scopes) == routed
  assert re.search(r'"ring_fwd/last_hop/[^"]*xla_hop_fwd_blocks/', hlo)
  assert re.search(r'"ring_bwd/last_hop/xla_hop_bwd_blocks/', hlo)


def test_blocks_of_different_documents_are_skipped():
  """With packed segments, block pairs that share no document are not computed."""
  n, length, block = 4, 64, 4
  mesh = make_mesh((n,), ("sequence",))
  seg = np.repeat(np.arange(1, 9, dtype=np.int32), 8)[None]  # 8 documents of 8 tokens
  seg[0, -4:] = 0                                            # and trailing padding
  seg = jnp.asarray(seg)
  q, k, v = qkv(4, 1, length, 2, 2, 8)
  kernel = PairLogKernel()
  fn = shard_mapped_with_segments(mesh, block, hop_kernel=kernel)
  out = jax.jit(fn)(q, k, v, seg)
  jax.effects_barrier()
  assert_close(out, ring_jax.reference_attention(q, k, v, is_causal=True, segment_ids=seg))
  computed = sum(len(pairs) for *_, pairs in kernel.log)
  scheduled = ring_jax.schedule("contiguous", n, length // n, block, block, True)
  # Each 8-token document covers two 4-token blocks: 3 causal pairs per document, none for
  # the padding block.
  assert computed == 7 * 3 + 1 < scheduled.num_pairs.sum()


def shard_mapped_with_segments(mesh, block, hop_kernel="auto"):
  spec, seg_spec = P(None, "sequence", None, None), P(None, "sequence")
  return jax.shard_map(
      lambda q, k, v, s: ring_jax.ring_attention(q, k, v, axis_name="sequence", is_causal=True,
                                                 segment_ids=s, block_q=block, block_kv=block,
                                                 hop_kernel=hop_kernel),
      mesh=mesh, in_specs=(spec, spec, spec, seg_spec), out_specs=spec)


@pytest.mark.parametrize("overlap_dkv", [False, True])
@pytest.mark.parametrize("window", [None, 12])
def test_dkv_accumulation_modes_match_the_oracle(overlap_dkv, window):
  """In-place dK/dV accumulation (default) and fresh per-hop buffers (``overlap_dkv``): the
  same gradients, on the full ring and on a window-pruned one; GQA, packed documents."""
  mesh = make_mesh((4,), ("sequence",))
  q, k, v = qkv(5, 2, 64, 4, 2, 8)
  seg = packed_segments(2, 64, seed=5, pad_rows=(1,))
  fn = functools.partial(ring_jax.ring_attention_sharded, mesh=mesh, is_causal=True,
                         layout="contiguous" if window else "zigzag", local_window_size=window,
                         segment_ids=seg, batch_axis=None, block_q=4, block_kv=4,
                         overlap_dkv=overlap_dkv)
  ref = functools.partial(ring_jax.reference_attention, is_causal=True, segment_ids=seg,
                          local_window_size=window)
  cot = jax.random.normal(jax.random.key(6), q.shape, jnp.float32)
  got = jax.jit(functools.partial(grads, fn))(q, k, v, cot)
  for name, g, w in zip("qkv", got, grads(ref, q, k, v, cot)):
    assert_close(g, w, what=f"d{name}")


def test_in_place_dkv_accumulation_needs_less_memory():
  """The default backward adds into the travelling dK/dV accumulators: two K/V-sized float32
  buffers fewer per device than ``overlap_dkv=True`` (compiled, nothing run)."""
  b, length, heads, hd = 1, 2048, 4, 32
  temps = {o: _fwd_bwd_temp_bytes(4, length // 4, heads, hd, layout="zigzag", block_q=64,
                                  block_kv=64, overlap_dkv=o) for o in (False, True)}
  kv_f32 = b * (length // 4) * heads * hd * 4
  assert temps[True] - temps[False] >= 1.5 * kv_f32, temps


def test_non_finite_v_is_checked_once_per_shard_not_per_hop():
  """The kernels' non-finite-V guard reads a flag computed once where the shard is born (one
  pass over the local V and one all_gather per forward), not a pass over V at every hop."""
  mesh = make_mesh((4,), ("sequence",))
  q, k, v = qkv(0, 1, 64, 2, 2, 8)
  fn = shard_mapped(mesh, is_causal=True, layout="zigzag", block_q=4, block_kv=4)
  local_v = (1, 16, 2, 8)

  def eqns(jaxpr):
    for eqn in jaxpr.eqns:
      yield eqn
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        yield from eqns(sub)

  found = list(eqns(jax.make_jaxpr(fn)(q, k, v).jaxpr))
  whole_v = [e for e in found if e.primitive.name == "is_finite"
             and tuple(e.invars[0].aval.shape) == local_v]
  assert len(whole_v) == 1
  assert sum(e.primitive.name == "all_gather" for e in found) == 1
  v_nan = v.at[0, 3, 0, 0].set(jnp.nan)  # the guard still works: NaN exactly where it is seen
  to = functools.partial(ring_jax.to_layout, layout="zigzag", ring_size=4)
  out = ring_jax.from_layout(jax.jit(fn)(to(q), to(k), to(v_nan)), "zigzag", 4)
  ref = ring_jax.reference_attention(q, k, v_nan, is_causal=True)
  assert np.isnan(np.asarray(ref)).any() and not np.isnan(np.asarray(ref)).all()
  np.testing.assert_array_equal(np.isnan(np.asarray(out)), np.isnan(np.asarray(ref)))


def test_default_block_follows_the_platforms_table():
  """The largest divisor of the layout's chunk (half the shard for zigzag) up to the
  platform's target for that shard length; platforms the table does not name get
  DEFAULT_BLOCK."""
  from ring_jax.ring import BLOCK_TARGETS, DEFAULT_BLOCK, block_target, default_block
  assert BLOCK_TARGETS["cpu"] == ((512, 64), (None, 128))
  assert block_target("cpu", 512) == 64 and block_target("cpu", 1024) == 128
  assert block_target("cpu") == 128  # no length: the longest shards' target
  assert block_target(local_len=4096) == block_target(jax.default_backend(), 4096)
  assert block_target("tpu", 64) == 512 and block_target("metal") == DEFAULT_BLOCK
  assert default_block("contiguous", 4096, platform="cpu") == 128
  assert default_block("contiguous", 512, platform="cpu") == 64
  assert default_block("contiguous", 4096, platform="tpu") == 512
  assert default_block("zigzag", 512, platform="tpu") == 256   # the chunk is half the shard
  assert default_block("contiguous", 48, platform="cpu") == 48  # the whole shard fits
  assert default_block("zigzag", 96, platform="cpu") == 48
  assert default_block("contiguous", 300, platform="cpu") == 60  # a divisor, not 64
  assert default_block("contiguous", 4096, 64) == 64              # an explicit target
  assert default_block("contiguous", 4096, platform="metal") == DEFAULT_BLOCK


def test_platform_defaults_resolve_none_per_platform():
  """``causal_routing=None`` / ``overlap_dkv=None``: the full rotation and fresh dK/dV buffers
  on TPU, elsewhere the layout rule (None) and in-place dK/dV; explicit values are kept."""
  from ring_jax.ring import platform_defaults
  assert platform_defaults("tpu") == {"causal_routing": False, "overlap_dkv": True}
  assert platform_defaults("cpu") == {"causal_routing": None, "overlap_dkv": False}
  assert platform_defaults("gpu") == {"causal_routing": None, "overlap_dkv": False}
  assert platform_defaults("tpu", causal_routing=True, overlap_dkv=False) == {
      "causal_routing": True, "overlap_dkv": False}
  assert platform_defaults() == platform_defaults(jax.default_backend())
  with pytest.raises(TypeError, match="overlap_dkv must be None"):
    platform_defaults("cpu", overlap_dkv="yes")


def test_default_overlap_dkv_and_routing_on_cpu_are_unchanged():
  """On CPU the defaults compile the program ``overlap_dkv=False`` and the layout's routing
  rule give (same HLO)."""
  mesh = make_mesh((4,), ("sequence",))
  x = jnp.zeros((1, 32, 2, 8), jnp.float32)

  def hlo(**kw):
    fn = functools.partial(ring_jax.ring_attention_sharded, mesh=mesh, is_causal=True,
                           batch_axis=None, hop_kernel="xla", **kw)
    return jax.jit(jax.grad(lambda q, k, v: fn(q, k, v).sum())).lower(x, x, x).as_text()

  assert hlo() == hlo(overlap_dkv=False, causal_routing=True)
  assert hlo() != hlo(overlap_dkv=True, causal_routing=True)


def _structure_matches_the_oracle(seed, layout, is_causal, overlap_dkv, segments):
  """A ring of 4 (blocks of 4, full rotation) against the oracle, output and gradients;
  returns ``(the HLO's location strings, a function lowering the gradient again)``."""
  mesh = make_mesh((4,), ("sequence",))
  q, k, v = qkv(seed, 2, 64, 4, 2, 8)
  seg = packed_segments(2, 64, seed=seed, pad_rows=(1,)) if segments else None
  fn = functools.partial(ring_jax.ring_attention_sharded, mesh=mesh, is_causal=is_causal,
                         layout=layout, segment_ids=seg, batch_axis=None, block_q=4,
                         block_kv=4, overlap_dkv=overlap_dkv, causal_routing=False)
  ref = functools.partial(ring_jax.reference_attention, is_causal=is_causal, segment_ids=seg)
  cot = jax.random.normal(jax.random.key(seed + 1), q.shape, jnp.float32)
  out, got = out_and_grads(fn, q, k, v, cot)  # one program
  assert_close(out, ref(q, k, v), what="out")
  for name, g, w in zip("qkv", got, grads(ref, q, k, v, cot)):
    assert_close(g, w, what=f"d{name}")
  lower = lambda: jax.jit(functools.partial(grads, fn)).lower(  # noqa: E731
      q, k, v, cot).as_text(debug_info=True)
  return set(re.findall(r'loc\("([^"]*)"', lower())), lower


def _scopes(locs):
  return {part for loc in locs for part in loc.split("/")}


@pytest.mark.parametrize("layout,is_causal,overlap_dkv,segments", [
    ("zigzag", True, True, True), ("zigzag", True, False, False),
    ("contiguous", False, False, True)])
def test_one_loop_matches_the_oracle(monkeypatch, layout, is_causal, overlap_dkv, segments):
  """Every hop of a full rotation in one loop per pass (``one_loop``, the TPU's table entry,
  here set for the CPU): the first and last hops run in the loop (their transfers unused),
  so the compiled program names no peeled hop; output and gradients as the oracle's."""
  monkeypatch.setitem(ring_jax.ring.PLATFORM_DEFAULTS, "cpu", {"one_loop": ("xla",)})
  locs, _ = _structure_matches_the_oracle(7, layout, is_causal, overlap_dkv, segments)
  assert {"hop", "send_kv", "send_dkv"} <= _scopes(locs)
  assert not {"hop_0", "last_hop"} & _scopes(locs)


@pytest.mark.parametrize("layout,is_causal,overlap_dkv,segments", [
    ("zigzag", True, True, True), ("contiguous", False, False, False)])
def test_unrolled_hops_match_the_oracle(monkeypatch, layout, is_causal, overlap_dkv, segments):
  """Passes of at most ``unroll_hops`` hops (the TPU's table entry, here set for the CPU, with
  ``one_loop`` too, which it overrides) run every hop outside a loop: the compiled ring has
  no loop of its own (the hop's block loops remain), and output and gradients are the
  oracle's."""
  monkeypatch.setitem(ring_jax.ring.PLATFORM_DEFAULTS, "cpu",
                      {"one_loop": ("xla",), "unroll_hops": 4})
  locs, lower = _structure_matches_the_oracle(9, layout, is_causal, overlap_dkv, segments)
  assert {"hop_0", "last_hop", "send_kv", "send_dkv"} <= _scopes(locs)
  ring_loops = {loc for loc in locs for name in ("ring_fwd", "ring_bwd")
                if f"{name}/while" in loc}
  assert not ring_loops, sorted(ring_loops)[:3]
  monkeypatch.setitem(ring_jax.ring.PLATFORM_DEFAULTS, "cpu", {"one_loop": ("xla",)})
  looped = lower()
  assert "ring_fwd/while" in looped and "ring_bwd/while" in looped


@pytest.mark.parametrize("layout,unroll,masked_fwd,masked_bwd", [
    ("zigzag", 4, [True, False, False, False], [False, False, False, True]),
    ("zigzag", 0, [True, False], [False, False, True]),
    ("striped", 4, [True] * 4, [True] * 4)])
def test_hops_between_whole_chunks_compile_only_unmasked_blocks(monkeypatch, layout, unroll,
                                                                 masked_fwd, masked_bwd):
  """A causal zigzag ring's hops on other devices' shards meet whole chunks (every block pair
  visible everywhere or skipped), so the hop kernel gets a block table that masks nothing and
  compiles only its unmasked blocks: unrolled, every such hop; with the ring's loop (the
  forward: hops 0-2 in the loop, the last peeled; the backward: its first and last peeled),
  a loop whose hops are all such. The own shard's hop (the forward's first, the backward's
  last), a loop holding it, and every striped hop keep the mask. Output and gradients as the
  oracle's."""
  monkeypatch.setitem(ring_jax.ring.PLATFORM_DEFAULTS, "cpu", {"unroll_hops": unroll})
  recording, seen = may_mask_recorder()

  mesh = make_mesh((4,), ("sequence",))
  q, k, v = qkv(21, 2, 64, 4, 2, 8)
  fn = functools.partial(ring_jax.ring_attention_sharded, mesh=mesh, is_causal=True,
                         layout=layout, batch_axis=None, block_q=4, block_kv=4,
                         hop_kernel=recording)
  ref = functools.partial(ring_jax.reference_attention, is_causal=True)
  cot = jax.random.normal(jax.random.key(22), q.shape, jnp.float32)
  got = jax.jit(functools.partial(grads, fn))(q, k, v, cot)
  for name, want in (("fwd", masked_fwd), ("bwd", masked_bwd)):  # traced once per pass or more
    assert seen[name] and seen[name] == want * (len(seen[name]) // len(want)), (name, seen[name])
  assert_close(jax.jit(fn)(q, k, v), ref(q, k, v), what="out")
  for name, g, w in zip("qkv", got, grads(ref, q, k, v, cot)):
    assert_close(g, w, what=f"d{name}")
