"""``hop_kernel="auto"``: a fused kernel is used only after it checked itself on the device
(ring_jax/kernels/selfcheck.py). On CPU the tests register kernels as ``auto``'s choice for
"cpu": a wrong one, one that fails to compile, a right one, and splash (interpret mode)."""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import ring_jax
from ring_jax import kernels
from ring_jax.kernels import selfcheck
from ring_jax.kernels.xla import XlaHopKernel

CALLS: dict[str, int] = {}


@dataclasses.dataclass(frozen=True)
class Counting(XlaHopKernel):
  """The XLA kernel under another name, counting its forward traces."""
  name: ClassVar[str] = "counting"

  def forward(self, q, k, v, masks, spec):
    CALLS[self.name] = CALLS.get(self.name, 0) + 1
    return super().forward(q, k, v, masks, spec)


@dataclasses.dataclass(frozen=True)
class Wrong(Counting):
  """Right lse, output off by half: what a miscompiled kernel might return."""
  name: ClassVar[str] = "wrong"

  def forward(self, q, k, v, masks, spec):
    out, lse = super().forward(q, k, v, masks, spec)
    return out * 1.5, lse


@dataclasses.dataclass(frozen=True)
class Broken(Counting):
  """Fails while being compiled (as a kernel the device's compiler rejects)."""
  name: ClassVar[str] = "broken"

  def forward(self, q, k, v, masks, spec):
    raise NotImplementedError("Mosaic: unsupported layout (a stand-in)")


@pytest.fixture
def auto_is(monkeypatch):
  """``auto_is(kernel_class)``: make that kernel auto's choice on cpu, verdicts forgotten;
  ``CALLS["check"]`` counts the self-checks run."""
  def install(cls):
    monkeypatch.setitem(kernels.HOP_KERNELS, cls.name, lambda platform: cls())
    monkeypatch.setitem(kernels.AUTO, "cpu", cls.name)
    CALLS.clear()

  compare = selfcheck._compare

  def counted(*args, **kwargs):
    CALLS["check"] = CALLS.get("check", 0) + 1
    return compare(*args, **kwargs)

  monkeypatch.setattr(selfcheck, "_compare", counted)
  selfcheck.reset()
  yield install
  selfcheck.reset()


def _ring(q, k, segment_ids=None, hop_kernel="auto", block=128, ring=4):
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:ring]), ("sequence",))
  row = P(None, "sequence")
  attend = functools.partial(ring_jax.ring_attention, axis_name="sequence", is_causal=True,
                             layout="zigzag", block_q=block, block_kv=block,
                             hop_kernel=hop_kernel)
  if segment_ids is None:
    fn = jax.shard_map(lambda q, k: attend(q, k, k), mesh=mesh, in_specs=(row, row),
                       out_specs=row)
    return jax.jit(fn)(q, k)
  fn = jax.shard_map(lambda q, k, s: attend(q, k, k, segment_ids=s), mesh=mesh,
                     in_specs=(row,) * 3, out_specs=row)
  return jax.jit(fn)(q, k, segment_ids)


def _inputs(length=1024, seed=0):
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((1, length, 4, 32)).astype(np.float32)
  k = rng.standard_normal((1, length, 2, 32)).astype(np.float32)
  return q, k


def _reference(q, k, ring=4):
  """Dense causal attention of layout-ordered inputs, back in layout order."""
  natural = lambda x: ring_jax.from_layout(x, "zigzag", ring)  # noqa: E731
  want = ring_jax.reference_attention(natural(q), natural(k), natural(k), is_causal=True)
  return np.asarray(ring_jax.to_layout(want, "zigzag", ring))


@pytest.mark.parametrize("cls, reason", [(Wrong, r"out: max error 0\.5"),
                                         (Broken, r"NotImplementedError: Mosaic")])
def test_a_failing_kernel_falls_back_to_xla_with_one_warning(auto_is, cls, reason):
  auto_is(cls)
  q, k = _inputs()
  with pytest.warns(RuntimeWarning, match=rf"'{cls.name}' failed its self-check on cpu "
                                          rf"\(float32\): {reason}.*hop_kernel='{cls.name}' "
                                          "forces it") as record:
    out = _ring(q, k)
  assert len([w for w in record if "self-check" in str(w.message)]) == 1
  np.testing.assert_allclose(out, _reference(q, k), rtol=1e-5, atol=1e-5)
  assert "self-check FAILED" in kernels.describe("auto", "cpu")
  assert kernels.describe("auto", "cpu").startswith("hop kernel: xla")


def test_a_passing_kernel_runs_and_the_check_runs_once_per_process(auto_is):
  auto_is(Counting)
  q, k = _inputs()
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # no warning when the kernel passes
    out = _ring(q, k)
  assert CALLS["check"] == 1 and CALLS["counting"] >= 2  # the check's hop, the ring's hops
  np.testing.assert_allclose(out, _reference(q, k), rtol=1e-5, atol=1e-5)
  (verdict,) = selfcheck.verdicts()
  assert verdict.ok and verdict.kernel == "counting" and verdict.dtype == "float32"
  assert kernels.describe("auto", "cpu") == (
      "hop kernel: counting (auto on cpu: counting float32: self-check passed)")
  # Other programs of the same dtype and features (gradients; the global-array wrapper,
  # which resolves "auto" for its mesh's platform): no second check, same results.
  grads = jax.grad(lambda q: _ring(q, k).sum())(q)
  assert np.isfinite(np.asarray(grads)).all()
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("sequence",))
  natural = lambda x: ring_jax.from_layout(x, "zigzag", 4)  # noqa: E731
  before = CALLS["counting"]
  out2 = ring_jax.ring_attention_sharded(natural(q), natural(k), natural(k), mesh=mesh,
                                         is_causal=True, layout="zigzag", block_q=128,
                                         block_kv=128)
  assert CALLS["counting"] > before  # it ran the auto kernel's choice
  np.testing.assert_allclose(ring_jax.to_layout(out2, "zigzag", 4), _reference(q, k),
                             rtol=1e-5, atol=1e-5)
  assert CALLS["check"] == 1 and len(selfcheck.verdicts()) == 1


def test_features_and_dtype_key_the_verdict(auto_is):
  """Segment ids in use, or another dtype, is another check; shapes the fused kernel does
  not take (blocks of 64) run XLA without one."""
  auto_is(Counting)
  q, k = _inputs()
  _ring(q, k)
  seg = np.repeat(np.array([[1, 2, 0, 3]]), 256, axis=1).astype(np.int32)
  _ring(q, k, segment_ids=seg)
  _ring(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16))
  assert [(v.dtype, v.ok) for v in selfcheck.verdicts()] == [
      ("float32", True), ("float32", True), ("bfloat16", True)]
  selfcheck.reset()

  @dataclasses.dataclass(frozen=True)
  class Needs128(Counting):
    name: ClassVar[str] = "needs128"

    def check(self, q_shape, kv_shape, dtype, spec):
      if spec.block_q % 128:
        raise ValueError("needs blocks of 128")

  auto_is(Needs128)
  out = _ring(q, k, block=64)
  assert selfcheck.verdicts() == () and "check" not in CALLS
  np.testing.assert_allclose(out, _reference(q, k), rtol=1e-5, atol=1e-5)


def test_processes_take_the_verdict_together(monkeypatch):
  """With several processes the kernel is used only if it passed on every one."""
  from jax.experimental import multihost_utils
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(multihost_utils, "process_allgather",
                      lambda x: np.array([0, 1], np.int32))  # process 1 failed
  assert selfcheck._agree("") == "failed on process(es) [1]"
  assert selfcheck._agree("out: max error 1") == "out: max error 1"
  monkeypatch.setattr(multihost_utils, "process_allgather",
                      lambda x: np.array([0, 0], np.int32))
  assert selfcheck._agree("") == ""


def test_splash_passes_its_self_check_and_runs(auto_is, monkeypatch):
  """The real TPU choice, in interpret mode on CPU: splash checks itself, passes, and the
  ring runs on it."""
  from ring_jax.kernels import splash
  monkeypatch.setitem(kernels.AUTO, "cpu", "splash")
  calls = []
  real = splash.SplashHopKernel.forward
  monkeypatch.setattr(splash.SplashHopKernel, "forward",
                      lambda self, *a: calls.append(1) or real(self, *a))
  q, k = _inputs(length=512)
  out = _ring(q, k, ring=2)
  (verdict,) = selfcheck.verdicts()
  assert verdict.ok and verdict.kernel == "splash", verdict
  assert len(calls) >= 2  # the check's hop and the ring's
  np.testing.assert_allclose(out, _reference(q, k, ring=2), rtol=1e-5, atol=1e-5)


def test_auto_without_a_fused_kernel_is_xla():
  assert "cpu" not in kernels.AUTO
  assert isinstance(ring_jax.get_hop_kernel("auto", "cpu"), XlaHopKernel)
  assert ring_jax.get_hop_kernel("auto", "tpu") == kernels.AutoHopKernel("tpu")
  assert kernels.describe("auto", "cpu") == (
      "hop kernel: xla (auto: no fused kernel is picked on cpu)")
  assert kernels.describe("splash", "tpu") == "hop kernel: splash"
