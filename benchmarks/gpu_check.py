"""One-GPU check (H200): attention TFLOP/s, longest trainable context, train-step MFU.

Run through ``benchmarks/gpu_check.sh`` (``PYTHONPATH=.``). Needs only jax and
ring_jax (no flax / ml_collections / grain): the 1B-class LLaMA here is a
self-contained pure-JAX model. Every section is wrapped in try/except (a
failure is printed and the next section runs) and the whole script keeps to a
global time budget (``GPU_CHECK_BUDGET_S``, default 450 s): cases that would
start after the budget are skipped and say so.

Sections:
  1. Per-device blockwise attention (ring_jax.ring_attention on a 1-device
     mesh, i.e. ring size 1) forward and forward+backward TFLOP/s at 8K / 32K /
     128K, bf16, causal and non-causal, next to
     ``jax.nn.dot_product_attention(implementation="cudnn")`` and ``"xla"``
     (cases whose compiled memory exceeds the GPU are reported, not run).
  2. Longest context at which a 1B-class LLaMA train step (blockwise ring
     attention + blockwise FFN + per-layer remat + chunked loss) fits, by
     doubling from 32K: compiled memory (``memory_analysis``) against the
     device's ``bytes_limit``; contexts up to ``GPU_CHECK_RUN_MAX`` (default
     64K) are also run once to confirm.
  3. Tokens/s and MFU of that train step at 32K.

``GPU_CHECK_DRY=1`` runs everything at tiny sizes on CPU (CI smoke test).

FLOP conventions: attention forward = 4*B*N*L^2*H (x0.5 causal), backward
= 2.5x forward (FlashAttention-2 convention; recomputation not counted).
Train step: 6*params_matmul + 6*layers*L*N*H per token (causal-halved
attention, PaLM App. B); remat recomputation not counted (MFU, not HFU).
"""

from __future__ import annotations

import functools
import math
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ring_jax  # noqa: E402

DRY = os.environ.get("GPU_CHECK_DRY", "0") not in ("", "0")
BUDGET_S = float(os.environ.get("GPU_CHECK_BUDGET_S", "300" if DRY else "450"))
MAX_LEN = int(os.environ.get("GPU_CHECK_MAX_LEN", 1024 if DRY else 4 * 2 ** 20))
RUN_MAX = int(os.environ.get("GPU_CHECK_RUN_MAX", 1024 if DRY else 65536))
# bf16 on the GPU; the CPU dry run uses float32 (XLA:CPU bf16 matmuls are very slow).
DTYPE = jnp.float32 if DRY else jnp.bfloat16
# Section 1 starts no new case after this many seconds, leaving time for sections 2-3.
ATTN_DEADLINE_S = float(os.environ.get("GPU_CHECK_ATTN_S", 0.5 * BUDGET_S))
T0 = time.perf_counter()
GIB = 2 ** 30
# H200 SXM dense bf16 peak (no sparsity); override with GPU_PEAK_TFLOPS.
PEAK_TFLOPS = float(os.environ.get("GPU_PEAK_TFLOPS", "989"))


def elapsed():
  return time.perf_counter() - T0


def left():
  return BUDGET_S - elapsed()


def say(*a):
  print(f"[{elapsed():6.1f}s]", *a, flush=True)


def section(fn):
  @functools.wraps(fn)
  def wrapped(*a, **k):
    say(f"===== {fn.__name__} =====")
    try:
      return fn(*a, **k)
    except Exception as e:  # noqa: BLE001
      say(f"SECTION FAILED: {type(e).__name__}: {e}")
      traceback.print_exc(limit=3)
      return None
  return wrapped


def gib(x):
  if x is None:
    return "n/a"
  return f"{x / GIB:.1f} GiB" if x >= GIB else f"{x / 2 ** 20:.1f} MiB"


def device_limit():
  if os.environ.get("GPU_CHECK_LIMIT_GIB"):  # testing the search logic on CPU
    return int(float(os.environ["GPU_CHECK_LIMIT_GIB"]) * GIB)
  try:
    stats = jax.devices()[0].memory_stats() or {}
    return int(stats.get("bytes_limit", 0)) or None
  except Exception:  # noqa: BLE001
    return None


def need_bytes(compiled):
  ma = compiled.memory_analysis()
  if ma is None:
    return None
  return (ma.temp_size_in_bytes + ma.argument_size_in_bytes + ma.output_size_in_bytes -
          getattr(ma, "alias_size_in_bytes", 0))


def bench(compiled, args, repeats):
  jax.block_until_ready(compiled(*args))
  ts = []
  for _ in range(repeats):
    t = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    ts.append(time.perf_counter() - t)
  return float(np.median(ts))


# ----------------------------------------------------------------------------
# 1. attention TFLOP/s
# ----------------------------------------------------------------------------

def attn_impls(mesh, causal, block):
  spec = P(None, "sequence", None, None)
  ring = jax.shard_map(
      functools.partial(ring_jax.ring_attention, axis_name="sequence", is_causal=causal,
                        block_q=block, block_kv=block),
      mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
  out = {"ring_jax blockwise (ring=1)": ring}
  for impl in ("cudnn", "xla"):
    out[f"dot_product_attention[{impl}]"] = functools.partial(
        jax.nn.dot_product_attention, is_causal=causal, implementation=impl)
  return out


@section
def attention_tflops():
  lengths = [512, 1024] if DRY else [8192, 32768, 131072]
  b, n, h = (1, 4, 64) if DRY else (1, 16, 128)
  block = int(os.environ.get("GPU_CHECK_BLOCK", "0")) or None
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("sequence",))
  limit = device_limit()
  dtype = DTYPE
  say(f"B={b} N={n} H={h} {jnp.dtype(dtype).name}, ring block={block or 'default'}; "
      f"device limit {gib(limit)}")
  print(f"{'L':>7} {'mask':<7} {'impl':<30} {'fwd ms':>9} {'fwd TF/s':>9} "
        f"{'f+b ms':>9} {'f+b TF/s':>9}  note", flush=True)
  results = []
  for length in lengths:
    ks = jax.random.split(jax.random.key(0), 4)
    q, k, v, do = (jax.random.normal(x, (b, length, n, h), dtype) for x in ks)
    for causal in (True, False):
      fwd_flops = 4 * b * n * length * length * h * (0.5 if causal else 1.0)
      for name, f in attn_impls(mesh, causal, block).items():
        row = dict(L=length, causal=causal, impl=name)
        cells = {}
        for mode, fn, a in (("fwd", f, (q, k, v)),
                            ("fb", lambda q, k, v, do, f=f: jax.vjp(f, q, k, v)[1](do),
                             (q, k, v, do))):
          if left() < 20 or elapsed() > ATTN_DEADLINE_S:
            cells[mode] = "skipped (time budget)"
            continue
          try:
            c = jax.jit(fn).lower(*a).compile()
            nb = need_bytes(c)
            if limit and nb and nb > limit:
              cells[mode] = f"OOM (compiled needs {nb / GIB:.0f} GiB)"
              continue
            reps = 2 if length >= 131072 else 5
            t = bench(c, a, reps)
            fl = fwd_flops * (1 if mode == "fwd" else 3.5)
            row[mode] = (t, fl / t / 1e12)
          except Exception as e:  # noqa: BLE001
            cells[mode] = f"{type(e).__name__}: {str(e).splitlines()[0][:90]}"
        cell = lambda m: (f"{1e3 * row[m][0]:9.1f} {row[m][1]:9.1f}" if m in row
                          else f"{'-':>9} {'-':>9}")
        print(f"{length:>7} {'causal' if causal else 'full':<7} {name:<30} {cell('fwd')} "
              f"{cell('fb')}  {'; '.join(f'{k_}: {v_}' for k_, v_ in cells.items())}",
              flush=True)
        results.append(row)
  return results


# ----------------------------------------------------------------------------
# 2./3. 1B-class LLaMA train step (pure JAX)
# ----------------------------------------------------------------------------

def llama_config():
  if DRY:
    return dict(vocab=512, dim=128, layers=2, heads=4, kv_heads=2, head_dim=32, mlp=256,
                ffn_chunk=128, loss_chunk=128)
  # LLaMA-3.2-1B shapes with a 32K vocabulary (LLaMA-2 tokenizer size): 1.1B parameters.
  return dict(vocab=32000, dim=2048, layers=16, heads=32, kv_heads=8, head_dim=64, mlp=8192,
              ffn_chunk=4096, loss_chunk=4096)


def init_params(cfg, key):
  d, f, h = cfg["dim"], cfg["mlp"], cfg["head_dim"]
  nl, n, kv = cfg["layers"], cfg["heads"], cfg["kv_heads"]
  ks = iter(jax.random.split(key, 16))
  w = lambda shape: (0.02 * jax.random.normal(next(ks), shape, jnp.float32))
  return dict(
      embed=w((cfg["vocab"], d)), head=w((d, cfg["vocab"])), norm=jnp.ones((d,)),
      layers=dict(attn_norm=jnp.ones((nl, d)), mlp_norm=jnp.ones((nl, d)),
                  wq=w((nl, d, n * h)), wk=w((nl, d, kv * h)), wv=w((nl, d, kv * h)),
                  wo=w((nl, n * h, d)), w1=w((nl, d, f)), w3=w((nl, d, f)), w2=w((nl, f, d))))


def num_matmul_params(cfg):
  d, f, h = cfg["dim"], cfg["mlp"], cfg["head_dim"]
  per = d * h * (2 * cfg["heads"] + 2 * cfg["kv_heads"]) + 3 * d * f
  return cfg["layers"] * per + d * cfg["vocab"]


def train_flops_per_token(cfg, length):
  return 6 * num_matmul_params(cfg) + 6 * cfg["layers"] * length * cfg["heads"] * cfg["head_dim"]


def rms(x, w):
  x32 = x.astype(jnp.float32)
  return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-5) * w).astype(x.dtype)


def rope(x, pos):
  h = x.shape[-1]
  inv = 1.0 / (500000.0 ** (np.arange(0, h, 2) / h))
  ang = pos[..., None].astype(jnp.float32) * inv  # [B, L, H/2]
  cos, sin = jnp.cos(ang)[:, :, None], jnp.sin(ang)[:, :, None]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, -1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


def make_loss(cfg, mesh):
  dt = DTYPE
  n, kv, h = cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
  spec = P(None, "sequence", None, None)
  attn = jax.shard_map(functools.partial(ring_jax.ring_attention, axis_name="sequence",
                                         is_causal=True),
                       mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)

  def layer(x, p, pos):
    b, length, d = x.shape
    y = rms(x, p["attn_norm"])
    q = rope((y @ p["wq"].astype(dt)).reshape(b, length, n, h), pos)
    k = rope((y @ p["wk"].astype(dt)).reshape(b, length, kv, h), pos)
    v = (y @ p["wv"].astype(dt)).reshape(b, length, kv, h)
    x = x + attn(q, k, v).reshape(b, length, n * h) @ p["wo"].astype(dt)

    def mlp(z):
      z = rms(z, p["mlp_norm"])
      return (jax.nn.silu(z @ p["w1"].astype(dt)) * (z @ p["w3"].astype(dt))) @ p["w2"].astype(dt)
    return x + ring_jax.blockwise_ffn(mlp, x, min(cfg["ffn_chunk"], length))

  layer = jax.checkpoint(layer, policy=jax.checkpoint_policies.nothing_saveable)

  def loss_fn(params, tokens, targets):
    b, length = tokens.shape
    pos = jnp.broadcast_to(jnp.arange(length), (b, length))
    x = params["embed"].astype(dt)[tokens]
    x, _ = jax.lax.scan(lambda x, p: (layer(x, p, pos), None), x, params["layers"])
    x = rms(x, params["norm"])
    c = min(cfg["loss_chunk"], length)

    @functools.partial(jax.checkpoint, policy=jax.checkpoint_policies.nothing_saveable)
    def chunk_loss(xc, tc):  # chunked cross-entropy: never materialises [L, vocab]
      logits = jnp.dot(xc, params["head"].astype(dt), preferred_element_type=jnp.float32)
      lse = jax.nn.logsumexp(logits, -1)
      return jnp.sum(lse - jnp.take_along_axis(logits, tc[..., None], -1)[..., 0])

    xs = x.reshape(b, length // c, c, -1).swapaxes(0, 1)
    ts = targets.reshape(b, length // c, c).swapaxes(0, 1)
    total, _ = jax.lax.scan(lambda s, a: (s + chunk_loss(*a), None), 0.0, (xs, ts))
    return total / (b * length)
  return loss_fn


def make_train_step(cfg, mesh, lr=1e-4):
  loss_fn = make_loss(cfg, mesh)

  def step(params, opt, tokens, targets):
    loss, g = jax.value_and_grad(loss_fn)(params, tokens, targets)
    m, v, t = opt
    t = t + 1
    m = jax.tree.map(lambda m_, g_: 0.9 * m_ + 0.1 * g_, m, g)
    v = jax.tree.map(lambda v_, g_: 0.95 * v_ + 0.05 * g_ * g_, v, g)
    params = jax.tree.map(
        lambda p_, m_, v_: p_ - lr * (m_ / (1 - 0.9 ** t)) /
        (jnp.sqrt(v_ / (1 - 0.95 ** t)) + 1e-8), params, m, v)
    return params, (m, v, t), loss
  return jax.jit(step, donate_argnums=(0, 1))


def abstract_state(cfg):
  params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
  zeros = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
  return params, (zeros, zeros, jax.ShapeDtypeStruct((), jnp.int32))


@section
def longest_context(known_fit=None):
  """Doubling from 32K over powers of two; after two compiled points, compiled memory
  (linear in L) is extrapolated to jump to the first power of two predicted not to fit,
  and the answer is confirmed by compiling it and its neighbour (compiles are the cost)."""
  cfg = llama_config()
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("sequence",))
  limit = device_limit()
  say(f"1B-class LLaMA: {num_matmul_params(cfg) / 1e9:.2f}B matmul params, {cfg}; "
      f"device limit {gib(limit)}; f32 params + Adam, {jnp.dtype(DTYPE).name} compute")
  step = make_train_step(cfg, mesh)
  params_a, opt_a = abstract_state(cfg)
  seen = {}  # length -> (needed bytes or None, fits)

  def check(length):
    if length in seen:
      return seen[length][1]
    tok = jax.ShapeDtypeStruct((1, length), jnp.int32)
    t = time.perf_counter()
    try:
      c = step.lower(params_a, opt_a, tok, tok).compile()
    except Exception as e:  # noqa: BLE001
      say(f"L={length:>8}: compile failed ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
          " -> counted as not fitting")
      seen[length] = (None, False)
      return False
    nb = need_bytes(c)
    fits = nb is not None and (limit is None or nb <= limit)
    say(f"L={length:>8}: compiled needs {gib(nb)} (compile {time.perf_counter() - t:.0f}s) "
        f"-> {'fits' if fits else 'does NOT fit'}")
    if fits and length <= RUN_MAX and left() > 60:
      try:
        params = init_params(cfg, jax.random.key(0))
        opt = (jax.tree.map(jnp.zeros_like, params), jax.tree.map(jnp.zeros_like, params),
               jnp.zeros((), jnp.int32))
        tokens = jax.random.randint(jax.random.key(1), (1, length), 0, cfg["vocab"])
        t = time.perf_counter()
        params, opt, loss = c(params, opt, tokens, tokens)
        say(f"L={length:>8}: ran one step in {time.perf_counter() - t:.1f}s, "
            f"loss {float(loss):.3f}")
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
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("sequence",))
  step = make_train_step(cfg, mesh)
  params = init_params(cfg, jax.random.key(0))
  opt = (jax.tree.map(jnp.zeros_like, params), jax.tree.map(jnp.zeros_like, params),
         jnp.zeros((), jnp.int32))
  tokens = jax.random.randint(jax.random.key(1), (1, length), 0, cfg["vocab"])
  for _ in range(2):  # compile + warm-up (the 2nd call sees committed outputs as inputs)
    params, opt, loss = step(params, opt, tokens, tokens)
    jax.block_until_ready(loss)
  times = []
  for i in range(2 if DRY else 5):
    if i and left() < 10:
      break
    t = time.perf_counter()
    params, opt, loss = step(params, opt, tokens, tokens)
    jax.block_until_ready(loss)
    times.append(time.perf_counter() - t)
  dt = float(np.median(times))
  tps = length / dt
  fl = train_flops_per_token(cfg, length)
  peak = PEAK_TFLOPS * 1e12
  say(f"L={length}: step {dt * 1e3:.0f} ms, {tps:,.0f} tokens/s, "
      f"{fl * tps / 1e12:.1f} model TFLOP/s, MFU {fl * tps / peak:.1%} "
      f"(peak {PEAK_TFLOPS:g} TFLOP/s bf16 dense; loss {float(loss):.3f})")
  return dict(length=length, step_s=dt, tokens_per_s=tps, mfu=fl * tps / peak)


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
