"""Tokens/s and MFU of the LLaMA train step: ring vs dense vs all-gather attention.

Builds ``models.llama`` with ``create_sharded_model`` on a ``(data, sequence,
tensor)`` mesh, and times a jitted AdamW train step (forward, backward,
update; params and optimizer state donated) on random tokens in the model's
layout order. Attention backends:

  ring       ``cfg.attention="ring"``: ring_jax.ring_attention_sharded
  dense      ``cfg.attention="dense"``: full-sequence reference attention per
             (batch, head) shard (O(L^2) memory)
  allgather  the model's attention function is swapped for
             ``benchmarks.baselines.allgather_attention`` (all-gather K/V over
             ``sequence``, local blockwise attention)

MFU = ``cfg.flops_per_token(L) * tokens/s / (devices * peak)``; remat
recomputation is not counted. ``--peak-tflops`` is per device (default: H200
989, TPU v5p 459, TPU v4 275 bf16; on CPU the measured f32 matmul rate of
the whole machine divided by the device count, so CPU "MFU" is relative to
what this host can do, not a hardware spec).

CPU example (8 fake devices, tiny model):
  PYTHONPATH=. python benchmarks/train_throughput.py --preset tiny --seq-len 2048 \\
      --mesh data=1,sequence=8,tensor=1 --attention ring,dense,allgather
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8").strip()

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ring_jax  # noqa: E402
from benchmarks.baselines import allgather_attention  # noqa: E402

PRESETS = {
    "tiny": dict(vocab_size=256, dim=256, num_layers=2, num_heads=8, num_kv_heads=8,
                 mlp_dim=512),
    "small": dict(vocab_size=32000, dim=512, num_layers=4, num_heads=8, num_kv_heads=4,
                  mlp_dim=1536),
    "1b": dict(vocab_size=32000, dim=2048, num_layers=16, num_heads=32, num_kv_heads=8,
               mlp_dim=8192),
}
PEAKS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "TPU v5p": 459.0, "TPU v5 lite": 197.0,
         "TPU v4": 275.0}


def cpu_peak_per_device(n_devices: int) -> float:
  """Measured f32 matmul FLOP/s of this host / devices (the CPU 'peak')."""
  n = 1024
  a = jnp.ones((n, n), jnp.float32)
  f = jax.jit(lambda a: a @ a)
  f(a).block_until_ready()
  ts = []
  for _ in range(5):
    t = time.perf_counter()
    f(a).block_until_ready()
    ts.append(time.perf_counter() - t)
  return 2 * n ** 3 / min(ts) / n_devices


def peak_per_device(args, n_devices):
  if args.peak_tflops:
    return args.peak_tflops * 1e12, "given"
  kind = jax.devices()[0].device_kind
  for key, v in PEAKS.items():
    if key.lower() in kind.lower():
      return v * 1e12, f"{kind} bf16 dense spec"
  if jax.default_backend() == "cpu":
    return cpu_peak_per_device(n_devices), "measured f32 matmul rate of this CPU / devices"
  return float("nan"), f"unknown device {kind}: pass --peak-tflops"


def allgather_model_attention(llama_mod):
  """A drop-in for ``models.llama.attention`` using the all-gather CP baseline."""

  def attention(cfg, q, k, v, positions, segment_ids):
    mesh = jax.sharding.get_abstract_mesh()
    axes = mesh.axis_names
    if "sequence" not in axes:
      raise ValueError("the all-gather baseline needs a 'sequence' mesh axis")
    batch = "data" if "data" in axes and q.shape[0] % mesh.shape["data"] == 0 else None
    heads = ("tensor" if "tensor" in axes and q.shape[2] % mesh.shape["tensor"] == 0 and
             k.shape[2] % mesh.shape["tensor"] == 0 else None)
    if segment_ids is not None:
      raise ValueError("the all-gather baseline does not take segment ids (pass none)")
    spec = P(batch, "sequence", heads, None)
    fn = jax.shard_map(functools.partial(allgather_attention, axis_name="sequence",
                                         is_causal=True, layout=cfg.layout,
                                         block_q=cfg.block_q, block_kv=cfg.block_kv),
                       mesh=mesh, in_specs=(spec,) * 3, out_specs=spec, check_vma=False)
    return fn(q, k, v)
  return attention


def run_one(backend, args, mesh, peak):
  import optax
  from flax import nnx
  from models import llama
  from models.llama import LlamaConfig, create_sharded_model

  preset = dict(PRESETS[args.preset])
  for k in ("vocab_size", "dim", "num_layers", "num_heads", "num_kv_heads", "mlp_dim"):
    v = getattr(args, k)
    if v:
      preset[k] = v
  cfg = LlamaConfig(**preset, attention="dense" if backend == "dense" else "ring",
                    layout=args.layout, remat_policy=args.remat, dtype=args.dtype,
                    param_dtype="float32", ffn_chunk_size=args.ffn_chunk,
                    block_q=args.block, block_kv=args.block)
  original = llama.attention
  if backend == "allgather":
    llama.attention = allgather_model_attention(llama)
  try:
    model = create_sharded_model(cfg, mesh, seed=0)
    graphdef, params = nnx.split(model)
    tx = optax.adamw(1e-4)
    b, length = args.batch, args.seq_len
    ring = mesh.shape["sequence"]
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, (b, length + 1))
    inp, tgt = tokens[:, :-1], tokens[:, 1:]
    perm = ring_jax.layout_positions(cfg.layout, ring, length)
    batch_sh = NamedSharding(mesh, P("data", "sequence"))
    put = lambda x: jax.device_put(jnp.asarray(x, jnp.int32), batch_sh)
    batch = dict(tokens=put(inp[:, perm]), labels=put(tgt[:, perm]),
                 positions=put(np.broadcast_to(perm, (b, length))))

    def loss_fn(params, batch):
      logits = nnx.merge(graphdef, params)(batch["tokens"], batch["positions"], None)
      logp = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
      return -jnp.mean(jnp.take_along_axis(logp, batch["labels"][..., None], -1))

    def step(params, opt_state, batch):
      loss, grads = jax.value_and_grad(loss_fn)(params, batch)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, loss

    with jax.set_mesh(mesh):
      opt_state = jax.jit(tx.init)(params)
      jstep = jax.jit(step, donate_argnums=(0, 1))
      t0 = time.perf_counter()
      compiled = jstep.lower(params, opt_state, batch).compile()
      compile_s = time.perf_counter() - t0
      ma = compiled.memory_analysis()
      temp = getattr(ma, "temp_size_in_bytes", None) if ma is not None else None
      if temp and jax.default_backend() == "cpu":
        # CPU "devices" share host RAM: refuse what would not fit (the dense backend at long
        # L replicates the full [L, L] scores on every device of the sequence axis).
        need = temp * mesh.devices.size
        avail = _mem_available()
        if avail and need > 0.6 * avail:
          raise MemoryError(f"OOM(est): compiled temp {temp / 2**30:.1f} GiB/device x "
                            f"{mesh.devices.size} devices > 60% of {avail / 2**30:.1f} GiB free")
      params, opt_state, loss = compiled(params, opt_state, batch)  # warm-up
      jax.block_until_ready(loss)
      ts = []
      for _ in range(args.steps):
        t = time.perf_counter()
        params, opt_state, loss = compiled(params, opt_state, batch)
        jax.block_until_ready(loss)
        ts.append(time.perf_counter() - t)
  finally:
    llama.attention = original
  dt = float(np.median(ts))
  tps = b * length / dt
  flops = cfg.flops_per_token(length) * tps
  n_dev = mesh.devices.size
  return dict(attention=backend, seq_len=length, batch=b, step_s=dt, step_times_s=ts,
              tokens_per_s=tps, model_tflops_per_s=flops / 1e12,
              mfu=flops / (n_dev * peak), compile_s=round(compile_s, 1),
              temp_bytes_per_device=temp, loss=float(loss), params=cfg.num_params(),
              config=cfg.to_dict())


def _mem_available():
  try:
    with open("/proc/meminfo") as fh:
      for line in fh:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024
  except OSError:
    return None
  return None


def parse_mesh(s):
  out = dict(data=1, sequence=1, tensor=1)
  for part in s.split(","):
    k, v = part.split("=")
    out[k.strip()] = int(v)
  return out


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
  for k in ("vocab_size", "dim", "num_layers", "num_heads", "num_kv_heads", "mlp_dim"):
    ap.add_argument(f"--{k.replace('_', '-')}", type=int, default=None)
  ap.add_argument("--seq-len", type=int, default=2048)
  ap.add_argument("--batch", type=int, default=1)
  ap.add_argument("--mesh", type=parse_mesh, default=parse_mesh("data=1,sequence=8,tensor=1"))
  ap.add_argument("--attention", default="ring,dense,allgather")
  ap.add_argument("--layout", default="zigzag")
  ap.add_argument("--remat", default="full")
  ap.add_argument("--ffn-chunk", type=int, default=None)
  ap.add_argument("--block", type=int, default=None)
  ap.add_argument("--dtype", default=None, help="compute dtype (default f32 on CPU, bf16 else)")
  ap.add_argument("--steps", type=int, default=3)
  ap.add_argument("--peak-tflops", type=float, default=None, help="per device")
  ap.add_argument("--out", default=None, help="write the results as JSON here")
  args = ap.parse_args(argv)
  if args.dtype is None:
    args.dtype = "float32" if jax.default_backend() == "cpu" else "bfloat16"
  shape = args.mesh
  n = shape["data"] * shape["sequence"] * shape["tensor"]
  devs = np.array(jax.devices()[:n]).reshape(shape["data"], shape["sequence"], shape["tensor"])
  mesh = jax.sharding.Mesh(devs, ("data", "sequence", "tensor"),
                           axis_types=(jax.sharding.AxisType.Auto,) * 3)
  peak, peak_src = peak_per_device(args, n)
  print(f"jax {jax.__version__} {jax.default_backend()} mesh {shape}; peak/device "
        f"{peak / 1e12:.3g} TFLOP/s ({peak_src}); preset {args.preset}, L={args.seq_len}, "
        f"B={args.batch}, layout {args.layout}, remat {args.remat}, {args.dtype}", flush=True)
  print(f"{'attention':<10} {'step ms':>9} {'tokens/s':>10} {'TFLOP/s':>8} {'MFU':>7} "
        f"{'temp MiB/dev':>12} {'loss':>7}", flush=True)
  results = []
  for backend in args.attention.split(","):
    try:
      r = run_one(backend, args, mesh, peak)
      print(f"{backend:<10} {1e3 * r['step_s']:>9.1f} {r['tokens_per_s']:>10.1f} "
            f"{r['model_tflops_per_s']:>8.3f} {r['mfu']:>7.1%} "
            f"{(r['temp_bytes_per_device'] or 0) / 2**20:>12.1f} {r['loss']:>7.3f}", flush=True)
    except Exception as e:  # noqa: BLE001
      r = dict(attention=backend, error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
      print(f"{backend:<10} FAILED: {r['error']}", flush=True)
    results.append(r)
  if args.out:
    with open(args.out, "w") as fh:
      json.dump(dict(meta=dict(jax=jax.__version__, platform=jax.default_backend(),
                               mesh=shape, peak_per_device=peak, peak_source=peak_src,
                               command="python " + " ".join(sys.argv)),
                     results=results), fh, indent=1)
  return results


if __name__ == "__main__":
  main()
