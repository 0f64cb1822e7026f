# ---
# jupyter:
#   accelerator: TPU
#   colab:
#     accelerator: TPU
#     gpuType: V28
#     name: ring_attention_colab.ipynb
#     provenance: []
#   jupytext:
#     formats: ipynb,py:percent
#     notebook_metadata_filter: accelerator,colab
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Ring attention in JAX: `ring_jax` on a Colab TPU
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/ring-jax/ring_jax/blob/main/notebooks/ring_attention_colab.ipynb)
#
# This notebook shows blockwise **ring attention** (sequence / context parallelism) with
# [`ring_jax`](https://github.com/ring-jax/ring_jax/blob/main/README.md):
#
# 1. install the project and look at the devices;
# 2. build a `(data, tensor, sequence)` mesh from whatever devices exist;
# 3. check ring attention against dense attention, forward and gradients;
# 4. measure per-device memory for growing sequence lengths (ring vs dense);
# 5. train the tiny LLaMA with the project's trainer and plot the loss;
# 6. drop `ring_jax.ring_attention` into your own Flax NNX attention layer.
#
# **Runtime.** On Colab choose *Runtime -> Change runtime type -> TPU*. Anywhere else
# (a laptop, CI) the notebook simulates 8 CPU devices and shrinks every size, so it runs top
# to bottom in a couple of minutes. The guides in `docs/` go further:
# [using the kernel](https://github.com/ring-jax/ring_jax/blob/main/docs/using_the_kernel.md),
# [training](https://github.com/ring-jax/ring_jax/blob/main/docs/training.md),
# [performance](https://github.com/ring-jax/ring_jax/blob/main/docs/performance.md).

# %% [markdown]
# ## 1. Install
#
# Inside a checkout of the repository (for example when CI runs this notebook) nothing is
# installed. On Colab the cell clones the repository and runs `pip install -e .[train]`; on a
# TPU runtime it also installs the matching `jax[tpu]`. Edit `REPO_URL` if you work from a fork.

# %%
import glob
import os
import subprocess
import sys

REPO_URL = "https://github.com/ring-jax/ring_jax.git"


def _is_checkout(path):
  return all(os.path.exists(os.path.join(path, f)) for f in ("ring_jax/__init__.py", "train.py"))


ROOT = next((p for p in (os.getcwd(), os.path.dirname(os.getcwd())) if _is_checkout(p)), None)
if ROOT is None:  # Colab (or any fresh machine): clone and install.
  ROOT = os.path.abspath("ring_jax")
  if not _is_checkout(ROOT):
    subprocess.run(["git", "clone", "--depth=1", REPO_URL, ROOT], check=True)
  subprocess.run([sys.executable, "-m", "pip", "install", "-q", "-e", f"{ROOT}[train]",
                  "matplotlib"], check=True)
  if glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"):  # a TPU VM runtime
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "jax[tpu]>=0.10,<0.13"],
                   check=True)
os.chdir(ROOT)
if ROOT not in sys.path:  # models/, training/, train.py and configs/ run from the checkout
  sys.path.insert(0, ROOT)
print("repository:", ROOT)

# %% [markdown]
# ## 2. Devices
#
# Before JAX starts we ask its CPU backend for 8 devices. This is harmless on a TPU or GPU
# runtime (the accelerators stay the default devices) and gives a laptop or CI machine 8
# simulated devices to build a ring on. Everything below sizes itself by `ON_ACCELERATOR`:
# tiny shapes and few steps on CPU, larger ones on a TPU.

# %%
import jax

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  jax.config.update("jax_num_cpu_devices", 8)

import functools
import time

import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ring_jax

ON_ACCELERATOR = jax.default_backend() != "cpu"
devices = jax.devices()
print(f"jax {jax.__version__}, backend {jax.default_backend()}, {len(devices)} devices:")
for d in devices:
  print("  ", d)

# %% [markdown]
# ## 3. A `(data, tensor, sequence)` mesh
#
# The `sequence` axis is the ring: each device holds `L / ring` tokens and key/value shards
# travel around it. Batch rows go over `data` and attention heads over `tensor`. With 8
# devices (8 TPU cores, or 8 simulated CPU devices) we use `data=2, tensor=1, sequence=4`;
# other device counts get a ring over as many devices as divide 4. On a single-chip runtime
# (e.g. TPU v5e-1) the ring has size 1: everything runs, but nothing travels; pick a
# multi-core TPU runtime (v2-8) to see a real ring, or read
# [docs/training.md](https://github.com/ring-jax/ring_jax/blob/main/docs/training.md) for pod
# slices and multi-GPU hosts. `jax.make_mesh` orders the devices along the physical
# interconnect, so ring neighbours are link neighbours on a TPU.

# %%
n = len(devices)
SEQ = int(np.gcd(n, 4))  # ring size
TP = 1  # tensor parallelism (heads); try 2 with 8 devices
DATA = n // (SEQ * TP)
mesh = jax.make_mesh((DATA, TP, SEQ), ("data", "tensor", "sequence"),
                     axis_types=(jax.sharding.AxisType.Auto,) * 3)
print(mesh.shape)

# %% [markdown]
# ## 4. Ring attention == dense attention (forward and gradients)
#
# `ring_jax.ring_attention_sharded` takes global `[B, L, N, H]` arrays and builds the
# `shard_map` for us. Here: causal, grouped-query attention (4 query heads on 2 key/value
# heads), two packed documents per row (segment ids), and the load-balanced `zigzag` layout.
# The oracle `ring_jax.reference_attention` materialises the whole `[L, L]` score matrix.

# %%
B, L, N, K, H = 2 * DATA, 64 * SEQ, 4, 2, 32
kq, kk, kv, kc = jax.random.split(jax.random.key(0), 4)
q = jax.random.normal(kq, (B, L, N, H), jnp.float32)
k = jax.random.normal(kk, (B, L, K, H), jnp.float32)
v = jax.random.normal(kv, (B, L, K, H), jnp.float32)
cotangent = jax.random.normal(kc, (B, L, N, H), jnp.float32)
# Two documents per row: ids 1 and 2, with the boundary at a different place in each row.
cut = np.array([L // 3, L // 2])[np.arange(B) % 2]
segment_ids = jnp.asarray(1 + (np.arange(L)[None, :] >= cut[:, None]), jnp.int32)

ring = functools.partial(ring_jax.ring_attention_sharded, mesh=mesh, is_causal=True,
                         layout="zigzag", block_q=16, block_kv=16)
dense = functools.partial(ring_jax.reference_attention, is_causal=True)


def loss_and_grads(attn, q, k, v, segment_ids):
  """<attn(q, k, v), cotangent> and its gradients with respect to q, k, v."""
  loss = lambda q, k, v: jnp.sum(attn(q, k, v, segment_ids=segment_ids) * cotangent)
  return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)


out_ring = jax.jit(ring)(q, k, v, segment_ids=segment_ids)
out_dense = dense(q, k, v, segment_ids=segment_ids)
(_, g_ring), (_, g_dense) = (jax.jit(functools.partial(loss_and_grads, ring))(q, k, v, segment_ids),
                             loss_and_grads(dense, q, k, v, segment_ids))


def rel_err(a, b):
  return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))


errors = {"out": rel_err(out_ring, out_dense)}
errors.update({f"d{name}": rel_err(a, b) for name, a, b in zip("qkv", g_ring, g_dense)})
print("max relative error, ring vs dense:", {k_: f"{e:.1e}" for k_, e in errors.items()})
print("output sharding:", out_ring.sharding.spec)
# TPUs run float32 matmuls in bf16 passes by default, hence the looser bound there.
assert max(errors.values()) < (2e-2 if ON_ACCELERATOR else 1e-4), errors

# %% [markdown]
# ## 5. Per-device memory for growing sequence lengths
#
# We compile one forward + backward pass and read XLA's
# `compiled.memory_analysis().temp_size_in_bytes` (scratch memory per device; nothing is
# run). Ring attention never forms more than a `block_q x block_kv` tile of scores per head,
# and its backward pass is a hand-written ring (a `custom_vjp`), so its memory grows
# linearly with the local length `L / ring`. Dense attention on one device holds `[L, L]`
# scores per head: quadratic. bfloat16 inputs, as in training.

# %%
MEM_HEADS, MEM_HEAD_DIM = 4, 64
MEM_LENGTHS = [2**i for i in range(13, 18)] if ON_ACCELERATOR else [512, 1024, 2048]
DENSE_MAX_LEN = 32768  # larger dense programs would not fit a TPU core anyway


def temp_mib(fn, length, sharding=None):
  shape = jax.ShapeDtypeStruct((1 * DATA, length, MEM_HEADS, MEM_HEAD_DIM), jnp.bfloat16,
                               sharding=sharding)
  grad = jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2))
  compiled = jax.jit(grad).lower(shape, shape, shape).compile()
  return compiled.memory_analysis().temp_size_in_bytes / 2**20


# inputs_in_layout=True: measure the attention itself. A model reorders its batch into the
# layout once, in the input pipeline (see section 7); reordering sharded activations inside
# every call would gather the whole sequence.
ring_mem = functools.partial(ring_jax.ring_attention_sharded, mesh=mesh, is_causal=True,
                             layout="zigzag", inputs_in_layout=True)
dense_mem = functools.partial(ring_jax.reference_attention, is_causal=True)
in_sharding = NamedSharding(mesh, P("data", "sequence", "tensor", None))
rows = []
for length in MEM_LENGTHS:
  r = temp_mib(ring_mem, length, in_sharding)
  try:  # an accelerator's compiler refuses programs larger than its memory
    d = temp_mib(dense_mem, length) if length <= DENSE_MAX_LEN else float("nan")
  except Exception as e:  # noqa: BLE001 - e.g. RESOURCE_EXHAUSTED at compile time
    print(f"dense at L={length} does not compile: {str(e).splitlines()[0][:100]}")
    d = float("nan")
  rows.append((length, r, d))
  print(f"L={length:6d}: ring {r:9.1f} MiB per device (local length {length // SEQ}), "
        f"dense on one device {d:9.1f} MiB")

lengths, ring_mib, dense_mib = map(np.array, zip(*rows))
fig, ax = plt.subplots(figsize=(6, 3.5))
ax.loglog(lengths, ring_mib, "o-", label=f"ring over {SEQ} devices (per device)")
ax.loglog(lengths, dense_mib, "s--", label="dense, one device")
ax.set_xlabel("global sequence length L")
ax.set_ylabel("temp memory, fwd+bwd (MiB)")
ax.set_title(f"B={DATA}, {MEM_HEADS} heads x {MEM_HEAD_DIM}, causal, bf16")
ax.legend()
ax.grid(True, which="both", alpha=0.3)
plt.show()

# %% [markdown]
# ## 6. Train the tiny LLaMA
#
# `train.train(config, workdir)` is the trainer `python train.py` runs, callable in-process.
# `configs/tiny.py` is a 2-layer LLaMA on a synthetic long-range retrieval task: key/value
# pairs sit at the start of the sequence and the queries at the end, so answering needs
# attention across the ring. Every attention layer is a ring over the `sequence` axis, in the
# layout `model.layout="auto"` picks at startup (and prints): `document` for these packed
# rows. `TRAIN_STEPS` is small on CPU; on a TPU try a few hundred steps to see the
# retrieval accuracy climb above chance.

# %%
import tempfile

import train as trainer
from configs import tiny
from training import flags as flags_lib

TRAIN_STEPS = int(os.environ.get("RING_JAX_NOTEBOOK_STEPS", 60 if ON_ACCELERATOR else 12))
config = tiny.get_config()
overrides = {"mesh.data": DATA, "mesh.tensor": TP, "mesh.sequence": SEQ,
             "total_steps": TRAIN_STEPS, "optim.warmup_steps": max(1, TRAIN_STEPS // 10),
             "log_every": max(1, TRAIN_STEPS // 6), "eval_every": TRAIN_STEPS,
             "eval_batches": 1, "checkpoint_every": 10 * TRAIN_STEPS}
if not ON_ACCELERATOR:  # smaller model and sequence so it trains in seconds on a CPU
  overrides.update({"model.dim": 32, "model.mlp_dim": 64, "data.seq_len": 64,
                    "batch_size": 8, "eval_batch_size": 8, "data.kv.num_pairs": 4,
                    "data.kv.num_queries": 4})
config = flags_lib.apply_overrides(config, overrides.items())
workdir = tempfile.mkdtemp(prefix="ring_jax_tiny_")
result = trainer.train(config, workdir)

steps = [row["step"] for row in result.history]
losses = [row["loss"] for row in result.history]
fig, ax = plt.subplots(figsize=(6, 3.5))
ax.plot(steps, losses)
ax.set_xlabel("step")
ax.set_ylabel("train loss")
ax.set_title(f"tiny LLaMA, ring attention over sequence={SEQ}")
plt.show()
print("final eval:", {k_: round(v_, 4) for k_, v_ in result.evals[-1].items()})
assert np.isfinite(losses).all() and losses[-1] < losses[0], losses

# %% [markdown]
# ## 7. Ring attention in your own Flax NNX layer
#
# The pattern `models/llama.py` follows, in a minimal self-attention module:
#
# * put the batch in the ring's layout **once** (`ring_jax.to_layout` on tokens / activations
#   and segment ids), and take RoPE positions from `ring_jax.layout_positions`, so every
#   token keeps its true position although it sits elsewhere in the array;
# * in the layer, run `ring_jax.ring_attention` on the local shards inside `jax.shard_map`
#   (or call `ring_jax.ring_attention_sharded(..., inputs_in_layout=True)`, which builds the
#   same `shard_map`);
# * restore natural order (`ring_jax.from_layout`) only where you need it, e.g. for the
#   final logits. Here we compare against the same layer with dense attention on natural
#   order.

# %%
from flax import nnx


def rope(x_BLNH, positions_BL, theta=10_000.0):
  """Rotary embedding at the given (global) positions."""
  half = x_BLNH.shape[-1] // 2
  freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
  angle = positions_BL[:, :, None, None].astype(jnp.float32) * freq
  x1, x2 = x_BLNH[..., :half], x_BLNH[..., half:]
  return jnp.concatenate([x1 * jnp.cos(angle) - x2 * jnp.sin(angle),
                          x2 * jnp.cos(angle) + x1 * jnp.sin(angle)], -1).astype(x_BLNH.dtype)


class SelfAttention(nnx.Module):
  """Causal GQA self-attention whose core is ring attention over the mesh's ``sequence`` axis.

  Inputs are in ``layout`` order when ``ring=True`` (see above); call it under
  ``jax.set_mesh(mesh)``.
  """

  def __init__(self, dim, num_heads, num_kv_heads, *, layout="zigzag", rngs: nnx.Rngs):
    head_dim = dim // num_heads
    self.layout = layout
    self.wq = nnx.LinearGeneral(dim, (num_heads, head_dim), use_bias=False, rngs=rngs)
    self.wk = nnx.LinearGeneral(dim, (num_kv_heads, head_dim), use_bias=False, rngs=rngs)
    self.wv = nnx.LinearGeneral(dim, (num_kv_heads, head_dim), use_bias=False, rngs=rngs)
    self.wo = nnx.LinearGeneral((num_heads, head_dim), dim, axis=(-2, -1), use_bias=False,
                                rngs=rngs)

  def __call__(self, x_BLD, positions_BL, segment_ids_BL, ring: bool = True):
    q = rope(self.wq(x_BLD), positions_BL)
    k = rope(self.wk(x_BLD), positions_BL)
    v = self.wv(x_BLD)
    if ring:
      qkv_spec, row_spec = P("data", "sequence", "tensor", None), P("data", "sequence")

      def local(q, k, v, seg):  # runs per device on its [B/data, L/ring, N/tensor, H] shard
        return ring_jax.ring_attention(q, k, v, axis_name="sequence", is_causal=True,
                                       segment_ids=seg, layout=self.layout)

      o = jax.shard_map(local, in_specs=(qkv_spec, qkv_spec, qkv_spec, row_spec),
                        out_specs=qkv_spec)(q, k, v, segment_ids_BL)  # mesh: jax.set_mesh's
    else:  # the dense oracle; masks by the given positions, so any order works
      o = ring_jax.reference_attention(q, k, v, is_causal=True, segment_ids=segment_ids_BL,
                                       q_positions=positions_BL, kv_positions=positions_BL)
    return self.wo(o)


D = 64
layer = SelfAttention(D, num_heads=4, num_kv_heads=2, rngs=nnx.Rngs(0))
x = jax.random.normal(jax.random.key(1), (B, L, D), jnp.float32)
positions = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L))

# Once per batch: reorder into the layout and take positions from it.
to_layout = functools.partial(ring_jax.to_layout, layout="zigzag", ring_size=SEQ, axis=1)
x_lay, seg_lay = to_layout(x), to_layout(segment_ids)
pos_lay = jnp.broadcast_to(jnp.asarray(ring_jax.layout_positions("zigzag", SEQ, L)), (B, L))
row_sharding = NamedSharding(mesh, P("data", "sequence"))
x_lay = jax.device_put(x_lay, NamedSharding(mesh, P("data", "sequence", None)))
pos_lay, seg_lay = jax.device_put((pos_lay, seg_lay), row_sharding)

graphdef, params = nnx.split(layer)


@functools.partial(jax.jit, static_argnames="ring")
def layer_loss(params, x, positions, segment_ids, ring):
  y = nnx.merge(graphdef, params)(x, positions, segment_ids, ring=ring)
  return jnp.mean(y**2), y


with jax.set_mesh(mesh):
  (loss_r, y_ring), g_ring = jax.value_and_grad(layer_loss, has_aux=True)(
      params, x_lay, pos_lay, seg_lay, ring=True)
(loss_d, y_dense), g_dense = jax.value_and_grad(layer_loss, has_aux=True)(
    params, x, positions, segment_ids, ring=False)

y_ring = ring_jax.from_layout(y_ring, "zigzag", SEQ, axis=1)  # back to natural order
err_y = rel_err(y_ring, y_dense)
err_g = max(jax.tree.leaves(jax.tree.map(rel_err, g_ring, g_dense)))
print(f"own layer, ring vs dense: output rel. error {err_y:.1e}, "
      f"weight-gradient rel. error {err_g:.1e}")
assert max(err_y, err_g) < (2e-2 if ON_ACCELERATOR else 1e-4)

# %% [markdown]
# `ring_jax.ring_attention_sharded(q, k, v, is_causal=True, segment_ids=seg,
# layout="zigzag", inputs_in_layout=True)` replaces the explicit `shard_map` above with one
# call (it reads the mesh set with `jax.set_mesh`, shards batch over `data` and heads over
# `tensor` too). See
# [docs/using_the_kernel.md](https://github.com/ring-jax/ring_jax/blob/main/docs/using_the_kernel.md)
# for segment ids, GQA/MQA under tensor parallelism, sliding windows and block sizes, and
# [docs/performance.md](https://github.com/ring-jax/ring_jax/blob/main/docs/performance.md) for
# choosing the ring size and layout.
