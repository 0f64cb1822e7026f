"""Orbax checkpoints: train state + data state round trip, restore onto another mesh shape."""

import jax
import ml_collections
import numpy as np
from flax import nnx

from models import llama
from models import sharding as shd
from training import checkpoint as ckpt_lib
from training import config as cfg_lib
from training import step as step_lib

MODEL = llama.LlamaConfig(vocab_size=64, dim=32, num_layers=2, num_heads=4, num_kv_heads=2,
                          mlp_dim=64, fsdp=True)
OPTIM = ml_collections.ConfigDict(dict(lr=1e-3, warmup_steps=1, min_lr_ratio=0.1,
                                       weight_decay=0.1, b1=0.9, b2=0.95, eps=1e-8,
                                       grad_clip=1.0))


def make_state(mesh):
  """Sharded params + AdamW state with non-trivial moments, and both shardings."""
  with jax.set_mesh(mesh):
    params = nnx.split(llama.create_sharded_model(MODEL, mesh, seed=1), nnx.Param, ...)[1]
    p_shard = shd.param_shardings(params, mesh)
    tx = step_lib.make_optimizer(OPTIM, total_steps=10)
    o_shard = step_lib.opt_state_shardings(tx, params, p_shard, mesh)
    opt_state = step_lib.init_opt_state(tx, params, o_shard)
    grads = jax.tree.map(lambda p: 0.01 * p + 0.001, params)
    _, opt_state = jax.jit(tx.update, out_shardings=(None, o_shard))(grads, opt_state, params)
  return tx, params, opt_state, p_shard, o_shard


def mesh_of(data, sequence, tensor=1):
  return cfg_lib.make_mesh(ml_collections.ConfigDict(dict(data=data, sequence=sequence,
                                                          tensor=tensor)))


def test_save_on_one_mesh_restore_on_another_and_keep_last_n(tmp_path):
  tx, params, opt_state, _, _ = make_state(mesh_of(2, 4))
  checkpointer = ckpt_lib.Checkpointer(str(tmp_path), every=5, keep=2, async_save=True)
  data_state = {"next_index": 17}
  assert not checkpointer.save(1, params, opt_state, data_state)  # off the interval
  assert checkpointer.save(5, params, opt_state, data_state)
  assert not checkpointer.save(6, params, opt_state, data_state)
  checkpointer.close()

  # A different mesh shape (and tensor parallelism): shardings come from the new mesh.
  new_mesh = mesh_of(1, 4, 2)
  with jax.set_mesh(new_mesh):
    abstract_params = nnx.split(nnx.eval_shape(lambda: llama.Llama(MODEL, rngs=nnx.Rngs(0))),
                                nnx.Param, ...)[1]
    p_shard = shd.param_shardings(abstract_params, new_mesh)
    o_shard = step_lib.opt_state_shardings(tx, abstract_params, p_shard, new_mesh)
    abstract_opt = jax.eval_shape(tx.init, abstract_params)
  restorer = ckpt_lib.Checkpointer(str(tmp_path), every=5, keep=2)
  assert restorer.latest_step() == 5
  got_params, got_opt, got_data = restorer.restore(
      5, ckpt_lib.abstract_like(abstract_params, p_shard),
      ckpt_lib.abstract_like(abstract_opt, o_shard))
  restorer.close()

  assert got_data == data_state
  for want, got, sharding in zip(jax.tree.leaves(params), jax.tree.leaves(got_params),
                                 jax.tree.leaves(p_shard)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert got.sharding == sharding
  # Sharded over 'tensor' on the new mesh where the old one had no such split.
  assert any("tensor" in str(s.spec) for s in jax.tree.leaves(p_shard))
  for want, got, sharding in zip(jax.tree.leaves(opt_state), jax.tree.leaves(got_opt),
                                 jax.tree.leaves(o_shard)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert got.sharding == sharding
  assert jax.tree.structure(got_opt) == jax.tree.structure(opt_state)

  # Keep-last-N: only the newest `keep` steps survive.
  keeper = ckpt_lib.Checkpointer(str(tmp_path / "keep"), every=1, keep=2, async_save=False)
  for step in (1, 2, 3):
    assert keeper.save(step, params, opt_state, {"next_index": step})
  keeper.close()
  assert keeper.all_steps() == [2, 3]
