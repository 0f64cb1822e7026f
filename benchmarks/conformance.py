"""The conformance kit's full matrix (ring_jax.testing) on ring_jax and on its peers.

    python benchmarks/conformance.py              # ring_jax's ring, all-gather, Ulysses
    python benchmarks/conformance.py --peers      # + the peers' adapters, where importable
    python benchmarks/conformance.py --targets ring --cases causal,gqa

Per target, its table (each case's verdict, each quantity's error against the float64 oracle)
is printed and written with the run's provenance to
``benchmarks/results/conformance_<target>.json`` (docs/conformance.md). 8 fake CPU devices.
"""

import functools
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # read when jax is imported
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchmarks import common  # noqa: E402

common.fake_cpu_devices()
# A correctness run of ~100 small programs: compile at LLVM -O0, as tests/conftest.py does
# (the same HLO and arithmetic, machine code that is slower to run and faster to produce).
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"

import ring_jax  # noqa: E402
from ring_jax import testing  # noqa: E402

#: The kit's tokens per device (a peer whose kernels need more says so in its adapter).
LOCAL_LEN = 64
#: ring_jax's own entry points in the kit's convention (blocks of 16: 4 per shard).
_BLOCKS = dict(block_q=16, block_kv=16)
OWN = {"ring": functools.partial(ring_jax.ring_attention_sharded, **_BLOCKS),
       **{name: functools.partial(ring_jax.attention_sharded, strategy=name, **_BLOCKS)
          for name in ("all_gather", "ulysses")}}
#: What ring_jax's own entry points declare beyond their keywords: V's own head size.
OWN_FEATURES = {name: ("value_head_dim",) for name in OWN}


def targets(names, peers: bool) -> dict:
  """``{name: (fn, tokens per device, declared features)}`` of ``names`` (of :data:`OWN`) and,
  with ``peers``, of every peer adapter importable here (the others named as not run)."""
  found = {n: (OWN[n], LOCAL_LEN, OWN_FEATURES.get(n, ())) for n in names}
  if peers:
    from benchmarks import conformance_peers as cp  # noqa: PLC0415
    found.update({n: (fn, cp.LOCAL_LEN.get(n, LOCAL_LEN), cp.FEATURES.get(n, ()))
                  for n, fn in cp.available().items()})
    for name in sorted(set(cp.PEERS) - set(found)):
      print(f"# {name}: not importable here, not run", flush=True)
  return found


def main(argv=None):
  ap = common.parser(__doc__)
  ap.add_argument("--targets", type=common.strs, default=list(OWN), help=f"of {list(OWN)}")
  ap.add_argument("--peers", action="store_true", help="also the peers' adapters")
  ap.add_argument("--cases", type=common.strs, help="comma-separated case names (default: all)")
  ap.add_argument("--out-dir", default=common.RESULTS, help="'' to write nothing")
  args = ap.parse_args(argv)
  failed = {}
  for name, (fn, local_len, features) in targets(args.targets, args.peers).items():
    report = testing.run(fn, args.cases or None, name=name, local_len=local_len, features=features,
                         progress=lambda r: print(f"  {r.case:24s} {r.status}", flush=True))
    print(report.table(), flush=True)
    failed[name] = [r.case for r in report.failed]
    path = os.path.join(args.out_dir, f"conformance_{name}.json") if args.out_dir else ""
    common.save(path, dict(meta=common.run_meta(argv, __file__, local_len=local_len),
                           **report.to_dict()))
  print("\nfailed cases:", failed)
  return failed


if __name__ == "__main__":
  main()
