r"""Generate text from a trained checkpoint (or a Hugging Face LLaMA) on the training mesh.

  python generate.py --config configs/tiny.py:text --workdir /tmp/text --prompt "def " \
      --max_new_tokens 64 --temperature 0.8 --top_p 0.95 --seed 0
  python generate.py --config configs/tiny.py:text --workdir /tmp/text --prompt_file prompts.txt \
      --temperature 0            # greedy; one prompt per line, one output line per prompt
  python generate.py --config configs/tiny.py --hf_dir /path/to/hf_llama --prompt "..."
  python generate.py --config configs/finetune.py --config.init.hf_dir=/path/to/hf_llama \
      --workdir /tmp/ft --prompt "..." --temperature 0 --max_new_tokens 32

The model is the config's (``--config`` and ``--config.model.*`` overrides, as
for train.py), with the newest checkpoint in ``--workdir`` restored onto the
config's mesh (``data x sequence x tensor``; only the parameters are read), or
the weights of ``--hf_dir`` (``models/convert_hf.py``). Prompts are prefilled
with the model's attention (the ring over ``sequence``), the KV cache stays
sharded over ``sequence`` and decoding merges the devices' partial attention
exactly (``models/inference.py``, ``docs/inference.md``). With
``--config.model.attention=dense`` the same weights give the same greedy text.

Only generated text goes to stdout: with one prompt it is streamed as it is
produced; with several (``--prompt_file``) each prompt's continuation is one
line, in order, once all are done. Logs go to stderr. Bad input (a prompt
longer than the cache, ``--max_new_tokens`` past it, a batch that does not
split over ``data``, a workdir without a checkpoint, token ids outside the
vocabulary) fails before anything compiles, exit status 2.

Tokenizer: by default the model's own, through
:func:`training.tokenizer.load_tokenizer` (local files only): with ``--hf_dir``
the tokenizer in that directory; with ``--workdir`` the ``data.tokenizer`` the
run trained with (its saved ``config.json``; ``"byte"`` for the ``:text``
configs, the ``init.hf_dir`` tokenizer for ``configs/finetune.py``).
``--tokenizer=ids``: prompts are whitespace-separated token ids (e.g. for the kv
task) and outputs are ids; ``bytes`` forces the byte tokenizer; ``hf`` the
``--hf_dir`` one.
"""

from __future__ import annotations

import os
import sys
import time

import jax
from absl import app
from absl import flags
from ml_collections import config_flags

from models import inference
from models import sharding as shd
from training import data as data_lib
from training.errors import EXIT_USAGE, ConfigError, UsageError
from training import flags as flags_lib
from training import loading
from training import mesh as mesh_lib
from training import validation as val_lib

_HERE = os.path.dirname(os.path.abspath(__file__))

def define_flags() -> dict:
  """The command-line flags (defined only when run as a script: train.py, imported next to
  this module by tests, defines --config and --workdir too)."""
  f = {}
  f["config"] = config_flags.DEFINE_config_file(
      "config", os.path.join(_HERE, "configs", "tiny.py"),
      "ml_collections config (as train.py): model, mesh and the default cache length.",
      lock_config=True)
  f["workdir"] = flags.DEFINE_string(
      "workdir", None, "train.py workdir: its newest checkpoint that restores is loaded.")
  f["hf_dir"] = flags.DEFINE_string(
      "hf_dir", None, "A local Hugging Face LLaMA directory to load instead of --workdir "
      "(config.json + safetensors).")
  f["prompt"] = flags.DEFINE_string("prompt", None, "One prompt.")
  f["prompt_file"] = flags.DEFINE_string(
      "prompt_file", None, "A file with one prompt per line (a batch; its size must split "
      "over the mesh 'data' axis).")
  f["max_new_tokens"] = flags.DEFINE_integer("max_new_tokens", 64, "Tokens to generate per "
                                             "prompt.")
  f["temperature"] = flags.DEFINE_float("temperature", 0.8, "Sampling temperature; 0 is greedy.")
  f["top_p"] = flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass in (0, 1].")
  f["seed"] = flags.DEFINE_integer("seed", 0, "Sampling seed.")
  f["cache_len"] = flags.DEFINE_integer(
      "cache_len", None, "KV cache length in tokens (prompt + generated). Default: the "
      "config's data.seq_len.")
  f["padding"] = flags.DEFINE_enum("padding", "left", list(inference.PADDING_SIDES),
                                   "Side prompts of a batch are padded on (pads are invisible).")
  f["tokenizer"] = flags.DEFINE_enum(
      "tokenizer", None, ["bytes", "ids", "hf"],
      "Default: the model's own: --hf_dir's tokenizer, or the run's data.tokenizer (its "
      "saved config.json). ids: prompts and outputs are token ids.")
  f["stop_at_eos"] = flags.DEFINE_bool("stop_at_eos", True,
                                       "Stop a row at the tokenizer's EOS.")
  return f


_FLAGS: dict = {}


# ----------------------------------------------------------------------------------------------
# Tokenizers
# ----------------------------------------------------------------------------------------------


class PromptTokenizer:
  """``encode(str) -> list[int]``, ``decode(list[int]) -> str``, ``eos``, ``vocab_limit``.

  ``kind="ids"``: prompts are whitespace-separated token ids and outputs are ids;
  otherwise a :class:`training.tokenizer.Tokenizer` (``tok``) encodes a prompt
  as the start of a document (BOS as the tokenizer adds it, no EOS: continue it).
  """

  def __init__(self, tok=None):
    self.kind = "ids" if tok is None else tok.kind
    self._tok = tok
    self.eos = None if tok is None else tok.eos_id
    self.vocab_limit = None if tok is None else tok.vocab_size

  def encode(self, text: str) -> list[int]:
    if self._tok is None:
      try:
        return [int(t) for t in text.split()]
      except ValueError:
        raise UsageError(f"--tokenizer=ids takes whitespace-separated integers, got "
                         f"{text!r}.") from None
    return self._tok.encode_document(text, bos=True, eos=False).tolist()

  def decode(self, ids) -> str:
    ids = [int(i) for i in ids]
    if self._tok is None:
      return "".join(f" {i}" for i in ids)
    return self._tok.decode(ids)


def prompt_tokenizer(config, kind: str | None, *, workdir=None, hf_dir=None,
                     log=lambda m: None) -> PromptTokenizer:
  """``--tokenizer``: None, the model's own (:func:`training.loading.run_tokenizer_spec`:
  ``--hf_dir``'s, or the one the run in ``--workdir`` trained with); ``ids``; ``bytes``;
  ``hf`` (``--hf_dir``'s, the default with it)."""
  if kind == "ids":
    return PromptTokenizer()
  if kind == "bytes":
    return PromptTokenizer(data_lib.load_tokenizer("byte"))
  if kind == "hf" and not hf_dir:
    raise UsageError("--tokenizer=hf needs --hf_dir (the tokenizer files live there).")
  try:
    return PromptTokenizer(loading.load_run_tokenizer(config, workdir=workdir, hf_dir=hf_dir,
                                                      log=log))
  except UsageError as e:
    raise UsageError(f"{e} (or pass --tokenizer=ids and token ids as prompts)") from None


# ----------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------


def read_prompts(prompt: str | None, prompt_file: str | None) -> list[str]:
  if (prompt is None) == (prompt_file is None):
    raise UsageError("pass exactly one of --prompt and --prompt_file.")
  if prompt is not None:
    return [prompt]
  if not os.path.isfile(prompt_file):
    raise UsageError(f"--prompt_file {prompt_file} does not exist.")
  with open(prompt_file, encoding="utf-8") as f:
    prompts = [line.rstrip("\n") for line in f]
  prompts = [p for p in prompts if p]
  if not prompts:
    raise UsageError(f"--prompt_file {prompt_file} holds no non-empty line.")
  return prompts


def run(config, *, workdir=None, hf_dir=None, prompts: list[str], max_new_tokens: int,
        temperature: float, top_p: float, seed: int, cache_len: int | None = None,
        padding: str = "left", tokenizer: str | None = None, stop_at_eos: bool = True,
        out=sys.stdout, log=lambda m: print(m, file=sys.stderr, flush=True)) -> list[str]:
  """Generates for ``prompts``; writes the text to ``out`` and returns one string per prompt."""
  if (workdir is None) == (hf_dir is None):
    raise UsageError("pass --workdir (a train.py run) or --hf_dir (a Hugging Face LLaMA).")
  if not temperature >= 0:
    raise UsageError(f"--temperature must be >= 0, got {temperature}.")
  if not 0 < top_p <= 1:
    raise UsageError(f"--top_p must be in (0, 1], got {top_p}.")
  try:
    sizes = mesh_lib.mesh_shape(config.mesh, jax.device_count())
    # init.hf_dir's shape (configs/finetune.py), --hf_dir's model, the last stage's RoPE and
    # length, and model.layout="auto" as train.py resolves it for this data and ring.
    config, _ = val_lib.resolve_config(config, shd.ring_size(sizes), hf_dir=hf_dir)
  except ConfigError as e:
    raise UsageError(str(e)) from None
  tok = prompt_tokenizer(config, tokenizer, workdir=workdir, hf_dir=hf_dir, log=log)
  mesh = mesh_lib.make_mesh(config.mesh)
  cache_len = cache_len or config.data.seq_len
  ids = [tok.encode(p) for p in prompts]
  model_cfg = (val_lib.llama_config(config) if hf_dir is None else None)
  if model_cfg is not None:  # checked before restoring: a mistake costs nothing
    try:
      inference.check_request(model_cfg, mesh, ids, max_new_tokens, cache_len, padding)
    except ValueError as e:
      raise UsageError(_with_flags(str(e))) from None
  log(f"mesh {sizes}; {len(prompts)} prompt(s), longest {max(map(len, ids))} tokens; "
      f"cache {cache_len} tokens")
  model_cfg, params = loading.load_model(config, mesh, workdir=workdir, hf_dir=hf_dir, log=log)
  try:
    inference.check_request(model_cfg, mesh, ids, max_new_tokens, cache_len, padding)
  except ValueError as e:
    raise UsageError(_with_flags(str(e))) from None
  log(f"attention={model_cfg.attention} layout={model_cfg.layout}; KV cache "
      f"{inference.cache_bytes_per_device(model_cfg, mesh, len(ids), cache_len) / 2**20:.2f} "
      "MiB per device")
  gen = inference.Generator(model_cfg, params, mesh, cache_len)
  vocab_limit = (tok.vocab_limit if tok.vocab_limit and tok.vocab_limit < model_cfg.vocab_size
                 else None)
  produced: list[list[int]] = [[] for _ in ids]
  done = [False] * len(ids)
  streamed = ""
  t0 = time.perf_counter()
  for i, tokens in enumerate(gen.generate(ids, max_new_tokens, temperature=temperature,
                                          top_p=top_p, seed=seed, padding=padding,
                                          vocab_limit=vocab_limit)):
    if i == 0:
      log(f"prefill + first token: {time.perf_counter() - t0:.2f}s")
      t0 = time.perf_counter()
    for b, t in enumerate(tokens.tolist()):
      if done[b]:
        continue
      if stop_at_eos and tok.eos is not None and t == tok.eos:
        done[b] = True
        continue
      produced[b].append(t)
    if len(ids) == 1:  # stream: print what decodes cleanly so far
      text = tok.decode(produced[0])
      if text.endswith("\ufffd"):  # a multi-byte character is still incomplete
        continue
      out.write(text[len(streamed):])
      out.flush()
      streamed = text
    if all(done):
      break
  steps = max(1, i)
  log(f"decoded {i + 1} step(s); {(time.perf_counter() - t0) / steps * 1e3:.1f} ms per step")
  texts = [tok.decode(p) for p in produced]
  if len(ids) == 1:
    out.write(texts[0][len(streamed):] + "\n")
  else:
    for text in texts:
      out.write(text.replace("\n", "\\n") + "\n")
  out.flush()
  return texts


def _with_flags(message: str) -> str:
  return message.replace("max_new_tokens=", "--max_new_tokens=")


def main(argv) -> None:
  v = flags_lib.start_script(argv, _FLAGS)
  try:
    run(v["config"], workdir=v["workdir"], hf_dir=v["hf_dir"],
        prompts=read_prompts(v["prompt"], v["prompt_file"]), max_new_tokens=v["max_new_tokens"],
        temperature=v["temperature"], top_p=v["top_p"], seed=v["seed"],
        cache_len=v["cache_len"], padding=v["padding"], tokenizer=v["tokenizer"],
        stop_at_eos=v["stop_at_eos"])
  except (UsageError, ConfigError) as e:
    print(f"error: {e}", file=sys.stderr, flush=True)
    sys.exit(EXIT_USAGE)


if __name__ == "__main__":
  _FLAGS.update(define_flags())
  app.run(main)
