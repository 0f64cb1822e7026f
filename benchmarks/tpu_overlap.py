"""Ring transfers in flight during block compute, in the TPU compiler's schedule (no TPU needed).

Compiles ``ring_attention_sharded`` fwd+bwd (``jax.value_and_grad`` of a sum of squares)
deviceless for a TPU slice (docs/performance.md, "Ring transfers on the TPU compiler") and
records per configuration a row of :func:`measure`. Nothing runs; compile seconds are this
host's (shared CPUs: indicative only).

    ALLOW_MULTIPLE_LIBTPU_LOAD=1 python benchmarks/tpu_overlap.py \\
        --topology v5p:2x2x1 --length 32768 --out benchmarks/results/tpu_overlap_v5p.json

Configurations (``--configs``, default :data:`CONFIGS`): ``<layout>-<causal|full>`` and
``+<suffix>``es: a keyword of the ring (:data:`RING_KW`, a hop kernel's name included; default
``xla``), ``+segments`` (an int32 ``segment_ids [B, L]`` argument), ``+gqa`` (a quarter as many
K/V heads), ``+sinks`` (a float32 ``sinks [heads]`` argument, differentiated too), ``+dv`` (V
and the output with head dim ``--value_head_dim``), ``+one_loop`` / ``+peeled`` (every hop of a
flat full rotation in one loop for every hop kernel / for none:
``ring_jax.ring.PLATFORM_DEFAULTS["tpu"]`` for that compile, loop kept however few its hops);
``two_level-<layout>-<mask>``: outer 2 x inner ring over the rest of the chips (mesh data=1 x
outer x inner; else data=1 x sequence=chips). A peer on the same compiler:
``tokamax_ring-<mask>`` (:func:`tokamax_ring`; jax >= 0.11, ``tokamax==0.0.17``), ``+block512``
(its blocks 512), ``+dq3`` (``dq_reduction_steps=3``). ``--repeats N``: N compiles each, in N
rounds over all configurations, median wall and process-CPU seconds. ``--hop-kernel
xla,splash``: every configuration once per hop kernel (its ``config`` gains ``+<kernel>``;
docs/performance.md, "Splash hop memory on the TPU compiler").
"""

from __future__ import annotations

import datetime
import os
import sys
from unittest import mock

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ring_jax  # noqa: E402
from benchmarks import common  # noqa: E402
from ring_jax import analysis, topology  # noqa: E402

#: The hop kernels that compile for a TPU: "xla" and the registry's TPU kernels.
HOP_KERNELS = ("xla", *(k for k, p in ring_jax.kernels.PLATFORM.items() if p == "tpu"))
#: The ``+<suffix>``es that set a keyword of ``ring_attention_sharded``.
RING_KW = {"routed": dict(causal_routing=True), "unrouted": dict(causal_routing=False),
           "overlap_dkv": dict(overlap_dkv=True), "inplace_dkv": dict(overlap_dkv=False),
           "inlayout": dict(inputs_in_layout=True), "window": dict(local_window_size=(4096, 0)),
           "softcap": dict(logits_soft_cap=50.0), **{k: dict(hop_kernel=k) for k in HOP_KERNELS}}
CONFIGS = ("zigzag-causal", "zigzag-causal+inplace_dkv", "zigzag-full", "contiguous-causal",
           "contiguous-causal+routed", "zigzag-causal+splash", "zigzag-causal+routed",
           "two_level-zigzag-causal", "two_level-zigzag-causal+inplace_dkv")


def build(config: str, devices, length: int, heads: int, head_dim: int,
          block: int | None = None, value_head_dim: int = 128):
  """A function of no arguments returning one configuration's fwd+bwd (``block``: block_q =
  block_kv, None: the default) compiled: ``jit(...).lower().compile()`` of what is built here
  first, so that timing it times the compile alone."""
  parts = config.split("+")
  words = parts[0].split("-")
  if words[0] == "tokamax_ring":
    jitted, args = tokamax_ring(parts, words[-1] == "causal", devices, length, heads, head_dim)
    return lambda: jitted.lower(*args).compile()
  kw = dict(is_causal=words[-1] == "causal", layout=words[-2], hop_kernel="xla", block_q=block,
            block_kv=block)
  for part in parts[1:]:
    kw.update(RING_KW.get(part, {}))
  n = len(devices)
  if words[0] == "two_level":
    shape, axes, seq = (1, 2, n // 2), ("data", "outer", "inner"), ("outer", "inner")
  else:
    shape, axes, seq = (1, n), ("data", "sequence"), "sequence"
  mesh = jax.sharding.Mesh(np.asarray(devices).reshape(shape), axes)
  sharded = lambda shape, dtype, *spec: jax.ShapeDtypeStruct(  # noqa: E731
      shape, dtype, sharding=jax.sharding.NamedSharding(mesh, jax.P(*spec)))
  kv_heads = heads // 4 if "gqa" in parts else heads
  x, xkv, xv = (sharded((1, length, h, d), jnp.bfloat16, "data", seq, None, None)
                for h, d in ((heads, head_dim), (kv_heads, head_dim),
                             (kv_heads, value_head_dim if "dv" in parts else head_dim)))
  sinks = sharded((heads,), jnp.float32) if "sinks" in parts else None
  seg = sharded((1, length), jnp.int32, "data", seq) if "segments" in parts else None

  def loss(q, k, v, sinks, seg):
    out = ring_jax.ring_attention_sharded(q, k, v, mesh=mesh, seq_axis=seq, segment_ids=seg,
                                          sinks=sinks, **kw)
    return jnp.sum(out.astype(jnp.float32) ** 2)

  argnums = (0, 1, 2, 3) if sinks is not None else (0, 1, 2)
  jitted = jax.jit(jax.value_and_grad(loss, argnums=argnums))

  loop = (dict(one_loop=HOP_KERNELS if "one_loop" in parts else (), unroll_hops=0)
          if "one_loop" in parts or "peeled" in parts else {})  # the ring's own loop, kept

  def compile_():
    with mock.patch.dict(ring_jax.ring.PLATFORM_DEFAULTS["tpu"], loop):  # then as shipped
      return jitted.lower(x, xkv, xv, sinks, seg).compile()

  return compile_


def tokamax_ring(parts, is_causal: bool, devices, length: int, heads: int, head_dim: int):
  """``(jitted fwd+bwd, its abstract arguments)`` of tokamax's TPU ring over all ``devices``
  (its layout: ``[heads, L, head_dim]``, the sequence split over the ring), as its own test
  builds it: its kernel's construction (``make_ring_attention``, the mask's metadata built on
  the host) is here, not in the timed compile."""
  from benchmarks.conformance import splash_module, tokamax_ring_kernel
  masks = splash_module("splash_attention_mask")
  n = len(devices)
  mesh = jax.sharding.Mesh(np.asarray(devices).reshape(1, n), ("heads", "ring"))
  mask = (masks.make_causal_mask((length, length)) if is_causal
          else masks.FullMask(_shape=(length, length)))
  extra = dict(dq_reduction_steps=3) if "dq3" in parts else {}
  kernel = tokamax_ring_kernel(mask, n, ring_axis="ring",
                               block=512 if "block512" in parts else None, **extra)
  spec = jax.P(None, "ring", None)
  attend = jax.shard_map(lambda kernel, q, k, v: kernel(q, k, v, None), mesh=mesh,
                         in_specs=(kernel.manual_sharding_spec(), spec, spec, spec),
                         out_specs=spec, check_vma=False)
  x = jax.ShapeDtypeStruct((heads, length, head_dim), jnp.bfloat16,
                           sharding=jax.sharding.NamedSharding(mesh, spec))

  def loss(q, k, v):
    return jnp.sum(attend(kernel, q, k, v).astype(jnp.float32) ** 2)

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))), (x, x, x)


def measure(config: str, compiled, times: dict, args) -> dict:
  """One result row: the ring's transfers and how many have block compute scheduled while in
  flight (:func:`ring_jax.analysis.overlap_report`), the memory per chip, the generated code
  size, the Mosaic custom calls and their distinct kernel bodies
  (:func:`ring_jax.analysis.mosaic_kernels`), the HLO's size, and the median compile seconds
  (``compile_s``, ``compile_cpu_s``: wall and process CPU) of ``times["wall"]`` / ``["cpu"]``."""
  report = analysis.overlap_report(compiled)
  hidden, total = report.ring()
  memory = common.compiled_memory(compiled, (*common.MEMORY_FIELDS, "generated_code_size_in_bytes"))
  text = compiled.as_text()
  parts = config.split("+")
  return {
      "config": config,
      "hop_kernel": "tokamax" if config.startswith("tokamax_ring") else next(
          (k for k in HOP_KERNELS if k in parts[1:]), "xla"),  # the one it names (+splash)
      "block": args.block, "heads": args.heads, "head_dim": args.head_dim,
      "value_head_dim": args.value_head_dim if "dv" in parts else args.head_dim,
      "kv_heads": args.heads // 4 if "gqa" in parts else args.heads,
      "compile_s": round(common.median(times["wall"]), 1),
      "compile_cpu_s": round(common.median(times["cpu"]), 1),
      **{f"{k}_mib": round(memory[f"{k}_size_in_bytes"] / common.MIB, 1)
         for k in ("temp", "argument", "output")},
      "code_mib": round(memory["generated_code_size_in_bytes"] / common.MIB, 2),
      "hlo_chars": len(text),
      "mosaic_calls": text.count(analysis.MOSAIC_CALL),
      "mosaic_kernels": len(analysis.mosaic_kernels(text)),
      "ring_in_flight": hidden,
      "ring_transfers": total,
      "kinds": {k: list(v) for k, v in report.kinds().items() if k.startswith("ring")},
      "exposed": sorted({f"{t.kind}: {t.scope}" for t in report.exposed()
                         if t.kind.startswith("ring")}),
  }


def main(argv=None):
  p = common.parser(__doc__, out="", repeats=1, length=32768, heads=8)
  p.add_argument("--topology", default="v5p:2x2x1")
  p.add_argument("--head_dim", type=int, default=128)
  p.add_argument("--value_head_dim", type=int, default=128,
                 help="V's head dim in configurations with +dv")
  p.add_argument("--block", type=int, default=None,
                 help="block_q = block_kv of the ring (default: the ring's default)")
  p.add_argument("--configs", default=",".join(CONFIGS))
  p.add_argument("--hop-kernel", default=None,
                 help=f"comma-separated hop kernels ({', '.join(HOP_KERNELS)}): each "
                      "configuration compiled once per kernel (default: as the config says)")
  p.add_argument("--label", default="", help="recorded with the rows (e.g. a commit)")
  args = p.parse_args(argv)
  configs = args.configs.split(",")
  if args.hop_kernel:
    kernels = args.hop_kernel.split(",")
    unknown = sorted(set(kernels) - set(HOP_KERNELS))
    if unknown:
      p.error(f"--hop-kernel: unknown {unknown}; choose from {', '.join(HOP_KERNELS)}")
    configs = [c if k == "xla" else f"{c}+{k}" for c in configs for k in kernels]
  devices = topology.devices(args.topology)
  # Rounds interleave the configurations (each built, untimed, then compiled once per round),
  # so a busy host slows every configuration alike and their ratios hold.
  built, compiled, errors = {}, {}, {}

  def before(config, _):
    built[config] = build(config, devices, args.length, args.heads, args.head_dim, args.block,
                          args.value_head_dim)

  def compile_(config):
    compiled[config] = built.pop(config)()

  times = common.interleaved(
      {c: (compile_, (c,)) for c in configs}, args.repeats, warmup=0, before=before,
      on_error=lambda config, e: errors.setdefault(config, common.error_line(e, 300)))
  rows = []
  for config in configs:
    row = ({"config": config, "error": errors[config]} if config in errors else
           measure(config, compiled[config], times[config], args))
    rows.append(row)
    print(row, flush=True)
  if args.out:
    import libtpu
    version = getattr(libtpu, "__version__", "?")
    common.write_result(args.out, {
        "about": "ring_attention_sharded fwd+bwd compiled deviceless for a TPU slice: ring "
                 "transfers with block compute in flight (ring_jax.analysis), temp per chip",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "jax": jax.__version__, "libtpu": version,
        "machine": f"CPU host, deviceless TPU compile ({args.topology}, libtpu {version})",
        "topology": args.topology, "length": args.length, "heads": args.heads,
        "head_dim": args.head_dim, "dtype": "bfloat16", "batch": 1, "label": args.label,
        "command": "python benchmarks/tpu_overlap.py " + " ".join(argv or sys.argv[1:]),
        "rows": rows})


if __name__ == "__main__":
  main()
