"""Figures for the ring_jax core: accuracy vs a float64 oracle, memory, causal work.

    python benchmarks/core_report.py     # 8 fake CPU devices, ~2 minutes on 2 cores

Three tables, printed and written to ``--out`` (results/core_report_cpu.json): the max
relative error of the output and of dQ/dK/dV against the dense float64 oracle per case;
per-device compiled fwd+bwd temp bytes per local length; causal block pairs per device per
layout (``ring_jax.schedule``).
"""

import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ring_jax  # noqa: E402
from benchmarks import common  # noqa: E402

common.fake_cpu_devices()


def segments(b, length, rng):
  """``[b, length]`` segment ids: per row segments 1..4 cut at random, the last 1/8 padding (0)."""
  seg = np.zeros((b, length), np.int32)
  for r in range(b):
    cuts = np.sort(rng.choice(np.arange(1, length), 3, replace=False))
    for i, (s, e) in enumerate(zip([0, *cuts], [*cuts, length - length // 8])):
      seg[r, s:e] = i + 1
  return seg


def accuracy_table():
  print("\n## 1. Error vs float64 dense oracle (max |err| / max |ref|), float32 inputs")
  print(f"{'case':44s} {'out':>9s} {'dq':>9s} {'dk':>9s} {'dv':>9s}")
  rng = np.random.default_rng(0)
  cases = [dict(n=4, layout=layout, causal=causal, seg=seg, heads=(4, 2))
           for layout in ring_jax.LAYOUTS for causal in (False, True) for seg in (False, True)]
  cases += [dict(n=n, layout=layout, causal=True, seg=True, heads=(4, 2))
            for n, layout in [(1, "contiguous"), (2, "zigzag"), (3, "zigzag"), (3, "striped"),
                              (8, "zigzag"), (8, "striped"), (8, "contiguous")]]
  cases.append(dict(n=8, layout="zigzag", causal=True, seg=True, heads=(4, 1)))  # MQA
  cases.append(dict(n=4, layout="zigzag", causal=True, seg=False, heads=(4, 4), tp=2))
  cases.append(dict(n=4, layout="zigzag", causal=True, seg=False, heads=(4, 1), tp=2))
  rows = []
  for c in cases:
    n, (nh, kh), tp = c["n"], c["heads"], c.get("tp", 1)
    length, b = 48 * n, 2
    mesh = common.make_mesh((tp, n), ("tensor", "sequence")) if tp > 1 else common.ring_mesh(n)
    q, k, v = (rng.normal(size=(b, length, h, 16)).astype(np.float32) for h in (nh, kh, kh))
    cot = rng.normal(size=q.shape).astype(np.float32)
    seg = segments(b, length, rng) if c["seg"] else None
    ring = functools.partial(ring_jax.ring_attention_sharded, mesh=mesh, is_causal=c["causal"],
                             segment_ids=seg, layout=c["layout"], block_q=8, block_kv=8)

    got = jax.jit(common.fwd_bwd(ring))(q, k, v, cot)
    with jax.enable_x64(True):
      ref = functools.partial(ring_jax.reference_attention, is_causal=c["causal"],
                              segment_ids=seg)
      want = [np.asarray(w) for w in common.fwd_bwd(ref)(
          *(jnp.asarray(x, jnp.float64) for x in (q, k, v, cot)))]
    errs = [np.abs(np.asarray(g, np.float64) - w).max() / np.abs(w).max()
            for g, w in zip(got, want)]
    name = (f"ring={n} tp={tp} {c['layout']} {'causal' if c['causal'] else 'full'}"
            f"{' +seg' if c['seg'] else ''} N={nh} K={kh}")
    print(f"{name:44s} " + " ".join(f"{e:9.2e}" for e in errs))
    rows.append(dict(case=name, ring=n, tensor=tp, layout=c["layout"], causal=c["causal"],
                     segments=c["seg"], heads=nh, kv_heads=kh,
                     **{k: float(e) for k, e in zip(("out", "dq", "dk", "dv"), errs)}))
  return rows


def memory_table():
  print("\n## 2. Per-device temp bytes, fwd+bwd, ring=8, 4 heads x 64, causal zigzag, f32, "
        "blocks 256")
  print(f"{'local len':>10s} {'global len':>11s} {'temp MiB':>9s} {'x prev':>7s} "
        f"{'[L/n]^2 scores/head MiB':>24s}")
  n, prev, rows = 8, None, []
  spec = jax.P(None, "sequence", None, None)
  for local in (512, 1024, 2048):
    fn = jax.shard_map(functools.partial(ring_jax.ring_attention, axis_name="sequence",
                                         is_causal=True, layout="zigzag", block_q=256,
                                         block_kv=256),
                       mesh=common.ring_mesh(n), in_specs=(spec,) * 3, out_specs=spec)
    shape = jax.ShapeDtypeStruct((1, n * local, 4, 64), jnp.float32)
    temp = common.temp_bytes(jax.grad(lambda q, k, v: fn(q, k, v).sum(), argnums=(0, 1, 2)),
                             shape, shape, shape)
    ratio = f"{temp / prev:7.2f}" if prev else f"{'':7s}"
    print(f"{local:10d} {n * local:11d} {temp / 2**20:9.2f} {ratio} "
          f"{local * local * 4 / 2**20:24.1f}")
    rows.append(dict(local_len=local, global_len=n * local, temp_bytes=int(temp)))
    prev = temp
  return dict(ring=n, heads=4, head_dim=64, layout="zigzag", causal=True, dtype="float32",
              block=256, rows=rows)


def work_table():
  print("\n## 3. Causal work: block pairs per device over a ring pass (ring=8, local 4096, "
        "blocks 512)")
  rows = []
  for layout in ring_jax.LAYOUTS:
    s = ring_jax.schedule(layout, 8, 4096, 512, 512, True)
    w = s.work_per_device()
    print(f"{layout:11s} per device {w.tolist()}  max/mean {w.max() / w.mean():.2f}  "
          f"critical path {s.critical_path()} pairs")
    rows.append(dict(layout=layout, work_per_device=[int(x) for x in w],
                     critical_path=int(s.critical_path())))
  return dict(ring=8, local_len=4096, block=512, causal=True, rows=rows)


def main(argv=None):
  args = common.parser(__doc__, out="core_report_cpu.json").parse_args(argv)
  print(f"jax {jax.__version__}, {jax.device_count()} {jax.devices()[0].platform} devices")
  return common.save(args.out, dict(meta=common.run_meta(argv, __file__),
                                    accuracy=accuracy_table(), memory=memory_table(),
                                    work=work_table()))


if __name__ == "__main__":
  main()
