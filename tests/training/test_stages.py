"""config.stages (training/stages.py): parsing, validation, and a two-stage run stopped in
its second stage and resumed, which must equal the uninterrupted run."""

import json

import jax
import numpy as np
import pytest
from flax import nnx

import train as train_script
from test_train import small_config as train_small_config
from training import errors
from training import stages as stages_lib
from training import validation as val_lib


def small_config(**overrides):
  """test_train.py's trimmed tiny config, one layer, 4 rows a batch (compiles in seconds)."""
  settings = {"model.num_layers": 1, "batch_size": 4, "eval_batch_size": 4}
  settings.update(overrides)
  return train_small_config(**settings)


def with_stages(stages, **overrides):
  config = small_config(**overrides)
  config.stages = stages
  return config


def test_parse_compact_form():
  assert stages_lib.stage_dicts(with_stages("256:20, 512:30:rope_theta=1e6:lr=1e-4")) == [
      dict(seq_len=256, steps=20), dict(seq_len=512, steps=30, rope_theta=1e6, lr=1e-4)]
  listed = [dict(seq_len=256, steps=2), dict(seq_len=512, steps=3, batch_size=2,
                                             rope_scaling={"rope_type": "linear",
                                                           "factor": 2.0})]
  assert stages_lib.stage_dicts(with_stages(listed)) == listed
  for empty in (None, "", []):
    assert stages_lib.stage_dicts(with_stages(empty)) == []


@pytest.mark.parametrize("stages, message", [
    ("256", "a stage is 'seq_len:steps"),
    ("256:20,", "a stage is 'seq_len:steps"),
    ("256:x", "steps='x' is not an integer"),
    ("256.5:2", "seq_len='256.5' is not an integer"),
    ("256:2:theta=1e6", "unknown field(s) ['theta']"),
    ("256:2:rope_theta", "'rope_theta' is not field=value"),
    ("256:2:rope_scaling=2", "rope_scaling takes a dict"),
    ("256:0", "steps must be >= 1, got 0"),
    ([dict(seq_len=256)], "missing ['steps']"),
    ([(256, 2)], "is not a dict with seq_len and steps"),
    (7, "must be a list of dicts or a string"),
])
def test_bad_stages_are_config_errors(stages, message):
  with pytest.raises(errors.ConfigError) as e:
    stages_lib.resolve(with_stages(stages))
  assert message in str(e.value)


@pytest.mark.parametrize("stages, message", [
    ("256:2,512:2:batch_size=3", "stage 2 (seq_len=512, steps=2): batch_size=3"),
    ("256:2,512:2:warmup_steps=5", "warmup_steps=5 exceeds the stage's steps=2"),
    ("256:2,512:2:rope_theta=-1", "model.rope_theta=-1.0 must be > 0."),
])
def test_each_stage_is_validated_for_the_mesh(stages, message):
  config = stages_lib.resolve(with_stages(stages))
  with pytest.raises(errors.ConfigError) as e:
    val_lib.validate_config(config, 8)
  assert message in str(e.value)


def test_resolve_makes_stages_explicit_and_the_top_level_the_last_stage():
  config = stages_lib.resolve(with_stages("256:2,512:3:rope_theta=1e5:lr=5e-4"))
  assert config.total_steps == 5
  assert (config.data.seq_len, config.model.rope_theta, config.optim.lr) == (512, 1e5, 5e-4)
  assert stages_lib.resolve(config).to_dict() == config.to_dict()  # idempotent
  plan = stages_lib.plan(config)
  assert [(s.start, s.end) for s in plan] == [(0, 2), (2, 5)]
  first, second = (s.config for s in plan)
  assert (first.data.seq_len, first.model.rope_theta, first.optim.lr) == (256, 1e4, 1e-3)
  assert (second.data.seq_len, second.model.rope_theta, second.optim.lr) == (512, 1e5, 5e-4)
  json.loads(config.to_json_best_effort())  # the saved config.json holds the stages
  # Without stages: one stage of the config as it is.
  plain = small_config(**{"total_steps": 7})
  (only,) = stages_lib.plan(plain)
  assert (only.start, only.end) == (0, 7) and only.config is plain


def test_two_stage_run_stopped_mid_stage_2_and_resumed_equals_uninterrupted(tmp_path):
  """256 tokens for 3 steps, then 512 tokens with a raised RoPE base for 3 steps.

  Stopped after step 4 (mid-stage 2, checkpointed there) and resumed: every step's loss
  equals the uninterrupted run's (same mesh, float32: exactly), as do the parameters.
  """
  stages = "256:3,512:3:rope_theta=1e5:lr=5e-4"
  full = train_script.train(with_stages(stages), str(tmp_path / "full"))
  first = train_script.train(with_stages(stages), str(tmp_path / "split"), stop_at_step=4)
  second = train_script.train(with_stages(stages), str(tmp_path / "split"))

  assert [r["step"] for r in full.history] == list(range(1, 7))
  assert [r["step"] for r in first.history] == [1, 2, 3, 4]
  assert [r["step"] for r in second.history] == [5, 6]
  losses = [r["loss"] for r in full.history]
  np.testing.assert_array_equal([r["loss"] for r in first.history + second.history], losses)
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(nnx.to_pure_dict(second.params)),
               jax.device_get(nnx.to_pure_dict(full.params)))
  # Each stage's end is evaluated and checkpointed (the next stage starts from it).
  assert [e["step"] for e in full.evals] == [3, 6]
  rows = [json.loads(l) for l in (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()]
  train_rows = [r for r in rows if "train/loss" in r]
  assert [r["step"] for r in train_rows] == list(range(1, 7))
  np.testing.assert_allclose([r["train/loss"] for r in train_rows], losses, rtol=1e-6)
  # Per-stage schedules (no warmup here): each stage starts at its own peak rate, then decays.
  lrs = [r["train/learning_rate"] for r in train_rows]
  assert lrs[0] == pytest.approx(1e-3) and lrs[3] == pytest.approx(5e-4)
  assert lrs[2] < lrs[0] and lrs[5] < lrs[3]
  # Stage 2 trains on 512-token rows: twice the tokens per step of stage 1.
  tokens = [r["train/tokens_per_s"] * r["train/step_time_s"] for r in train_rows]
  np.testing.assert_allclose(tokens, [4 * 256] * 3 + [4 * 512] * 3, rtol=1e-3)
