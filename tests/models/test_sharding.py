"""models.sharding: the rules table, constraints, parameter shardings, sharded init, FSDP."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import ring_jax
from model_utils import graphdef as _graphdef
from model_utils import make_mesh, packed_batch
from model_utils import random_params as _random_params
from models import sharding as shd
from models.attention import attention
from models.llama import Llama, LlamaConfig, create_sharded_model
from models.sharding import param_shardings

TINY = dict(vocab_size=64, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, mlp_dim=64,
            init_std=0.2, attention="ring", layout="zigzag", block_q=2, block_kv=2)
B, L = 2, 16


def _batch():
  """Tokens/positions/segment ids in natural order (two documents per row, some padding)."""
  return packed_batch(TINY["vocab_size"], ((6, 7), (11, 5)), L)


def _to_layout(batch, ring, layout=TINY["layout"]):
  return tuple(np.asarray(ring_jax.to_layout(x, layout, ring)) for x in batch)


@pytest.fixture(scope="module")
def reference():
  """Dense attention, no mesh: params, batch and logits every sharded variant must reproduce."""
  cfg = LlamaConfig(**{**TINY, "attention": "dense"})
  params = _random_params(cfg)
  batch = _batch()
  logits = jax.jit(lambda p, *b: nnx.merge(_graphdef(cfg), p)(*b))(params, *batch)
  return params, batch, np.asarray(logits)


# ----------------------------------------------------------------------------------------------
# The rules table
# ----------------------------------------------------------------------------------------------


def test_mesh_axes_are_the_rules_targets():
  """MESH_AXES lists exactly the mesh axes the rules table names (one list, one order)."""
  targets = set()
  for _, target in shd.LOGICAL_RULES:
    targets.update((target,) if isinstance(target, str) else (target or ()))
  assert set(shd.MESH_AXES) == targets
  assert len(set(shd.MESH_AXES)) == len(shd.MESH_AXES)
  # Each logical name has one rule (no aliases such as a second name for "length").
  names = [name for name, _ in shd.LOGICAL_RULES]
  assert len(set(names)) == len(names)


def test_logical_to_spec_maps_and_drops_axes():
  # Without a mesh every target is kept: the sequence over both levels of the ring.
  assert shd.logical_to_spec(("batch", "length", "embed")) == P(
      "data", ("sequence_outer", "sequence"), None)
  assert shd.logical_to_spec(("embed", "heads", "head_dim")) == P(None, "tensor", None)
  # FSDP weights: over every device holding other tokens (data replicas and ring devices).
  assert shd.logical_to_spec(("embed_fsdp", "mlp")) == P(
      ("data", "sequence_outer", "sequence"), "tensor")
  # Stacked layers in contiguous blocks over the pipeline stages (replicated without them).
  assert shd.logical_to_spec(("layers", "norm")) == P("pipeline", None)
  # Axes the mesh lacks are dropped: the same names work on a (data, sequence) mesh.
  ds = jax.make_mesh((2, 4), ("data", "sequence"))
  assert shd.logical_to_spec(("batch", "length", "heads"), mesh=ds) == P("data", "sequence", None)
  assert shd.logical_to_spec(("layers", "norm"), mesh=ds) == P(None, None)
  full = make_mesh(data=2, sequence=2, tensor=2)
  # An axis that does not divide the dimension is dropped (1 kv head over tensor=2).
  assert shd.logical_to_spec(("embed", "kv_heads"), mesh=full, shape=(32, 1)) == P(None, None)
  # A mesh axis is used once per spec: the first dimension that asks gets it.
  assert shd.logical_to_spec(("heads", "mlp"), mesh=full) == P("tensor", None)
  # Custom rules (several mesh axes for one name) work through the same function.
  rules = shd.LOGICAL_RULES + (("tokens", ("data", "sequence")),)
  assert shd.logical_to_spec(("tokens",), rules, mesh=full) == P(("data", "sequence"))
  with pytest.raises(ValueError, match="no rule"):
    shd.logical_to_spec(("hidden",))
  with pytest.raises(ValueError, match="logical names"):
    shd.logical_to_spec(("batch",), shape=(2, 3))


def test_two_level_sequence_rules():
  """sequence_outer > 1 splits the sequence outer-major over (sequence_outer, sequence):
  device (g, r) holds block g * sequence + r (ring_jax.two_level's combined ring index);
  with sequence_outer=1 the specs are those of a mesh without that axis."""
  names = ("batch", "length", "embed")
  two = make_mesh(sequence_outer=2, sequence=4)
  assert shd.logical_to_spec(names, mesh=two) == P("data", ("sequence_outer", "sequence"), None)
  # tensor=1 here splits nothing: dropped from the residual's axes.
  assert shd.logical_to_spec(("batch", "residual_length"), mesh=two) == P(
      "data", ("sequence_outer", "sequence"))
  assert shd.ring_size(two.shape) == 8 == shd.ring_size(dict(sequence_outer=2, sequence=4))
  one = make_mesh(sequence=4, tensor=2)
  assert one.shape["sequence_outer"] == 1
  assert shd.logical_to_spec(names, mesh=one) == P("data", "sequence", None)
  assert shd.logical_to_spec(("residual_length",), mesh=one) == P(("sequence", "tensor"))
  assert shd.ring_size(one.shape) == 4 == shd.ring_size(dict(data=2, sequence=4))
  x = jax.device_put(np.arange(16), NamedSharding(two, shd.logical_to_spec(("length",),
                                                                          mesh=two)))
  where = dict(zip(two.axis_names, range(len(two.axis_names))))
  for shard in x.addressable_shards:
    at = np.argwhere(two.devices == shard.device)[0]
    g, r = at[where["sequence_outer"]], at[where["sequence"]]
    np.testing.assert_array_equal(shard.data, np.arange(16)[(g * 4 + r) * 2:][:2])
  # The model's backends that need one sequence axis say so on such a mesh.
  q = jnp.zeros((1, 16, 4, 8))
  for name in ("ulysses", "hybrid"):
    cfg = LlamaConfig(**{**TINY, "attention": name})
    with jax.set_mesh(two), pytest.raises(ValueError, match=f"model.attention='{name}' runs "
                                          "over one sequence axis.*mesh.sequence_outer=1"):
      attention(cfg, q, q, q, jnp.zeros((1, 16), jnp.int32), None)


@pytest.mark.parametrize("auto", [False, True])
def test_with_logical_constraint(auto):
  x = jnp.arange(B * L * 4, dtype=jnp.float32).reshape(B, L, 4)
  # No mesh: a no-op.
  assert shd.with_logical_constraint(x, ("batch", "length", "embed")) is x
  mesh = make_mesh(auto=auto, data=2, sequence=2, tensor=2)
  with jax.set_mesh(mesh):
    y = jax.jit(lambda a: shd.with_logical_constraint(a * 2, ("batch", "length", "embed")))(x)
  assert y.sharding.is_equivalent_to(NamedSharding(mesh, P("data", "sequence", None)), 3)
  np.testing.assert_array_equal(y, 2 * x)


def test_param_shardings_follow_rules():
  mesh = make_mesh(data=2, sequence=2, tensor=2)
  for fsdp, embed in ((False, None), (True, ("data", "sequence"))):
    model = nnx.eval_shape(lambda: Llama(LlamaConfig(**TINY, fsdp=fsdp), rngs=nnx.Rngs(0)))
    sh = param_shardings(model, mesh)
    # The stacked-layer axis is named for the pipeline stages (one here: nothing moves).
    layers = "pipeline"
    assert sh["layers"]["attn"]["wq"].get_value().spec == P(layers, embed, "tensor", None)
    assert sh["layers"]["attn"]["wo"].get_value().spec == P(layers, "tensor", None, embed)
    assert sh["layers"]["mlp"]["w_down"].get_value().spec == P(layers, "tensor", embed)
    assert sh["layers"]["attn_norm"]["scale"].get_value().spec == P(layers, None)
    assert sh["embed"].get_value().spec == P("tensor", embed)
    assert sh["lm_head"].get_value().spec == P(embed, "tensor")
    # Same structure as the params the trainer splits off (tree mode).
    _, params, _ = nnx.split(model, nnx.Param, ...)
    assert jax.tree.structure(param_shardings(params, mesh)) == jax.tree.structure(sh)
  # shard_params places real arrays (a State, or a whole Module) the same way.
  cfg = LlamaConfig(**TINY, fsdp=True)
  placed = shd.shard_params(_random_params(cfg), mesh)
  assert placed["lm_head"].get_value().sharding.spec == P(("data", "sequence"), "tensor")
  module = shd.shard_params(nnx.merge(_graphdef(cfg), _random_params(cfg)), mesh)
  assert module.layers.mlp.w_up[...].sharding.spec == P("pipeline", ("data", "sequence"), "tensor")


# ----------------------------------------------------------------------------------------------
# Sharded init and sharded execution
# ----------------------------------------------------------------------------------------------


def test_create_sharded_model_places_shards_without_full_copies():
  """Params are created sharded per the rules; per-device init memory stays near one shard."""
  from models.llama import _sharded_init

  cfg = LlamaConfig(vocab_size=8192, dim=512, num_layers=4, num_heads=8, num_kv_heads=4,
                    mlp_dim=2048, fsdp=True)
  mesh = make_mesh(data=2, sequence=2, tensor=2)
  _, init = _sharded_init(cfg, mesh, 3)  # the jitted initialiser create_sharded_model runs
  with jax.set_mesh(mesh):
    memory = init.lower().compile().memory_analysis()
  model_bytes = 4 * cfg.num_params()
  # Each device holds 1/8 of every weight (embed over data x sequence, heads/mlp/vocab over
  # tensor).
  assert memory.output_size_in_bytes < 0.15 * model_bytes
  # Drawing full weights and slicing them needs > model_bytes of temp per device (352 MiB
  # measured for this 92 MiB model before weights were drawn sharded; 32 MiB after).
  assert memory.temp_size_in_bytes < 0.5 * model_bytes

  model = create_sharded_model(cfg, mesh, seed=3)
  is_var = lambda x: isinstance(x, nnx.Variable)
  for var, sharding in zip(jax.tree.leaves(nnx.state(model), is_leaf=is_var),
                           jax.tree.leaves(param_shardings(model, mesh), is_leaf=is_var)):
    assert var.get_value().sharding.spec == sharding.get_value().spec
  wq = model.layers.attn.wq[...]
  assert {s.data.shape for s in wq.addressable_shards} == {(4, 128, 4, 64)}
  # Weights ~ N(0, init_std^2), independent across layers and matrices; norm scales 1.
  wq_np = np.asarray(wq)
  assert abs(wq_np.std() - cfg.init_std) < 0.001 and abs(wq_np.mean()) < 0.001
  assert not np.allclose(wq_np[0], wq_np[1])
  assert not np.allclose(np.asarray(model.layers.attn.wk[...]), wq_np[:, :, :4])
  norms = np.asarray(model.final_norm.scale[...])
  np.testing.assert_array_equal(norms, np.ones_like(norms))


@pytest.mark.parametrize("mesh_shape,names,auto,fsdp,layout", [
    ((2, 1, 1, 2, 2), shd.MESH_AXES, False, True, "zigzag"),  # FSDP + tensor + sequence
    ((2, 1, 1, 2, 2), shd.MESH_AXES, True, True, "striped"),  # the same on Auto (GSPMD) axes
    ((1, 1, 1, 1, 1), shd.MESH_AXES, False, False, "zigzag"),  # a 1-device mesh: ring of 1
    ((1, 1, 2, 2, 2), shd.MESH_AXES, False, False, "zigzag"),  # two-level ring 2 x 2, tensor
    ((2, 4), ("data", "tensor"), False, False, "zigzag"),  # no sequence axis: dense fallback
])
def test_sharded_forward_matches_reference(reference, mesh_shape, names, auto, fsdp, layout):
  params, batch, want = reference
  cfg = LlamaConfig(**{**TINY, "layout": layout}, fsdp=fsdp)
  kw = {"axis_types": (AxisType.Auto,) * len(names)} if auto else {}
  mesh = jax.make_mesh(mesh_shape, names, devices=jax.devices()[:int(np.prod(mesh_shape))], **kw)
  ring = shd.ring_size(mesh.shape)
  with jax.set_mesh(mesh):
    sharded = jax.device_put(params, param_shardings(params, mesh))
    got = jax.jit(lambda p, *b: nnx.merge(_graphdef(cfg), p)(*b))(
        sharded, *_to_layout(batch, ring, layout))
  got = ring_jax.from_layout(np.asarray(got), layout, ring)
  real = batch[2] > 0
  np.testing.assert_allclose(np.asarray(got)[real], want[real], rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# Tensor sequence parallelism (the residual_length rule)
# ----------------------------------------------------------------------------------------------


def test_tensor_sequence_parallel_is_one_rule():
  """The switch changes one entry of the table: residual_length over (sequence, tensor) or
  sequence alone; a mesh without tensor > 1 reduces "on" to "off" by itself."""
  on, off = shd.rules(None), shd.rules(False)
  assert shd.rules(True) == on == shd.LOGICAL_RULES
  assert [r for r in on if r not in off] == [
      ("residual_length", ("sequence_outer", "sequence", "tensor"))]
  full = make_mesh(data=1, sequence=2, tensor=4)
  names = ("batch", "residual_length", "embed")
  assert shd.logical_to_spec(names, on, mesh=full) == P("data", ("sequence", "tensor"), None)
  assert shd.logical_to_spec(names, off, mesh=full) == P("data", "sequence", None)
  ds = make_mesh(data=2, sequence=4)
  on_ds, off_ds = (NamedSharding(ds, shd.logical_to_spec(names, r, mesh=ds)) for r in (on, off))
  assert on_ds.is_equivalent_to(off_ds, 3)  # tensor=1: the same placement
  with shd.use_rules(off):
    assert shd.active_rules() == off
    assert shd.logical_to_spec(names, mesh=full) == P("data", "sequence", None)
  assert shd.active_rules() == shd.LOGICAL_RULES
  with pytest.raises(ValueError, match="tensor_sequence_parallel"):
    shd.rules("yes")


def _weighted_loss_and_grads(cfg, params, batch, weights, mesh):
  graphdef = _graphdef(cfg)

  def loss(p, t, q, s):
    return jnp.sum(nnx.merge(graphdef, p)(t, q, s) * weights)

  with jax.set_mesh(mesh):
    sharded = jax.device_put(params, param_shardings(params, mesh))
    value, grads = jax.jit(jax.value_and_grad(loss))(sharded, *batch)
  return float(value), jax.tree.map(np.asarray, grads)


@pytest.mark.parametrize("sizes,auto,ffn_chunk", [
    (dict(data=1, sequence=2, tensor=4), True, 2),  # GSPMD; blockwise FFN on L/(s t) chunks
    (dict(sequence=4, tensor=2), False, None),  # Explicit axes: reshard / out_sharding
])
def test_tensor_sequence_parallel_keeps_loss_and_gradients(sizes, auto, ffn_chunk):
  """tensor_sequence_parallel off == on (float32): the loss and every parameter gradient."""
  mesh = make_mesh(auto=auto, **sizes)
  ring = shd.ring_size(mesh.shape)
  base = LlamaConfig(**{**TINY, "num_kv_heads": 4}, ffn_chunk_size=ffn_chunk)
  params = _random_params(base)
  batch = _to_layout(_batch(), ring)
  weights = np.random.default_rng(1).normal(size=(B, L, TINY["vocab_size"])).astype(np.float32)
  weights *= (batch[2] > 0)[..., None] / (B * L)
  got = {}
  for tsp in (False, None):
    cfg = dataclasses.replace(base, tensor_sequence_parallel=tsp)
    got[tsp] = _weighted_loss_and_grads(cfg, params, batch, weights, mesh)
  np.testing.assert_allclose(got[None][0], got[False][0], rtol=1e-5)
  assert jax.tree.leaves(got[None][1])
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
               got[None][1], got[False][1])


def test_tensor_sequence_parallel_trades_all_reduce_for_reduce_scatter_and_all_gather():
  """The train step's partitioned HLO (data=1 x sequence=2 x tensor=4): with the switch on,
  the layer's row-parallel outputs (and the input gradients of the column-parallel ones)
  are reduce-scattered into L/(s t) tokens and gathered back before the next projection;
  off, they are all-reduced. The ring (collective-permute over sequence) is unchanged."""
  import optax

  from benchmarks import common as bench
  from training import step as step_lib

  mesh = make_mesh(auto=True, data=1, sequence=2, tensor=4)
  counts, temp = {}, {}
  for tsp in (False, None):
    cfg = LlamaConfig(**{**TINY, "num_kv_heads": 4}, tensor_sequence_parallel=tsp)
    step = step_lib.build_train_step(cfg, mesh, optax.sgd(1e-2))
    compiled, hlo = bench.compile_partitioned(step.lower((B, 64)))
    counts[tsp] = bench.count_collectives(hlo)
    temp[tsp] = compiled.memory_analysis().temp_size_in_bytes
  off, on = counts[False], counts[None]
  assert off["reduce-scatter"]["count"] == 0
  # Per layer (scanned: counted once): forward o and down projections, backward the input
  # gradients of q/k/v and gate/up; and the embedding.
  assert on["reduce-scatter"]["count"] >= 5
  assert on["all-gather"]["count"] >= off["all-gather"]["count"] + 4
  assert on["all-reduce"]["bytes"] < off["all-reduce"]["bytes"] / 2
  assert on["all-to-all"]["count"] == off["all-to-all"]["count"] == 0  # no stray reshards
  assert on["collective-permute"] == off["collective-permute"]
  assert temp[None] < temp[False]
