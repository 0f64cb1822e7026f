r"""Decode-step figures: step time and cache memory vs context length (``time``), the
longest cache whose compiled decode step fits a budget (``fit``); JSON lines on stdout.

  python benchmarks/decode.py time --devices 8 --lengths 1024,4096,16384,65536
  python benchmarks/decode.py fit --devices 8 --config configs/llama_7b.py --budget_gib 80

What each mode builds and measures: docs/benchmarks.md, "Decode". ``fit`` compiles on fake
CPU devices with abstract inputs: the step's peak is linear in the cache length, so two
compiles give the line and a third confirms the answer.
"""

from __future__ import annotations

import dataclasses
import json
import os
import runpy
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # read when jax is imported

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import common  # noqa: E402
from models import inference, llama  # noqa: E402
from training import mesh as mesh_lib  # noqa: E402
from training import step as step_lib  # noqa: E402
from training import validation as val_lib  # noqa: E402


def step_memory(cfg, mesh, params, cache) -> dict:
  """Compiled memory of ``models.inference.Generator``'s decode step at ``params``, ``cache``."""
  with jax.set_mesh(mesh):
    return common.compiled_memory(inference._step_jit.lower(
        params, cache, jax.ShapeDtypeStruct((1,), jnp.int32), cfg=cfg).compile())


def peak_bytes(cfg, mesh, cache_len: int) -> int:
  """Bytes one device holds in the decode step, compiled with abstract params and cache:
  XLA's peak where it reports one, at least args + outputs + temporaries - aliased outputs
  (:func:`common.per_device_bytes`)."""
  memory = step_memory(cfg, mesh, step_lib.abstract_model(cfg, mesh)[1],
                       inference.abstract_cache(cfg, mesh, 1, cache_len))
  return max(memory.get("peak_memory_in_bytes", 0), common.per_device_bytes(memory))


def run_time(args):
  mesh = mesh_lib.make_mesh({"data": 1, "sequence": args.devices, "tensor": 1})
  cfg = llama.LlamaConfig(vocab_size=256, dim=256, num_layers=4, num_heads=8, num_kv_heads=4,
                          mlp_dim=512)
  params = nnx.split(llama.create_sharded_model(cfg, mesh), nnx.Param, ...)[1]
  gen = inference.Generator(cfg, params, mesh, max(args.lengths))
  for length in args.lengths:
    kv = (cfg.num_layers, 1, length, cfg.num_kv_heads, cfg.resolved_head_dim)
    filled = length - 2 * args.devices  # room for the timed steps
    cache = jax.device_put(inference.KVCache(
        k=jnp.ones(kv, cfg.compute_dtype), v=jnp.ones(kv, cfg.compute_dtype),
        positions=jnp.arange(length, dtype=jnp.int32)[None],
        segment_ids=(jnp.arange(length) < filled).astype(jnp.int32)[None],
        next_position=jnp.full((1,), filled, jnp.int32), segment=jnp.ones((1,), jnp.int32),
        prompt_slots=jnp.int32(length // args.devices - 2), steps=jnp.int32(0)),
        inference.cache_shardings(cfg, mesh, 1, length))
    gen.cache_len = length
    m = step_memory(cfg, mesh, params, cache)
    tokens = jnp.zeros((1,), jnp.int32)
    state = dict(cache=cache)

    def one_step():
      logits, state["cache"] = gen.step(state["cache"], tokens)
      return logits

    times = common.time_calls(one_step, repeats=args.steps)  # after a compile + warm-up call
    print(json.dumps(dict(
        mode="time", devices=args.devices, length=length,
        cache_mib_per_device=inference.cache_bytes_per_device(cfg, mesh, 1, length) / common.MIB,
        step_args_mib_per_device=m["argument_size_in_bytes"] / common.MIB,
        step_temp_mib_per_device=m["temp_size_in_bytes"] / common.MIB,
        step_ms_median=1e3 * common.median(times))), flush=True)


def run_fit(args):
  config = runpy.run_path(args.config)["get_config"]()
  tensor = int(config.mesh.tensor)
  n = args.devices // tensor
  mesh = mesh_lib.make_mesh({"data": 1, "sequence": n, "tensor": tensor})
  config, _ = val_lib.resolve_layout(config, n)  # model.layout="auto"
  # XLA:CPU computes bfloat16 in float32 and holds a float32 copy of a bf16 cache (measured:
  # temp = 2x the cache), which no accelerator does; so the fit compiles a float32 model,
  # where the CPU's memory analysis is faithful, and a bf16 cache is derived from it below.
  cfg = dataclasses.replace(val_lib.llama_config(config), dtype="float32")
  bf16 = dataclasses.replace(cfg, dtype="bfloat16")
  budget, step = args.budget_gib * common.GIB, n * 1024
  (l0, p0), (l1, p1) = ((length, peak_bytes(cfg, mesh, length))
                        for length in (n * 4096, n * 16384))
  slope = (p1 - p0) / (l1 - l0)
  fixed = p0 - slope * l0
  longest = int((budget - fixed) / slope) // step * step
  for _ in range(4):  # the line is nearly exact; step down until the compiled step fits
    peak = peak_bytes(cfg, mesh, longest)
    if peak <= budget:
      break
    longest -= -(-int((peak - budget) / slope) // step) * step
  print(json.dumps(dict(
      mode="fit", config=os.path.basename(args.config), devices=args.devices,
      mesh=dict(data=1, sequence=n, tensor=tensor), param_dtype=cfg.param_dtype,
      cache_dtype=cfg.dtype, bytes_per_token_per_device=slope,
      fixed_gib_per_device=fixed / common.GIB, longest_cache_tokens=longest,
      peak_gib_at_longest=peak / common.GIB, budget_gib=args.budget_gib,
      cache_gib_at_longest=inference.cache_bytes_per_device(cfg, mesh, 1, longest) / common.GIB,
      # Same fixed memory, the cache at 2 bytes per element instead of 4 (not compiled).
      longest_bf16_cache_tokens_derived=int((budget - fixed) / (
          slope - inference.cache_bytes_per_device(cfg, mesh, 1, n) / n
          + inference.cache_bytes_per_device(bf16, mesh, 1, n) / n)) // step * step)), flush=True)


def main(argv=None):
  parser = common.parser(__doc__, lengths=(1024, 4096, 16384, 65536))
  parser.add_argument("mode", choices=["time", "fit"])
  parser.add_argument("--devices", type=int, default=8)
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--config", default="configs/llama_7b.py")
  parser.add_argument("--budget_gib", type=float, default=80.0)
  args = parser.parse_args(argv)
  common.fake_cpu_devices(args.devices)
  (run_time if args.mode == "time" else run_fit)(args)


if __name__ == "__main__":
  main()
