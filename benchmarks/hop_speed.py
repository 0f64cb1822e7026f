"""Quick interleaved comparison of two XLA hop kernels in the full ring (CPU, fake devices).

Runs ``ring_attention`` fwd+bwd on a ring of ``--ring`` fake CPU devices with the
current :class:`ring_jax.XlaHopKernel` and with a baseline kernel loaded from a git
revision of ``ring_jax/kernels/xla.py`` (default: the pair-list kernel of the "SEAM:"
commit), alternating the two ``--repeats`` times and reporting the best process CPU time
of each (process CPU time, ``benchmarks.common.timed_call``: on a shared machine CPU time is steadier than wall time;
all fake devices share this process's threads). Also prints the per-device fwd+bwd temp
memory from ``memory_analysis()``. This is the short check; ``benchmarks/attention.py``
has the full comparison with the paper's code.

  PYTHONPATH=. python benchmarks/hop_speed.py --length 4096 --ring 8 --repeats 5
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import inspect
import os
import subprocess
import sys
import tempfile
from typing import ClassVar


def _load_baseline(rev: str):
  src = subprocess.run(["git", "show", f"{rev}:ring_jax/kernels/xla.py"], check=True,
                       capture_output=True, text=True).stdout
  path = os.path.join(tempfile.mkdtemp(), "baseline_xla.py")
  with open(path, "w") as f:
    f.write(src)
  spec = importlib.util.spec_from_file_location("baseline_xla", path)
  mod = importlib.util.module_from_spec(spec)
  sys.modules["baseline_xla"] = mod  # dataclasses look their module up there
  spec.loader.exec_module(mod)
  kernel = mod.XlaHopKernel()
  params = len(inspect.signature(kernel.backward).parameters)
  if params in (9, 12):  # residuals (and accumulators) as separate positional arrays
    return _OldProtocol(kernel, accumulates=params == 12)
  return kernel


@dataclasses.dataclass(frozen=True)
class _OldProtocol:
  """A kernel of an older revision adapted to today's protocol: its backward took the
  residuals ``out, lse, do, dlse`` (and, later, the accumulators ``dq, dk, dv``) as separate
  positional arrays; before the accumulators it returned the hop's gradients alone."""
  inner: object
  accumulates: bool
  name: ClassVar[str] = "baseline"

  def check(self, *a):
    return self.inner.check(*a)

  def forward(self, *a):
    return self.inner.forward(*a)

  def backward(self, q, k, v, masks, spec, res, acc):
    from ring_jax.hop import HopGrads
    if self.accumulates:
      return HopGrads(*self.inner.backward(q, k, v, *res, masks, spec, *acc))
    gq, gk, gv = self.inner.backward(q, k, v, *res, masks, spec)
    return HopGrads(acc.dq + gq, acc.dk + gk, acc.dv + gv)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--length", type=int, default=4096)
  p.add_argument("--ring", type=int, default=8)
  p.add_argument("--heads", type=int, default=8)
  p.add_argument("--head-dim", type=int, default=64)
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--baseline-rev", default="102b3ae")
  p.add_argument("--memory-length", type=int, default=16384,
                 help="length for the temp-memory comparison (0: skip)")
  args = p.parse_args(argv)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             f" --xla_force_host_platform_device_count={args.ring}").strip()
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import PartitionSpec as P
  import ring_jax
  from benchmarks import common
  from benchmarks.common import MIB

  mesh = common.make_mesh((args.ring,), ("sequence",))
  kernels = {"new": ring_jax.XlaHopKernel(), "old": _load_baseline(args.baseline_rev)}
  spec = P(None, "sequence")

  def step(kernel, is_causal, layout):
    fn = jax.shard_map(functools.partial(ring_jax.ring_attention, axis_name="sequence",
                                         is_causal=is_causal, layout=layout, hop_kernel=kernel),
                       mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
    return jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v)), argnums=(0, 1, 2)))

  rng = np.random.default_rng(0)
  shape = (1, args.length, args.heads, args.head_dim)
  q, k, v = (jnp.asarray(rng.normal(size=shape), jnp.float32) for _ in range(3))
  for name, is_causal, layout in (("causal zigzag", True, "zigzag"),
                                  ("non-causal", False, "contiguous")):
    fns = {kn: step(kern, is_causal, layout) for kn, kern in kernels.items()}
    ref = None
    for kn, f in fns.items():  # compile + warm up, and check the two agree
      got = jax.block_until_ready(f(q, k, v))
      if ref is None:
        ref = got
      else:
        err = max(float(jnp.abs(a - b).max() / jnp.abs(b).max()) for a, b in zip(got, ref))
        assert err < 1e-4, err
    best = {kn: float("inf") for kn in fns}
    for _ in range(args.repeats):
      for kn, f in fns.items():
        best[kn] = min(best[kn], common.timed_call(f, q, k, v)[1])  # process CPU seconds
    print(f"{name:14s} L={args.length} ring={args.ring}: new {best['new']:.3f}s  "
          f"old {best['old']:.3f}s  new/old {best['new'] / best['old']:.3f}", flush=True)
    if args.memory_length:
      st = jax.ShapeDtypeStruct((1, args.memory_length, args.heads, args.head_dim),
                                jnp.float32)
      mem = {}
      for kn, kern in kernels.items():
        fn = jax.shard_map(functools.partial(ring_jax.ring_attention, axis_name="sequence",
                                             is_causal=is_causal, layout=layout,
                                             hop_kernel=kern),
                           mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
        g = jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v)), argnums=(0, 1, 2)))
        mem[kn] = common.compiled_memory(g.lower(st, st, st).compile())["temp_size_in_bytes"] / MIB
      print(f"{'':14s} fwd+bwd temp per device at L={args.memory_length}, "
            f"{args.heads} heads: new {mem['new']:.1f} MiB  old {mem['old']:.1f} MiB",
            flush=True)


if __name__ == "__main__":
  sys.exit(main())
