"""Export a train.py run as a Hugging Face LLaMA directory.

  python export_hf.py --workdir /tmp/ft --out /tmp/ft_hf [--step N] [--max_shard_size 5GB]

Restores the parameters of checkpoint ``--step`` (default: the newest that
restores) of ``--workdir`` onto the host, with the model config the run saved
(``<workdir>/config.json``, written by train.py), and writes into ``--out``:

* ``config.json``: the run's family (``LlamaForCausalLM``, ``MistralForCausalLM``,
  ``Qwen2ForCausalLM`` or ``Qwen3ForCausalLM``, with its window fields;
  :func:`models.convert_hf.hf_config_dict`) with the run's shape and RoPE
  (``rope_theta``, ``rope_scaling``: the trained ones, overrides included),
  ``tie_word_embeddings`` and ``torch_dtype`` = the parameter dtype;
  the token ids and ``max_position_embeddings`` of the run's
  ``init.hf_dir`` config.json are kept (the latter raised to
  ``data.seq_len`` if the run trained longer);
* ``model.safetensors`` in the parameter dtype, or shards of at most
  ``--max_shard_size`` plus ``model.safetensors.index.json``;
* the tokenizer files found in the run's ``init.hf_dir`` (:data:`TOKENIZER_FILES`);
  ``tokenizer.json`` with a post-processor that adds the BOS / EOS the run's tokenizer
  added (:func:`training.tokenizer.write_hf_tokenizer_json`), so ``transformers``'
  ``AutoTokenizer`` encodes a text to the ids the run trained on.

``transformers.AutoModelForCausalLM.from_pretrained(out)`` loads the result
(tests/hf/test_export_hf.py checks its logits against ours, and that import ->
export without training reproduces every tensor of the original bit for bit).
Run it as one process: the whole model passes through this host's memory.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from typing import Iterable

import jax
import ml_collections
import numpy as np
from absl import app, flags, logging

from models import convert_hf
from models import llama
from models.sharding import MESH_AXES
from training import errors
from training import hf_init as hf_init_lib
from training import loading as loading_lib
from training import tokenizer as tok_lib
from training import validation as val_lib

#: Copied from the run's ``init.hf_dir`` when present.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json",
                   "special_tokens_map.json", "generation_config.json")

UsageError = errors.UsageError  # a bad flag or workdir: one line, exit status EXIT_USAGE


def parse_size(text: str | int) -> int:
  """Bytes of ``"5GB"`` (10^9), ``"5GiB"`` (2^30), ``"20KB"``, ``"300MB"`` or a plain int."""
  if isinstance(text, int):
    return text
  match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B)?\s*", text, re.IGNORECASE)
  if not match:
    raise UsageError(f"--max_shard_size={text!r} is not a size such as 5GB, 500MiB or 1000000.")
  number, unit = float(match.group(1)), (match.group(2) or "").upper()
  scale = {"": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9,
           "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}[unit]
  return int(number * scale)


# ----------------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------------


def read_run_config(workdir: str) -> ml_collections.ConfigDict:
  """The config train.py saved in ``workdir``, with the model fields resolved."""
  path = loading_lib.run_config_path(workdir)
  if not os.path.isfile(path):
    raise UsageError(f"{workdir} has no config.json; pass the --workdir of a train.py run.")
  with open(path) as f:
    config = ml_collections.ConfigDict(json.load(f))
  # Saved unresolved (a field present and None): fill them from init.hf_dir. A field the
  # saved config lacks (a run saved before the field existed) keeps LlamaConfig's default.
  if any(name in config.model and config.model[name] is None
         for name in convert_hf.HF_SHAPE_FIELDS if name != "head_dim"):
    config = hf_init_lib.resolve_hf_init(config)
  return config


def restore_params(workdir: str, model_cfg: llama.LlamaConfig, step: int | None):
  """``(step, params State)`` of the run on this host's first CPU device: checkpoint ``step``,
  or the newest that restores (:func:`training.loading.restore_params`)."""
  host = jax.sharding.Mesh(np.asarray(jax.devices("cpu")[:1]).reshape((1,) * len(MESH_AXES)),
                           MESH_AXES)
  return loading_lib.restore_params(model_cfg, host, workdir, step=step,
                                    fix="pass the --workdir of a train.py run")


# ----------------------------------------------------------------------------------------------
# Writing
# ----------------------------------------------------------------------------------------------


def write_safetensors(tensors: Iterable[tuple[str, np.ndarray]], out: str,
                      max_shard_bytes: int) -> list[str]:
  """Writes ``model.safetensors``, or shards + index when the tensors exceed ``max_shard_bytes``.

  Shards fill in order up to ``max_shard_bytes`` (a larger tensor gets a shard
  of its own), written as soon as they are full; names follow
  ``save_pretrained``: ``model-00001-of-00003.safetensors``. Returns the file names.
  """
  from safetensors.numpy import save_file

  shards: list[list[str]] = []
  weight_sizes: dict[str, int] = {}
  pending: dict[str, np.ndarray] = {}

  def flush():
    if pending:
      save_file(pending, os.path.join(out, f".shard-{len(shards)}.tmp"),
                metadata={"format": "pt"})
      shards.append(list(pending))
      pending.clear()

  for name, array in tensors:
    size = array.nbytes
    if pending and sum(a.nbytes for a in pending.values()) + size > max_shard_bytes:
      flush()
    pending[name] = array
    weight_sizes[name] = size
  flush()
  # safetensors creates its files readable by their owner only (0600); these get the mode
  # of any other file written here (0644 under the usual umask 022).
  mask = os.umask(0)
  os.umask(mask)

  def finish(i: int, file: str) -> None:
    os.chmod(os.path.join(out, f".shard-{i}.tmp"), 0o666 & ~mask)
    os.replace(os.path.join(out, f".shard-{i}.tmp"), os.path.join(out, file))

  if len(shards) == 1:
    finish(0, convert_hf.SINGLE_FILE)
    return [convert_hf.SINGLE_FILE]
  files, weight_map = [], {}
  for i, names in enumerate(shards):
    file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
    finish(i, file)
    files.append(file)
    weight_map.update({n: file for n in names})
  with open(os.path.join(out, convert_hf.INDEX_FILE), "w") as f:
    json.dump({"metadata": {"total_size": sum(weight_sizes.values())},
               "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
  return files + [convert_hf.INDEX_FILE]


def write_hf_dir(params, model_cfg: llama.LlamaConfig, out: str, *, hf_dir: str = "",
                 max_position_embeddings: int | None = None,
                 max_shard_bytes: int = 5 * 10**9) -> list[str]:
  """Writes the HF directory of ``params`` (a State or :class:`Llama`) into ``out``.

  ``hf_dir``: the source model (its config.json's token ids are kept, its
  tokenizer files copied), or "" for a model trained from scratch. Returns the
  file names written.
  """
  os.makedirs(out, exist_ok=True)
  base = convert_hf.read_hf_config_json(hf_dir) if hf_dir else None
  config = convert_hf.hf_config_dict(model_cfg, base,
                                     max_position_embeddings=max_position_embeddings)
  with open(os.path.join(out, "config.json"), "w") as f:
    json.dump(config, f, indent=2)
  written = ["config.json"]
  written += write_safetensors(convert_hf.hf_state_dict(params, model_cfg), out,
                               max_shard_bytes)
  for name in TOKENIZER_FILES if hf_dir else ():
    if os.path.isfile(os.path.join(hf_dir, name)):
      if name == "tokenizer.json":  # the post-processor adding what training added
        tok_lib.write_hf_tokenizer_json(hf_dir, os.path.join(out, name))
      else:
        shutil.copyfile(os.path.join(hf_dir, name), os.path.join(out, name))
      written.append(name)
  return written


def export(workdir: str, out: str, step: int | None = None,
           max_shard_bytes: int = 5 * 10**9, log=print) -> list[str]:
  """Restores the run in ``workdir`` and writes it to ``out`` (see the module docstring)."""
  if os.path.isdir(out) and os.listdir(out):
    raise UsageError(f"--out {out} exists and is not empty; pass a new directory.")
  config = read_run_config(workdir)
  # The weights do not depend on the layout; the host restores them on a ring of 1 device.
  config, _ = val_lib.resolve_layout(config, ring_size=1)
  model_cfg = val_lib.llama_config(config)
  step, params = restore_params(workdir, model_cfg, step)
  hf_dir = hf_init_lib.hf_init_dir(config)
  if hf_dir and not os.path.isdir(hf_dir):
    log(f"warning: the run's init.hf_dir {hf_dir} is gone: no tokenizer files are copied and "
        "config.json gets no token ids.")
    hf_dir = ""
  seq_len = config.get("data", {}).get("seq_len")
  written = write_hf_dir(params, model_cfg, out, hf_dir=hf_dir,
                         max_position_embeddings=seq_len, max_shard_bytes=max_shard_bytes)
  if not any(name in written for name in TOKENIZER_FILES):
    log("note: no tokenizer files copied (the run has no init.hf_dir, or it holds none).")
  log(f"exported step {step} of {workdir} ({model_cfg.num_params() / 1e6:.2f}M params, "
      f"{model_cfg.param_dtype}) to {out}: {', '.join(written)}")
  return written


# ----------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------

def define_flags() -> dict:
  """The command-line flags (defined on demand: importing this module defines none)."""
  return dict(
      workdir=flags.DEFINE_string("workdir", None, "The train.py run to export."),
      out=flags.DEFINE_string("out", None, "The Hugging Face directory to write (new or empty)."),
      step=flags.DEFINE_integer("step", None,
                                "Checkpoint step; default: the newest that restores."),
      max_shard_size=flags.DEFINE_string(
          "max_shard_size", "5GB", "Shard the safetensors above this size (as save_pretrained)."),
  )


_FLAGS: dict = {}


def main(argv) -> None:
  if len(argv) > 1:
    print(f"error: unexpected arguments {argv[1:]}; flags are written --name=value.",
          file=sys.stderr)
    sys.exit(errors.EXIT_USAGE)
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # Orbax logs each restore at INFO; -v shows it.
  v = {name: flag.value for name, flag in _FLAGS.items()}
  try:
    if not v["workdir"] or not v["out"]:
      raise UsageError("pass --workdir (a train.py run) and --out (the directory to write).")
    export(v["workdir"], v["out"], v["step"], parse_size(v["max_shard_size"]))
  except (UsageError, errors.ConfigError) as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(errors.EXIT_USAGE)


if __name__ == "__main__":
  _FLAGS.update(define_flags())
  app.run(main)
