"""One-accelerator check: attention TFLOP/s of each hop kernel; on a GPU also the longest
trainable context and train-step MFU.

Run through ``benchmarks/{gpu,tpu}_check.sh`` (``python benchmarks/accelerator_check.py
{gpu,tpu}``); knobs: environment variables ``<P>_CHECK_*`` (:func:`settings`). A failing
section is printed and the next one runs (``common.Clock``); cases past the budget are skipped
and say so; ``<P>_CHECK_DRY=1``: tiny sizes on CPU (TPU kernels interpreted). The sections and
their sizes: benchmarks/README.md, "One GPU" (tokamax offline: ``pip install --no-index
--find-links DIR tokamax==0.0.17``).

FLOPs: attention forward = 4*B*N*L^2*H (x0.5 causal), fwd+bwd = 3.5x forward
(FlashAttention-2's convention). Train step: ``LlamaConfig.flops_per_token`` (PaLM App. B;
MFU, not HFU). Peak FLOP/s: ``GPU_PEAK_TFLOPS``, else ``train_throughput.peak_per_device``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import sys
import time
import types

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ring_jax  # noqa: E402
from benchmarks import common  # noqa: E402

GIB = common.GIB
RING_XLA = "ring_jax ring=1 [xla]"
CUDNN, SPLASH = "dot_product_attention[cudnn]", "splash"
# The fused hop kernel(s) checked on each platform, and what each is compared with (the
# single-device ceiling first; the XLA ring as well).
FUSED = {"gpu": {"ring_jax ring=1 [tokamax]": "tokamax"},
         "tpu": {"ring_jax ring=1 [splash]": "splash"}}
BASELINES = {"gpu": (CUDNN, RING_XLA), "tpu": (SPLASH, RING_XLA)}


# (platform, dry run): lengths, (B, N query heads, K kv heads (GQA), H), the ring's block.
SIZES = {("gpu", False): ("8192,32768,65536", (1, 16, 16, 128), None),
         ("gpu", True): ("128", (1, 2, 2, 64), 64),
         ("tpu", False): ("8192,16384,32768,65536", (1, 16, 8, 128), 512),
         ("tpu", True): ("256", (1, 2, 1, 128), 128)}


def settings(platform: str) -> types.SimpleNamespace:
  """The run's sizes and knobs for ``platform`` ("gpu" or "tpu"), from ``<P>_CHECK_`` + DRY,
  BUDGET_S, LENGTHS, BLOCK, MAX_LEN (longest context tried), RUN_MAX and OUT."""
  def env(name, default):
    return os.environ.get(f"{platform.upper()}_CHECK_{name}") or default

  dry = env("DRY", "0") != "0"
  gpu = platform == "gpu"
  budget = float(env("BUDGET_S", "300" if dry and gpu else "450"))
  lengths, (b, n, k, h), block = SIZES[platform, dry]
  out = f"{platform}_check{'_dry' if dry else '_h200' if gpu else ''}.json"
  return types.SimpleNamespace(
      platform=platform, dry=dry, budget_s=budget, clock=common.Clock(budget),
      lengths=common.ints(env("LENGTHS", lengths)), B=b, N=n, K=k, H=h,
      block=int(env("BLOCK", "0")) or block,
      # bf16 on the accelerator; the GPU dry run uses float32 (XLA:CPU bf16 matmuls are slow).
      dtype=jnp.float32 if dry and gpu else jnp.bfloat16,
      # Section 1 starts no new case after this many seconds, leaving time for sections 2-3.
      attn_deadline_s=0.5 * budget if gpu else budget - 20,
      max_len=int(env("MAX_LEN", 1024 if dry else 4 * 2 ** 20)),
      run_max=int(env("RUN_MAX", 1024 if dry else 65536)),
      out=env("OUT", os.path.join(common.RESULTS, out)))


def gib(x):
  if x is None:
    return "n/a"
  return f"{x / GIB:.1f} GiB" if x >= GIB else f"{x / 2 ** 20:.1f} MiB"


# --- 1. Attention TFLOP/s ---------------------------------------------------------------------


def ring_impl(s, causal, hop_kernel):
  """``ring_jax.ring_attention`` on a ring of one with ``hop_kernel``."""
  # TPU dry run (CPU): check_vma=False lets Pallas run its generic interpreter, 3.5-6x faster
  # than the TPU interpreter check_vma=True takes on CPU (tests/ring_jax/test_hop.py runs
  # both); on a TPU the kernels compile under check_vma=True, as users call them.
  return jax.shard_map(
      functools.partial(ring_jax.ring_attention, axis_name="sequence", is_causal=causal,
                        block_q=s.block, block_kv=s.block, hop_kernel=hop_kernel),
      mesh=common.ring_mesh(1), in_specs=(common.SEQ_SPEC,) * 3, out_specs=common.SEQ_SPEC,
      check_vma=not (s.dry and s.platform == "tpu"))


def splash_impl(s, length, causal):
  """The splash attention kernel bundled with JAX (``make_splash_mha``, fused backward,
  queries pre-scaled) on ``[B, L, heads, H]`` inputs (built when traced: a JAX without it
  fails that case, not the run)."""

  def fwd(q, k, v):  # [B, L, heads, H] -> splash's [heads, L, H] per batch row
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm
    head = sm.CausalMask((length, length)) if causal else sm.FullMask((length, length))
    bs = sk.BlockSizes(block_q=s.block, block_kv=s.block, block_kv_compute=s.block,
                       block_q_dkv=s.block, block_kv_dkv=s.block,
                       block_kv_dkv_compute=s.block, use_fused_bwd_kernel=True)
    kern = sk.make_splash_mha(sm.MultiHeadMask([head] * s.N), head_shards=1, q_seq_shards=1,
                              block_sizes=bs, interpret=s.dry)
    t = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731
    return jnp.swapaxes(jax.vmap(kern)(t(q * jnp.asarray(s.H ** -0.5, q.dtype)), t(k), t(v)),
                        1, 2)

  return fwd


def attn_impls(s, length, causal):
  """name -> f(q, k, v): the ring on a ring of one with each hop kernel, and the ceiling(s):
  on a GPU ``jax.nn.dot_product_attention`` (cuDNN and XLA), on a TPU :func:`splash_impl`."""
  out = {RING_XLA: ring_impl(s, causal, "xla")}
  out.update({name: ring_impl(s, causal, kernel) for name, kernel in FUSED[s.platform].items()})
  if s.platform == "tpu":
    out[SPLASH] = splash_impl(s, length, causal)
  else:
    for impl in ("cudnn", "xla"):
      out[f"dot_product_attention[{impl}]"] = functools.partial(
          jax.nn.dot_product_attention, is_causal=causal, implementation=impl)
  return out


def auto_verdict(s) -> str:
  """What ``hop_kernel="auto"`` runs here for a small bf16 causal ring call (which triggers
  the fused kernel's self-check on the device) and why: ``ring_jax.kernels.describe``."""
  x = jax.random.normal(jax.random.key(1), (s.B, s.lengths[0], s.N, s.H), jnp.bfloat16)
  try:
    jax.block_until_ready(jax.jit(ring_impl(s, True, "auto"))(x, x[:, :, :s.K],
                                                               x[:, :, :s.K]))
  except Exception as e:  # noqa: BLE001
    return f"auto: the ring call failed: {common.error_line(e, 120)}"
  return ring_jax.kernels.describe("auto")


def attention_tflops(s):
  """Section 1: fwd and fwd+bwd TFLOP/s of each implementation of :func:`attn_impls`, bf16,
  causal and not (a case whose compiled memory exceeds the device is reported, not run); each
  fused hop kernel's ratios to the ceiling and to the XLA hop kernel (targets at 32K causal:
  >= 0.9x the ceiling, >= 3x the XLA kernel); max |difference| of its outputs from the first
  baseline that ran; what ``hop_kernel="auto"`` resolved to. JSON to ``s.out``."""
  clock, limit, fused = s.clock, common.device_bytes_limit(), FUSED[s.platform]
  shape = dict(B=s.B, N=s.N, K=s.K, H=s.H, dtype=jnp.dtype(s.dtype).name, block=s.block)
  clock.say(f"{shape}, lengths {s.lengths}; device limit {gib(limit)}")
  print(f"{'L':>7} {'mask':<7} {'impl':<30} {'fwd ms':>9} {'fwd TF/s':>9} "
        f"{'f+b ms':>9} {'f+b TF/s':>9}  note", flush=True)
  rows, checks, ratios = [], [], []
  for length in s.lengths:
    q, k, v, do = (jax.random.normal(key, (s.B, length, heads, s.H), s.dtype) for key, heads
                   in zip(jax.random.split(jax.random.key(0), 4), (s.N, s.K, s.K, s.N)))
    reps = 1 if s.dry else (3 if length >= 32768 else 5)
    for causal in (True, False):
      mask = "causal" if causal else "full"
      fwd_flops = 4 * s.B * s.N * length * length * s.H * (0.5 if causal else 1.0)
      outs, by = {}, {}
      for name, f in attn_impls(s, length, causal).items():
        row, notes = dict(L=length, causal=causal, impl=name), []
        for mode, fn, a in (("fwd", f, (q, k, v)), ("fb", common.fwd_bwd(f), (q, k, v, do))):
          if clock.left() < 20 or clock.elapsed() > s.attn_deadline_s:
            notes.append(f"{mode}: skipped (time budget)")
            continue
          try:
            c = jax.jit(fn).lower(*a).compile()
            nb = common.per_device_bytes(c)
            if limit and nb and nb > limit:
              notes.append(f"{mode}: OOM (compiled needs {nb / GIB:.0f} GiB)")
              continue
            # No warm-up in a dry run: its interpreted kernels take seconds a call.
            t = common.median(common.time_calls(c, a, reps, warmup=0 if s.dry else 1))
            row[f"{mode}_ms"] = 1e3 * t
            row[f"{mode}_tflops"] = fwd_flops * (1 if mode == "fwd" else 3.5) / t / 1e12
            if mode == "fwd":
              outs[name] = np.asarray(jax.device_get(c(*a)), np.float32)
          except Exception as e:  # noqa: BLE001
            notes.append(f"{mode}: {common.error_line(e, 90)}")
        row["note"] = "; ".join(notes)
        cell = lambda m: (f"{row[m + '_ms']:9.1f} {row[m + '_tflops']:9.2f}"  # noqa: E731
                          if m + "_ms" in row else f"{'-':>9} {'-':>9}")
        print(f"{length:>7} {mask:<7} {name:<30} {cell('fwd')} {cell('fb')}  {row['note']}",
              flush=True)
        rows.append(row)
        by[name] = row
      ref = next((b for b in BASELINES[s.platform] if b in outs), None)
      for name in fused:
        if name in outs and ref:
          diff = float(np.abs(outs[name] - outs[ref]).max())
          checks.append(dict(L=length, causal=causal, impl=name, against=ref,
                             max_abs_diff=diff))
          clock.say(f"L={length} {mask}: max |{name} - {ref}| = {diff:.3e} "
                    f"({jnp.dtype(s.dtype).name} outputs)")
        for other in BASELINES[s.platform]:
          for mode in ("fwd", "fb"):
            key = f"{mode}_tflops"
            if key in by.get(name, {}) and key in by.get(other, {}):
              ratios.append(dict(L=length, causal=causal, mode=mode, impl=name, vs=other,
                                 ratio=by[name][key] / by[other][key]))
  print("\nratios of TF/s (targets at 32K causal fwd+bwd: a fused kernel >= 0.9x the "
        "ceiling, >= 3x the XLA hop kernel):", flush=True)
  for r in ratios:
    print(f"  L={r['L']:>6} {'causal' if r['causal'] else 'full':<6} {r['mode']:<3} "
          f"{r['impl']} / {r['vs']}: x{r['ratio']:.2f}", flush=True)
  auto = auto_verdict(s)
  clock.say(auto)
  common.write_result(s.out, dict(
      device=str(jax.devices()[0].device_kind), backend=jax.default_backend(),
      jax=jax.__version__, dry=s.dry, date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
      meta=common.run_meta(), shape=shape, rows=rows, ratios=ratios, checks=checks, auto=auto))
  clock.say(f"wrote {s.out}")
  return rows


# --- 2./3. 1B-class LLaMA train step: models/llama.py + training/step.py ----------------------

# The variant of configs/llama_1b.py measured here.
VARIANT = "long"


def llama_config(dry: bool = False):
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
  if dry:
    return dataclasses.replace(cfg, vocab_size=512, dim=128, num_layers=2, num_heads=4,
                               num_kv_heads=2, head_dim=32, mlp_dim=256, block_q=None,
                               block_kv=None, ffn_chunk_size=128, loss_chunk_size=128,
                               dtype="float32")
  return cfg


def longest_context(s, known_fit=None):
  """The longest power of two, doubling from 32K (:func:`benchmarks.fit.search`; halving
  where that does not fit) up to ``s.max_len``, at which the shipped train step (batch 1,
  one device, built once for all lengths) fits the device's compiled memory; lengths up to
  ``s.run_max`` also run one step. ``known_fit``: a length the throughput section ran."""
  from benchmarks.fit import search
  from training import batch as batch_lib
  from training import step as step_lib

  say, left = s.clock.say, s.clock.left
  cfg = llama_config(s.dry)
  limit = common.device_bytes_limit()
  say(f"1B-class LLaMA (models/llama.py, configs/llama_1b.py:{VARIANT}"
      f"{'; tiny sizes in the dry run' if s.dry else ''}): {cfg.num_params() / 1e9:.2f}B "
      f"params, {cfg}; device limit {gib(limit)}; f32 params + AdamW, {cfg.dtype} compute")
  mesh = common.make_mesh({})  # the trainer's axes, all of size 1: a ring of one
  step = step_lib.build_train_step(cfg, mesh, step_lib.make_optimizer(common.OPTIM, 100))
  out_of_time = []

  def check(length):
    if length == known_fit:
      say(f"L={length:>8}: fits (a train step ran in the throughput section)")
      return True
    if left() < 30:
      out_of_time.append(length)
      return False
    t = time.perf_counter()
    try:
      c = step.compile((1, length))
    except Exception as e:  # noqa: BLE001
      say(f"L={length:>8}: compile failed ({common.error_line(e, 120)}) -> counted as not fitting")
      return False
    nb = common.per_device_bytes(c)
    fits = nb is not None and (limit is None or nb <= limit)
    say(f"L={length:>8}: compiled needs {gib(nb)} (compile {time.perf_counter() - t:.0f}s) "
        f"-> {'fits' if fits else 'does NOT fit'}")
    if fits and length <= s.run_max and left() > 60:
      try:
        params, opt = step.init_state()
        batch = jax.device_put(batch_lib.random_documents(1, 1, length, cfg.vocab_size,
                                                          cfg.layout, 1),
                               batch_lib.shardings(mesh))
        t = time.perf_counter()
        params, opt, metrics = c(params, opt, batch)
        say(f"L={length:>8}: ran one step in {time.perf_counter() - t:.1f}s, "
            f"loss {float(metrics['loss']):.3f}")
        del params, opt
      except Exception as e:  # noqa: BLE001
        say(f"L={length:>8}: RUN FAILED ({common.error_line(e, 120)})")
        fits = False
    return fits

  best, bounded = search(check, known_fit or (256 if s.dry else 32768), s.max_len,
                         resolution=1.0)
  if out_of_time or not bounded:
    say(f"stopped before finding a length that does not fit (time budget or "
        f"{s.platform.upper()}_CHECK_MAX_LEN): the answer is a lower bound")
  say(f"LONGEST CONTEXT THAT FITS (1 {s.platform.upper()}, 1B-class, batch 1, compiled memory"
      f"{'' if best and best <= s.run_max else '; not run'}): {best}")
  return best


def throughput(s):
  """Section 3: tokens/s and MFU of the shipped train step at 32K (batch 1, one device)."""
  from benchmarks import train_throughput  # the backend has started: its fake devices are moot

  length = 512 if s.dry else 32768
  peak, source = train_throughput.peak_per_device(1, float(os.environ.get("GPU_PEAK_TFLOPS") or 0))
  r = train_throughput.time_train_step(llama_config(s.dry), common.make_mesh({}), 1, length,
                                       2 if s.dry else 5, peak)
  dt, tps, mfu = r["step_s"], r["tokens_per_s"], r["mfu"]
  s.clock.say(f"L={length}: step {dt * 1e3:.0f} ms, {tps:,.0f} tokens/s, "
              f"{r['model_tflops_per_s']:.1f} model TFLOP/s, MFU "
              + (f"{mfu:.1%} (peak {peak / 1e12:g} TFLOP/s: {source}"
                 if not math.isnan(peak) else f"n/a ({source}") + f"; loss {r['loss']:.3f})")
  return dict(length=length, step_s=dt, tokens_per_s=tps, mfu=mfu)


def main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  if len(argv) != 1 or argv[0] not in FUSED:
    raise SystemExit(f"usage: accelerator_check.py {{{','.join(FUSED)}}}")
  s = settings(argv[0])
  section = s.clock.section
  s.clock.say(f"jax {jax.__version__}, backend {jax.default_backend()}, devices "
              f"{jax.devices()}, dry={s.dry}, budget {s.budget_s:.0f}s")
  section(attention_tflops)(s)
  if s.platform == "gpu":
    tp = section(throughput)(s)
    section(longest_context)(s, tp["length"] if tp else None)
  s.clock.say("done")


if __name__ == "__main__":
  main()
