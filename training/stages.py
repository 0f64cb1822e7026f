"""Progressive context extension: ``config.stages``, run in order in one workdir.

A stage is a ``seq_len`` and a number of ``steps``, optionally with its own :data:`FIELDS`;
steps are global (stage ``i`` runs ``start_i + 1 .. start_i + steps_i``) and ``total_steps``
is their sum. What carries over between stages and how resuming works: docs/context_extension.md.
A config file lists dicts (``config.stages = [dict(seq_len=4096, steps=500), ...]``), the
command line the compact form ``--config.stages="256:20,512:20:rope_theta=1e6:lr=1e-4"``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import ml_collections
from ml_collections import config_dict

from models import sharding as shd
from training import metrics as metrics_lib
from training import step as step_lib
from training.errors import ConfigError

#: Stage field -> (the config field it sets, its type). ``steps`` sets no field: it is
#: the stage's share of ``total_steps``.
FIELDS: dict[str, tuple[str | None, type]] = {
    "seq_len": ("data.seq_len", int),
    "steps": (None, int),
    "rope_theta": ("model.rope_theta", float),
    "rope_scaling": ("model.rope_scaling", dict),
    "batch_size": ("batch_size", int),
    "lr": ("optim.lr", float),
    "warmup_steps": ("optim.warmup_steps", int),
}
REQUIRED = ("seq_len", "steps")
_EXAMPLE = '--config.stages="256:20,512:20:rope_theta=1e6"'


@dataclasses.dataclass(frozen=True)
class Stage:
  """Stage ``index`` runs global steps ``start + 1 .. end`` with ``config``: the run's
  config with the stage's fields set (and ``stages`` cleared)."""
  index: int
  start: int
  steps: int
  config: ml_collections.ConfigDict

  @property
  def end(self) -> int:
    return self.start + self.steps

  def describe(self) -> str:
    c = self.config
    return (f"stage {self.index + 1}: steps {self.start + 1}-{self.end}, seq_len "
            f"{c.data.seq_len}, batch {c.batch_size}, lr {c.optim.lr:g}, rope_theta "
            f"{c.model.rope_theta:g}"
            + (f", rope_scaling {dict(c.model.rope_scaling)}" if c.model.rope_scaling else ""))


def _cast(where: str, name: str, value):
  """``value`` of stage field ``name`` as its type (:data:`FIELDS`); ConfigError if it has
  none."""
  kind = FIELDS[name][1]
  if kind is dict:
    if value is not None and not hasattr(value, "keys"):
      raise ConfigError(f"{where}: rope_scaling must be a dict such as "
                        "{'rope_type': 'llama3', 'factor': 8.0, ...}, got "
                        f"{value!r}; set it in a config file's stages list.")
    return None if value is None else dict(value)
  if isinstance(value, bool) or not isinstance(value, (int, float, str)):
    raise ConfigError(f"{where}: {name} must be a number, got {value!r}.")
  try:
    number = float(value)
  except ValueError:
    number = None
  if number is None or (kind is int and not number.is_integer()):
    raise ConfigError(f"{where}: {name}={value!r} is not "
                      f"{'an integer' if kind is int else 'a number'}.")
  return int(number) if kind is int else number


def parse(text: str) -> list[dict[str, Any]]:
  """The compact form ``"seq_len:steps[:field=value...],..."`` -> a list of stage dicts
  (untyped); ConfigError for a stage without ``seq_len:steps`` or an item not ``field=value``."""
  out = []
  for i, part in enumerate(p.strip() for p in text.split(",")):
    where = f"config.stages stage {i + 1} ({part!r})"
    items = [s.strip() for s in part.split(":")]
    if len(items) < 2 or any("=" in s for s in items[:2]) or not all(items[:2]):
      raise ConfigError(f"{where}: a stage is 'seq_len:steps[:field=value...]', stages are "
                        f"separated by ',', e.g. {_EXAMPLE}.")
    stage: dict[str, Any] = {"seq_len": items[0], "steps": items[1]}
    for item in items[2:]:
      name, sep, value = item.partition("=")
      if not sep or not value:
        raise ConfigError(f"{where}: {item!r} is not field=value (fields: "
                          f"{sorted(set(FIELDS) - set(REQUIRED))}).")
      if name == "rope_scaling":
        raise ConfigError(f"{where}: rope_scaling takes a dict, which the compact form cannot "
                          "write; set it in a config file's stages list.")
      stage[name] = value
    out.append(stage)
  return out


def stage_dicts(config) -> list[dict[str, Any]]:
  """``config.stages`` as a list of dicts with typed values (empty: no stages); ConfigError
  for anything but a string or a list of dicts, an unknown or missing field, a bad value."""
  raw = config.get("stages")
  if raw is None or (isinstance(raw, (str, list, tuple)) and not raw):
    return []
  if isinstance(raw, str):
    raw = parse(raw)
  if not isinstance(raw, (list, tuple)):
    raise ConfigError(f"config.stages must be a list of dicts or a string such as "
                      f"{_EXAMPLE}, got {type(raw).__name__}.")
  out = []
  for i, stage in enumerate(raw):
    where = f"config.stages stage {i + 1}"
    if not hasattr(stage, "keys"):
      raise ConfigError(f"{where}: {stage!r} is not a dict with seq_len and steps.")
    unknown = set(stage.keys()) - set(FIELDS)
    if unknown:
      raise ConfigError(f"{where}: unknown field(s) {sorted(unknown)}; a stage has "
                        f"{list(FIELDS)}.")
    missing = [name for name in REQUIRED if name not in stage]
    if missing:
      raise ConfigError(f"{where}: missing {missing}; e.g. {_EXAMPLE}.")
    out.append({name: _cast(where, name, stage[name]) for name in FIELDS if name in stage})
    if out[-1]["steps"] < 1:
      raise ConfigError(f"{where}: steps must be >= 1, got {out[-1]['steps']}.")
  return out


def resolve(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """``config`` with explicit stages, ``total_steps`` their sum and the top-level stage
  fields those of the last stage (a copy; unchanged without stages). Idempotent;
  :func:`stage_dicts`'s ConfigErrors."""
  stages = stage_dicts(config)
  if not stages:
    return config
  explicit = [{name: (stage[name] if name in stage else _get(config, path))
               for name, (path, _) in FIELDS.items()} for stage in stages]
  config = _with_stage(config, explicit[-1], stages=explicit)
  config.total_steps = sum(stage["steps"] for stage in explicit)
  return config


def _with_stage(config, stage: dict[str, Any], stages) -> ml_collections.ConfigDict:
  """A copy of ``config`` with the fields of ``stage`` and ``config.stages = stages`` (the
  field's type stays ``object``, as ``configs/common.py`` declares it)."""
  config = config.copy_and_resolve_references()
  with config.unlocked():
    del config["stages"]
    config.stages = config_dict.FieldReference(stages, field_type=object)
    config.update_from_flattened_dict(
        {path: stage[name] for name, (path, _) in FIELDS.items() if path})
  return config


def _get(config, path: str):
  """The value at the dotted ``path`` of ``config`` (a dict for a ConfigDict)."""
  value = config[path]
  return value.to_dict() if isinstance(value, ml_collections.ConfigDict) else value


def plan(config: ml_collections.ConfigDict) -> list[Stage]:
  """The stages of ``config`` (resolved by :func:`resolve` first) in order; without
  ``config.stages``, one stage of ``total_steps`` steps with the config as it is."""
  config = resolve(config)
  stages = stage_dicts(config)
  if not stages:
    return [Stage(index=0, start=0, steps=config.total_steps, config=config)]
  out, start = [], 0
  for i, stage in enumerate(stages):
    out.append(Stage(index=i, start=start, steps=stage["steps"],
                     config=_with_stage(config, stage, stages=None)))
    start += stage["steps"]
  return out


@dataclasses.dataclass
class StageSetup:
  """What one stage builds (:func:`build_stage`): its step, schedule and batch shapes."""
  stage: Stage
  model_cfg: Any
  attention_line: str | None  # why model.attention="auto" chose; logged here after stage 1
  train_step: Any  # training.step.TrainStep
  schedule: Any  # learning rate at the stage's update count (0 at its first step)
  train_shape: tuple[int, int]
  eval_shape: tuple[int, int]


def build_stage(stage: Stage, mesh) -> StageSetup:
  """The train step of ``stage`` (abstract only): its model and an optimizer whose schedule
  spans the stage's steps, its batch shapes ``[rows, run length]`` (the padding logged).
  Parameter shapes are the same in every stage, so any stage restores another's checkpoint."""
  from training import validation as val_lib  # Local: validation imports this module.

  c = stage.config
  model_cfg, attention_line = val_lib.resolve_attention(c, mesh)
  if stage.index > 0:  # train.py logs the first stage's
    metrics_lib.log(attention_line)
  ring = shd.ring_size(mesh.shape)
  metrics_lib.log(val_lib.padding_line(model_cfg, ring, c.data.seq_len))
  run_len = val_lib.run_length(model_cfg, ring, c.data.seq_len)  # data.seq_len, padded
  train_step = cached_train_step(model_cfg, mesh, ml_collections.FrozenConfigDict(c.optim),
                                 stage.steps, c.microbatches, c.seed)
  return StageSetup(stage=stage, model_cfg=model_cfg, attention_line=attention_line,
                    train_step=train_step, schedule=step_lib.make_schedule(c.optim, stage.steps),
                    train_shape=(c.batch_size, run_len), eval_shape=(c.eval_batch_size, run_len))


@functools.lru_cache(maxsize=4)
def cached_train_step(model_cfg, mesh, optim: ml_collections.FrozenConfigDict, steps: int,
                      microbatches: int, seed: int):
  """``build_train_step`` with an optimizer over ``steps``, or the same one built before: the
  last few are kept, so a second train() of the same setup in one process reuses the jitted
  step and JAX's compiled program (the key holds everything the program depends on)."""
  tx = step_lib.make_optimizer(optim, steps)
  return step_lib.build_train_step(model_cfg, mesh, tx, microbatches=microbatches, seed=seed)
