"""Orbax checkpoints: train state + data state round trip, restore onto another mesh shape."""

import shutil

import jax
import ml_collections
import numpy as np
import pytest

from models import llama
from training import checkpoint as ckpt_lib
from training import mesh as mesh_lib
from training import step as step_lib

# Save/restore of the train state across meshes: Orbax on the newest jax's arrays and
# shardings, so leg 2 of .ci/run runs them too (tests/conftest.py).
pytestmark = pytest.mark.newest_jax

MODEL = llama.LlamaConfig(vocab_size=64, dim=32, num_layers=2, num_heads=4, num_kv_heads=2,
                          mlp_dim=64, fsdp=True)
OPTIM = ml_collections.ConfigDict(dict(lr=1e-3, warmup_steps=1, min_lr_ratio=0.1,
                                       weight_decay=0.1, b1=0.9, b2=0.95, eps=1e-8,
                                       grad_clip=1.0))


def make_state(mesh):
  """Sharded params + AdamW state with non-trivial moments, and both shardings."""
  tx = step_lib.make_optimizer(OPTIM, total_steps=10)
  built = step_lib.build_train_step(MODEL, mesh, tx, seed=1)
  p_shard, o_shard = built.param_shardings, built.opt_shardings
  params, opt_state = built.init_state()
  with jax.set_mesh(mesh):
    grads = jax.tree.map(lambda p: 0.01 * p + 0.001, params)
    _, opt_state = jax.jit(tx.update, out_shardings=(None, o_shard))(grads, opt_state, params)
  return tx, params, opt_state, p_shard, o_shard


def mesh_of(data, sequence, tensor=1):
  return mesh_lib.make_mesh(ml_collections.ConfigDict(dict(data=data, sequence=sequence,
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
  target = step_lib.build_train_step(MODEL, new_mesh, tx)
  p_shard, o_shard = target.param_shardings, target.opt_shardings
  restorer = ckpt_lib.Checkpointer(str(tmp_path), every=5, keep=2)
  assert restorer.all_steps()[-1] == 5
  got_params, got_opt, got_data = restorer.restore(5, target.abstract_params,
                                                   target.abstract_opt_state)
  restorer.close()
  # Read only, the parameters alone (what generate.py and evaluate.py restore).
  reader = ckpt_lib.Checkpointer(str(tmp_path), read_only=True)
  step, only_params, no_opt, no_data = reader.restore_latest(target.abstract_params)
  reader.close()
  assert step == 5 and no_opt is None and no_data is None
  jax.tree.map(np.testing.assert_array_equal, only_params, got_params)
  with pytest.raises(ckpt_lib.NoCheckpointError, match="no checkpoints/ directory"):
    ckpt_lib.Checkpointer(str(tmp_path / "elsewhere"), read_only=True)

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


# --- Reliability: corrupt checkpoints, non-finite state ------------------------------------


def targets(tx, mesh):
  """Abstract (params, opt_state) restore targets with ``mesh``'s shardings."""
  built = step_lib.build_train_step(MODEL, mesh, tx)
  return built.abstract_params, built.abstract_opt_state


def _largest_file(directory):
  return max((p for p in directory.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def _truncate(step_dir):
  # Every array data file (not only the largest: which arrays share a file varies between
  # runs, and a cut that spares the arrays read first let restores succeed now and then).
  files = [p for p in (step_dir / "state").rglob("*")
           if p.is_file() and p.name != "manifest.ocdbt" and p.suffix != ".json"
           and p.stat().st_size > 1]
  assert files
  for f in files:
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _empty(step_dir):
  _largest_file(step_dir / "state").write_bytes(b"")


def _no_manifest(step_dir):
  manifests = list(step_dir.rglob("manifest.ocdbt"))
  assert manifests
  for m in manifests:
    m.unlink()


def _no_item(name):
  def corrupt(step_dir):
    shutil.rmtree(step_dir / name)
  return corrupt


def _bare(step_dir):
  shutil.rmtree(step_dir)
  step_dir.mkdir()


CORRUPTIONS = {"truncated array file": _truncate, "emptied array file": _empty,
               "missing manifest": _no_manifest, "missing state/": _no_item("state"),
               "missing data/": _no_item("data"), "bare numbered directory": _bare}


@pytest.fixture(scope="module")
def saved_state(tmp_path_factory):
  """State and a workdir with steps 1 and 2 of it (saved once for all tests here)."""
  mesh = mesh_of(2, 4)
  tx, params, opt_state, _, _ = make_state(mesh)
  workdir = tmp_path_factory.mktemp("saved")
  checkpointer = ckpt_lib.Checkpointer(str(workdir), every=1, keep=5, async_save=False)
  for step in (1, 2):
    assert checkpointer.save(step, params, opt_state, {"next_index": step})
  checkpointer.close()
  return mesh, tx, params, opt_state, workdir


def copy_steps(saved_state, directory):
  """A copy of the saved workdir at a new path: TensorStore caches what it read or wrote
  per path within a process, and a restarted run reads from storage."""
  shutil.copytree(saved_state[-1], directory, dirs_exist_ok=True)


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_corrupt_latest_falls_back_and_is_moved_aside(tmp_path, saved_state, kind):
  mesh, tx, params, _, _ = saved_state
  copy_steps(saved_state, tmp_path)
  CORRUPTIONS[kind](tmp_path / "checkpoints" / "2")

  warnings = []
  checkpointer = ckpt_lib.Checkpointer(str(tmp_path), every=1, keep=2, async_save=False)
  step, got_params, _, data = checkpointer.restore_latest(*targets(tx, mesh),
                                                          warn=warnings.append)
  assert step == 1 and data == {"next_index": 1}
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
               got_params, params)
  # One warning naming the step and why, one saying where it went.
  assert len(warnings) == 2, warnings
  assert "checkpoint step 2" in warnings[0] and "(" in warnings[0]
  moved = list((tmp_path / ckpt_lib.CORRUPT_DIRNAME).iterdir())
  assert len(moved) == 1 and moved[0].name.startswith("2-") and str(moved[0]) in warnings[1]
  assert checkpointer.all_steps() == [1]

  # Neither the step listing nor retention ever touches the moved directory again.
  _, _, p, o, _ = saved_state
  for s in (2, 3, 4):
    assert checkpointer.save(s, p, o, {"next_index": s})
  checkpointer.close()
  assert checkpointer.all_steps() == [3, 4]
  assert moved[0].is_dir() and any(moved[0].iterdir()) == (kind != "bare numbered directory")


def test_read_only_params_restore_skips_a_corrupt_step_and_moves_nothing(tmp_path, saved_state):
  """generate.py/evaluate.py's restore: the parameters of the newest step that restores."""
  mesh, tx, params, _, _ = saved_state
  copy_steps(saved_state, tmp_path)
  _truncate(tmp_path / "checkpoints" / "2")
  warnings = []
  reader = ckpt_lib.Checkpointer(str(tmp_path), read_only=True)
  step, got_params, opt_state, data = reader.restore_latest(targets(tx, mesh)[0],
                                                            warn=warnings.append)
  reader.close()
  assert (step, opt_state, data) == (1, None, None)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
               got_params, params)
  assert len(warnings) == 1 and "checkpoint step 2" in warnings[0]
  assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["1", "2"]
  assert not (tmp_path / ckpt_lib.CORRUPT_DIRNAME).exists()
  with pytest.raises(ValueError, match="read_only"):
    reader.save(3, params, saved_state[3], {})


def test_no_restorable_checkpoint_is_an_error_and_moves_nothing(tmp_path, saved_state):
  mesh, tx, _, _, _ = saved_state
  copy_steps(saved_state, tmp_path)
  _empty(tmp_path / "checkpoints" / "2")
  _no_item("data")(tmp_path / "checkpoints" / "1")
  checkpointer = ckpt_lib.Checkpointer(str(tmp_path), every=1, keep=2, async_save=False)
  with pytest.raises(ckpt_lib.NoRestorableCheckpointError, match="step 2: .*step 1: "):
    checkpointer.restore_latest(*targets(tx, mesh), warn=lambda _: None)
  checkpointer.close()
  assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["1", "2"]
  assert not (tmp_path / ckpt_lib.CORRUPT_DIRNAME).exists()


def test_non_finite_state_is_never_saved(tmp_path, saved_state):
  _, _, params, opt_state, _ = saved_state
  copy_steps(saved_state, tmp_path)
  bad = jax.tree.map(lambda x: x * np.nan, params)
  checkpointer = ckpt_lib.Checkpointer(str(tmp_path), every=1, keep=2, async_save=False)
  for step in (3, 4):  # Retention would otherwise drop 1 and 2 for these.
    with pytest.raises(ckpt_lib.NonFiniteStateError, match=f"step {step}"):
      checkpointer.save(step, bad, opt_state, {"next_index": step})
  checkpointer.close()
  assert checkpointer.all_steps() == [1, 2]
  assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["1", "2"]


def test_one_process_writes_replicated_arrays_whole_and_restores_them(tmp_path):
  """With one process, Orbax's replica-parallel split is off (no slice program per replica
  and shape): a replicated array and a sharded one are written and restore bit for bit."""
  import orbax.checkpoint as ocp
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  mesh = mesh_of(2, 4)
  replicated = jax.device_put(np.arange(48, dtype=np.float32).reshape(6, 8),
                              NamedSharding(mesh, P()))
  sharded = jax.device_put(np.arange(64, dtype=np.float32).reshape(8, 8),
                           NamedSharding(mesh, P("data", "sequence")))
  checkpointer = ckpt_lib.Checkpointer(str(tmp_path), every=1, keep=1, async_save=False)
  assert ocp.type_handlers.get_type_handler(jax.Array)._use_replica_parallel is False
  assert checkpointer.save(1, {"r": replicated}, {"s": sharded}, {"pos": 3})
  checkpointer.close()
  reader = ckpt_lib.Checkpointer(str(tmp_path), read_only=True)
  target = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)
  params, opt_state, data = reader.restore(1, {"r": target(replicated)},
                                           {"s": target(sharded)})
  reader.close()
  np.testing.assert_array_equal(params["r"], replicated)
  np.testing.assert_array_equal(opt_state["s"], sharded)
  assert params["r"].sharding == replicated.sharding and data == {"pos": 3}


def test_asyncio_reports_of_a_failed_read_are_dropped_and_others_kept():
  """After a failed restore, asyncio's "exception was never retrieved" records of the same
  corruption (TensorStore's read error, or an exception raised in Orbax) are dropped; any
  other asyncio record, or another exception's, still reaches the log."""
  import logging
  import sys

  keep = ckpt_lib._keeps_asyncio_record

  def record(exc, msg="Future exception was never retrieved"):
    try:
      raise exc
    except Exception:  # noqa: BLE001
      exc_info = sys.exc_info()
    return logging.LogRecord("asyncio", logging.ERROR, "base_events.py", 1771, msg, (),
                             exc_info)

  read_error = ValueError('OUT_OF_RANGE: Error reading "params.lm_head.value/0.0" in OCDBT '
                          'database at local file "/run/checkpoints/4/state/"')
  assert not keep(record(read_error))
  assert keep(record(ValueError("a bug of ours")))
  assert keep(record(read_error, msg="Task was destroyed but it is pending!"))
  assert keep(logging.LogRecord("asyncio", logging.ERROR, "x.py", 1, "plain", (), None))
