"""models.llama: ring vs dense on meshes, RoPE, blockwise FFN, scan, remat, config checks.

Tiny float32 models on the 8 fake CPU devices of conftest.py. The oracle for
every sharded run is the dense backend on one device in natural token order.
"""

import collections
import contextlib
import dataclasses
import io
import math
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.ad_checkpoint import print_saved_residuals

import ring_jax
from model_utils import graphdef as _graphdef
from model_utils import make_mesh, packed_batch, random_params
from models import sharding as shd
from models.llama import (DTYPES, REMAT_POLICIES, Llama, LlamaConfig, apply_rope, rope_inv_freq,
                          rope_tables, weight_decay_mask)

B, L = 2, 16
TINY = dict(vocab_size=64, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, mlp_dim=64,
            init_std=0.2, attention="dense")


def _cfg(**kw) -> LlamaConfig:
  return LlamaConfig(**{**TINY, **kw})


def _packed_batch():
  """Tokens, per-document positions, segment ids (several documents per row + padding), weights."""
  # Row 0: documents of 5 and 7 tokens, then 4 padding tokens; row 1: 9 + 3 + 4 tokens.
  tokens, pos, segs = packed_batch(TINY["vocab_size"], ((5, 7), (9, 3, 4)), L)
  rng = np.random.default_rng(0)
  # Per-token loss weights (0 on padding) make the gradient depend on every logit; the 1/(B*L)
  # keeps gradients O(1) like a mean loss, so absolute tolerances mean what they say.
  weights = rng.normal(size=(B, L, TINY["vocab_size"])) * (segs > 0)[..., None] / (B * L)
  weights = weights.astype(np.float32)
  return tokens, pos, segs, weights


def _loss_and_grads(cfg, params, tokens, pos, segs, weights, mesh=None):
  """(logits, grads) of sum(logits * weights), jitted pure function on split params (tree mode)."""
  graphdef = _graphdef(cfg)

  def loss(p, t, q, s, w):
    logits = nnx.merge(graphdef, p)(t, q, s)
    return jnp.sum(logits * w), logits

  fn = jax.jit(jax.value_and_grad(loss, has_aux=True))
  if mesh is None:
    (_, logits), grads = fn(params, tokens, pos, segs, weights)
  else:
    shardings = shd.param_shardings(params, mesh)
    with jax.set_mesh(mesh):
      (_, logits), grads = fn(jax.device_put(params, shardings), tokens, pos, segs, weights)
    if all(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types):
      # Explicit axes: gradients come back sharded exactly like their params (FSDP included).
      is_var = lambda x: isinstance(x, nnx.Variable)
      for g, sh in zip(jax.tree.leaves(grads, is_leaf=is_var),
                       jax.tree.leaves(shardings, is_leaf=is_var)):
        assert g.get_value().sharding.spec == sh.get_value().spec
  return np.asarray(logits), jax.tree.map(np.asarray, grads)


@pytest.fixture(scope="module")
def baseline():
  """Dense backend, one device, natural order: params, batch, logits, grads."""
  cfg = _cfg()
  params = random_params(cfg)
  batch = _packed_batch()
  logits, grads = _loss_and_grads(cfg, params, *batch)
  return params, batch, logits, grads


def _assert_tree_close(a, b, rtol=1e-5, atol=1e-5):
  assert jax.tree.leaves(a)  # an empty tree would compare equal to anything empty
  chex.assert_trees_all_close(a, b, rtol=rtol, atol=atol)


@pytest.mark.parametrize("mesh_sizes,layout,axis_types,ffn_chunk,fsdp", [
    (dict(data=2, sequence=4), "contiguous", "explicit", None, False),
    (dict(data=2, sequence=4), "zigzag", "explicit", 2, True),
    (dict(tensor=2, sequence=4), "zigzag", "explicit", None, False),
    (dict(tensor=2, sequence=4), "contiguous", "auto", 2, False),
])
def test_ring_on_mesh_matches_dense(baseline, mesh_sizes, layout, axis_types, ffn_chunk, fsdp):
  """Sharded ring model == one-device dense model: logits and parameter gradients.

  Inputs (tokens, positions, segment ids, loss weights) are put in layout order
  once, as the train step does; logits come back in layout order.
  """
  params, (tokens, pos, segs, weights), want_logits, want_grads = baseline
  mesh = make_mesh(auto=axis_types == "auto", **mesh_sizes)
  ring = mesh.shape["sequence"]
  cfg = _cfg(attention="ring", layout=layout, block_q=2, block_kv=2, ffn_chunk_size=ffn_chunk,
             fsdp=fsdp)
  to = lambda x: np.asarray(ring_jax.to_layout(x, layout, ring))
  logits, grads = _loss_and_grads(cfg, params, to(tokens), to(pos), to(segs), to(weights), mesh)
  logits = np.asarray(ring_jax.from_layout(logits, layout, ring))
  real = segs > 0  # padding logits are meaningless (their attention output is 0 by definition)
  np.testing.assert_allclose(logits[real], want_logits[real], rtol=1e-5, atol=1e-5)
  _assert_tree_close(grads, want_grads)


def test_ring_hop_kernel_by_name(baseline):
  """LlamaConfig.hop_kernel reaches the ring: "xla" by name matches the dense model; an
  unknown name fails at construction, listing the known ones."""
  params, (tokens, pos, segs, weights), want_logits, _ = baseline
  mesh = make_mesh(auto=True, sequence=4)
  cfg = _cfg(attention="ring", layout="zigzag", block_q=2, block_kv=2, hop_kernel="xla")
  to = lambda x: np.asarray(ring_jax.to_layout(x, "zigzag", 4))
  logits, _ = _loss_and_grads(cfg, params, to(tokens), to(pos), to(segs), to(weights), mesh)
  logits = np.asarray(ring_jax.from_layout(logits, "zigzag", 4))
  real = segs > 0
  np.testing.assert_allclose(logits[real], want_logits[real], rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="hop_kernel='flash'.*'auto', 'xla'"):
    _cfg(hop_kernel="flash")


def test_causal_routing_reaches_the_ring_and_keeps_values(baseline):
  """LlamaConfig.causal_routing=True routes the zigzag ring's K/V (another program: the
  routed parts travel in other collective-permutes) and keeps the dense model's logits and
  gradients; None (the library's default) leaves zigzag unrouted."""
  params, (tokens, pos, segs, weights), want_logits, want_grads = baseline
  mesh = make_mesh(auto=True, data=2, sequence=4)
  to = lambda x: np.asarray(ring_jax.to_layout(x, "zigzag", 4))  # noqa: E731
  cfgs = {r: _cfg(attention="ring", layout="zigzag", block_q=2, block_kv=2, causal_routing=r)
          for r in (None, True)}
  logits, grads = _loss_and_grads(cfgs[True], params, to(tokens), to(pos), to(segs),
                                  to(weights), mesh)
  logits = np.asarray(ring_jax.from_layout(logits, "zigzag", 4))
  real = segs > 0
  np.testing.assert_allclose(logits[real], want_logits[real], rtol=1e-5, atol=1e-5)
  _assert_tree_close(grads, want_grads)

  def permutes(cfg):
    fn = jax.jit(lambda p, t, q, s: nnx.merge(_graphdef(cfg), p)(t, q, s))
    with jax.set_mesh(mesh):
      text = fn.lower(jax.device_put(params, shd.param_shardings(params, mesh)), to(tokens),
                      to(pos), to(segs)).as_text()
    return sorted(re.findall(r"collective_permute.*?source_target_pairs = dense<(.*?)>", text))
  assert permutes(cfgs[True]) != permutes(cfgs[None])
  assert permutes(cfgs[None]) == permutes(dataclasses.replace(cfgs[None], causal_routing=False))


@pytest.mark.parametrize("kernel", ["splash"])
def test_fused_hop_kernels_run_in_the_model(kernel):
  """The model with each fused hop kernel (Pallas interpret mode on CPU) equals the dense
  model on one device: logits and parameter gradients. One layer, one row of two packed
  documents (the second across two of the zigzag's 64-token chunks) and padding, a ring of 2
  in the zigzag layout with blocks of 128 (what the TPU kernel tiles): one block per shard,
  the smallest shape a TPU kernel takes (interpret mode is slow)."""
  length, ring = 256, 2
  dims = dict(num_layers=1, dim=64, num_heads=4, num_kv_heads=2, mlp_dim=64)
  dense = _cfg(**dims)
  params = random_params(dense)
  tokens, pos, segs = packed_batch(TINY["vocab_size"], ((100, 125),), length)
  rng = np.random.default_rng(1)
  weights = (rng.normal(size=(1, length, TINY["vocab_size"])) * (segs > 0)[..., None]
             / length).astype(np.float32)
  want_logits, want_grads = _loss_and_grads(dense, params, tokens, pos, segs, weights)
  cfg = _cfg(**dims, attention="ring", layout="zigzag", block_q=128, block_kv=128,
             hop_kernel=kernel)
  to = lambda x: np.asarray(ring_jax.to_layout(x, "zigzag", ring))
  logits, grads = _loss_and_grads(cfg, params, to(tokens), to(pos), to(segs), to(weights),
                                  make_mesh(auto=True, sequence=ring))
  logits = np.asarray(ring_jax.from_layout(logits, "zigzag", ring))
  real = segs > 0
  np.testing.assert_allclose(logits[real], want_logits[real], rtol=1e-5, atol=1e-5)
  _assert_tree_close(grads, want_grads)


def test_dense_backend_on_layout_order(baseline):
  """The dense backend masks by the given positions, so zigzag-ordered inputs give the same
  result."""
  params, (tokens, pos, segs, _), want_logits, _ = baseline
  to = lambda x: np.asarray(ring_jax.to_layout(x, "zigzag", 4))
  model = nnx.merge(_graphdef(_cfg(layout="zigzag")), params)
  logits = jax.jit(lambda m, *b: m(*b))(model, to(tokens), to(pos), to(segs))
  logits = np.asarray(ring_jax.from_layout(np.asarray(logits), "zigzag", 4))
  real = segs > 0
  np.testing.assert_allclose(logits[real], want_logits[real], rtol=1e-5, atol=1e-5)


def test_ring_without_mesh_falls_back_to_dense(baseline):
  params, (tokens, pos, segs, _), want_logits, _ = baseline
  model = nnx.merge(_graphdef(_cfg(attention="ring")), params)
  logits = jax.jit(lambda m: m(tokens, pos, segs))(model)
  np.testing.assert_allclose(logits, want_logits, rtol=1e-5, atol=1e-5)


def test_unrolled_layers_and_blockwise_ffn_match(baseline):
  """Python loop over the stacked layers + chunked MLP == scan + plain MLP (same params)."""
  params, batch, want_logits, want_grads = baseline
  logits, grads = _loss_and_grads(_cfg(scan_layers=False, ffn_chunk_size=4), params, *batch)
  np.testing.assert_allclose(logits, want_logits, rtol=1e-5, atol=1e-5)
  _assert_tree_close(grads, want_grads)


def test_remat_policy_keeps_values(baseline):
  """Remat changes what the backward pass stores, not what it computes."""
  params, batch, want_logits, want_grads = baseline
  logits, grads = _loss_and_grads(_cfg(remat_policy="save_qkv_attn_out"), params, *batch)
  np.testing.assert_allclose(logits, want_logits, rtol=1e-5, atol=1e-5)
  _assert_tree_close(grads, want_grads)


def _remat_policies(jaxpr) -> list:
  """The policy of every jax.checkpoint (primitive ``remat2``) in ``jaxpr`` and in the jaxprs
  of its equations (scan bodies, jitted calls), outermost first."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "remat2":
      found.append(eqn.params["policy"])
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's Jaxpr
        if hasattr(sub, "eqns"):
          found += _remat_policies(sub)
  return found


def _saved_residuals(fn, *args) -> list[tuple[str, str]]:
  """``(type, what it is)`` of each value the backward pass of ``fn`` reads, as
  jax.ad_checkpoint.print_saved_residuals prints them (``f32[2,16,32] named 'query' from
  ...``, ``f32<host>[...]`` for a value in host memory)."""
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    print_saved_residuals(fn, *args)
  return [tuple(line.split(" ", 1)) for line in out.getvalue().splitlines()]


# What each policy makes the backward pass of two unrolled TINY layers read, beyond the
# layers' inputs and weights: checkpoint names, projection (dot_general) outputs, the
# attention einsums' outputs (the dense backend's jitted "_dense"), elementwise MLP values
# (silu) and values in host memory. Per layer: 6 projections (q, k, v, o, gate, up) and
# 3 attention einsums. "mlp_out" only feeds the residual add, so no policy needs to keep it.
REMAT_EFFECTS = {
    # No jax.checkpoint: autodiff keeps what the backward pass needs (which of the other
    # values exactly is jax's choice), the elementwise MLP values included.
    "none": dict(silu=6, host=0),
    "full": dict(named={}, dots=0, attention=0, silu=0, host=0),
    "save_dots": dict(named={}, dots=12, attention=6, silu=0, host=0),
    "save_dots_no_batch": dict(named={}, dots=12, attention=0, silu=0, host=0),
    "save_qkv_attn_out": dict(named={"query": 2, "key": 2, "value": 2, "attn_out": 2},
                              dots=0, attention=0, silu=0, host=0),
    "save_attn_mlp_out": dict(named={"attn_out": 2}, dots=0, attention=0, silu=0, host=0),
    "offload_layer_in": dict(named={}, dots=0, attention=0, silu=0, host=2),
}


@pytest.mark.parametrize("policy", sorted(REMAT_POLICIES))
def test_remat_policy_is_applied(baseline, policy):
  """Each layer runs under jax.checkpoint with the named policy (none for "none"), scanned
  or unrolled, and the backward pass then reads what that policy saves."""
  assert set(REMAT_EFFECTS) == set(REMAT_POLICIES)
  params, (tokens, pos, segs, _), _, _ = baseline
  for scan in (True, False):
    model = nnx.merge(_graphdef(_cfg(remat_policy=policy, scan_layers=scan)), params)
    jaxpr = jax.make_jaxpr(lambda t: model(t, pos, segs))(tokens).jaxpr
    layers = 1 if scan else TINY["num_layers"]  # one scan body, or each unrolled layer
    want = [] if policy == "none" else [REMAT_POLICIES[policy]] * layers
    got = _remat_policies(jaxpr)
    assert len(got) == len(want) and all(g is w for g, w in zip(got, want)), (got, want)

  model = nnx.merge(_graphdef(_cfg(remat_policy=policy, scan_layers=False)), params)
  saved = _saved_residuals(lambda m: jnp.sum(m(tokens, pos, segs)), model)
  named = collections.Counter(m[1] for _, what in saved
                              if (m := re.match(r"named '(\w+)'", what)))
  got = dict(named=dict(named),
             dots=sum(what.startswith("output of dot_general") for _, what in saved),
             attention=sum("'_dense'" in what for _, what in saved),
             silu=sum("'silu'" in what for _, what in saved),
             host=sum("<host>" in aval for aval, _ in saved))
  want = REMAT_EFFECTS[policy]
  assert {k: got[k] for k in want} == want, got
  assert policy != "none" or got["attention"] > 0  # the attention's internals too


def test_bf16_compute(baseline):
  """bfloat16 compute keeps float32 params and logits, and stays near the float32 result."""
  params, (tokens, pos, segs, _), want, _ = baseline
  bf16 = nnx.merge(_graphdef(_cfg(dtype="bfloat16")), params)
  got = jax.jit(lambda m: m(tokens, pos, segs))(bf16)
  assert got.dtype == jnp.float32
  real = segs > 0
  scale = float(np.abs(want).max())
  err = np.abs(np.asarray(got)[real] - want[real]).max()
  assert 0 < err < 0.05 * scale  # bf16 rounding really happened, and stayed small
  stored = nnx.eval_shape(lambda: Llama(_cfg(param_dtype="bfloat16"), rngs=nnx.Rngs(0)))
  assert {x.dtype for x in jax.tree.leaves(nnx.state(stored))} == {jnp.dtype(jnp.bfloat16)}


def test_shared_positions_broadcast(baseline):
  """Positions ``[L]`` mean the same positions for every row (no segment ids: plain causal)."""
  params, (tokens, _, _, _), _, _ = baseline
  model = nnx.merge(_graphdef(_cfg()), params)
  pos_L = np.arange(L, dtype=np.int32)
  shared, per_row = jax.jit(lambda m: (m(tokens, pos_L), m(tokens, np.tile(pos_L, (B, 1)))))(model)
  np.testing.assert_array_equal(shared, per_row)


def test_tied_embeddings(baseline):
  params, (tokens, pos, segs, _), _, _ = baseline
  tied_params = {k: v for k, v in params.items() if k != "lm_head"}
  model = nnx.merge(_graphdef(_cfg(tie_embeddings=True)), nnx.State(tied_params))
  assert not hasattr(model, "lm_head")

  def both(m):
    # With tied weights the head is the embedding transposed: recompute the logits by hand.
    x = m.embed[...][tokens]
    graphdef, stacked = nnx.split(m.layers)
    cos, sin = rope_tables(jnp.asarray(pos), rope_inv_freq(m.cfg))
    for i in range(m.cfg.num_layers):
      x = nnx.merge(graphdef, jax.tree.map(lambda a: a[i], stacked))(x, cos, sin, pos, segs)
    return m(tokens, pos, segs), m.final_norm(x) @ m.embed[...].T

  got, want = jax.jit(both)(model)
  assert got.shape == (B, L, TINY["vocab_size"])
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# RoPE
# ----------------------------------------------------------------------------------------------


def test_rope_matches_rotation_formula():
  """Each pair (x_i, x_{i+H/2}) is rotated by angle p * theta^(-2i/H)."""
  cfg = _cfg(dim=32, num_heads=2, rope_theta=100.0)  # head_dim 16
  h = cfg.resolved_head_dim
  rng = np.random.default_rng(1)
  x = rng.normal(size=(1, 5, 2, h)).astype(np.float32)
  positions = np.array([[0, 1, 7, 30, 123]])
  cos, sin = rope_tables(jnp.asarray(positions), rope_inv_freq(cfg))
  got = np.asarray(apply_rope(jnp.asarray(x), cos, sin))
  want = np.empty_like(x)
  for t, p in enumerate(positions[0]):
    for i in range(h // 2):
      angle = p * 100.0 ** (-2 * i / h)
      a, b = x[0, t, :, i], x[0, t, :, i + h // 2]
      want[0, t, :, i] = a * math.cos(angle) - b * math.sin(angle)
      want[0, t, :, i + h // 2] = b * math.cos(angle) + a * math.sin(angle)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  # Position 0 is the identity; scores depend only on the relative position.
  np.testing.assert_allclose(got[0, 0], x[0, 0], atol=1e-6)
  q, k = jnp.asarray(x[:, :1, :1]), jnp.asarray(x[:, 1:2, :1])

  def score(pq, pk):
    cq, sq = rope_tables(jnp.array([[pq]]), rope_inv_freq(cfg))
    ck, sk = rope_tables(jnp.array([[pk]]), rope_inv_freq(cfg))
    return float(jnp.sum(apply_rope(q, cq, sq) * apply_rope(k, ck, sk)))

  assert score(10, 3) == pytest.approx(score(57, 50), rel=1e-4, abs=1e-5)


def test_llama3_scaling_matches_reference_formula():
  """Our inv_freq vs Meta's llama3 ``apply_scaling`` loop (the formula HF reimplements)."""
  scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                 original_max_position_embeddings=512)
  cfg = _cfg(dim=128, num_heads=1, num_kv_heads=1, rope_theta=500000.0, rope_scaling=scaling)
  base = 1.0 / (500000.0 ** (np.arange(0, 128, 2) / 128))
  want = []
  low_wavelen, high_wavelen = 512 / 1.0, 512 / 4.0
  for freq in base:
    wavelen = 2 * math.pi / freq
    if wavelen < high_wavelen:
      want.append(freq)
    elif wavelen > low_wavelen:
      want.append(freq / 8.0)
    else:
      smooth = (512 / wavelen - 1.0) / (4.0 - 1.0)
      want.append((1 - smooth) * freq / 8.0 + smooth * freq)
  got = rope_inv_freq(cfg)
  np.testing.assert_allclose(got, np.array(want), rtol=1e-6)
  ratio = base / got  # all three bands are exercised
  assert np.isclose(ratio, 1).any() and np.isclose(ratio, 8).any()
  assert ((ratio > 1.01) & (ratio < 7.99)).any()
  linear = rope_inv_freq(_cfg(dim=128, num_heads=1, num_kv_heads=1, rope_theta=500000.0,
                              rope_scaling={"type": "linear", "factor": 4.0}))
  np.testing.assert_allclose(linear, base / 4.0, rtol=1e-6)


# ----------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad,match", [
    (dict(attention="flash"), "attention"),
    (dict(layout="spiral"), "layout"),
    (dict(num_heads=4, num_kv_heads=3), "num_kv_heads"),
    (dict(dim=30, num_heads=4), "head_dim"),
    (dict(head_dim=7), "even"),
    (dict(remat_policy="sometimes"), "remat_policy"),
    (dict(dtype="float8"), "dtype"),
    (dict(param_dtype="int8"), "param_dtype"),
    (dict(ffn_chunk_size=0), "ffn_chunk_size"),
    (dict(block_q=-1), "block_q"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 2.0}), "rope_scaling"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "missing"),
    (dict(num_layers=0), "num_layers"),
    (dict(causal_routing="yes"), "causal_routing must be None"),
])
def test_bad_config_raises(bad, match):
  with pytest.raises(ValueError, match=match):
    _cfg(**bad)


def test_ffn_chunk_must_divide_local_length(baseline):
  params, (tokens, pos, segs, _), _, _ = baseline
  model = nnx.merge(_graphdef(_cfg(ffn_chunk_size=5)), params)
  with pytest.raises(ValueError, match="ffn_chunk_size"):
    jax.eval_shape(lambda m: m(tokens, pos, segs), model)


def test_config_dict_roundtrip_and_hash():
  cfg = _cfg(rope_scaling={"rope_type": "linear", "factor": 2.0})
  again = LlamaConfig.from_dict({**cfg.to_dict(), "learning_rate": 1e-3, "steps": 10})
  assert again == cfg and hash(again) == hash(cfg)  # hashable despite the rope_scaling dict
  assert dataclasses.replace(cfg, dim=64).resolved_head_dim == 16


@pytest.mark.parametrize("table", [REMAT_POLICIES, DTYPES], ids=["REMAT_POLICIES", "DTYPES"])
def test_name_tables_have_one_name_per_thing(table):
  """No aliases: two names for the same remat policy or dtype would be two spellings of one
  config (and two cache entries for one compiled step)."""
  values = list(table.values())
  assert len({id(v) for v in values}) == len(values), table


def test_flops_per_token_formula():
  cfg = _cfg(tie_embeddings=True)
  d, f, h, n, k, v, layers = 32, 64, 8, 4, 2, 64, 2
  per_layer = d * n * h + 2 * d * k * h + n * h * d + 3 * d * f
  want = 6 * (layers * per_layer + d * v) + 6 * layers * 100 * n * h
  assert cfg.flops_per_token(100) == want
  # The parameter count agrees with the model actually built.
  for c in (cfg, _cfg()):
    model = nnx.eval_shape(lambda: Llama(c, rngs=nnx.Rngs(0)))
    assert c.num_params() == sum(x.size for x in jax.tree.leaves(nnx.state(model)))


def test_weight_decay_mask_excludes_norm_scales():
  model = nnx.eval_shape(lambda: Llama(_cfg(), rngs=nnx.Rngs(0)))
  mask = weight_decay_mask(nnx.split(model, nnx.Param, ...)[1])
  flat = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(mask)}
  assert len(flat) == 12
  # Stacked norm scales are 2-D ([layers, dim]) yet must not be decayed.
  assert {k for k, v in flat.items() if not v} == {
      "['final_norm']['scale'].value", "['layers']['attn_norm']['scale'].value",
      "['layers']['mlp_norm']['scale'].value"}


@pytest.mark.parametrize("mesh_sizes", [None, dict(data=2, sequence=4)])
def test_chunked_loss_matches_whole_sequence_loss(baseline, mesh_sizes):
  """nll_sums with loss_chunk_size (head + log-softmax per local chunk, remat) == unchunked:
  values and gradients, unsharded and on a data=2 x sequence=4 ring."""
  params, (tokens, pos, segs, _), _, _ = baseline
  rng = np.random.default_rng(3)
  labels = rng.integers(0, TINY["vocab_size"], size=(B, L)).astype(np.int32)
  mask = (segs > 0).astype(np.float32)
  mesh = None if mesh_sizes is None else make_mesh(auto=True, **mesh_sizes)

  def run(cfg):
    graphdef = _graphdef(cfg)

    def loss(p):
      nll, correct = nnx.merge(graphdef, p).nll_sums(tokens, pos, segs, labels, mask)
      return nll, correct

    fn = jax.jit(jax.value_and_grad(loss, has_aux=True))
    if mesh is None:
      return fn(params)
    with jax.set_mesh(mesh):
      return fn(jax.device_put(params, shd.param_shardings(params, mesh)))

  (nll, correct), grads = run(_cfg(attention="ring"))
  (nll_c, correct_c), grads_c = run(_cfg(attention="ring", loss_chunk_size=2))
  np.testing.assert_allclose(nll_c, nll, rtol=1e-5)
  assert float(correct_c) == float(correct)
  _assert_tree_close(jax.tree.map(np.asarray, grads_c), jax.tree.map(np.asarray, grads))
  # The unchunked sum is the plain masked NLL of the logits.
  logits = jax.jit(lambda p: nnx.merge(_graphdef(_cfg()), p)(tokens, pos, segs))(params)
  want = -np.take_along_axis(np.asarray(jax.nn.log_softmax(logits)), labels[..., None],
                             axis=-1)[..., 0]
  np.testing.assert_allclose(nll, (want * mask).sum(), rtol=1e-5)


def test_loss_chunk_must_divide_local_length(baseline):
  params, (tokens, pos, segs, _), _, _ = baseline
  model = nnx.merge(_graphdef(_cfg(loss_chunk_size=5)), params)
  with pytest.raises(ValueError, match="loss_chunk_size=5 must divide"):
    model.nll_sums(tokens, pos, segs, tokens, np.ones((B, L), np.float32))


def test_profile_names(baseline):
  """Blocks run under jax.named_scope, so a profile (HLO op names) reads by block."""
  params, (tokens, pos, segs, _), _, _ = baseline
  model = nnx.merge(_graphdef(_cfg()), params)
  mask = np.ones((B, L), np.float32)
  text = jax.jit(lambda m: m.nll_sums(tokens, pos, segs, tokens, mask)).lower(model).as_text(
      debug_info=True)
  for scope in ("embed/", "layer/attention/dense/", "layer/mlp/", "final_norm/", "loss/head/"):
    assert scope in text, scope


def test_mixed_window_stack_scan_loop_remat_and_pipeline():
  """A stack mixing full and windowed layers (Qwen2's max_window_layers) with q/k/v biases and
  q/k norms runs as one scan per group: scan == Python loop == remat, the window changes the
  output only where a query has more than 4 tokens before it (the logits' agreement with
  transformers is test_convert_hf's), and a pipeline mesh, whose stages run one program,
  refuses the mix with a ValueError naming the fix."""
  cfg = _cfg(num_layers=3, qkv_bias=True, qk_norm=True, sliding_window=4, attention="dense",
             family="qwen2", layer_types=("full_attention", "sliding_attention",
                                          "sliding_attention"))
  assert cfg.layer_groups == ((0, 1, None), (1, 3, 4))
  params = random_params(cfg)
  tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(2, L))
  pos = np.arange(L)
  run = lambda c: np.asarray(jax.jit(lambda p: nnx.merge(_graphdef(c), p)(tokens, pos))(params))
  scanned = run(cfg)
  np.testing.assert_allclose(run(dataclasses.replace(cfg, scan_layers=False)), scanned,
                             rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(run(dataclasses.replace(cfg, remat_policy="full")), scanned,
                             rtol=1e-5, atol=1e-5)
  # Positions < 4 see no more than the window anyway: equal there, different after.
  full = run(dataclasses.replace(cfg, sliding_window=None, layer_types=None))
  np.testing.assert_allclose(full[:, :4], scanned[:, :4], rtol=1e-5, atol=1e-5)
  assert np.abs(full[:, 4:] - scanned[:, 4:]).max() > 1e-3
  with pytest.raises(ValueError, match="sliding_attention.*needs|sliding_window is None"):
    _cfg(num_layers=2, layer_types=("full_attention", "sliding_attention"))
  mesh = make_mesh(pipeline=2)
  with jax.set_mesh(mesh), pytest.raises(ValueError, match="pipeline=1"):
    jax.eval_shape(lambda p: nnx.merge(_graphdef(cfg), p)(tokens, pos), params)
