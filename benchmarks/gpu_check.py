"""One-GPU check (H200): attention TFLOP/s, longest trainable context, train-step MFU.

Run through ``benchmarks/gpu_check.sh`` (``PYTHONPATH=.``). Measures the
shipped code and config: the model of ``configs/llama_1b.py:long`` (the
LLaMA-3.2-1B shape at long context: offload_layer_in remat, blockwise FFN,
chunked loss; ``llama_1b.model_fields("long")``) on one device, with the
train step and state of ``training.step.build_train_step`` (AdamW +
clipping, donated state), the same that ``train.py`` runs. Needs jax, flax,
optax and einops (the accelerator image has them), not ml_collections or
grain, which only the config modules of ``training/`` (flags, validation, hf_init, stages)
and ``training/data.py`` import. Every section is wrapped in try/except (a failure is
printed and the next section runs) and the whole script keeps to a global time budget
(``GPU_CHECK_BUDGET_S``, default 450 s): cases that would start after the budget are
skipped and say so.

Sections:
  1. Per-device blockwise attention (ring_jax.ring_attention on a 1-device
     mesh, i.e. ring size 1) with each GPU hop kernel: XLA, tokamax's Mosaic GPU
     flash attention (``hop_kernel="tokamax"``: needs the ``[gpu]`` extra; the
     accelerator image lacks it and has no network, so carry a wheel directory
     and ``pip install --no-index --find-links DIR tokamax==0.0.17``), forward and
     forward+backward TFLOP/s at 8K / 32K /
     64K, bf16, causal and non-causal, next to
     ``jax.nn.dot_product_attention(implementation="cudnn")`` (the single-device
     ceiling) and ``"xla"`` (cases whose compiled memory exceeds the GPU are
     reported, not run); each fused kernel's ratios to cuDNN and to the XLA
     kernel and its output's distance from cuDNN's; then what
     ``hop_kernel="auto"`` resolved to and its self-check verdict
     (``ring_jax.kernels.describe``). Writes
     ``benchmarks/results/gpu_check_h200.json`` (``GPU_CHECK_OUT``).
  2. Longest context at which that train step (ring attention on a ring of 1)
     fits, by doubling from 32K: compiled memory (``memory_analysis``) against the
     device's ``bytes_limit``; contexts up to ``GPU_CHECK_RUN_MAX`` (default
     64K) are also run once to confirm.
  3. Tokens/s and MFU of that train step at 32K.

``GPU_CHECK_DRY=1`` runs everything at tiny sizes on CPU (CI smoke test).

FLOP conventions: attention forward = 4*B*N*L^2*H (x0.5 causal), backward
= 2.5x forward (FlashAttention-2 convention; recomputation not counted).
Train step: ``LlamaConfig.flops_per_token`` (6*params_matmul + 6*layers*L*N*H
per token, causal-halved attention, PaLM App. B); remat recomputation not
counted (MFU, not HFU). Peak FLOP/s: ``ring_jax.hardware`` by device kind,
or ``GPU_PEAK_TFLOPS``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ring_jax  # noqa: E402
from benchmarks import common  # noqa: E402
from ring_jax import hardware  # noqa: E402

DRY = os.environ.get("GPU_CHECK_DRY", "0") not in ("", "0")
BUDGET_S = float(os.environ.get("GPU_CHECK_BUDGET_S", "300" if DRY else "450"))
MAX_LEN = int(os.environ.get("GPU_CHECK_MAX_LEN", 1024 if DRY else 4 * 2 ** 20))
RUN_MAX = int(os.environ.get("GPU_CHECK_RUN_MAX", 1024 if DRY else 65536))
# bf16 on the GPU; the CPU dry run uses float32 (XLA:CPU bf16 matmuls are very slow).
DTYPE = jnp.float32 if DRY else jnp.bfloat16
# Section 1 starts no new case after this many seconds, leaving time for sections 2-3.
ATTN_DEADLINE_S = float(os.environ.get("GPU_CHECK_ATTN_S", 0.5 * BUDGET_S))
GIB = 2 ** 30
CLOCK = common.Clock(BUDGET_S)
say, left, elapsed, section = CLOCK.say, CLOCK.left, CLOCK.elapsed, CLOCK.section


def peak_flops() -> tuple[float | None, str]:
  """(dense bf16 peak FLOP/s of device 0, source); GPU_PEAK_TFLOPS overrides the table."""
  if os.environ.get("GPU_PEAK_TFLOPS"):
    return float(os.environ["GPU_PEAK_TFLOPS"]) * 1e12, "GPU_PEAK_TFLOPS"
  kind = jax.devices()[0].device_kind
  spec = hardware.device_spec(kind)
  if spec is None:
    return None, f"no peak known for {kind!r} (set GPU_PEAK_TFLOPS)"
  return spec.peak_bf16_flops, spec.source


def gib(x):
  if x is None:
    return "n/a"
  return f"{x / GIB:.1f} GiB" if x >= GIB else f"{x / 2 ** 20:.1f} MiB"


def device_limit():
  if os.environ.get("GPU_CHECK_LIMIT_GIB"):  # testing the search logic on CPU
    return int(float(os.environ["GPU_CHECK_LIMIT_GIB"]) * GIB)
  return common.device_bytes_limit()


def bench(compiled, args, repeats):
  """Median seconds of ``compiled(*args)`` (after one warm-up call; none in a dry run,
  whose timings mean nothing)."""
  return common.median(common.time_calls(compiled, args, repeats, warmup=0 if DRY else 1))


# ----------------------------------------------------------------------------
# 1. attention TFLOP/s
# ----------------------------------------------------------------------------

RING_XLA = "ring_jax ring=1 [xla]"
RING_TOKAMAX = "ring_jax ring=1 [tokamax]"
FUSED = {RING_TOKAMAX: "tokamax"}
CUDNN = "dot_product_attention[cudnn]"
OUT = os.environ.get("GPU_CHECK_OUT", os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "results",
    "gpu_check_dry.json" if DRY else "gpu_check_h200.json"))


def attn_impls(mesh, causal, block):
  """name -> f(q, k, v): the ring on a ring of one with each hop kernel, and jax's own."""
  spec = P(None, "sequence", None, None)
  out = {}
  for name, kernel in ((RING_XLA, "xla"), *FUSED.items()):
    out[name] = jax.shard_map(
        functools.partial(ring_jax.ring_attention, axis_name="sequence", is_causal=causal,
                          block_q=block, block_kv=block, hop_kernel=kernel),
        mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
  for impl in ("cudnn", "xla"):
    out[f"dot_product_attention[{impl}]"] = functools.partial(
        jax.nn.dot_product_attention, is_causal=causal, implementation=impl)
  return out


def auto_verdict(mesh, b, n, h, block) -> str:
  """What ``hop_kernel="auto"`` runs here for a small bf16 causal ring call (which triggers
  the fused kernel's self-check on the device) and why: ``ring_jax.kernels.describe``."""
  spec = P(None, "sequence", None, None)
  f = jax.shard_map(functools.partial(ring_jax.ring_attention, axis_name="sequence",
                                      is_causal=True, block_q=block, block_kv=block,
                                      hop_kernel="auto"),
                    mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
  x = jax.random.normal(jax.random.key(1), (b, 1024, n, h), jnp.bfloat16)
  try:
    jax.block_until_ready(jax.jit(f)(x, x, x))
  except Exception as e:  # noqa: BLE001
    return f"auto: the ring call failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
  return ring_jax.kernels.describe("auto")


@section
def attention_tflops():
  """Section 1: TFLOP/s of each implementation; the fused hop kernel's ratios to cuDNN (target
  >= 0.9x at 32K causal bf16) and to the XLA hop kernel (target >= 3x); max |difference| of
  the outputs from cuDNN's (the XLA kernel's where cuDNN cannot run). JSON to ``OUT``."""
  lengths = [128] if DRY else [8192, 32768, 65536]
  b, n, h = (1, 2, 64) if DRY else (1, 16, 128)
  block = int(os.environ.get("GPU_CHECK_BLOCK", "0")) or (64 if DRY else None)
  mesh = common.make_mesh((1,), ("sequence",))
  limit = device_limit()
  dtype = DTYPE
  say(f"B={b} N={n} H={h} {jnp.dtype(dtype).name}, ring block={block or 'default'}; "
      f"device limit {gib(limit)}")
  print(f"{'L':>7} {'mask':<7} {'impl':<30} {'fwd ms':>9} {'fwd TF/s':>9} "
        f"{'f+b ms':>9} {'f+b TF/s':>9}  note", flush=True)
  results, checks = [], []
  for length in lengths:
    ks = jax.random.split(jax.random.key(0), 4)
    q, k, v, do = (jax.random.normal(x, (b, length, n, h), dtype) for x in ks)
    for causal in (True, False):
      fwd_flops = 4 * b * n * length * length * h * (0.5 if causal else 1.0)
      outs = {}
      for name, f in attn_impls(mesh, causal, block).items():
        row = dict(L=length, causal=causal, impl=name)
        cells = {}
        for mode, fn, a in (("fwd", f, (q, k, v)),
                            ("fb", common.fwd_bwd(f), (q, k, v, do))):
          if left() < 20 or elapsed() > ATTN_DEADLINE_S:
            cells[mode] = "skipped (time budget)"
            continue
          try:
            c = jax.jit(fn).lower(*a).compile()
            nb = common.per_device_bytes(c)
            if limit and nb and nb > limit:
              cells[mode] = f"OOM (compiled needs {nb / GIB:.0f} GiB)"
              continue
            reps = 1 if DRY else 5
            t = bench(c, a, reps)
            fl = fwd_flops * (1 if mode == "fwd" else 3.5)
            row[mode] = (t, fl / t / 1e12)
            if mode == "fwd":
              outs[name] = np.asarray(jax.device_get(c(*a)), np.float32)
          except Exception as e:  # noqa: BLE001
            cells[mode] = f"{type(e).__name__}: {str(e).splitlines()[0][:90]}"
        cell = lambda m: (f"{1e3 * row[m][0]:9.1f} {row[m][1]:9.1f}" if m in row
                          else f"{'-':>9} {'-':>9}")
        row["note"] = "; ".join(f"{k_}: {v_}" for k_, v_ in cells.items())
        print(f"{length:>7} {'causal' if causal else 'full':<7} {name:<30} {cell('fwd')} "
              f"{cell('fb')}  {row['note']}", flush=True)
        results.append(row)
      ref = CUDNN if CUDNN in outs else RING_XLA
      for fused, kernel in FUSED.items():
        if fused in outs and ref in outs:
          diff = float(np.abs(outs[fused] - outs[ref]).max())
          checks.append(dict(L=length, causal=causal, kernel=kernel, against=ref,
                             max_abs_diff=diff))
          say(f"L={length} {'causal' if causal else 'full'}: max |{kernel} - {ref}| = "
              f"{diff:.3e} ({jnp.dtype(dtype).name} outputs)")

  print("\nratios of fwd+bwd TF/s (targets at 32K causal: a fused kernel >= 0.9x cuDNN, >= 3x "
        "the XLA hop kernel):", flush=True)
  by = {(r["L"], r["causal"], r["impl"]): r for r in results}
  ratios = []
  for length in lengths:
    for causal in (True, False):
      for fused, kernel in FUSED.items():
        a = by.get((length, causal, fused), {})
        for other in (CUDNN, RING_XLA):
          o = by.get((length, causal, other), {})
          if "fb" in a and "fb" in o:
            x = a["fb"][1] / o["fb"][1]
            ratios.append(dict(L=length, causal=causal, kernel=kernel, vs=other,
                               fwdbwd_ratio=x))
            print(f"  L={length:>6} {'causal' if causal else 'full':<6} {kernel} / {other}: "
                  f"x{x:.2f}", flush=True)
  auto = auto_verdict(mesh, b, n, h, block)
  say(auto)
  common.write_result(OUT, dict(
      device=str(jax.devices()[0].device_kind), backend=jax.default_backend(),
      jax=jax.__version__, dry=DRY, date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
      meta=common.run_meta([], __file__), shape=dict(B=b, N=n, H=h, dtype=jnp.dtype(dtype).name,
                                                     block=block),
      rows=results, ratios=ratios, checks=checks, auto=auto))
  say(f"wrote {OUT}")
  return results


# ----------------------------------------------------------------------------
# 2./3. 1B-class LLaMA train step: models/llama.py + training/step.py
# ----------------------------------------------------------------------------

# The variant of configs/llama_1b.py measured here.
VARIANT = "long"


def llama_config():
  """``configs/llama_1b.py:long``'s model; in the dry run the same at tiny sizes, float32.
  Its ``layout="auto"`` resolves as train.py resolves it on one device (a ring of 1:
  ``ring_jax.planning.choose_layout``); the rows here are one document each."""
  from configs import llama_1b
  from models.llama import LlamaConfig
  from ring_jax.planning import choose_layout

  fields = llama_1b.model_fields(VARIANT)
  if fields["layout"] == "auto":
    fields["layout"] = choose_layout(1, packed=False)[0]
  cfg = LlamaConfig.from_dict(fields)
  if DRY:
    return dataclasses.replace(cfg, vocab_size=512, dim=128, num_layers=2, num_heads=4,
                               num_kv_heads=2, head_dim=32, mlp_dim=256, block_q=None,
                               block_kv=None, ffn_chunk_size=128, loss_chunk_size=128,
                               dtype="float32")
  return cfg


class TrainStep:
  """The shipped train step for ``cfg`` on one device (batch 1), built once for all lengths."""

  def __init__(self, cfg):
    from training import batch as batch_lib
    from training import step as step_lib

    self.cfg, self.batch_lib = cfg, batch_lib
    self.mesh = common.make_mesh({})  # the trainer's axes, all of size 1: a ring of one
    tx = step_lib.make_optimizer(common.OPTIM, total_steps=100)
    self.built = step_lib.build_train_step(cfg, self.mesh, tx)

  def compile(self, length):
    return self.built.compile((1, length))

  def state(self):
    """Fresh sharded params and optimizer state."""
    return self.built.init_state()

  def batch(self, length):
    host = self.batch_lib.random_documents(1, 1, length, self.cfg.vocab_size, self.cfg.layout,
                                           1)
    return jax.device_put(host, self.batch_lib.shardings(self.mesh))


@section
def longest_context(known_fit=None):
  """Doubling from 32K over powers of two; after two compiled points, compiled memory
  (linear in L) is extrapolated to jump to the first power of two predicted not to fit,
  and the answer is confirmed by compiling it and its neighbour (compiles are the cost)."""
  cfg = llama_config()
  limit = device_limit()
  say(f"1B-class LLaMA (models/llama.py, configs/llama_1b.py:{VARIANT}"
      f"{'; tiny sizes in the dry run' if DRY else ''}): {cfg.num_params() / 1e9:.2f}B params, "
      f"{cfg}; device limit {gib(limit)}; f32 params + AdamW, {cfg.dtype} compute")
  step = TrainStep(cfg)
  seen = {}  # length -> (needed bytes or None, fits)

  def check(length):
    if length in seen:
      return seen[length][1]
    t = time.perf_counter()
    try:
      c = step.compile(length)
    except Exception as e:  # noqa: BLE001
      say(f"L={length:>8}: compile failed ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
          " -> counted as not fitting")
      seen[length] = (None, False)
      return False
    nb = common.per_device_bytes(c)
    fits = nb is not None and (limit is None or nb <= limit)
    say(f"L={length:>8}: compiled needs {gib(nb)} (compile {time.perf_counter() - t:.0f}s) "
        f"-> {'fits' if fits else 'does NOT fit'}")
    if fits and length <= RUN_MAX and left() > 60:
      try:
        params, opt = step.state()
        batch = step.batch(length)
        t = time.perf_counter()
        params, opt, metrics = c(params, opt, batch)
        say(f"L={length:>8}: ran one step in {time.perf_counter() - t:.1f}s, "
            f"loss {float(metrics['loss']):.3f}")
        del params, opt
      except Exception as e:  # noqa: BLE001
        say(f"L={length:>8}: RUN FAILED ({type(e).__name__}: {str(e).splitlines()[0][:120]})")
        fits = False
    seen[length] = (nb, fits)
    return fits

  start = 256 if DRY else 32768
  best = None
  if known_fit:  # the throughput section already ran a step at this length
    say(f"L={known_fit:>8}: fits (a train step ran in the throughput section)")
    best, start = known_fit, 2 * known_fit
  length = start
  answered = False
  while left() > 30 and length <= MAX_LEN:
    if not check(length):
      answered = True
      break
    best = length
    nxt = 2 * length
    fitted = sorted((L, v[0]) for L, v in seen.items() if v[1] and v[0])
    if len(fitted) >= 2 and limit:
      (l1, b1), (l2, b2) = fitted[-2], fitted[-1]
      slope = (b2 - b1) / (l2 - l1)
      if slope > 0:
        pred = l2 + (limit - b2) / slope  # predicted longest length that fits
        jump = min(2 ** int(math.floor(math.log2(max(pred, 1)))), MAX_LEN)
        if jump > nxt:
          say(f"linear fit of compiled memory predicts ~{pred / 1024:.0f}K tokens fit: "
              f"jumping to {jump}")
          nxt = jump
    if nxt > 2 * length:
      if check(nxt):
        best, length = nxt, 2 * nxt
        continue
      down = nxt // 2  # overshot: halve back down
      while down > length and left() > 30:
        if check(down):
          best = down
          break
        down //= 2
      answered = down <= length or seen.get(down, (0, False))[1]
      break
    length = nxt
  if not answered:
    say("stopped before finding a length that does not fit (time budget or "
        "GPU_CHECK_MAX_LEN): the answer is a lower bound")
  say(f"LONGEST CONTEXT THAT FITS (1 GPU, 1B-class, batch 1, compiled memory"
      f"{'' if best and best <= RUN_MAX else '; not run'}): {best}")
  return best


@section
def throughput():
  cfg = llama_config()
  length = 512 if DRY else 32768
  step = TrainStep(cfg)
  compiled = step.compile(length)
  params, opt = step.state()
  batch = step.batch(length)
  state = {}

  def one_step():
    nonlocal params, opt
    params, opt, state["metrics"] = compiled(params, opt, batch)
    return state["metrics"]

  times = common.time_calls(one_step, repeats=2 if DRY else 5)
  metrics = state["metrics"]
  dt = common.median(times)
  tps = length / dt
  fl = cfg.flops_per_token(length)
  peak, source = peak_flops()
  mfu = fl * tps / peak if peak else None
  say(f"L={length}: step {dt * 1e3:.0f} ms, {tps:,.0f} tokens/s, "
      f"{fl * tps / 1e12:.1f} model TFLOP/s, MFU "
      + (f"{mfu:.1%} (peak {peak / 1e12:g} TFLOP/s bf16 dense: {source}" if mfu is not None
         else f"n/a ({source}") + f"; loss {float(metrics['loss']):.3f})")
  return dict(length=length, step_s=dt, tokens_per_s=tps, mfu=mfu)


def main():
  say(f"jax {jax.__version__}, backend {jax.default_backend()}, devices {jax.devices()}, "
      f"dry={DRY}, budget {BUDGET_S:.0f}s")
  sections = os.environ.get("GPU_CHECK_SECTIONS", "attention,throughput,longest").split(",")
  if "attention" in sections:
    attention_tflops()
  tp = throughput() if "throughput" in sections else None
  if "longest" in sections:
    longest_context(tp["length"] if tp else None)
  say("done")


if __name__ == "__main__":
  main()
