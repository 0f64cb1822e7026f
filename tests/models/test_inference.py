"""Prefill + sequence-sharded KV cache + decode (models/inference.py, ring_jax/decode.py).

The oracle recomputes every row from scratch at every step with dense
attention on one device (no mesh, no cache, no padding): greedy decoding over
the ring-prefilled, sequence-sharded cache must produce the same tokens.
"""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import ring_jax
from models import inference
from models import sharding as shd
from models.llama import LlamaConfig
from ring_jax import decode as decode_lib
from tests import model_utils

# Packed rows: prompt 1 holds two documents, generation continues the second.
PROMPTS_RNG = np.random.default_rng(7)
PROMPTS = [
    PROMPTS_RNG.integers(3, 64, 21).tolist(),
    [PROMPTS_RNG.integers(3, 64, 9).tolist(), PROMPTS_RNG.integers(3, 64, 5).tolist()],
    PROMPTS_RNG.integers(3, 64, 3).tolist(),
    PROMPTS_RNG.integers(3, 64, 30).tolist(),
]
STEPS = 64
CACHE_LEN = 128


def _cfg(**kw):
  # A larger init_std than training's spreads the logits, so the greedy argmax is never a
  # near-tie that float rounding (ring vs dense summation order) could flip.
  base = dict(vocab_size=64, dim=64, num_layers=2, num_heads=4, num_kv_heads=2, mlp_dim=128,
              init_std=0.3)
  base.update(kw)
  return LlamaConfig(**base)


@pytest.fixture(scope="module")
def params():
  return model_utils.random_params(_cfg(), seed=3)


@pytest.fixture(scope="module")
def oracle(params):
  return model_utils.dense_greedy(_cfg(), params, PROMPTS, STEPS)


SEQ_TENSOR = dict(sequence=4, tensor=2)


@pytest.mark.parametrize("layout,padding,auto,sizes", [
    ("zigzag", "left", True, SEQ_TENSOR), ("contiguous", "right", True, SEQ_TENSOR),
    ("zigzag", "right", False, SEQ_TENSOR), ("document", "right", True, SEQ_TENSOR),
    # The two-level mesh: prefill by the two-level ring, the cache over both axes.
    ("zigzag", "left", False, dict(sequence_outer=2, sequence=4))])
def test_greedy_matches_dense_recompute(params, oracle, layout, padding, auto, sizes):
  """sequence=4 x tensor=2 (and sequence_outer=2 x sequence=4), GQA, a batch of different
  lengths (one row packs 2 documents); Auto and Explicit mesh axes."""
  cfg = _cfg(layout=layout)
  mesh = model_utils.make_mesh(auto=auto, **sizes)
  sharded = shd.shard_params(params, mesh)
  gen = inference.Generator(cfg, sharded, mesh, CACHE_LEN)
  tokens = np.stack(list(gen.generate(PROMPTS, STEPS, padding=padding)), axis=1)
  np.testing.assert_array_equal(tokens, oracle)


def test_cache_is_sharded_and_decode_logits_match_dense(params):
  """Per-device cache = 1/(4*2) of it (sequence x kv heads); logits close to the oracle's."""
  cfg = _cfg(layout="zigzag")
  mesh = model_utils.make_mesh(auto=True, data=2, sequence=4)
  gen = inference.Generator(cfg, shd.shard_params(params, mesh), mesh, CACHE_LEN)
  prompts = PROMPTS[:2]
  logits, cache = gen.prefill(prompts, 8)
  shard = cache.k.sharding.shard_shape(cache.k.shape)
  assert shard == (cfg.num_layers, 1, CACHE_LEN // 4, cfg.num_kv_heads, cfg.resolved_head_dim)
  assert inference.cache_bytes_per_device(cfg, mesh, 2, CACHE_LEN) == 2 * 4 * np.prod(shard)
  seen = [np.asarray(logits)]
  tokens = np.argmax(seen[-1], -1)
  fed = [tokens]
  for _ in range(7):
    logits, cache = gen.step(cache, tokens)
    seen.append(np.asarray(logits))
    tokens = np.argmax(seen[-1], -1)
    fed.append(tokens)
  # Dense logits of the whole sequence at once (teacher forcing the fed tokens).
  dense_cfg = dataclasses.replace(cfg, attention="dense", layout="contiguous")
  model = nnx.merge(model_utils.graphdef(dense_cfg), params)
  full = [list(inference._documents(p)[:-1]) + [inference._documents(p)[-1]
          + [int(f[b]) for f in fed[:-1]]] for b, p in enumerate(prompts)]
  batch = inference.prepare_prompts(full, 48, "right")
  dense = np.asarray(model(batch["tokens"], batch["positions"], batch["segment_ids"]))
  for b in range(len(prompts)):
    last = batch["last"][b]
    want = dense[b, last - 7:last + 1]
    got = np.stack([s[b] for s in seen])
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=2e-4)
  assert int(cache.steps) == 7


def test_merge_is_exact_over_shards():
  """Partial (out, lse) per shard, merged over a mesh axis == attention over all keys."""
  rng = np.random.default_rng(0)
  b, t, n, k, h, s = 2, 1, 4, 2, 16, 32
  q = jnp.asarray(rng.normal(size=(b, t, n, h)), jnp.float32)
  kk = jnp.asarray(rng.normal(size=(b, s, k, h)), jnp.float32)
  vv = jnp.asarray(rng.normal(size=(b, s, k, h)), jnp.float32)
  kv_pos = jnp.asarray(np.tile(np.arange(s), (b, 1)), jnp.int32)
  kv_seg = jnp.asarray(np.where(np.arange(s) < 5, 0, 1)[None].repeat(b, 0), jnp.int32)
  kv_seg = kv_seg.at[1, 8:].set(0)  # row 1: only keys 5..7 visible, all on shard 0
  q_pos = jnp.full((b, t), s, jnp.int32)
  q_seg = jnp.ones((b, t), jnp.int32)
  mesh = model_utils.make_mesh(auto=True, sequence=4)
  spec, row = jax.P(None, "sequence"), jax.P(None, "sequence")
  fn = jax.shard_map(
      lambda q, kk, vv, p, sg, qp, qs: decode_lib.cache_attention(
          q, kk, vv, qp, qs, p, sg, axis_name="sequence"), mesh=mesh,
      in_specs=(jax.P(), spec, spec, row, row, jax.P(), jax.P()), out_specs=jax.P())
  got = fn(q, kk, vv, kv_pos, kv_seg, q_pos, q_seg)
  mask = decode_lib.cache_mask(q_pos, q_seg, kv_pos, kv_seg)
  want = decode_lib.partial_attention(q, kk, vv, mask)[0]
  np.testing.assert_allclose(got, want, atol=1e-5)
  # The local partial itself against the dense oracle (all keys visible).
  chex.assert_trees_all_close(
      decode_lib.partial_attention(q, kk, vv, jnp.ones((b, t, s), bool))[0],
      ring_jax.reference_attention(q, kk, vv), atol=1e-5)


def test_sample_top_p_and_vocab_limit():
  logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]] * 2000))
  key = jax.random.key(0)
  tokens = np.asarray(inference.sample(logits, key, temperature=1.0, top_p=0.7))
  assert set(tokens.tolist()) == {0, 1}  # 0.5 < 0.7 <= 0.5 + 0.3: the nucleus is {0, 1}
  assert abs(np.mean(tokens == 0) - 0.5 / 0.8) < 0.05
  tokens = np.asarray(inference.sample(logits, key, temperature=1.0, vocab_limit=2))
  assert set(tokens.tolist()) <= {0, 1}
  assert (np.asarray(inference.sample(logits, key, vocab_limit=3)) == 0).all()
  assert (np.asarray(inference.sample(-logits, key, vocab_limit=3)) == 2).all()


@pytest.mark.parametrize("prompts,new,match", [
    ([[1] * 200], 4, "longer than the cache"),
    ([[1] * 100], 40, "past the cache"),
    ([[1, 2, 99]], 4, "outside the model's vocabulary"),
    ([[1, 2], [3], [4]], 4, "do not split over the mesh .data. axis"),  # data=2
    ([[]], 4, "is empty"),
])
def test_bad_requests_fail_before_compiling(prompts, new, match):
  cfg = _cfg()
  mesh = model_utils.make_mesh(auto=True, data=len(prompts) - 1 if len(prompts) > 1 else 1,
                               sequence=2)
  with pytest.raises(ValueError, match=match):
    inference.check_request(cfg, mesh, prompts, new, CACHE_LEN)


def test_decode_step_updates_the_cache_in_place():
  """Compile-time memory: the donated cache aliases the new one, and temp grows by about one
  layer's share of it (the slice a layer reads), never by a copy of the whole cache."""
  cfg = _cfg(layout="zigzag", num_layers=4)
  mesh = model_utils.make_mesh(auto=True, sequence=4, tensor=2)
  graphdef = inference._graphdef(inference.config_for_length(cfg, 1))
  values = model_utils.random_params(cfg)
  params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        values, shd.param_shardings(values, mesh))

  def step(params, cache, tokens):
    return inference.decode_step(nnx.merge(graphdef, params), cache, tokens)

  analyses = {}
  for length in (1024, 4096):
    cache = inference.abstract_cache(cfg, mesh, 2, length)
    with jax.set_mesh(mesh):
      compiled = jax.jit(step, donate_argnums=1).lower(
          params, cache, jax.ShapeDtypeStruct((2,), jnp.int32)).compile()
    analyses[length] = (compiled.memory_analysis(),
                        inference.cache_bytes_per_device(cfg, mesh, 2, length))
  for memory, cache_bytes in analyses.values():
    assert memory.alias_size_in_bytes >= cache_bytes
  (m0, c0), (m1, c1) = analyses[1024], analyses[4096]
  # k and v x layers x 2 rows x 1024/4 slots x 2/2 kv heads x head_dim 16 x 4 bytes.
  assert c1 == 4 * c0 and c0 == 2 * cfg.num_layers * 2 * (1024 // 4) * 1 * 16 * 4
  assert m1.temp_size_in_bytes - m0.temp_size_in_bytes < 0.5 * (c1 - c0)
