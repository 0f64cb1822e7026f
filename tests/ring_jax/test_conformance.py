"""The conformance kit itself (ring_jax.testing): its oracle, its verdicts, its CLI.

Kept honest: a correct small ring (tests/conformance_rings.py) passes the kit's bug-class
cases, and each of five deliberately broken copies of it fails, with the case that
catches its bug named in the failure. The oracle is checked against autodiff of a dense
float64 JAX attention (independent of its hand-written backward).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import conformance_rings
import ring_jax
from ring_jax import testing
from ring_jax.testing import oracle

#: The cases the correct ring must pass (one of each class its bugs break, and more).
RING_CASES = ["causal", "first-last-hop", "segments-crossing", "masked-rows", "gqa",
              "odd-ring", "sinks+10", "sinks-10", "sinks-masked-rows"]


def test_case_names_are_stable_and_listed():
  """Names are the kit's interface (CLI --cases, result files, CI): renaming one is a
  breaking change, so the list is spelled out here."""
  assert testing.case_names() == [
      "full", "causal", "causal-zigzag", "causal-striped", "zigzag", "striped",
      "in-layout-zigzag", "in-layout-striped", "first-last-hop", "window-short",
      "window-zigzag", "window-two-sided", "segments-crossing", "segments-zigzag",
      "segments-striped", "masked-rows", "gqa", "mqa-causal", "t-ne-s", "value-head-dim",
      "ring1", "ring2-causal-zigzag", "ring2-segments-striped", "ring2-t-ne-s", "odd-ring",
      "odd-ring-zigzag", "ring8", "tensor2", "explicit-mesh", "sinks+10", "sinks-10",
      "sinks-masked-rows", "soft-cap", "value-head-dim-sinks-cap", "value-head-dim-ring8",
      "bf16", "bf16-growth", "f32-growth", "bf16-growth-variants"]
  assert set(testing.CI_CASES) <= set(testing.CASES)
  assert set(testing.HOP_CASES) <= set(testing.CASES)
  assert all(c.catches for c in testing.CASES.values())
  with pytest.raises(ValueError, match="unknown case.*'nope'.*the cases are: full, causal"):
    testing.select(["nope"])


def test_tolerance_follows_the_dtype():
  assert testing.tolerance(jnp.float32) == 2.0 ** -16
  assert testing.tolerance(jnp.bfloat16) == 2.0 ** -7
  assert testing.tolerance(jnp.float16) == 2.0 ** -10


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "striped"])
@pytest.mark.parametrize("ring", [1, 3, 4])
def test_layout_order_agrees_with_the_library(layout, ring):
  """The kit derives layout order on its own; it must be the order ring_jax documents."""
  np.testing.assert_array_equal(oracle.layout_permutation(layout, ring, 12 * ring),
                                ring_jax.layout_positions(layout, ring, 12 * ring))


def _dense64(q, k, v, vis, scale, sinks, cap):
  """Dense float64 attention in JAX with sinks as an extra score column (autodiff'd)."""
  g = q.shape[2] // k.shape[2]
  kr, vr = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
  s = jnp.einsum("btnh,bsnh->bnts", q, kr) * scale
  s = cap * jnp.tanh(s / cap)
  s = jnp.where(vis[:, None], s, -jnp.inf)
  z = jnp.broadcast_to(sinks[None, :, None, None], s.shape[:3] + (1,))
  lse = jax.nn.logsumexp(jnp.concatenate([s, z], -1), axis=-1)
  p = jnp.exp(s - lse[..., None])
  return jnp.einsum("bnts,bsnh->btnh", p, vr), lse.transpose(0, 2, 1)


def test_oracle_gradients_match_autodiff():
  """The oracle's hand-written backward (GQA, Dv != D, windows, segments, sinks, soft-cap,
  an lse cotangent) against jax.grad of a dense float64 attention."""
  rng = np.random.default_rng(0)
  b, t, n, kh, h, hv = 2, 24, 4, 2, 8, 6
  q, k = rng.normal(size=(b, t, n, h)) * 2, rng.normal(size=(b, t, kh, h))
  v, do = rng.normal(size=(b, t, kh, hv)), rng.normal(size=(b, t, n, hv))
  dlse, sinks = rng.normal(size=(b, t, n)), rng.normal(size=n) * 3
  seg = np.repeat([[1, 2, 3]], b, 0).repeat(8, 1)
  vis = oracle.visibility(np.arange(t), np.arange(t), True, (5, 0), seg, seg)
  want = oracle.attention(q, k, v, vis, 0.4, do, dlse, sinks, soft_cap=3.0)
  with jax.enable_x64(True):
    def loss(q, k, v, z):
      out, lse = _dense64(q, k, v, jnp.asarray(vis), 0.4, z, 3.0)
      return jnp.sum(out * do) + jnp.sum(lse * dlse), (out, lse)
    (_, (out, lse)), grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(
        *(jnp.asarray(x, jnp.float64) for x in (q, k, v, sinks)))
  for name, got in zip(("out", "lse", "dq", "dk", "dv", "dsinks"), (out, lse, *grads)):
    np.testing.assert_allclose(want[name], np.asarray(got), rtol=1e-10, atol=1e-12,
                               err_msg=name)


def test_oracle_rows_with_no_visible_key():
  """0 output, -inf lse, no gradient; with a sink: 0 output, lse = the sink."""
  rng = np.random.default_rng(1)
  q, k, v, do = (rng.normal(size=(1, 4, 2, 4)) for _ in range(4))
  seg = np.array([[0, 1, 1, 0]])
  vis = oracle.visibility(np.arange(4), np.arange(4), False, None, seg, seg)
  r = oracle.attention(q, k, v, vis, 0.5, do, np.ones((1, 4, 2)))
  assert (r["out"][:, [0, 3]] == 0).all() and np.isneginf(r["lse"][:, [0, 3]]).all()
  assert (r["dq"][:, [0, 3]] == 0).all() and (r["dk"][:, [0, 3]] == 0).all()
  r = oracle.attention(q, k, v, vis, 0.5, do, None, sinks=np.array([2.0, -3.0]))
  assert (r["out"][:, [0, 3]] == 0).all()
  np.testing.assert_array_equal(r["lse"][0, [0, 3]], [[2.0, -3.0]] * 2)


def test_correct_ring_passes():
  report = testing.run(conformance_rings.simple_ring, RING_CASES + ["causal-zigzag"])
  status = {r.case: r.status for r in report.rows}
  assert status == {**dict.fromkeys(RING_CASES, testing.PASS),
                    "causal-zigzag": testing.NOT_SUPPORTED}, report.table()
  assert report.ok
  assert report.rows[-1].message == "takes no layout"
  sinks = next(r for r in report.rows if r.case == "sinks+10")
  assert set(sinks.errors) == {"out", "dq", "dk", "dv", "dsinks"}


@pytest.mark.parametrize("bug", list(conformance_rings.BUGS))
def test_each_broken_ring_fails_naming_its_case(bug):
  case = conformance_rings.BUGS[bug]
  report = testing.run(conformance_rings.broken(bug), [case])
  assert not report.ok, report.table()
  [row] = report.rows
  assert row.status == testing.FAIL and min(row.errors.values()) >= 0
  assert max(row.errors.values()) > 100 * row.tolerance, row
  assert report.failures().startswith(f"FAIL {case} (ring 4): ")


def test_a_raising_or_misshaped_function_fails_its_case_and_the_run_goes_on():
  calls = []

  def picky(query, key, value, *, is_causal, scale, mesh, segment_ids=None):
    calls.append(is_causal)
    if segment_ids is not None:
      raise NotImplementedError("no segments here\nsecond line")
    out = conformance_rings.simple_ring(query, key, value, is_causal=is_causal, scale=scale,
                                        mesh=mesh)
    return out if is_causal else out[:, :, :1]

  report = testing.run(picky, ["masked-rows", "full", "causal"])
  assert [(r.case, r.status) for r in report.rows] == [
      ("masked-rows", testing.FAIL), ("full", testing.FAIL), ("causal", testing.PASS)]
  assert report.rows[0].message.startswith("NotImplementedError: no segments here (")
  assert "returned shape (2, 256, 1, 32), expected (2, 256, 4, 32)" in report.rows[1].message
  assert not report.ok and len(report.failures().splitlines()) == 2
  assert len(calls) == 3


def test_cli_sets_devices_exits_nonzero_on_failure_and_needs_no_flax():
  """The CLI as a user runs it, in a fresh process that cannot import Flax or pytest and
  has no fake-device flag of its own: the correct ring exits 0, a broken one 1, naming
  the case."""
  script = textwrap.dedent("""
      import sys
      sys.modules["flax"] = None      # importing either now raises ImportError
      sys.modules["pytest"] = None
      from ring_jax.testing.__main__ import main
      ok = main(["conformance_rings:simple_ring", "--cases", "causal,soft-cap"])
      bad = main(["conformance_rings:drop_last_hop", "--cases", "causal"])
      import jax
      print("RESULT", ok, bad, jax.device_count())
  """)
  env = dict(os.environ)
  env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                              if "force_host_platform_device_count" not in f)
  env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(ring_jax.__file__)),
                                       env.get("PYTHONPATH", "")])
  proc = subprocess.run([sys.executable, "-c", script],
                        cwd=os.path.dirname(conformance_rings.__file__), env=env,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "RESULT 0 1 8" in proc.stdout, proc.stdout[-3000:]
  assert "soft-cap" in proc.stdout and "takes no logits_soft_cap" in proc.stdout
  assert "FAIL causal (ring 4): out " in proc.stderr


def test_a_hop_kernel_runs_as_the_ring():
  """run() takes a HopKernel: the ring with that kernel at every hop (here with lse)."""
  report = testing.run(ring_jax.XlaHopKernel(), ["ring2-t-ne-s"])
  assert report.function == "HopKernel xla"
  [row] = report.rows
  assert row.status == testing.PASS, row
  assert set(row.errors) == {"out", "lse", "dq", "dk", "dv"}
