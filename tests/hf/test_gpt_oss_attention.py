"""GPT-OSS's attention (learned sinks, alternating 128-token sliding windows, q/k/v biases,
YaRN RoPE) as the model's attention layer (``LlamaConfig.attn_sinks``) against transformers'
own ``GptOssAttention``, forward and gradients, with ring attention on a data=2 x sequence=4
mesh; and the sink / soft-cap paths of the dense reference and of KV-cache decoding against
the ring. (GPT-OSS's mixture-of-experts MLP is not part of this model.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import ring_jax
from models import sharding as shd
from models.llama import (Attention, LlamaConfig, backend_attend, rope_attention_factor,
                          rope_inv_freq, rope_tables)
from training import mesh as mesh_lib

HF_TEST = ("pip install torch --index-url https://download.pytorch.org/whl/cpu && "
           "pip install -e '.[dev,hf-test]'")

#: GPT-OSS's RoPE (transformers' GptOssConfig default) with its rope_theta.
GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 4096}
WINDOW = 128  # GPT-OSS's sliding_window
LENGTH = 256  # 64 tokens per device of a ring of 4: the window prunes hops


def _hf_attention(layer_idx: int, seed: int = 0):
  """A tiny ``GptOssAttention`` (4 query heads, 2 kv heads of 16; layer 0 sliding, layer 1
  full, as GptOssConfig alternates them) with random weights, biases and sinks of up to
  ~|8| (a zero sink would hide a sink counted wrongly). Its ``o_proj`` bias (not a field of
  ours) is set to 0."""
  torch = pytest.importorskip("torch", reason=HF_TEST)
  transformers = pytest.importorskip("transformers", reason=HF_TEST)
  from transformers.models.gpt_oss import modeling_gpt_oss

  config = transformers.GptOssConfig(
      hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
      num_hidden_layers=2, sliding_window=WINDOW, num_local_experts=2, vocab_size=64,
      intermediate_size=32, rope_parameters=dict(GPT_OSS_ROPE, rope_theta=150000.0))
  config._attn_implementation = "eager"
  assert config.layer_types == ["sliding_attention", "full_attention"]
  torch.manual_seed(seed + layer_idx)
  module = modeling_gpt_oss.GptOssAttention(config, layer_idx).eval()
  with torch.no_grad():
    for name, p in module.named_parameters():
      p.copy_(0.2 * torch.randn_like(p))
    module.sinks.copy_(torch.tensor([-8.0, -1.0, 2.5, 8.0]))
    module.o_proj.bias.zero_()
  rotary = modeling_gpt_oss.GptOssRotaryEmbedding(config)
  return torch, config, module, rotary


def _hf_forward_and_grads(torch, config, module, rotary, x_BLD, g_BLD):
  """Their output, and the gradients of ``sum(out * g)`` w.r.t. the input and the sinks."""
  x = torch.tensor(x_BLD, requires_grad=True)
  b, length = x_BLD.shape[:2]
  positions = torch.arange(length)[None].expand(b, -1)
  cos, sin = rotary(x, positions)
  q, k = torch.arange(length)[:, None], torch.arange(length)[None, :]
  visible = k <= q
  if module.sliding_window is not None:  # transformers' sliding_window_overlay: k > q - w
    visible &= k > q - module.sliding_window
  mask = torch.where(visible, 0.0, torch.finfo(torch.float32).min)[None, None]
  module.zero_grad()
  out, _ = module(x, (cos, sin), mask.expand(b, 1, length, length))
  (out * torch.tensor(g_BLD)).sum().backward()
  return (out.detach().numpy(), x.grad.numpy(), module.sinks.grad.numpy().copy())


def _ours(module, window, attention="ring"):
  """Our attention layer (``attn_sinks``, ``qkv_bias``, GPT-OSS's YaRN) holding
  ``module``'s weights."""
  cfg = LlamaConfig(dim=64, num_heads=4, num_kv_heads=2, head_dim=16, qkv_bias=True,
                    attn_sinks=True, rope_theta=150000.0, rope_scaling=GPT_OSS_ROPE,
                    attention=attention, layout="zigzag", block_q=16, block_kv=16)
  attn = Attention(cfg, rngs=nnx.Rngs(0))
  w = lambda p: np.asarray(p.detach().numpy(), np.float32)
  d, n, k, h = 64, 4, 2, 16
  attn.wq.set_value(jnp.asarray(w(module.q_proj.weight).reshape(n, h, d).transpose(2, 0, 1)))
  attn.wk.set_value(jnp.asarray(w(module.k_proj.weight).reshape(k, h, d).transpose(2, 0, 1)))
  attn.wv.set_value(jnp.asarray(w(module.v_proj.weight).reshape(k, h, d).transpose(2, 0, 1)))
  attn.wo.set_value(jnp.asarray(w(module.o_proj.weight).reshape(d, n, h).transpose(1, 2, 0)))
  attn.bq.set_value(jnp.asarray(w(module.q_proj.bias).reshape(n, h)))
  attn.bk.set_value(jnp.asarray(w(module.k_proj.bias).reshape(k, h)))
  attn.bv.set_value(jnp.asarray(w(module.v_proj.bias).reshape(k, h)))
  attn.sinks.set_value(jnp.asarray(w(module.sinks)))
  assert attn.sinks[...].dtype == jnp.float32
  return cfg, attn


def _ours_forward_and_grads(cfg, attn, window, x_BLD, g_BLD, mesh):
  """Our output and the gradients of ``sum(out * g)`` w.r.t. the input and the sinks, with
  ring attention over the mesh's sequence axis (inputs in ``cfg.layout`` order, results back
  in natural order)."""
  ring = mesh.shape["sequence"]
  to = lambda a: np.asarray(ring_jax.to_layout(a, cfg.layout, ring))
  back = lambda a: np.asarray(ring_jax.from_layout(np.asarray(a), cfg.layout, ring))
  b, length = x_BLD.shape[:2]
  positions_BL = to(np.broadcast_to(np.arange(length), (b, length)).astype(np.int32))
  graphdef, state = nnx.split(attn)
  inv_freq = rope_inv_freq(cfg)
  factor = rope_attention_factor(cfg)

  def loss(state, x_BLD, g_BLD):
    layer = nnx.merge(graphdef, state)
    cos, sin = rope_tables(positions_BL, inv_freq, factor)
    with shd.use_rules(cfg.logical_rules):
      out, _ = layer.forward(x_BLD, cos, sin,
                             backend_attend(cfg, positions_BL, None, window=window))
    return jnp.sum(out * g_BLD), out

  with jax.set_mesh(mesh):
    grad_fn = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))
    (d_state, dx), out = grad_fn(state, to(x_BLD), to(g_BLD))
  return back(out), back(dx), np.asarray(d_state["sinks"][...])


@pytest.mark.parametrize("layer_idx,attention,mesh_shape", [
    (0, "ring", dict(data=2, sequence=4, tensor=1)),
    (1, "ring", dict(data=2, sequence=4, tensor=1)),
    (0, "ring", dict(data=2, sequence=2, tensor=2)),  # sinks split with their heads
    (0, "dense", dict(data=2, sequence=2, tensor=2)),
    # sinks in the other strategies: sliced to the heads each device attends after Ulysses'
    # all_to_all (heads over tensor=2 too), and in the hybrid over (sequence, tensor)
    (0, "ulysses", dict(data=2, sequence=2, tensor=2)),
    (1, "hybrid", dict(data=2, sequence=2, tensor=2)),
    (0, "all_gather", dict(data=2, sequence=4, tensor=1)),
], ids=["sliding128-ring4", "full-ring4", "sliding128-ring2-tensor2", "sliding128-dense",
        "sliding128-ulysses2-tensor2", "full-hybrid2x2", "sliding128-all_gather4"])
def test_gpt_oss_attention_layer_matches_transformers(layer_idx, attention, mesh_shape):
  """Our attention layer with GPT-OSS's sinks (and, on layer 0, its 128-token window) equals
  transformers' GptOssAttention on a 256-token batch: output, d input and d sinks (float32,
  rtol/atol 1e-4), the ring running over the mesh's sequence axis in zigzag order (or the
  dense backend, or the Ulysses, hybrid and all-gather strategies), heads split over tensor
  where it is 2."""
  torch, config, module, rotary = _hf_attention(layer_idx)
  window = module.sliding_window
  assert window == (WINDOW if layer_idx == 0 else None)
  rng = np.random.default_rng(layer_idx)
  x_BLD = rng.normal(size=(2, LENGTH, 64)).astype(np.float32)
  g_BLD = rng.normal(size=(2, LENGTH, 64)).astype(np.float32)
  want_out, want_dx, want_dsinks = _hf_forward_and_grads(torch, config, module, rotary,
                                                         x_BLD, g_BLD)
  cfg, attn = _ours(module, window, attention)
  mesh = mesh_lib.make_mesh(mesh_shape)
  out, dx, dsinks = _ours_forward_and_grads(cfg, attn, window, x_BLD, g_BLD, mesh)
  np.testing.assert_allclose(out, want_out, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(dx, want_dx, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(dsinks, want_dsinks, rtol=1e-4, atol=1e-4)
  assert np.abs(want_dsinks).max() > 1e-2  # the sinks matter to the loss
  # Not vacuous: without the sinks (or the window) the output differs.
  attn.sinks.set_value(jnp.full((4,), -jnp.inf))
  no_sinks, _, _ = _ours_forward_and_grads(cfg, attn, window, x_BLD, g_BLD, mesh)
  assert np.abs(no_sinks - want_out).max() > 1e-2
  if window is not None:
    attn.sinks.set_value(jnp.asarray(module.sinks.detach().numpy()))
    no_window, _, _ = _ours_forward_and_grads(cfg, attn, None, x_BLD, g_BLD, mesh)
    assert np.abs(no_window - want_out).max() > 1e-2


def _qkv(seed, b=2, length=32, n=4, k=2, h=16):
  rng = np.random.default_rng(seed)
  return (jnp.asarray(rng.normal(size=(b, length, n, h)), jnp.float32),
          jnp.asarray(rng.normal(size=(b, length, k, h)), jnp.float32),
          jnp.asarray(rng.normal(size=(b, length, k, h)), jnp.float32))


@pytest.mark.parametrize("window", [None, 8])
def test_reference_sinks_and_soft_cap_equal_the_ring(window):
  """ring_jax.reference_attention (the model's dense backend) with sinks of |s| up to 6 and a
  soft-cap equals ring_attention_sharded on a ring of 4 (float32), outputs and d(q, k, v,
  sinks); and the sinks and cap are not vacuous."""
  q, k, v = _qkv(0)
  q = 3.0 * q  # scores of order 10: the cap of 4 bends them
  sinks = jnp.asarray([-6.0, 0.5, 2.0, 6.0])
  mesh = jax.make_mesh((4,), ("sequence",))
  opts = dict(is_causal=True, local_window_size=None if window is None else (window - 1, 0),
              scale=0.2, logits_soft_cap=4.0)

  def ref(q, k, v, sinks):
    return ring_jax.reference_attention(q, k, v, sinks=sinks, **opts)

  def ring(q, k, v, sinks):
    return ring_jax.ring_attention_sharded(q, k, v, mesh=mesh, sinks=sinks, block_q=4,
                                           block_kv=4, **opts)

  g = jnp.asarray(np.random.default_rng(1).normal(size=q.shape), jnp.float32)
  grads = lambda f: jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) * g), argnums=(0, 1, 2, 3)))
  np.testing.assert_allclose(ref(q, k, v, sinks), ring(q, k, v, sinks), rtol=1e-5, atol=1e-5)
  for a, b in zip(grads(ref)(q, k, v, sinks), grads(ring)(q, k, v, sinks)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
  base = ring_jax.reference_attention(q, k, v, is_causal=True, scale=0.2,
                                      local_window_size=opts["local_window_size"])
  assert np.abs(ref(q, k, v, sinks) - base).max() > 1e-2
  uncapped = ring_jax.reference_attention(q, k, v, sinks=sinks, is_causal=True, scale=0.2,
                                          local_window_size=opts["local_window_size"])
  assert np.abs(ref(q, k, v, sinks) - uncapped).max() > 1e-2


def test_decode_sinks_and_soft_cap_equal_the_reference():
  """KV-cache decoding (ring_jax.decode.cache_attention, the cache split over 4 devices and
  merged by log-sum-exp, the new token's own key merged after) with sinks and a soft-cap
  gives the last rows of reference_attention over the whole sequence."""
  from ring_jax import decode

  q, k, v = _qkv(2, length=16)
  q = 3.0 * q
  sinks = jnp.asarray([-6.0, 0.5, 2.0, 6.0])
  opts = dict(scale=0.2, logits_soft_cap=4.0)
  want = ring_jax.reference_attention(q, k, v, is_causal=True, sinks=sinks, **opts)[:, -1:]
  mesh = jax.make_mesh((4,), ("sequence",))
  b, length = q.shape[:2]
  positions = jnp.broadcast_to(jnp.arange(length - 1, dtype=jnp.int32), (b, length - 1))
  positions = jnp.concatenate([positions, jnp.zeros((b, 1), jnp.int32)], axis=1)
  segments = jnp.concatenate([jnp.ones((b, length - 1), jnp.int32),
                              jnp.zeros((b, 1), jnp.int32)], axis=1)  # one empty slot
  q_pos = jnp.full((b, 1), length - 1, jnp.int32)
  q_seg = jnp.ones((b, 1), jnp.int32)
  P = jax.P

  def step(q, k_new, v_new, k_cache, v_cache, kv_pos, kv_seg, sinks):
    return decode.cache_attention(q, k_cache, v_cache, q_pos, q_seg, kv_pos, kv_seg,
                                  new_kv=(k_new, v_new), axis_name="sequence", sinks=sinks,
                                  **opts)

  specs = (P(), P(), P(), P(None, "sequence"), P(None, "sequence"), P(None, "sequence"),
           P(None, "sequence"), P())
  shard_fn = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=specs, out_specs=P()))
  put = lambda *args: [jax.device_put(a, jax.NamedSharding(mesh, s))
                       for a, s in zip(args, specs)]
  fn = lambda *args: shard_fn(*put(*args))
  got = fn(q[:, -1:], k[:, -1:], v[:, -1:], k, v, positions, segments, sinks)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  no_sinks = fn(q[:, -1:], k[:, -1:], v[:, -1:], k, v, positions, segments,
                jnp.full((4,), -jnp.inf))
  assert np.abs(no_sinks - want).max() > 1e-2


def test_model_with_sinks_decodes_as_it_recomputes():
  """A model with every score option (sinks of up to |4|, soft-cap, query_pre_attn_scalar,
  a 16-token window on every other layer of 4, scanned as one pattern) prefills with ring
  attention on data=2 x sequence=4, decodes from the sharded KV cache, and its greedy tokens
  equal the dense full recompute at every step."""
  from models import inference
  from tests import model_utils

  cfg = LlamaConfig(vocab_size=64, dim=64, num_layers=4, num_heads=4, num_kv_heads=2,
                    mlp_dim=128, init_std=0.3, attn_sinks=True, attn_logits_soft_cap=8.0,
                    query_pre_attn_scalar=24.0, sliding_window=16,
                    layer_types=("sliding_attention", "full_attention") * 2, layout="zigzag")
  assert cfg.layer_segments == ((0, 4, (16, None)),)  # the cache folds into the pattern scan
  params = model_utils.random_params(cfg, seed=3)
  sinks = params["layers"]["attn"]["sinks"]
  sinks.set_value(jnp.asarray([[-4.0, -1.0, 1.0, 4.0], [3.0, -3.0, 0.0, 2.0]] * 2))
  rng = np.random.default_rng(5)
  prompts = [rng.integers(3, 64, 21).tolist(), rng.integers(3, 64, 9).tolist()]
  want = model_utils.dense_greedy(cfg, params, prompts, 24)
  mesh = model_utils.make_mesh(auto=True, data=2, sequence=4)
  gen = inference.Generator(cfg, shd.shard_params(params, mesh), mesh, 64)
  tokens = np.stack(list(gen.generate(prompts, 24)), axis=1)
  np.testing.assert_array_equal(tokens, want)
