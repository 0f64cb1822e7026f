"""The trained model of a run and its tokenizer (for generate.py, evaluate.py, export_hf.py),
and the run's saved config; errors are one line each (:class:`training.errors.UsageError`)."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
from typing import Callable

import jax

from training import checkpoint as ckpt_lib
from training import errors
from training import metrics as metrics_lib
from training import step as step_lib
from training import tokenizer as tok_lib
from training import validation as val_lib


_stderr = functools.partial(print, file=sys.stderr, flush=True)


def restore_params(model_cfg, mesh, workdir: str, warn: Callable[[str], None] = _stderr, *,
                   step: int | None = None, fix: str | None = None):
  """``(step, params)``: checkpoint ``step`` of ``workdir``, else the newest that restores,
  sharded on ``mesh`` (read only). No checkpoint: a UsageError ending in ``fix`` (default:
  train first, or pass ``--hf_dir``)."""
  fix = fix or f"train first (python train.py --config ... --workdir {workdir}) or pass --hf_dir"
  _, target, _ = step_lib.abstract_model(model_cfg, mesh)
  try:
    checkpointer = ckpt_lib.Checkpointer(workdir, read_only=True)
  except ckpt_lib.NoCheckpointError as e:
    raise errors.UsageError(f"--workdir {e}; {fix}.") from None
  with contextlib.closing(checkpointer), errors.reraise_as(
      errors.UsageError, catch=ckpt_lib.NoRestorableCheckpointError):
    if step is not None:
      if step not in checkpointer.all_steps():
        raise errors.UsageError(f"{checkpointer.directory} has no checkpoint of step {step} "
                                f"(steps: {checkpointer.all_steps()}).")
      return step, checkpointer.restore_params(step, target)
    restored = checkpointer.restore_latest(target, warn=warn)
  if restored is None:
    raise errors.UsageError(f"{checkpointer.directory} holds no checkpoint; {fix}.")
  return restored[0], restored[1]


def load_model(config, mesh, *, workdir: str | None = None, hf_dir: str | None = None,
               log: Callable[[str], None] = _stderr):
  """``(LlamaConfig, params sharded on mesh)`` from ``hf_dir`` (its model, run with
  ``config.model``'s attention, layout, blocks and dtypes) if given, else ``workdir``."""
  if hf_dir:
    from flax import nnx
    from models import convert_hf
    # A ValueError: e.g. a layout the model's window rules out.
    with errors.reraise_as(errors.UsageError, f"--hf_dir {hf_dir}: "):
      cfg = convert_hf.load_hf_config(hf_dir, **{k: config.model[k] for k in (
          "attention", "layout", "block_q", "block_kv", "dtype", "param_dtype")})
    model = convert_hf.load_hf_checkpoint(hf_dir, cfg, mesh=mesh)
    log(f"loaded {hf_dir}")
    return model.cfg, nnx.split(model, nnx.Param, ...)[1]
  model_cfg = val_lib.llama_config(config)
  warn_model_differences(config, workdir, log)
  step, params = restore_params(model_cfg, mesh, workdir, warn=log)
  log(f"restored step {step} from {workdir}")
  return model_cfg, params


# Model fields a script may change at inference without changing what the weights compute.
_INFERENCE_FIELDS = ("attention", "layout", "block_q", "block_kv", "hop_kernel", "causal_routing",
                     "ffn_chunk_size", "loss_chunk_size", "remat_policy", "scan_layers", "dtype",
                     "fsdp")


def run_config_path(workdir: str) -> str:
  """Where train.py keeps the config its checkpoints in ``workdir`` restore under."""
  return os.path.join(workdir, "config.json")


def saved_run_config(workdir: str) -> dict:
  """The config train.py saved in ``workdir`` (``config.json``), or {} without one."""
  try:
    with open(run_config_path(workdir), encoding="utf-8") as f:
      saved = json.load(f)
  except (OSError, ValueError):
    return {}
  return saved if isinstance(saved, dict) else {}


def model_differences(config, workdir: str) -> list[tuple[str, object, object]]:
  """``(field, saved value, config's value)`` of each ``config.model`` field but
  :data:`_INFERENCE_FIELDS` that differs from the run's saved one ([] without one)."""
  saved = saved_run_config(workdir).get("model") or {}
  # Compared as JSON stores them (tuples come back as lists).
  return [(name, saved[name], value) for name, value in config.model.to_dict().items()
          if name not in _INFERENCE_FIELDS and name in saved
          and saved[name] != json.loads(json.dumps(value))]


def warn_model_differences(config, workdir: str, log: Callable[[str], None] = _stderr) -> None:
  """One warning per :func:`model_differences` field: the weights compute something else."""
  for name, saved, value in model_differences(config, workdir):
    log(f"warning: model.{name}={value!r} differs from the run's {saved!r} "
        f"({run_config_path(workdir)}); pass --config.model.{name}=... to match it")


def run_tokenizer_spec(config, *, workdir: str | None = None, hf_dir: str | None = None,
                       log: Callable[[str], None] = _stderr) -> str:
  """The ``data.tokenizer`` spec of the model :func:`load_model` loads: ``hf_dir``'s, else
  the one the run's saved ``config.json`` records, else ``config.data.tokenizer``."""
  if hf_dir:
    return hf_dir
  spec = config.data.get("tokenizer")
  saved = (saved_run_config(workdir).get("data") or {}).get("tokenizer") if workdir else None
  if saved:
    if spec and saved != spec:
      log(f"tokenizer: {saved} (the run's {run_config_path(workdir)}), not --config's {spec}")
    spec = saved
  if not spec:
    raise errors.UsageError(f"no tokenizer: {tok_lib.UNSET}")
  return spec


def load_run_tokenizer(config, *, workdir: str | None = None, hf_dir: str | None = None,
                       log: Callable[[str], None] = _stderr):
  """The :class:`training.tokenizer.Tokenizer` of :func:`run_tokenizer_spec` (UsageError
  naming the fix when it does not load)."""
  spec = run_tokenizer_spec(config, workdir=workdir, hf_dir=hf_dir, log=log)
  with errors.reraise_as(errors.UsageError, f"tokenizer {spec!r} "):
    return tok_lib.load_explained(spec)


def save_run_config(config, workdir: str) -> None:
  """Writes ``config`` to the run's ``config.json`` (process 0, in one rename); train.py calls
  it once the checkpoint restored under ``config``, so a run that cannot resume leaves it."""
  if jax.process_index() == 0:
    os.makedirs(workdir, exist_ok=True)
    metrics_lib.replace_file(run_config_path(workdir), config.to_json_best_effort(indent=2))


def saved_config_hint(config, workdir: str) -> str:
  """The end of the error of a run none of whose checkpoints restores: what differs from the
  saved config and how to rerun with it."""
  diffs = model_differences(config, workdir)
  if not diffs:
    return f"This run wrote nothing into {workdir}."
  flags = " ".join(f"--config.model.{name}={saved}" for name, saved, _ in diffs
                   if isinstance(saved, (bool, int, float, str)))
  changes = ", ".join(f"model.{name} ({saved!r} there, {value!r} here)"
                      for name, saved, value in diffs)
  return (f"The checkpoints were written under the config saved in {run_config_path(workdir)}, "
          f"which differs in {changes}: rerunning with the saved values resumes"
          + (f" (e.g. add {flags})" if flags else "") + f". This run wrote nothing into {workdir}.")
