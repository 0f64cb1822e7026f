"""One-TPU-chip check of the splash hop kernel: TFLOP/s against splash attention and XLA.

Run through ``benchmarks/tpu_check.sh`` (``PYTHONPATH=.``). On one chip (ring
size 1), bf16, causal and non-causal, at 8K / 16K / 32K / 64K tokens:

* ``splash``: the splash attention kernel bundled with JAX
  (``make_splash_mha``, ``CausalMask``/``FullMask``, fused backward), through
  its own VJP: the single-chip ceiling. Queries pre-scaled (splash has no scale
  argument).
* ``ring_jax ring=1 [<kernel>]``: ``ring_jax.ring_attention`` on a 1-device
  mesh with ``hop_kernel="xla"`` and ``"splash"`` (our hop on splash's kernels,
  ``ring_jax/kernels/splash.py``; rows say "n/a" where this checkout's
  ``ring_attention`` lacks the kernel).

At the smallest length it also prints the largest difference between the
``ring_jax ring=1 [splash]`` and ``splash`` outputs (a hardware correctness check),
then the splash hop's fwd+bwd ratios to splash and to the XLA ring, and at the end what
``hop_kernel="auto"`` resolved to with splash's self-check verdict
(``ring_jax.kernels.describe``). A short table is
printed; all rows go to ``benchmarks/results/tpu_check.json`` (or
``$TPU_CHECK_OUT``). Every case is guarded (a failure is printed, the next case
runs) and the run keeps to ``TPU_CHECK_BUDGET_S`` (default 450 s).

``TPU_CHECK_DRY=1``: tiny shapes on CPU, kernels in Pallas interpret mode
(a smoke test of the script; its timings mean nothing).

FLOPs: forward 4*B*N*L^2*H (x0.5 causal); fwd+bwd 3.5x forward (FlashAttention-2
convention, recomputation not counted).
"""

from __future__ import annotations

import functools
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ring_jax  # noqa: E402
from benchmarks import common  # noqa: E402

DRY = os.environ.get("TPU_CHECK_DRY", "0") not in ("", "0")
BUDGET_S = float(os.environ.get("TPU_CHECK_BUDGET_S", "450"))
LENGTHS = [int(x) for x in os.environ.get(
    "TPU_CHECK_LENGTHS", "256" if DRY else "8192,16384,32768,65536").split(",")]
BLOCK = int(os.environ.get("TPU_CHECK_BLOCK", "128" if DRY else "512"))
B, N, K, H = (1, 2, 1, 128) if DRY else (1, 16, 8, 128)   # N query heads, K kv heads (GQA)
DTYPE = jnp.bfloat16
OUT = os.environ.get("TPU_CHECK_OUT") or os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "results",
    "tpu_check_dry.json" if DRY else "tpu_check.json")
CLOCK = common.Clock(BUDGET_S)
say = CLOCK.say
SPLASH, RING_XLA, RING_SPLASH = "splash", "ring_jax ring=1 [xla]", "ring_jax ring=1 [splash]"


def bench(fn, args, repeats):
  """Median seconds of a compiled call (after one warm-up call; none in a dry run, whose
  timings mean nothing and whose interpreted kernels take seconds a call)."""
  return common.median(common.time_calls(fn, args, repeats, warmup=0 if DRY else 1))


def splash_impl(length, causal):
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm
  shape = (length, length)
  head = sm.CausalMask(shape) if causal else sm.FullMask(shape)
  bs = sk.BlockSizes(block_q=BLOCK, block_kv=BLOCK, block_kv_compute=BLOCK,
                     block_q_dkv=BLOCK, block_kv_dkv=BLOCK, block_kv_dkv_compute=BLOCK,
                     use_fused_bwd_kernel=True)
  kern = sk.make_splash_mha(sm.MultiHeadMask([head] * N), head_shards=1, q_seq_shards=1,
                            block_sizes=bs, interpret=DRY)

  def fwd(q, k, v):  # [B, L, heads, H] -> splash's [heads, L, H] per batch row
    t = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731
    o = jax.vmap(kern)(t(q * jnp.asarray(H ** -0.5, q.dtype)), t(k), t(v))
    return jnp.swapaxes(o, 1, 2)

  return fwd, common.fwd_bwd(fwd)


def ring_impl(length, causal, hop_kernel):
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("sequence",))
  spec = jax.P(None, "sequence", None, None)
  kwargs = dict(axis_name="sequence", is_causal=causal, block_q=BLOCK, block_kv=BLOCK,
                hop_kernel=hop_kernel)
  # Dry (CPU): check_vma=False lets Pallas run its generic interpreter, 3.5-6x faster than
  # the TPU interpreter check_vma=True takes on CPU (tests/ring_jax/test_hop.py runs both); on a TPU
  # the kernels compile under check_vma=True, as users call them.
  fn = jax.shard_map(functools.partial(ring_jax.ring_attention, **kwargs), mesh=mesh,
                     in_specs=(spec,) * 3, out_specs=spec, check_vma=not DRY)
  return fn, common.fwd_bwd(fn)


def auto_verdict() -> str:
  """What ``hop_kernel="auto"`` runs here for a small causal ring call in the check's dtype
  (which triggers splash's self-check on a TPU) and why: ``ring_jax.kernels.describe``."""
  fn, _ = ring_impl(LENGTHS[0], True, "auto")
  x = jax.random.normal(jax.random.key(1), (B, LENGTHS[0], N, H), DTYPE)
  try:
    jax.block_until_ready(jax.jit(fn)(x, x[:, :, :K], x[:, :, :K]))
  except Exception as e:  # noqa: BLE001
    return f"auto: the ring call failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
  return ring_jax.kernels.describe("auto")


def main():
  say(f"devices: {jax.devices()}; jax {jax.__version__}; dry={DRY}")
  say(f"B={B} N={N} K={K} H={H} {jnp.dtype(DTYPE).name}, block {BLOCK}, lengths {LENGTHS}")
  impls = {
      SPLASH: splash_impl,
      RING_XLA: functools.partial(ring_impl, hop_kernel="xla"),
      RING_SPLASH: functools.partial(ring_impl, hop_kernel="splash"),
  }
  rows, checks = [], []
  header = (f"{'L':>6} {'mask':<6} {'impl':<30} {'fwd ms':>9} {'fwd TF/s':>9} {'f+b ms':>9} "
            f"{'f+b TF/s':>9}  note")
  print(header, flush=True)
  for length in LENGTHS:
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (B, length, N, H), DTYPE)
    k = jax.random.normal(keys[1], (B, length, K, H), DTYPE)
    v = jax.random.normal(keys[2], (B, length, K, H), DTYPE)
    do = jax.random.normal(keys[3], (B, length, N, H), DTYPE)
    for causal in (True, False):
      fwd_flops = 4 * B * N * length * length * H * (0.5 if causal else 1.0)
      outs = {}
      for name, make in impls.items():
        row = dict(L=length, causal=causal, impl=name, B=B, N=N, K=K, H=H, block=BLOCK)
        notes = []
        try:
          fwd, fwd_bwd = make(length, causal)
        except Exception as e:  # noqa: BLE001
          fwd = fwd_bwd = None
          notes.append(f"n/a: {type(e).__name__}: {str(e).splitlines()[0][:80]}")
        for mode, fn, args in (("fwd", fwd, (q, k, v)), ("fb", fwd_bwd, (q, k, v, do))):
          if fn is None:
            continue
          if CLOCK.left() < 0:
            notes.append(f"{mode} skipped (time budget)")
            continue
          try:
            compiled = jax.jit(fn).lower(*args).compile()
            reps = 1 if DRY else (3 if length >= 32768 else 5)
            t = bench(compiled, args, reps)
            flops = fwd_flops * (1.0 if mode == "fwd" else 3.5)
            row[f"{mode}_ms"], row[f"{mode}_tflops"] = 1e3 * t, flops / t / 1e12
            if mode == "fwd" and length == LENGTHS[0]:
              outs[name] = np.asarray(jax.device_get(compiled(*args)), np.float32)
          except Exception as e:  # noqa: BLE001
            notes.append(f"{mode}: {type(e).__name__}: {str(e).splitlines()[0][:80]}")
            if os.environ.get("TPU_CHECK_TRACEBACK"):
              traceback.print_exc(limit=4)
        row["note"] = "; ".join(notes)
        cell = lambda m: (f"{row[m + '_ms']:9.1f} {row[m + '_tflops']:9.2f}"  # noqa: E731
                          if m + "_ms" in row else f"{'-':>9} {'-':>9}")
        print(f"{length:>6} {'causal' if causal else 'full':<6} {name:<30} {cell('fwd')} "
              f"{cell('fb')}  {row['note']}", flush=True)
        rows.append(row)
      if RING_SPLASH in outs and SPLASH in outs:
        diff = float(np.abs(outs[RING_SPLASH] - outs[SPLASH]).max())
        checks.append(dict(L=length, causal=causal, impl=RING_SPLASH, against=SPLASH,
                           max_abs_diff=diff))
        say(f"L={length} {'causal' if causal else 'full'}: max |{RING_SPLASH} - {SPLASH}| = "
            f"{diff:.3e} (bf16 outputs)")

  print(f"\nratios ({RING_SPLASH} / {SPLASH}, and / {RING_XLA}; TF/s):", flush=True)
  by = {(r["L"], r["causal"], r["impl"]): r for r in rows}
  ratios = []
  for length in LENGTHS:
    for causal in (True, False):
      a, b = by.get((length, causal, RING_SPLASH)), by.get((length, causal, SPLASH))
      x = by.get((length, causal, RING_XLA))
      for mode in ("fwd", "fb"):
        key = f"{mode}_tflops"
        if a and b and key in a and key in b:
          ratio = dict(L=length, causal=causal, mode=mode, vs_splash=a[key] / b[key],
                       vs_xla_ring=(a[key] / x[key]) if x and key in x else None)
          ratios.append(ratio)
          print(f"  L={length:>6} {'causal' if causal else 'full':<6} {mode:<3} "
                f"x{ratio['vs_splash']:.2f} of splash"
                + (f", x{ratio['vs_xla_ring']:.2f} of the XLA ring"
                   if ratio["vs_xla_ring"] else ""), flush=True)
  auto = auto_verdict()
  say(auto)
  common.write_result(OUT, dict(
      device=str(jax.devices()[0].device_kind), backend=jax.default_backend(),
      jax=jax.__version__, dry=DRY, date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
      meta=common.run_meta([], __file__), rows=rows, ratios=ratios, checks=checks, auto=auto))
  say(f"wrote {OUT}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
