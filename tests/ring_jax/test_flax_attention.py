"""ring_jax.flax_attention_fn in Flax modules vs the same modules on dense attention.

The oracle is the module itself with its default ``attention_fn`` and the
equivalent dense mask (causal and/or segment equality, padding), so these tests
check the adapter's whole contract: Flax's call signature, dtype handling, the
sharding of what comes out, and the gradients the module's parameters receive.
"""

import functools
import inspect
import os
import subprocess
import sys
import textwrap

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import ring_jax
from attn_utils import make_mesh, packed_segments

B, L, F, HEADS = 2, 32, 16, 2  # batch, length, features, heads (head_dim 8)
TOL = dict(atol=1e-5, rtol=1e-5)


def inputs(seed=0, shape=(B, L, F)):
  kx, kc = jax.random.split(jax.random.key(seed))
  return jax.random.normal(kx, shape, jnp.float32), jax.random.normal(kc, shape, jnp.float32)


def dense_mask(seg, is_causal, batch_length=(B, L)):
  """bool ``[B, 1, L, L]`` equivalent to ring attention's causal / segment-id masking."""
  mask = None
  if is_causal:
    mask = nnx.make_causal_mask(jnp.zeros(batch_length))
  if seg is not None:
    same_doc = nnx.make_attention_mask(seg, seg, jnp.equal)
    not_pad = nnx.make_attention_mask(seg > 0, seg > 0)
    mask = nnx.combine_masks(mask, same_doc, not_pad)
  return mask


def token_weights(seg):
  """Loss weights: padding tokens (id 0) are left out.

  Flax's dense attention gives a fully masked (padding) query the mean of all
  values, ring attention gives 0: both are meaningless and a model masks them
  out of its loss, so the comparison does too.
  """
  return jnp.ones((B, L, 1)) if seg is None else (seg > 0)[..., None].astype(jnp.float32)


def mesh_of(kind):
  if kind == "explicit":
    return jax.make_mesh((2, 4), ("data", "sequence"))  # the jax.make_mesh default: Explicit
  return make_mesh((2, 4), ("data", "sequence"))


# ---------------------------------------------------------------- nnx.MultiHeadAttention

def nnx_mha(attention_fn=None, **kw):
  if attention_fn is not None:
    kw["attention_fn"] = attention_fn
  return nnx.MultiHeadAttention(num_heads=HEADS, in_features=F, decode=False,
                                rngs=nnx.Rngs(0), **kw)


def nnx_value_and_grads(graphdef, params, rest, x, cot, weights, seg, *, adapter_kw=None,
                        **call_kw):
  """<module(x), cot> over the non-padding tokens and its gradients w.r.t. params and x.

  With ``adapter_kw`` the module's attention_fn is built here, inside the
  traced function, from the segment ids it receives: the documented pattern
  for per-batch segment ids.
  """
  def loss(params, x):
    model = nnx.merge(graphdef, params, rest)
    if adapter_kw is not None:
      model.attention_fn = ring_jax.flax_attention_fn(segment_ids=seg, **adapter_kw)
    out = model(x, **call_kw)
    return jnp.sum(out * cot * weights), out
  (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x)
  return out, grads


@pytest.mark.parametrize("mesh_kind,layout,causal,with_segments", [
    ("auto", "contiguous", None, False),
    ("auto", "contiguous", "adapter", False),
    ("auto", "zigzag", "adapter", True),
    ("auto", "striped", "module call", False),  # nnx's own is_causal=True call argument
    ("explicit", "zigzag", "adapter", False),
    ("explicit", "contiguous", None, True),
])
def test_nnx_matches_dense(mesh_kind, layout, causal, with_segments):
  mesh = mesh_of(mesh_kind)
  x, cot = inputs(1)
  seg = packed_segments(B, L, seed=2) if with_segments else None
  weights = token_weights(seg)
  adapter_kw = dict(mesh=mesh, layout=layout, is_causal=causal == "adapter")
  call_kw = {"is_causal": True} if causal == "module call" else {}

  ring_model = nnx_mha(ring_jax.flax_attention_fn(**adapter_kw))
  graphdef, params, rest = nnx.split(ring_model, nnx.Param, ...)
  ring_step = jax.jit(functools.partial(nnx_value_and_grads, graphdef,
                                        adapter_kw=adapter_kw if with_segments else None,
                                        **call_kw))
  out, (d_params, d_x) = ring_step(params, rest, x, cot, weights, seg)

  dense_graphdef, dense_params, dense_rest = nnx.split(nnx_mha(), nnx.Param, ...)
  chex.assert_trees_all_equal(params, dense_params)  # same seed: same weights
  want, (want_params, want_x) = jax.jit(functools.partial(
      nnx_value_and_grads, dense_graphdef, mask=dense_mask(seg, causal is not None)))(
          dense_params, dense_rest, x, cot, weights, seg)

  chex.assert_shape(out, (B, L, F))
  chex.assert_trees_all_close(out * weights, want * weights, **TOL)
  chex.assert_trees_all_close(d_x, want_x, **TOL)
  chex.assert_trees_all_close(d_params, want_params, **TOL)


def test_nnx_dropout_module_runs_deterministic():
  """A module built with dropout runs when called deterministically (evaluation)."""
  mesh = mesh_of("auto")
  x, _ = inputs(3)
  ring = nnx_mha(ring_jax.flax_attention_fn(mesh=mesh, is_causal=True), dropout_rate=0.1)
  dense = nnx_mha(dropout_rate=0.1)
  out = jax.jit(lambda m, x: m(x, deterministic=True))(ring, x)
  want = dense(x, mask=dense_mask(None, True), deterministic=True)
  chex.assert_trees_all_close(out, want, **TOL)


def test_batch_dims_flattened_or_added():
  """Several leading batch dims are flattened for the ring; none means a batch of one."""
  mesh = mesh_of("auto")
  ring = nnx_mha(ring_jax.flax_attention_fn(mesh=mesh, is_causal=True))
  dense = nnx_mha()
  x4, _ = inputs(4, (2, 2, L, F))
  out4 = jax.jit(lambda m, x: m(x))(ring, x4)
  mask4 = nnx.make_causal_mask(jnp.zeros((2, 2, L)))
  chex.assert_trees_all_close(out4, dense(x4, mask=mask4), **TOL)

  unbatched = nnx_mha(ring_jax.flax_attention_fn(mesh=mesh, is_causal=True, batch_axis=None))
  x2 = x4[0, 0]
  out2 = jax.jit(lambda m, x: m(x))(unbatched, x2)
  chex.assert_trees_all_close(out2, dense(x2, mask=nnx.make_causal_mask(jnp.zeros((L,)))), **TOL)


class SinkAttention(nnx.Module):
  """An nnx attention layer with learned sinks (GPT-OSS style): q/k/v projections, V with a
  head size of its own (``dv``), the sinks a parameter bound into the ``attention_fn`` at
  each call. ``mesh=None``: dense attention (``reference_attention``) with the same sinks."""

  def __init__(self, mesh, *, heads=4, dk=8, dv=4, cap=None, rngs):
    self.mesh, self.heads, self.dk, self.dv, self.cap = mesh, heads, dk, dv, cap
    self.q = nnx.Linear(F, heads * dk, rngs=rngs)
    self.k = nnx.Linear(F, heads * dk, rngs=rngs)
    self.v = nnx.Linear(F, heads * dv, rngs=rngs)
    self.sinks = nnx.Param(jnp.array([6.0, -6.0, 1.5, -0.5])[:heads])

  def __call__(self, x, seg):
    split = lambda y, d: y.reshape(*y.shape[:-1], self.heads, d)  # noqa: E731
    q, k, v = split(self.q(x), self.dk), split(self.k(x), self.dk), split(self.v(x), self.dv)
    if self.mesh is None:
      return ring_jax.reference_attention(q, k, v, is_causal=True, segment_ids=seg,
                                          sinks=self.sinks[...], logits_soft_cap=self.cap)
    attend = ring_jax.flax_attention_fn(mesh=self.mesh, is_causal=True, segment_ids=seg,
                                        sinks=self.sinks[...], logits_soft_cap=self.cap)
    return attend(q, k, v)


@pytest.mark.parametrize("cap", [None, 3.0])
def test_sinks_and_value_head_dim_in_a_module_match_dense(cap):
  """Sinks (a learned parameter, |s| up to 6) and V's own head size through the adapter, with
  padding (sink-only rows) and a soft-cap: output and every parameter's gradient, the sinks'
  included, equal the same module on dense attention (ring_jax.reference_attention)."""
  mesh = mesh_of("auto")
  ring = SinkAttention(mesh, cap=cap, rngs=nnx.Rngs(0))
  dense = SinkAttention(None, cap=cap, rngs=nnx.Rngs(0))
  x, _ = inputs(7)
  seg = packed_segments(B, L, seed=7).at[0, -4:].set(0)

  def loss(module, x):
    out = module(x, seg)
    assert out.shape == (B, L, 4, 4)
    return jnp.sum(jnp.sin(out) * jnp.arange(out.size).reshape(out.shape) / out.size), out

  (_, out_r), g_r = jax.jit(nnx.value_and_grad(loss, has_aux=True))(ring, x)
  (_, out_d), g_d = nnx.value_and_grad(loss, has_aux=True)(dense, x)
  chex.assert_trees_all_close(out_r, out_d, **TOL)
  pad = (seg == 0)
  assert pad.any()
  chex.assert_trees_all_close(out_r[pad], jnp.zeros_like(out_r[pad]))  # sink-only rows
  chex.assert_trees_all_close(nnx.state(g_r), nnx.state(g_d), atol=1e-5, rtol=1e-4)
  assert float(jnp.abs(g_r.sinks[...]).min()) > 0  # the sinks do get a gradient


def test_inputs_in_layout():
  """A model that reorders once per batch: module inputs and outputs in zigzag order."""
  mesh = mesh_of("auto")
  ring_size = mesh.shape["sequence"]
  x, _ = inputs(5)
  seg = packed_segments(B, L, seed=6)
  to = functools.partial(ring_jax.to_layout, layout="zigzag", ring_size=ring_size, axis=1)

  @jax.jit
  def run(model, x_lay, seg_lay):
    model.attention_fn = ring_jax.flax_attention_fn(
        mesh=mesh, is_causal=True, layout="zigzag", inputs_in_layout=True, segment_ids=seg_lay)
    return model(x_lay)

  out = ring_jax.from_layout(run(nnx_mha(), to(x), to(seg)), "zigzag", ring_size, axis=1)
  want = nnx_mha()(x, mask=dense_mask(seg, True))
  weights = token_weights(seg)
  chex.assert_trees_all_close(out * weights, want * weights, **TOL)


def test_dtype_promotion_and_precision():
  """Inputs are promoted to ``dtype`` and the output has it, as in Flax; precision reaches
  the kernel's matmuls."""
  mesh = mesh_of("auto")
  attend = jax.jit(functools.partial(ring_jax.flax_attention_fn(mesh=mesh, is_causal=True),
                                     dtype=jnp.bfloat16,
                                     precision=jax.lax.Precision.HIGHEST))
  kq, kk, kv = jax.random.split(jax.random.key(7), 3)
  q, k, v = (jax.random.normal(r, (B, L, HEADS, 8), jnp.float32) for r in (kq, kk, kv))
  out = attend(q, k, v)
  chex.assert_type(out, jnp.bfloat16)
  chex.assert_shape(out, (B, L, HEADS, 8))
  q16, k16, v16 = (a.astype(jnp.bfloat16) for a in (q, k, v))
  want = ring_jax.reference_attention(q16, k16, v16, is_causal=True)
  chex.assert_trees_all_close(out.astype(jnp.float32), want.astype(jnp.float32), atol=2e-2,
                              rtol=2e-2)
  # No dtype: the common dtype of the inputs, like flax's promote_dtype.
  chex.assert_type(jax.eval_shape(ring_jax.flax_attention_fn(mesh=mesh), q16, k, v),
                   jnp.float32)


# ---------------------------------------------------- linen.MultiHeadDotProductAttention

@pytest.mark.parametrize("layout,is_causal,with_segments", [
    ("contiguous", False, False),
    ("zigzag", True, False),
    ("contiguous", True, True),
])
def test_linen_matches_dense(layout, is_causal, with_segments):
  mesh = mesh_of("auto")
  x, cot = inputs(8)
  seg = packed_segments(B, L, seed=9) if with_segments else None
  weights = token_weights(seg)
  dense = nn.MultiHeadDotProductAttention(num_heads=HEADS)
  params = dense.init(jax.random.key(0), x)

  def value_and_grads(module, params, x, **kw):
    def loss(params, x):
      out = module.apply(params, x, **kw)
      return jnp.sum(out * cot * weights), out
    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x)
    return out, grads

  @jax.jit
  def ring_step(params, x, seg):
    # Linen modules are built where they are applied: bind this batch's segment ids here.
    adapter = ring_jax.flax_attention_fn(mesh=mesh, is_causal=is_causal, layout=layout,
                                         segment_ids=seg)
    return value_and_grads(nn.MultiHeadDotProductAttention(num_heads=HEADS,
                                                           attention_fn=adapter), params, x)

  out, (d_params, d_x) = ring_step(params, x, seg)
  want, (want_params, want_x) = jax.jit(functools.partial(
      value_and_grads, dense, mask=dense_mask(seg, is_causal)))(params, x)
  chex.assert_trees_all_close(out * weights, want * weights, **TOL)
  chex.assert_trees_all_close(d_x, want_x, **TOL)
  chex.assert_trees_all_close(d_params, want_params, **TOL)


def test_linen_segment_ids_bound_at_construction():
  """Segment ids given as a concrete array when the module is defined (a fixed packing)."""
  mesh = mesh_of("auto")
  x, _ = inputs(10)
  seg = packed_segments(B, L, seed=11)
  ring = nn.MultiHeadDotProductAttention(
      num_heads=HEADS, attention_fn=ring_jax.flax_attention_fn(mesh=mesh, segment_ids=seg))
  dense = nn.MultiHeadDotProductAttention(num_heads=HEADS)
  params = dense.init(jax.random.key(0), x)
  weights = token_weights(seg)
  out = jax.jit(ring.apply)(params, x)
  want = dense.apply(params, x, mask=dense_mask(seg, False))
  chex.assert_trees_all_close(out * weights, want * weights, **TOL)


# ------------------------------------------------------------------------------ refusals

MASK_FIX = r"is_causal=True.*segment_ids=.*local_window_size="


def test_refuses_dense_mask_nnx_and_linen():
  mesh = mesh_of("auto")
  x, _ = inputs(0)
  adapter = ring_jax.flax_attention_fn(mesh=mesh)
  mask = nnx.make_causal_mask(jnp.zeros((B, L)))
  with pytest.raises(ValueError, match=f"got a mask.*mask=None.*{MASK_FIX}"):
    nnx_mha(adapter)(x, mask=mask)
  linen = nn.MultiHeadDotProductAttention(num_heads=HEADS, attention_fn=adapter)
  params = nn.MultiHeadDotProductAttention(num_heads=HEADS).init(jax.random.key(0), x)
  with pytest.raises(ValueError, match=f"got a mask.*{MASK_FIX}"):
    linen.apply(params, x, mask=mask)


def test_refuses_bias():
  q = jnp.zeros((B, L, HEADS, 8))
  with pytest.raises(ValueError, match=f"got a bias.*bias=None.*{MASK_FIX}"):
    ring_jax.flax_attention_fn(mesh=mesh_of("auto"))(q, q, q, bias=jnp.zeros((B, HEADS, L, L)))


def test_refuses_active_dropout_nnx_and_linen():
  mesh = mesh_of("auto")
  x, _ = inputs(0)
  adapter = ring_jax.flax_attention_fn(mesh=mesh)
  fix = r"dropout_rate=0\.0.*deterministic=True"
  with pytest.raises(ValueError, match=f"attention dropout.*{fix}"):
    nnx_mha(adapter, dropout_rate=0.1)(x, deterministic=False)
  linen = nn.MultiHeadDotProductAttention(num_heads=HEADS, dropout_rate=0.1,
                                          attention_fn=adapter)
  params = nn.MultiHeadDotProductAttention(num_heads=HEADS).init(jax.random.key(0), x)
  with pytest.raises(ValueError, match=f"attention dropout.*{fix}"):
    linen.apply(params, x, deterministic=False, rngs={"dropout": jax.random.key(1)})


def test_refuses_sow_weights_and_custom_einsums():
  x, _ = inputs(0)
  adapter = ring_jax.flax_attention_fn(mesh=mesh_of("auto"))
  with pytest.raises(ValueError, match="sow_weights=False"):
    nnx_mha(adapter)(x, sow_weights=True)
  q = jnp.zeros((B, L, HEADS, 8))
  with pytest.raises(ValueError, match="custom einsum"):
    adapter(q, q, q, qk_attn_weights_einsum=jnp.einsum, attn_weights_value_einsum=jnp.einsum)


def test_refuses_segment_ids_of_another_batch():
  q = jnp.zeros((B, L, HEADS, 8))
  adapter = ring_jax.flax_attention_fn(mesh=mesh_of("auto"),
                                       segment_ids=jnp.ones((B, L // 2), jnp.int32))
  with pytest.raises(ValueError, match=r"segment_ids must have shape .*\(2, 32\).*\(2, 16\)"):
    adapter(q, q, q)


def test_refuses_bad_layout_at_construction():
  with pytest.raises(ValueError, match="layout must be one of"):
    ring_jax.flax_attention_fn(mesh=mesh_of("auto"), layout="zig-zag")


# --------------------------------------------------------------- signature and imports

@pytest.mark.parametrize("flax_fn", [nnx.dot_product_attention, nn.dot_product_attention],
                         ids=["nnx", "linen"])
def test_signature_mirrors_flax(flax_fn):
  """Every argument flax's dot_product_attention takes, ours takes; the positional ones in
  the same order. (Linen's modules drop kwargs their attention_fn does not name, so a missing
  one would be ignored silently.)"""
  ours = inspect.signature(ring_jax.flax_attention_fn(mesh=mesh_of("auto"))).parameters
  theirs = inspect.signature(flax_fn).parameters
  assert set(theirs) <= set(ours), set(theirs) - set(ours)
  shared_positional = list(theirs)[:12]  # query ... module: the same in nnx and linen
  assert list(ours)[:12] == shared_positional


def test_ring_jax_imports_without_flax():
  """``import ring_jax`` and tracing the adapter work with Flax unimportable."""
  script = textwrap.dedent("""
      import importlib.abc
      import sys

      class NoFlax(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
          if name == "flax" or name.startswith("flax."):
            raise ImportError(f"blocked: {name}")
          return None

      sys.meta_path.insert(0, NoFlax())
      import jax
      import ring_jax

      mesh = jax.make_mesh((4,), ("sequence",))
      q = jax.random.normal(jax.random.key(0), (1, 16, 2, 8))
      out = jax.eval_shape(ring_jax.flax_attention_fn(mesh=mesh, is_causal=True), q, q, q)
      assert out.shape == q.shape, out
      assert not any(m == "flax" or m.startswith("flax.") for m in sys.modules)
      print("ok")
  """)
  root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
  proc = subprocess.run([sys.executable, "-c", script], cwd=root, env=env, capture_output=True,
                        text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.strip() == "ok"
