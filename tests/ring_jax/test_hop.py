"""Hop kernels through the conformance kit (ring_jax.testing): every registered kernel against
its float64 numpy oracle, one hop and whole rings; then the registry and the kernels' contract.

Each kernel named in ``KERNELS_UNDER_TEST`` runs
* one hop (``ring_jax.testing.run_hop_case``: the kernel called directly, outside any ring),
* whole rings (``ring_jax.testing.run_case`` on ``hop_kernel_attention(kernel)``, i.e.
  ``ring_jax.ring_attention`` with the kernel at every hop, ``return_lse=True``),
and must pass the kit's cases at its float32 bound (2**-16 of each tensor's largest entry):
forward output and lse, and the gradients of a loss that uses both, across contiguous /
zigzag / striped, causal and not, windows, packed segments with padding (pad rows: output 0,
finite gradients), GQA and MQA, T != S, inputs in layout order, odd rings. The kit's full
matrix is ``benchmarks/conformance.py``; here the XLA kernel runs XLA_RING_CASES and the fused
kernels a reduced set (their element masks are covered case by case at one hop).

Adding a kernel is one entry in ``KERNELS_UNDER_TEST``: it is built with
``ring_jax.get_hop_kernel(name, "cpu")``, so a Pallas kernel runs in interpret mode here.
Shapes are small (local length 256, blocks of 128: a multiple of 128, as TPU kernels need;
2-6 heads, head dim 32-64) so interpret mode stays affordable; the XLA kernel's rings run at
64 tokens per device in blocks of 16.
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

import ring_jax
from attn_utils import make_mesh
from ring_jax import testing
from ring_jax.hop import HopSpec

# Kernel names run by this suite.
KERNELS_UNDER_TEST = ["xla", "splash"]
# tokamax (the [gpu] extra: Python >= 3.12, leg 2 of CI) runs here with its own XLA forward
# and a reference of its Mosaic VJP's contract (tests/ring_jax/test_tokamax_gpu.py, cpu_kernel()).
if importlib.util.find_spec("tokamax") is not None:
  KERNELS_UNDER_TEST.append("tokamax")

BLOCK = 128
LOCAL = 256


def kernel_for(name):
  """The kernel instance under test: as the registry builds it for a CPU backend
  (Pallas kernels in interpret mode; tokamax on its CPU stand-ins where installed)."""
  if name == "tokamax" and name in KERNELS_UNDER_TEST:
    import test_tokamax_gpu  # noqa: PLC0415
    return test_tokamax_gpu.cpu_kernel()
  return ring_jax.get_hop_kernel(name, "cpu")


def assert_passes(row):
  assert row.status == testing.PASS, f"{row.case} (ring {row.ring}): {row.status}: {row.message}"


# --- One hop, the kernel called directly -----------------------------------------------------

# Interpret-mode Pallas costs 10-50x the XLA kernel on CPU, so to keep CI to minutes the fused
# kernels meet every case at ONE hop (rotating through HOP_SHARDS) and the ring in two cases
# (see FUSED_RING_CASES); the XLA kernel runs the whole matrix.
ONE_HOP_PARAMS = [
    pytest.param(name, case, shards, id=f"{name}-{case}-q{shards[0]}-kv{shards[1]}")
    for name in KERNELS_UNDER_TEST for i, case in enumerate(testing.HOP_CASES)
    for shards in (testing.HOP_SHARDS if name == "xla"
                   else [testing.HOP_SHARDS[i % len(testing.HOP_SHARDS)]])]


@pytest.mark.parametrize("kernel_name,case,shards", ONE_HOP_PARAMS)
def test_one_hop(kernel_name, case, shards):
  """forward -> (out_h, lse_h); backward with the final out/lse adds (dq, dk, dv) to the
  accumulators passed in. A kernel without a variant refuses it in ``check`` (tokamax: the
  soft-cap), naming what to use."""
  row = testing.run_hop_case(kernel_for(kernel_name), case, shards, local_len=LOCAL,
                             block=BLOCK)
  if (kernel_name, case) in REFUSED:
    assert row.status == testing.NOT_SUPPORTED and REFUSED[kernel_name, case] in row.message, row
  else:
    assert_passes(row)


# (kernel, case) -> what its check() says instead of running it.
REFUSED = {("tokamax", "soft-cap"): "soft-cap",
           ("tokamax", "value-head-dim"): "V's head size 16 differs"}


# --- Full rings ------------------------------------------------------------------------------

# The XLA kernel's rings in CI: the cases of the suite this kit replaced (every layout, mask,
# window, segment and head case at ring 4, three at ring 2) and one of each bug class the kit
# adds (input order, first/last hop, short window, documents crossing shards, masked rows,
# odd ring, bf16 error growth 1 -> 8). All at the kit's own size, 64 tokens per device in
# blocks of 16 (XLA_RING_LOCAL, XLA_RING_BLOCK): four blocks per shard (two per zigzag or
# striped chunk), so every hop loops over blocks; windows and documents scale with the shard
# (ring_jax.testing.cases).
XLA_RING_CASES = [
    "full", "causal", "causal-zigzag", "zigzag", "causal-striped", "striped", "window-zigzag",
    "window-two-sided", "segments-zigzag", "segments-striped", "mqa-causal", "t-ne-s",
    "ring2-causal-zigzag", "ring2-segments-striped", "ring2-t-ne-s",
    "in-layout-zigzag", "first-last-hop", "window-short", "segments-crossing", "masked-rows",
    "odd-ring", "bf16-growth", "sinks+10", "sinks-10", "sinks-masked-rows", "soft-cap",
    "value-head-dim", "value-head-dim-sinks-cap", "value-head-dim-ring8"]
XLA_RING_LOCAL, XLA_RING_BLOCK = 64, 16

# Fused kernels: a ring of 2 and a ring of 4, between them causal zigzag, packed segments with
# padding and GQA; their element masks are covered case by case in test_one_hop.
FUSED_RING_CASES = ["ring2-causal-zigzag", "segments-zigzag", "sinks+10"]
# Those without documents run one row of the kit's two (interpret mode's time grows with the
# rows; their second row is only another draw of the same case).
FUSED_ONE_ROW = {"ring2-causal-zigzag", "sinks+10"}

# TPU kernels (Mosaic) run here in a Pallas interpreter. Inside ``shard_map(check_vma=True)``
# that is the TPU interpreter (``pltpu.InterpretParams``; see SplashHopKernel._interpret_mode),
# which runs every load and store as a host callback: 3.5x the time of the generic
# interpreter that ``check_vma=False`` allows (ring of 4 below: splash 42 -> 12 s). What
# check_vma changes is the varying-axes typing at trace time and which interpreter runs, not
# the kernel's arithmetic. So their rings test the numerics at check_vma=False, and
# test_tpu_kernels_under_check_vma runs the smallest ring as a CPU user calls it
# (check_vma=True). On a TPU the kernels lower to Mosaic under check_vma=True:
# test_splash.py exports a ring fwd+bwd for "tpu".
TPU_INTERPRETED = {"splash"}


def ring_function(kernel_name, block=BLOCK, check_vma=None):
  """The ring with ``kernel_name`` at every hop, in the kit's calling convention."""
  if check_vma is None:
    check_vma = kernel_name not in TPU_INTERPRETED
  return testing.hop_kernel_attention(kernel_for(kernel_name), block=block,
                                      check_vma=check_vma)


RING_PARAMS = [
    pytest.param(name, case, id=f"{name}-{case}")
    for name in KERNELS_UNDER_TEST
    for case in (XLA_RING_CASES if name == "xla" else FUSED_RING_CASES)]


@pytest.mark.parametrize("kernel_name,case", RING_PARAMS)
def test_ring(kernel_name, case):
  """ring_attention(hop_kernel=name, return_lse=True): out, lse and gradients vs the oracle."""
  if kernel_name == "xla":  # V's own head size too
    assert_passes(testing.run_case(ring_function(kernel_name, block=XLA_RING_BLOCK), case,
                                   local_len=XLA_RING_LOCAL, features=("value_head_dim",)))
  else:
    if case in FUSED_ONE_ROW:
      case = dataclasses.replace(testing.CASES[case], batch=1)
    assert_passes(testing.run_case(ring_function(kernel_name), case, local_len=LOCAL))


@pytest.mark.parametrize("kernel_name", sorted(TPU_INTERPRETED))
def test_tpu_kernels_under_check_vma(kernel_name):
  """A TPU kernel as a CPU user runs it, inside shard_map(check_vma=True) (Pallas' TPU
  interpreter): the smallest ring (2 devices, one block per shard, causal zigzag, GQA)."""
  case = dataclasses.replace(testing.CASES["ring2-causal-zigzag"], heads=(2, 1), batch=1)
  assert_passes(testing.run_case(ring_function(kernel_name, check_vma=True), case,
                                 local_len=BLOCK))


@pytest.mark.parametrize("case", ["causal", "window-two-sided", "zigzag", "segments-zigzag"])
def test_xla_ring_one_block_per_shard(case):
  """Blocks the size of the whole shard: each hop's range rows are one case of three
  (skipped, unmasked, masked) taken by a switch (hop.fold_blocks, num_blocks=1)."""
  assert_passes(testing.run_case(ring_function("xla", block=64), case, local_len=64))


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


# (lse bound, error ratio to the XLA kernel) of a kernel whose bf16 numerics differ by
# design; the others: float32-level lse, 1.1x. splash takes queries pre-scaled (it has no
# scale argument), so q * scale is rounded to bf16 once more (2**-9 relative: its lse is
# exact for those scores, 6e-4 off here), and its per-hop dK/dV come back in bf16 before
# the float32 accumulators add them (dv 1.28x, dk 1.09x, out and dq below the XLA kernel's,
# measured on jax 0.10.2).
BF16_BOUNDS = {"splash": (2e-3, 1.5)}


@pytest.mark.parametrize("kernel_name", [k for k in KERNELS_UNDER_TEST if k != "xla"])
def test_bfloat16_ring_of_4_error_within_xla(kernel_name):
  """A ring of 4 in bf16 (the kit's segments-zigzag case: causal zigzag, packed segments,
  GQA): each fused kernel's error of the output and all three gradients vs float64 is at most
  1.1x the XLA kernel's (lse: float32-level), or within the kernel's BF16_BOUNDS. Ring size
  1 is in the kernels' own test files."""
  case = dataclasses.replace(testing.CASES["segments-zigzag"], name="segments-zigzag-bf16",
                             dtype="bfloat16")
  errors = {}
  for name in ("xla", kernel_name):
    row = testing.run_case(ring_function(name), case, local_len=LOCAL)
    assert row.status == testing.PASS, (name, row)
    errors[name] = row.errors
  lse_bound, ratio = BF16_BOUNDS.get(kernel_name, (1e-6, 1.1))
  assert errors[kernel_name]["lse"] <= lse_bound, errors
  for what in ("out", "dq", "dk", "dv"):
    assert 1e-4 < errors["xla"][what] < 5e-2, (what, errors)
    assert errors[kernel_name][what] <= ratio * errors["xla"][what], (what, errors)


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
    ("zigzag", 256, "splash", 128),          # the chunk is 128 tokens
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
