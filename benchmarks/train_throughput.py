"""Tokens/s and MFU of the shipped LLaMA train step (``training.step.build_train_step``, as
``train.py`` runs it) on random tokens, once per ``--attention`` backend named in
``models.attention.ATTENTION_BACKENDS`` (dense: full-sequence reference attention).

MFU = ``cfg.flops_per_token(L) * tokens/s / (devices * peak)``, remat recomputation not
counted; ``--peak-tflops`` per device, default :func:`peak_per_device`.

CPU example (8 fake devices, tiny model):
  PYTHONPATH=. python benchmarks/train_throughput.py --preset tiny --seq-len 2048 \\
      --mesh data=1,sequence=8,tensor=1 --attention ring,dense,all_gather
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import common  # noqa: E402
from ring_jax import hardware  # noqa: E402

common.fake_cpu_devices()

#: The model sizes a flag may override (``--dim`` ...), else the preset's.
MODEL_FIELDS = ("vocab_size", "dim", "num_layers", "num_heads", "num_kv_heads", "mlp_dim")
PRESETS = {"tiny": dict(vocab_size=256, dim=256, num_layers=2, num_heads=8, num_kv_heads=8,
                        mlp_dim=512)}


def peak_per_device(n_devices: int, tflops: float | None = None) -> tuple[float, str]:
  """``(peak FLOP/s per device, its source)``: ``tflops`` if given, else the device kind's
  dense bf16 peak (``ring_jax.hardware``), else on CPU the measured f32 matmul rate of this
  host / ``n_devices``; NaN for an accelerator of unknown peak."""
  if tflops:
    return tflops * 1e12, "given"
  kind = jax.devices()[0].device_kind
  spec = hardware.device_spec(kind)
  if spec is not None:
    return spec.peak_bf16_flops, f"{kind}: {spec.source}"
  if jax.default_backend() == "cpu":
    n = 1024
    a = jnp.ones((n, n), jnp.float32)
    ts = common.time_calls(jax.jit(lambda a: a @ a), (a,), repeats=5)
    return 2 * n ** 3 / min(ts) / n_devices, "measured f32 matmul rate of this CPU / devices"
  return float("nan"), f"unknown device {kind}: pass its peak (--peak-tflops, GPU_PEAK_TFLOPS)"


def time_train_step(cfg, mesh, b, length, steps, peak):
  """The shipped train step of ``cfg`` on ``mesh`` (``training.step.build_train_step``),
  ``b`` rows of ``length`` tokens: median step seconds of ``steps`` after a warm-up,
  tokens/s, model TFLOP/s, MFU against ``peak`` FLOP/s per device (None: no MFU), compile
  seconds, compiled temp bytes per device, the last loss."""
  from models import sharding as shd
  from training import batch as batch_lib
  from training import step as step_lib

  tx = step_lib.make_optimizer(common.OPTIM, total_steps=steps + 1)
  train_step = step_lib.build_train_step(cfg, mesh, tx)
  state = dict(zip(("params", "opt_state"), train_step.init_state()))
  host = batch_lib.random_documents(0, b, length, cfg.vocab_size, cfg.layout,
                                    shd.ring_size(mesh.shape))
  batch = jax.device_put(host, batch_lib.shardings(mesh))
  compile_s, _, compiled = common.timed_call(train_step.compile, (b, length), state["params"],
                                            state["opt_state"])
  temp = common.compiled_memory(compiled).get("temp_size_in_bytes")
  if temp and jax.default_backend() == "cpu":
    # CPU "devices" share host RAM: refuse what would not fit (the dense backend at long
    # L replicates the full [L, L] scores on every device of the sequence axis).
    avail = common.host_memory_available()
    if avail and temp * mesh.devices.size > 0.6 * avail:
      raise MemoryError(f"OOM(est): compiled temp {temp / 2**30:.1f} GiB/device x "
                        f"{mesh.devices.size} devices > 60% of {avail / 2**30:.1f} GiB free")

  def one_step():
    state["params"], state["opt_state"], state["metrics"] = compiled(
        state["params"], state["opt_state"], batch)
    return state["metrics"]

  with jax.set_mesh(mesh):
    ts = common.time_calls(one_step, repeats=steps)
  dt = common.median(ts)
  tps = b * length / dt
  flops = cfg.flops_per_token(length) * tps
  return dict(seq_len=length, batch=b, step_s=dt, step_times_s=ts,
              tokens_per_s=tps, model_tflops_per_s=flops / 1e12,
              mfu=flops / (mesh.devices.size * peak) if peak else None,
              compile_s=round(compile_s, 1),
              temp_bytes_per_device=temp, loss=float(state["metrics"]["loss"]),
              params=cfg.num_params(), config=cfg.to_dict())


def main(argv=None):
  from models.llama import LlamaConfig

  ap = common.parser(__doc__, out="", mesh="data=1,sequence=8,tensor=1")
  ap.add_argument("--dtype", default=None, help="compute dtype (default f32 on CPU, bf16 else)")
  ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
  for k in MODEL_FIELDS:
    ap.add_argument(f"--{k.replace('_', '-')}", type=int, default=None)
  ap.add_argument("--seq-len", type=int, default=2048)
  ap.add_argument("--batch", type=int, default=1)
  ap.add_argument("--attention", default="ring,dense,all_gather")
  ap.add_argument("--layout", default="zigzag")
  ap.add_argument("--remat", default="full")
  ap.add_argument("--steps", type=int, default=3)
  ap.add_argument("--peak-tflops", type=float, default=None, help="per device")
  args = ap.parse_args(argv)
  if args.dtype is None:
    args.dtype = "float32" if jax.default_backend() == "cpu" else "bfloat16"
  mesh = common.make_mesh(args.mesh)
  peak, peak_src = peak_per_device(mesh.devices.size, args.peak_tflops)
  print(f"jax {jax.__version__} {jax.default_backend()} mesh {args.mesh}; peak/device "
        f"{peak / 1e12:.3g} TFLOP/s ({peak_src}); preset {args.preset}, L={args.seq_len}, "
        f"B={args.batch}, layout {args.layout}, remat {args.remat}, {args.dtype}", flush=True)
  print(f"{'attention':<10} {'step ms':>9} {'tokens/s':>10} {'TFLOP/s':>8} {'MFU':>7} "
        f"{'temp MiB/dev':>12} {'loss':>7}", flush=True)
  sizes = dict(PRESETS[args.preset], **{k: getattr(args, k) for k in MODEL_FIELDS
                                         if getattr(args, k)})
  results = []
  for backend in args.attention.split(","):
    try:
      cfg = LlamaConfig(**sizes, attention=backend, layout=args.layout, remat_policy=args.remat,
                        dtype=args.dtype, param_dtype="float32")
      r = dict(attention=backend, **time_train_step(cfg, mesh, args.batch, args.seq_len,
                                                    args.steps, peak))
      print(f"{backend:<10} {1e3 * r['step_s']:>9.1f} {r['tokens_per_s']:>10.1f} "
            f"{r['model_tflops_per_s']:>8.3f} {r['mfu']:>7.1%} "
            f"{(r['temp_bytes_per_device'] or 0) / 2**20:>12.1f} {r['loss']:>7.3f}", flush=True)
    except Exception as e:  # noqa: BLE001
      r = dict(attention=backend, error=common.error_line(e, 300))
      print(f"{backend:<10} FAILED: {r['error']}", flush=True)
    results.append(r)
  common.save(args.out, dict(meta=common.run_meta(
      argv, __file__, mesh=args.mesh, peak_per_device=peak, peak_source=peak_src),
      results=results))
  return results


if __name__ == "__main__":
  main()
