"""Conformance suite for hop kernels: every registered kernel against a float64 numpy oracle.

Each kernel named in ``KERNELS_UNDER_TEST`` runs
* one hop (the kernel called directly, outside any ring) and
* full rings of 2 and 4 devices (``ring_attention(..., hop_kernel=name, return_lse=True)``;
  fused kernels on a reduced matrix, see ONE_HOP_PARAMS and FUSED_RING_CASES),
and must match the oracle within 1e-5 relative in float32: forward output and lse, and the
gradients of a loss that uses both, across contiguous/zigzag/striped, causal and not,
windows, packed segments with padding (pad rows: output 0, finite gradients), GQA and MQA,
and T != S (contiguous).

Adding a kernel is one entry in ``KERNELS_UNDER_TEST``: it is built with
``ring_jax.get_hop_kernel(name, "cpu")``, so a Pallas kernel runs in interpret mode here.
Shapes are small (local length 256, blocks of 128: a multiple of 128, as TPU kernels need;
2-4 heads, head dim 32-64) so interpret mode stays affordable.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import ring_jax
from attn_utils import make_mesh
from ring_jax.hop import HopGrads, HopMasks, HopResiduals, HopSpec, lse_for_backward

# Kernel names run by this suite.
KERNELS_UNDER_TEST = ["xla", "pallas_tpu", "splash"]
# tokamax (the [gpu] extra: Python >= 3.12, leg 2 of CI) runs here with its own XLA forward
# and a reference of its Mosaic VJP's contract (tests/test_tokamax_gpu.py, cpu_kernel()).
if importlib.util.find_spec("tokamax") is not None:
  KERNELS_UNDER_TEST.append("tokamax")

RTOL = ATOL = 1e-5
BLOCK = 128


def kernel_for(name):
  """The kernel instance under test: as the registry builds it for a CPU backend
  (Pallas kernels in interpret mode; tokamax on its CPU stand-ins where installed)."""
  if name == "tokamax" and name in KERNELS_UNDER_TEST:
    import test_tokamax_gpu  # noqa: PLC0415
    return test_tokamax_gpu.cpu_kernel()
  return ring_jax.get_hop_kernel(name, "cpu")


# --- The float64 numpy oracle ----------------------------------------------------------------

def visibility(q_pos, kv_pos, is_causal, window, q_seg=None, kv_seg=None):
  """bool ``[B or 1, T, S]``: which (query, key) pairs are visible (hop.py's rule)."""
  d = np.asarray(q_pos)[:, None].astype(np.int64) - np.asarray(kv_pos)[None, :]
  vis = np.ones(d.shape, bool)
  if is_causal:
    vis &= d >= 0
  if window is not None:
    vis &= (d <= window[0]) & (d >= -window[1])
  vis = vis[None]
  if q_seg is not None:
    qs, ks = np.asarray(q_seg)[:, :, None], np.asarray(kv_seg)[:, None, :]
    vis = vis & (qs == ks) & (qs != 0)
  return vis


def oracle(q, k, v, vis, scale, do, dlse):
  """float64 attention over visible pairs, and the gradients of
  ``<out, do> + <lse, dlse>`` (lse terms only where finite).

  ``q`` ``[B, T, N, H]``, ``k``/``v`` ``[B, S, K, H]``, ``vis`` ``[B|1, T, S]``,
  ``do`` ``[B, T, N, H]``, ``dlse`` ``[B, T, N]``. Returns ``out``, ``lse``
  (``-inf`` for rows with no visible key; their output is 0), ``dq``, ``dk``, ``dv``.
  """
  q, k, v, do, dlse = (np.asarray(x, np.float64) for x in (q, k, v, do, dlse))
  b, t, n, h = q.shape
  kh = k.shape[2]
  g = n // kh
  kr, vr = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)  # head n reads K/V head n // g
  s = np.einsum("btnh,bsnh->bnts", q, kr) * scale
  vis = np.broadcast_to(vis[:, None], s.shape)
  s = np.where(vis, s, -np.inf)
  m = s.max(-1, keepdims=True)
  m = np.where(np.isfinite(m), m, 0.0)
  p = np.where(vis, np.exp(s - m), 0.0)
  l = p.sum(-1, keepdims=True)
  empty = l == 0
  pn = p / np.where(empty, 1.0, l)                           # softmax (0 in empty rows)
  out = np.einsum("bnts,bsnh->btnh", pn, vr)
  lse = np.where(empty, -np.inf, m + np.log(np.where(empty, 1.0, l)))[..., 0]  # [B, N, T]
  lse = lse.transpose(0, 2, 1)
  dlse = np.where(np.isfinite(lse), dlse, 0.0)
  dv = np.einsum("bnts,btnh->bsnh", pn, do)
  dp = np.einsum("btnh,bsnh->bnts", do, vr)
  delta = np.einsum("btnh,btnh->bnt", do, out)[..., None] - dlse.transpose(0, 2, 1)[..., None]
  ds = pn * (dp - delta) * scale
  dq = np.einsum("bnts,bsnh->btnh", ds, kr)
  dk = np.einsum("bnts,btnh->bsnh", ds, q)
  group = lambda x: x.reshape(b, x.shape[1], kh, g, h).sum(3)
  return out, lse, dq, group(dk), group(dv)


def assert_close(actual, expected, what):
  actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
  same_inf = np.isinf(expected) & (actual == expected)
  assert np.isfinite(actual[~same_inf]).all(), f"{what}: non-finite where the oracle is finite"
  a, e = actual[~same_inf], expected[~same_inf]
  err = np.abs(a - e)
  bound = ATOL + RTOL * np.abs(e)
  assert (err <= bound).all(), f"{what}: max abs err {err.max():.3g} (max |expected| " \
                               f"{np.abs(e).max():.3g})"


# --- Cases -----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Case:
  layout: str = "contiguous"
  is_causal: bool = False
  window: tuple[int, int] | None = None
  segments: bool = False          # packed documents with padding (a row of pure padding too)
  heads: tuple[int, int] = (4, 2)  # query heads, K/V heads
  head_dim: int = 32
  local_q: int = 256
  local_kv: int = 256
  batch: int = 2


CASES = {
    "contiguous": Case(),
    "contiguous-causal": Case(is_causal=True),
    "zigzag-causal": Case(layout="zigzag", is_causal=True),
    "zigzag": Case(layout="zigzag", heads=(2, 2), head_dim=64),
    "striped-causal": Case(layout="striped", is_causal=True),
    "striped": Case(layout="striped", heads=(2, 1)),
    "window-zigzag": Case(layout="zigzag", is_causal=True, window=(150, 0)),
    "window-two-sided": Case(window=(40, 300)),
    "segments-causal-zigzag": Case(layout="zigzag", is_causal=True, segments=True,
                                   heads=(2, 1)),
    "segments-striped": Case(layout="striped", segments=True, heads=(2, 2)),
    "mqa-causal": Case(is_causal=True, heads=(4, 1)),
    "t-ne-s": Case(local_q=128, heads=(2, 1)),
}


def packed(b, length, rng):
  """Packed documents of random lengths and trailing padding; row 1 is all padding."""
  seg = np.zeros((b, length), np.int32)
  for r in range(b):
    if r == 1:
      continue
    pos, doc, end = 0, 1, length - int(rng.integers(1, length // 8))
    while pos < end:
      step = int(rng.integers(8, length // 3))
      seg[r, pos:min(end, pos + step)] = doc
      pos, doc = pos + step, doc + 1
  return seg


def inputs(case: Case, length_q, length_kv, seed=0):
  rng = np.random.default_rng(seed)
  n, kh = case.heads
  f = lambda *shape: rng.normal(size=shape).astype(np.float32)
  q, k, v = (f(case.batch, length_q, n, case.head_dim), f(case.batch, length_kv, kh, case.head_dim),
             f(case.batch, length_kv, kh, case.head_dim))
  do, dlse = f(case.batch, length_q, n, case.head_dim), f(case.batch, length_q, n)
  seg = packed(case.batch, length_q, rng) if case.segments else None
  return q, k, v, do, dlse, seg


# --- One hop, the kernel called directly -----------------------------------------------------

# (q shard, kv shard) of a ring of 4 met at one hop: the diagonal, a shard in the past and
# (non-causal) one in the future.
HOP_SHARDS = [(0, 0), (2, 1), (1, 3)]


# Interpret-mode Pallas costs 10-50x the XLA kernel on CPU, so to keep CI to minutes the fused
# kernels meet every case at ONE hop (rotating through HOP_SHARDS) and the ring in two cases
# (see FUSED_RING_CASES); the XLA kernel runs the whole matrix.
ONE_HOP_PARAMS = [
    pytest.param(name, case, shards, id=f"{name}-{case}-q{shards[0]}-kv{shards[1]}")
    for name in KERNELS_UNDER_TEST for i, case in enumerate(CASES)
    for shards in (HOP_SHARDS if name == "xla" else [HOP_SHARDS[i % len(HOP_SHARDS)]])]


@pytest.mark.parametrize("kernel_name,case,shards", ONE_HOP_PARAMS)
def test_one_hop(kernel_name, case, shards):
  """forward -> (out_h, lse_h); backward with that hop's own out/lse adds (dq, dk, dv) to
  the accumulators passed in."""
  case = CASES[case]
  ring, (qd, kd) = 4, shards
  q, k, v, do, dlse, seg = inputs(case, case.local_q, case.local_kv, seed=qd * 4 + kd)
  q_pos = np.asarray(ring_jax.local_positions(case.layout, ring, case.local_q, qd))
  kv_pos = np.asarray(ring_jax.local_positions(case.layout, ring, case.local_kv, kd))
  kv_seg = None
  if seg is not None:  # the kv shard's ids: the same documents, shifted, to share some
    kv_seg = np.roll(seg, (kd - qd) * 37, axis=1)
  vis = visibility(q_pos, kv_pos, case.is_causal, case.window, seg, kv_seg)
  scale = case.head_dim ** -0.5
  out, lse, dq, dk, dv = oracle(q, k, v, vis, scale, do, dlse)

  kernel = kernel_for(kernel_name)
  b, t, n, h = q.shape
  kh = k.shape[2]
  spec = HopSpec(scale=scale, is_causal=case.is_causal, window=case.window, block_q=BLOCK,
                 block_kv=BLOCK)
  q5 = q.reshape(b, t, kh, n // kh, h)
  kernel.check(q5.shape, k.shape, jnp.float32, spec)
  masks = HopMasks.build(spec, jnp.asarray(q_pos, jnp.int32), jnp.asarray(kv_pos, jnp.int32),
                         None if seg is None else jnp.asarray(seg),
                         None if kv_seg is None else jnp.asarray(kv_seg))
  out_h, lse_h = jax.jit(kernel.forward, static_argnums=4)(q5, k, v, masks, spec)
  assert out_h.dtype == jnp.float32 and lse_h.dtype == jnp.float32
  assert_close(out_h.reshape(b, t, n, h), out, "out_h")
  assert_close(lse_h.reshape(b, t, n), lse, "lse_h")

  out_final = jnp.asarray(out.reshape(q5.shape), jnp.float32)
  lse_final = lse_for_backward(jnp.asarray(lse.reshape(b, t, kh, n // kh), jnp.float32))
  dlse5 = jnp.asarray(np.where(np.isfinite(lse), dlse, 0.0).reshape(b, t, kh, n // kh),
                      jnp.float32)
  rng = np.random.default_rng(qd * 4 + kd)
  accs = [rng.standard_normal(x.shape).astype(np.float32) for x in (q5, k, v)]
  got = jax.jit(kernel.backward, static_argnums=4)(
      q5, k, v, masks, spec, HopResiduals(out_final, lse_final, do.reshape(q5.shape), dlse5),
      HopGrads(*map(jnp.asarray, accs)))
  assert isinstance(got, HopGrads)
  for name, g, w, acc in zip(("dq", "dk", "dv"), got, (dq, dk, dv), accs):
    assert g.dtype == jnp.float32, name
    # g - acc: the accumulator (magnitude ~1) adds at most an ulp of itself.
    assert_close(np.asarray(g).reshape(w.shape) - acc.reshape(w.shape), w, name)


# --- Full rings ------------------------------------------------------------------------------

RING_CASES = [(4, c) for c in CASES] + [(2, "zigzag-causal"), (2, "segments-striped"),
                                        (2, "t-ne-s")]


# Fused kernels: a ring of 2 and a ring of 4, between them causal zigzag, packed segments with
# padding and GQA; their element masks are covered case by case in test_one_hop.
FUSED_RING_CASES = [(2, "zigzag-causal"), (4, "segments-causal-zigzag")]

# TPU kernels (Mosaic) run here in a Pallas interpreter. Inside ``shard_map(check_vma=True)``
# that is the TPU interpreter (``pltpu.InterpretParams``; see pallas_tpu.interpret_mode),
# which runs every load and store as a host callback: 3.5-6x the time of the generic
# interpreter that ``check_vma=False`` allows (ring of 4 below: splash 42 -> 12 s, pallas_tpu
# 36 -> 6 s). What check_vma changes is the varying-axes typing at trace time and which
# interpreter runs, not the kernel's arithmetic. So their rings test the numerics at
# check_vma=False, and test_tpu_kernels_under_check_vma runs the smallest ring as a CPU user
# calls it (check_vma=True). On a TPU the kernels lower to Mosaic under check_vma=True:
# test_splash.py / test_pallas_tpu.py export a ring fwd+bwd for "tpu".
TPU_INTERPRETED = {"pallas_tpu", "splash"}


def numerics_check_vma(kernel_name):
  """``check_vma`` of the shard_map that tests ``kernel_name``'s numerics on a ring."""
  return kernel_name not in TPU_INTERPRETED
RING_PARAMS = [
    pytest.param(name, ring, case, id=f"{name}-ring{ring}-{case}")
    for name in KERNELS_UNDER_TEST
    for ring, case in (RING_CASES if name == "xla" else FUSED_RING_CASES)]


@pytest.mark.parametrize("kernel_name,ring,case", RING_PARAMS)
def test_ring(kernel_name, ring, case):
  """ring_attention(hop_kernel=name, return_lse=True) on inputs in layout order."""
  check_ring(kernel_name, ring, CASES[case], numerics_check_vma(kernel_name))


@pytest.mark.parametrize("kernel_name", sorted(TPU_INTERPRETED))
def test_tpu_kernels_under_check_vma(kernel_name):
  """A TPU kernel as a CPU user runs it, inside shard_map(check_vma=True) (Pallas' TPU
  interpreter): the smallest ring (2 devices, one block per shard, causal zigzag, GQA)."""
  case = Case(layout="zigzag", is_causal=True, heads=(2, 1), local_q=BLOCK, local_kv=BLOCK,
              batch=1)
  check_ring(kernel_name, 2, case, check_vma=True)


def check_ring(kernel_name, ring, case: Case, check_vma: bool, block: int = BLOCK):
  """The ring's out, lse and gradients against the oracle."""
  length_q, length_kv = ring * case.local_q, ring * case.local_kv
  q, k, v, do, dlse, seg = inputs(case, length_q, length_kv, seed=ring)
  pos_q = ring_jax.layout_positions(case.layout, ring, length_q)
  pos_kv = ring_jax.layout_positions(case.layout, ring, length_kv)
  vis = visibility(pos_q, pos_kv, case.is_causal, case.window, seg, seg)
  scale = case.head_dim ** -0.5
  out, lse, dq, dk, dv = oracle(q, k, v, vis, scale, do, dlse)

  mesh = make_mesh((ring,), ("sequence",))
  spec, row = P(None, "sequence"), P(None, "sequence")
  shard_map = functools.partial(jax.shard_map, check_vma=check_vma)
  attend = functools.partial(ring_jax.ring_attention, axis_name="sequence",
                             is_causal=case.is_causal, local_window_size=case.window,
                             layout=case.layout, block_q=block, block_kv=block,
                             hop_kernel=kernel_for(kernel_name), return_lse=True)
  if seg is None:
    fn = shard_map(lambda q, k, v: attend(q, k, v), mesh=mesh, in_specs=(spec,) * 3,
                   out_specs=(spec, row))
    args = (q, k, v)
  else:
    fn = shard_map(lambda q, k, v, s: attend(q, k, v, segment_ids=s), mesh=mesh,
                   in_specs=(spec,) * 3 + (row,), out_specs=(spec, row))
    args = (q, k, v, jnp.asarray(seg))

  def loss(q, k, v, *rest):
    o, l = fn(q, k, v, *rest)
    return jnp.sum(o * do) + jnp.sum(jnp.where(jnp.isfinite(l), l, 0.0) * dlse), (o, l)

  (_, (o, l)), got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(*args)
  assert o.dtype == jnp.float32 and l.dtype == jnp.float32 and l.shape == lse.shape
  assert_close(o, out, "out")
  assert_close(l, lse, "lse")
  for name, g, w in zip(("dq", "dk", "dv"), got, (dq, dk, dv)):
    assert_close(g, w, name)
  if seg is not None:
    pad = seg == 0
    assert (np.asarray(o)[pad] == 0).all() and np.isneginf(np.asarray(l)[pad]).all()
    assert all(np.isfinite(np.asarray(g)).all() for g in got)


@pytest.mark.parametrize("case", ["contiguous-causal", "window-two-sided", "zigzag",
                                  "segments-causal-zigzag"])
def test_xla_ring_one_block_per_shard(case):
  """Blocks the size of the whole shard: each hop's range rows are one case of three
  (skipped, unmasked, masked) taken by a switch (hop.fold_blocks, num_blocks=1)."""
  case = dataclasses.replace(CASES[case], local_q=64, local_kv=64)
  check_ring("xla", 4, case, check_vma=True, block=64)


def _entry_level_dots(hlo: str) -> int:
  """``dot`` instructions that run unconditionally in a compiled HLO module: in the entry
  computation or in what it calls as part of an instruction (fusions, reducers), not in the
  branches of a conditional or the body of a loop."""
  comps, name = {}, None
  for line in hlo.splitlines():
    if line and not line.startswith(" ") and line.rstrip().endswith("{"):
      name = "ENTRY" if line.startswith("ENTRY") else line.split()[0].lstrip("%")
      comps[name] = []
    elif name is not None:
      comps[name].append(line)
  seen, todo, dots = set(), ["ENTRY"], 0
  while todo:
    comp = todo.pop()
    if comp in seen or comp not in comps:
      continue
    seen.add(comp)
    for line in comps[comp]:
      dots += " dot(" in line
      todo += re.findall(r"(?:calls|to_apply)=%([\w.\-]+)", line)
  return dots


def test_xla_one_block_hop_computes_only_pairs_in_range():
  """XLA removes a loop whose trip count it bounds by 1 and runs its body unconditionally
  behind a select. The kernel's loops over a one-block range row were such loops: with
  blocks the size of the shard, every hop computed its pair in all three loops (masked
  before, unmasked, masked after), in range or not (the ring's fwd+bwd measured 2-2.6x
  slower than with two blocks per shard). Every block matmul of the compiled ring must sit
  behind control flow."""
  local, ring = 64, 2
  mesh = make_mesh((ring,), ("sequence",))
  q = jnp.zeros((1, ring * local, 2, 16), jnp.float32)

  def loss(q, k, v):
    return jnp.sum(ring_jax.ring_attention_sharded(
        q, k, v, mesh=mesh, is_causal=True, block_q=local, block_kv=local,
        hop_kernel="xla") ** 2)

  hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, q, q).compile().as_text()
  assert " dot(" in hlo
  assert _entry_level_dots(hlo) == 0


def _rel_err(actual, expected):
  actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
  return np.abs(actual - expected).max() / max(np.abs(expected).max(), 1e-30)


# (lse bound, error ratio to the XLA kernel) of a kernel whose bf16 numerics differ by
# design; the others: float32-level lse, 1.1x. splash takes queries pre-scaled (it has no
# scale argument), so q * scale is rounded to bf16 once more (2**-9 relative: its lse is
# exact for those scores, 6e-4 off here), and its per-hop dK/dV come back in bf16 before
# the float32 accumulators add them (dv 1.28x, dk 1.09x, out and dq below the XLA kernel's,
# measured on jax 0.10.2).
BF16_BOUNDS = {"splash": (2e-3, 1.5)}


@pytest.mark.parametrize("kernel_name", [k for k in KERNELS_UNDER_TEST if k != "xla"])
def test_bfloat16_ring_of_4_error_within_xla(kernel_name):
  """A ring of 4 in bf16 (zigzag, causal, packed segments, GQA): each fused kernel's error of
  the output and all three gradients vs float64 is at most 1.1x the XLA kernel's (lse:
  float32-level), or within the kernel's BF16_BOUNDS. Ring size 1 is in the kernels' own
  test files."""
  ring = 4
  case = CASES["segments-causal-zigzag"]
  length = ring * case.local_q
  q, k, v, do, dlse, seg = inputs(case, length, length, seed=5)
  q, k, v = (jnp.asarray(x).astype(jnp.bfloat16) for x in (q, k, v))
  pos = ring_jax.layout_positions(case.layout, ring, length)
  want = oracle(*(np.asarray(x.astype(jnp.float32)) for x in (q, k, v)),
                visibility(pos, pos, True, None, seg, seg), case.head_dim ** -0.5, do, dlse)
  mesh = make_mesh((ring,), ("sequence",))
  spec = P(None, "sequence")
  errors = {}
  for name in ("xla", kernel_name):
    attend = functools.partial(
        ring_jax.ring_attention, axis_name="sequence", is_causal=True, layout=case.layout,
        block_q=BLOCK, block_kv=BLOCK, hop_kernel=kernel_for(name), return_lse=True)
    fn = jax.shard_map(lambda q, k, v, s: attend(q, k, v, segment_ids=s), mesh=mesh,
                       in_specs=(spec,) * 4, out_specs=(spec, spec),
                       check_vma=numerics_check_vma(name))

    def loss(q, k, v, s):
      o, l = fn(q, k, v, s)
      return (jnp.sum(o.astype(jnp.float32) * do)
              + jnp.sum(jnp.where(jnp.isfinite(l), l, 0.0) * dlse)), (o, l)

    (_, (o, l)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
        q, k, v, jnp.asarray(seg))
    fin = np.isfinite(want[1])
    errors[name] = [_rel_err(o.astype(jnp.float32), want[0]),
                    _rel_err(np.asarray(l)[fin], want[1][fin]),
                    *(_rel_err(g.astype(jnp.float32), w) for g, w in zip(grads, want[2:]))]
  lse_bound, ratio = BF16_BOUNDS.get(kernel_name, (RTOL / 10, 1.1))
  assert errors[kernel_name][1] <= lse_bound, errors
  for i, what in [(0, "out"), (2, "dq"), (3, "dk"), (4, "dv")]:
    assert 1e-4 < errors["xla"][i] < 5e-2, (what, errors)
    assert errors[kernel_name][i] <= ratio * errors["xla"][i], (what, errors)


# --- The registry ----------------------------------------------------------------------------

def test_registry_names_and_errors():
  assert "xla" in ring_jax.HOP_KERNELS
  for name in ring_jax.HOP_KERNELS:  # one rule: a kernel's name is its registry key
    assert type(kernel_for(name)).name == kernel_for(name).name == name
  assert ring_jax.get_hop_kernel("auto", "cpu").name == "xla"
  # TPU: splash, GPU: tokamax, each after its self-check on the device (test_selfcheck.py)
  for platform in ("tpu", "gpu"):
    assert ring_jax.get_hop_kernel("auto", platform) == ring_jax.kernels.AutoHopKernel(platform)
  kernel = ring_jax.XlaHopKernel()
  assert ring_jax.get_hop_kernel(kernel) is kernel
  with pytest.raises(ValueError, match="'flash'.*'auto', 'xla'"):
    ring_jax.get_hop_kernel("flash")
  with pytest.raises(TypeError, match="missing check, forward, backward"):
    ring_jax.get_hop_kernel(object())
  mesh = make_mesh((2,), ("sequence",))
  q = jnp.zeros((1, 8, 2, 8))
  with pytest.raises(ValueError, match="not a known hop kernel"):
    ring_jax.ring_attention_sharded(q, q, q, mesh=mesh, hop_kernel="flash")


@pytest.mark.parametrize("layout, local, kernel_name, want", [
    ("contiguous", 256, "xla", 64),          # the CPU table's 64 up to 512-token shards
    ("contiguous", 256, "splash", 128),      # multiples of 128: the smallest, nearest 64
    ("contiguous", 256, "pallas_tpu", 128),
    ("zigzag", 256, "pallas_tpu", 128),      # the chunk is 128 tokens
    ("contiguous", 1024, "splash", 128),     # the table's 128 above 512-token shards
    ("contiguous", 48, "xla", 48),
])
def test_default_block_is_one_the_kernel_takes(layout, local, kernel_name, want):
  """default_block: the largest divisor of the chunk up to the platform's target that the
  kernel takes (its takes_block), else the smallest it takes; every kernel's check()
  accepts it."""
  kernel = kernel_for(kernel_name)
  block = ring_jax.ring.default_block(layout, local, platform="cpu", kernel=kernel)
  assert block == want
  spec = HopSpec(scale=0.1, is_causal=True, window=None, block_q=block, block_kv=block)
  kernel.check((1, local, 1, 1, 128), (1, local, 1, 128), jnp.float32, spec)


def test_default_block_refuses_a_chunk_no_kernel_block_divides():
  with pytest.raises(ValueError, match=r"'splash' takes no block size that divides the local "
                                       r"length of 192 tokens.*hop_kernel='xla'"):
    ring_jax.ring.default_block("contiguous", 192, platform="cpu", kernel=kernel_for("splash"))


@pytest.mark.parametrize("kernel_name", sorted(TPU_INTERPRETED))
def test_tpu_kernels_run_with_default_blocks(kernel_name):
  """ring_attention_sharded(hop_kernel=...) on 256-token shards without blocks: the default
  (CPU table: 64) is one the kernel takes (128), and the output matches the reference; an
  explicit block it does not take is still refused, naming the fix."""
  ring, local = 2, 256
  mesh = make_mesh((ring,), ("sequence",))
  rng = np.random.default_rng(3)
  q = jnp.asarray(rng.standard_normal((1, ring * local, 2, 32)), jnp.float32)
  k, v = (jnp.asarray(rng.standard_normal((1, ring * local, 1, 32)), jnp.float32)
          for _ in range(2))
  out = jax.jit(lambda q, k, v: ring_jax.ring_attention_sharded(
      q, k, v, mesh=mesh, is_causal=True, hop_kernel=kernel_name))(q, k, v)
  want = ring_jax.reference_attention(q, k, v, is_causal=True)
  np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=2e-5, atol=2e-5)
  with pytest.raises(ValueError, match="block_q=64: .* needs multiples of 128; pass block_q=128"):
    ring_jax.ring_attention_sharded(q, k, v, mesh=mesh, is_causal=True, hop_kernel=kernel_name,
                                    block_q=64)


def test_check_runs_at_trace_time():
  """A kernel's check() refuses shapes before anything runs, with its own message."""

  @dataclasses.dataclass(frozen=True)
  class Picky(ring_jax.XlaHopKernel):
    def check(self, q_shape, kv_shape, dtype, spec):
      if spec.block_q % 128:
        raise ValueError("Picky needs block_q a multiple of 128")

  mesh = make_mesh((2,), ("sequence",))
  q = jnp.zeros((1, 64, 2, 8))
  with pytest.raises(ValueError, match="multiple of 128"):
    ring_jax.ring_attention_sharded(q, q, q, mesh=mesh, hop_kernel=Picky(), block_q=16)


def test_check_runs_once_per_ring_not_per_hop():
  """The ring checks its kernel once at trace time; the hops (forward and backward, four
  of each) do not check again."""
  calls = []

  @dataclasses.dataclass(frozen=True)
  class Counted(ring_jax.XlaHopKernel):
    def check(self, *args):
      calls.append(args)
      return super().check(*args)

  mesh = make_mesh((4,), ("sequence",))
  q = jnp.ones((1, 64, 2, 8))
  fn = functools.partial(ring_jax.ring_attention_sharded, mesh=mesh, hop_kernel=Counted(),
                         is_causal=True, block_q=8, block_kv=8)
  jax.make_jaxpr(jax.grad(lambda q: fn(q, q, q).sum()))(q)
  assert len(calls) == 1


def test_sharded_return_lse_natural_order():
  """ring_attention_sharded(return_lse=True): lse [B, L, N] in natural order, like out."""
  case = Case(is_causal=True, heads=(2, 1), local_q=32, local_kv=32)
  ring = 4
  q, k, v, do, dlse, _ = inputs(case, 128, 128, seed=3)
  vis = visibility(np.arange(128), np.arange(128), True, None)
  out, lse, dq, dk, dv = oracle(q, k, v, vis, case.head_dim ** -0.5, do, dlse)
  mesh = make_mesh((ring,), ("sequence",))
  fn = functools.partial(ring_jax.ring_attention_sharded, mesh=mesh, is_causal=True,
                         layout="zigzag", block_q=8, block_kv=8, return_lse=True)

  def loss(q, k, v):
    o, l = fn(q, k, v)
    return jnp.sum(o * do) + jnp.sum(l * dlse), (o, l)

  (_, (o, l)), got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
  assert_close(o, out, "out")
  assert_close(l, lse, "lse")
  for name, g, w in zip(("dq", "dk", "dv"), got, (dq, dk, dv)):
    assert_close(g, w, name)
