"""``config.init.hf_dir``: the model fields (and tokenizer) of a Hugging Face checkpoint
filled into the run's ConfigDict before anything else reads it."""

from __future__ import annotations

import os

import ml_collections

from training.errors import ConfigError


def hf_init_dir(config) -> str:
  """``config.init.hf_dir``, or "" (also for configs saved before the field existed)."""
  return (config.get("init") or {}).get("hf_dir") or ""


def resolve_hf_init(config: ml_collections.ConfigDict, log=None) -> ml_collections.ConfigDict:
  """``config`` (a copy) with the model fields of ``init.hf_dir/config.json``: None takes
  config.json's value, a value overrides it (a line to ``log``) but for a shape field
  (ConfigError); see docs/huggingface.md, "Which model settings win". A None ``data.tokenizer``
  becomes ``init.hf_dir``. Idempotent; unchanged without ``init.hf_dir``."""
  hf_dir = hf_init_dir(config)
  if not hf_dir:
    return config
  from models import convert_hf  # Local: keeps this module importable without Flax.

  if not os.path.isdir(hf_dir):
    raise ConfigError(f"init.hf_dir={hf_dir!r} is not a directory; pass a local Hugging Face "
                      "LLaMA directory (config.json + *.safetensors, as save_pretrained writes).")
  if not any(os.path.exists(os.path.join(hf_dir, name))
             for name in (convert_hf.SINGLE_FILE, convert_hf.INDEX_FILE)):
    raise ConfigError(f"init.hf_dir={hf_dir!r} holds neither {convert_hf.SINGLE_FILE} nor "
                      f"{convert_hf.INDEX_FILE}; save the model with "
                      "save_pretrained(..., safe_serialization=True).")
  fields = _model_fields(hf_dir, f"init.hf_dir={hf_dir!r}")
  config = config.copy_and_resolve_references()
  if config.data.get("tokenizer") is None:
    config.data.tokenizer = hf_dir
  # JSON turns tuples into lists: compare the saved config's lists as tuples.
  same = lambda a, b: (tuple(a) == tuple(b) if isinstance(a, (list, tuple))
                       and isinstance(b, (list, tuple)) else a == b)
  for name, value in fields.items():
    current = config.model.get(name)
    if current is None:
      with config.unlocked():
        config.model[name] = value
    elif name in convert_hf.HF_SHAPE_FIELDS:
      if not same(current, value):
        raise ConfigError(
            f"model.{name}={current!r} contradicts {hf_dir}/config.json ({value!r}), whose "
            f"weights fix it; leave model.{name} unset (None, as configs/finetune.py does).")
    elif not same(current, value) and log is not None:
      log(f"model.{name}={current!r} overrides {value!r} of {hf_dir}/config.json")
  return config


def _model_fields(hf_dir: str, who: str) -> dict:
  """:func:`models.convert_hf.hf_model_fields` of ``hf_dir``; a missing or foreign config.json
  is a one-line ``ConfigError`` starting with ``who`` (the flag that named the directory)."""
  from models import convert_hf  # Local: keeps this module importable without Flax.

  try:
    return convert_hf.hf_model_fields(hf_dir)
  except (OSError, ValueError, KeyError) as e:
    what = f"config.json lacks {e}" if isinstance(e, KeyError) else str(e)
    raise ConfigError(f"{who}: {what}") from None


def with_hf_model(config: ml_collections.ConfigDict, hf_dir: str) -> ml_collections.ConfigDict:
  """``config`` (a copy) whose :data:`models.convert_hf.HF_FIELDS` are ``hf_dir``'s: the model
  a script's ``--hf_dir`` loads, for whatever reads ``config.model`` before it loads (the
  layout resolver); the other model fields stay ``config``'s."""
  fields = _model_fields(hf_dir, f"--hf_dir {hf_dir}")
  config = config.copy_and_resolve_references()
  # A new model dict: config.json's values replace --config's whatever their type (a float
  # rope_theta over an int one, a dict over None).
  model = ml_collections.ConfigDict({**config.model.to_dict(), **fields})
  if config.model.is_locked:
    model.lock()
  with config.unlocked():
    config.model = model
  return config
