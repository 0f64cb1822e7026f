r"""Retrieval accuracy vs context length for a trained checkpoint.

  python evaluate.py --config configs/tiny.py --workdir /tmp/tiny --lengths 512,1024,2048,4096
  python evaluate.py --config configs/tiny.py:text --config.data.path=... --workdir /tmp/text \
      --lengths 512,1024 --tasks passkey
  python evaluate.py --config configs/finetune.py --config.init.hf_dir=DIR --workdir /tmp/ft \
      --lengths 1024,2048 --tasks passkey        # a fine-tuned run, its tokenizer
  python evaluate.py --hf_dir DIR --lengths 1024,2048 --tasks passkey   # an HF model as is

Two tasks, each at every length (one full forward pass per batch, with the
model's attention: the ring over the mesh's ``sequence`` axis, rows over
``data``; the next-token predictions are read at the answer tokens only):

* ``kv``: training/data.py's key/value retrieval task at ``seq_len = length``
  (the config's ``data.kv`` settings): accuracy of predicting each queried
  value. Needs the kv task's vocabulary (``data.kind='kv_retrieval'`` configs).
* ``passkey``: one needle in filler at a random depth, asked for at the end of
  the row. For kv-task models the needle is a key/value pair among filler
  tokens, followed by ``QUERY key`` (predict the value); for text models it
  is ``The pass key is 48213.`` in repeated filler sentences, followed by
  ``What is the pass key? The pass key is 48213``, built as text and encoded
  with the model's tokenizer (the run's ``data.tokenizer``, or ``--hf_dir``'s),
  lengths in its tokens (accuracy over the key's tokens, each predicted from
  the text before it).

Prints a table (length x task) to stdout, and writes ``eval_lengths.jsonl``
(one row per length and task) and ``eval_lengths.png`` (accuracy vs length,
with chance level) to the workdir. Any length >= 1 runs: a row of ``length``
tokens runs padded at its end to the model's length rule
(:func:`models.lengths.padded_length`: e.g. the next multiple of 8 for zigzag on
4 devices), the padding masked (segment 0, no answer), so each answer is
predicted from the ``length`` tokens alone.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import jax
import numpy as np
from absl import app
from absl import flags
from flax import nnx
from jax.sharding import NamedSharding
from ml_collections import config_flags

from models import lengths as lengths_lib
from models import sharding as shd
from training import data as data_lib
from training.errors import EXIT_USAGE, ConfigError, UsageError
from training import flags as flags_lib
from training import loading
from training import mesh as mesh_lib
from training import step as step_lib
from training import validation as val_lib

TASKS = ("kv", "passkey")
FILLER_TEXT = ("The grass is green. The sky is blue. The sun is yellow. Here we go. "
               "There and back again. ")


# ----------------------------------------------------------------------------------------------
# Examples (natural order; reordered into the layout just before the forward pass)
# ----------------------------------------------------------------------------------------------


def kv_rows(config, length: int, rows: int, seed: int) -> dict[str, np.ndarray]:
  """The kv task at ``seq_len = length`` (loss mask = the queried values)."""
  task = data_lib.KVRetrievalTask.from_config(config.data)
  task = dataclasses.replace(task, seq_len=length)
  task.check()
  return task.rows(seed, 0, rows)


def kv_passkey_rows(config, length: int, rows: int, seed: int) -> dict[str, np.ndarray]:
  """One key/value pair at a random depth in filler, then ``QUERY key value`` at the end."""
  task = data_lib.KVRetrievalTask.from_config(config.data)
  rng = np.random.default_rng([seed, length])
  out = {k: np.zeros((rows, length), v) for k, v in data_lib.DTYPES.items()}
  for r in range(rows):
    tokens = rng.integers(task.filler_start, task.key_start, size=length)
    tokens[0] = data_lib.BOS_ID
    key = task.key_start + rng.integers(task.num_keys)
    value = task.value_start + rng.integers(task.num_values)
    depth = 1 + rng.integers(0, length - 5)
    tokens[depth:depth + 2] = key, value
    tokens[-3:] = task.QUERY_ID, key, value
    out["tokens"][r] = tokens
    out["positions"][r] = np.arange(length)
    out["segment_ids"][r] = 1
    out["labels"][r, -2] = value
    out["loss_mask"][r, -2] = 1.0
  return out


def text_passkey_rows(tokenizer, length: int, rows: int, seed: int) -> dict[str, np.ndarray]:
  """A 5-digit pass key in filler text, asked for at the end (loss mask: the key's tokens).

  Built as text and encoded with the model's ``tokenizer``
  (:class:`training.tokenizer.Tokenizer`), lengths counted in its tokens: ``[BOS]``,
  filler, the needle ``The pass key is 48213. Remember it. ...`` at a random token
  depth, more filler, ``What is the pass key? The pass key is `` and the key. The
  pieces are encoded separately, so a BPE merge never spans two of them; the filler is
  whole repetitions of :data:`FILLER_TEXT`'s tokens, cut to the row's budget. With the
  byte tokenizer this is the byte text exactly.
  """
  rng = np.random.default_rng([seed, length])
  out = {k: np.zeros((rows, length), v) for k, v in data_lib.DTYPES.items()}
  bos = [tokenizer.bos_id] if tokenizer.add_bos and tokenizer.bos_id is not None else []
  filler_ids = tokenizer.encode(FILLER_TEXT)
  for r in range(rows):
    key = "".join(str(d) for d in rng.integers(0, 10, 5))
    needle = tokenizer.encode(f"The pass key is {key}. Remember it. {key} is the pass key. ")
    question = tokenizer.encode("What is the pass key? The pass key is ")
    answer = tokenizer.encode(key)
    budget = length - len(bos) - len(needle) - len(question) - len(answer)  # filler tokens
    if budget < 0:
      raise ValueError(f"length {length} is too short for the passkey text ({length - budget} "
                       f"{tokenizer.name} tokens); use a longer length.")
    filler = np.tile(filler_ids, budget // max(len(filler_ids), 1) + 1)[:budget]
    cut = int(rng.integers(0, budget + 1))
    tokens = np.concatenate([np.asarray(bos, np.int32), filler[:cut], needle, filler[cut:],
                             question, answer]).astype(np.int32)
    assert len(tokens) == length
    out["tokens"][r] = tokens
    out["positions"][r] = np.arange(length)
    out["segment_ids"][r] = 1
    out["labels"][r, :-1] = tokens[1:]
    out["loss_mask"][r, length - 1 - len(answer):length - 1] = 1.0  # predicting the key
  return out


def text_passkey_chance(tokenizer) -> float:
  """Per-token accuracy of guessing a uniform 5-digit key (0.1 when each digit is a token)."""
  return 0.1 ** (5 / len(tokenizer.encode("48213")))


def make_rows(config, task: str, length: int, rows: int, seed: int, tokenizer=None):
  """``(batch, chance accuracy)`` of ``task`` at ``length``; ``tokenizer``: a text model's
  (None: the kv task's token ids)."""
  if tokenizer is None:
    chance = 1.0 / config.data.kv.num_values
    if task == "kv":
      return kv_rows(config, length, rows, seed), chance
    return kv_passkey_rows(config, length, rows, seed), chance
  if task == "kv":
    raise ValueError("the kv task needs a kv_retrieval model (its token ids); with a text "
                     "model use --tasks passkey.")
  return text_passkey_rows(tokenizer, length, rows, seed), text_passkey_chance(tokenizer)


# ----------------------------------------------------------------------------------------------
# Evaluation
# ----------------------------------------------------------------------------------------------


def check_lengths(lengths) -> None:
  """Every length is a positive int (each one runs padded to the model's length rule)."""
  for length in lengths:
    if not isinstance(length, (int, np.integer)) or length < 1:
      raise UsageError(f"--lengths: every length must be a positive int, got {length!r}.")


def evaluate(config, workdir: str | None, lengths, tasks=TASKS, *, hf_dir: str | None = None,
             batch_size: int | None = None, batches: int = 2, seed: int = 0,
             log=lambda m: print(m, file=sys.stderr, flush=True)):
  """Accuracy rows ``{task, length, accuracy, answers, chance}``; also written to the workdir.

  The model is the newest checkpoint of ``workdir`` or, with ``hf_dir``, that Hugging
  Face directory's (a text model; outputs go to ``workdir`` if given). Text models
  use their own tokenizer (:func:`training.loading.load_run_tokenizer`).
  """
  if (workdir is None) and (hf_dir is None):
    raise UsageError("pass --workdir (a train.py run) or --hf_dir (a Hugging Face LLaMA).")
  for task in tasks:
    if task not in TASKS:
      raise UsageError(f"--tasks: unknown task {task!r}; choose from {TASKS}.")
  text = bool(hf_dir) or config.data.kind != "kv_retrieval"
  if text and "kv" in tasks:
    raise UsageError("the kv task needs a kv_retrieval model (its token ids); with a "
                              "text model pass --tasks passkey.")
  mesh = mesh_lib.make_mesh(config.mesh)
  # init.hf_dir's shape (configs/finetune.py), --hf_dir's model, the last stage's RoPE and
  # length, and model.layout="auto" as train.py resolves it for this data and ring.
  config, _ = val_lib.resolve_config(config, shd.ring_size(mesh.shape), hf_dir=hf_dir)
  check_lengths(lengths)  # before anything loads
  tokenizer = (loading.load_run_tokenizer(config, workdir=workdir, hf_dir=hf_dir, log=log)
               if text else None)
  rows = batch_size or config.eval_batch_size
  data = mesh.shape["data"]
  if rows % data:
    raise UsageError(f"--batch_size={rows} is not divisible by the mesh 'data' axis "
                              f"({data}).")
  model_cfg, params = loading.load_model(config, mesh, workdir=workdir, hf_dir=hf_dir, log=log)
  graphdef, _, _ = step_lib.abstract_model(model_cfg, mesh)
  ring = shd.ring_size(mesh.shape)

  @jax.jit
  def hits(params, batch):
    model = nnx.merge(graphdef, params)
    _, correct = model.nll_sums(batch["tokens"], batch["positions"], batch["segment_ids"],
                                batch["labels"], batch["loss_mask"])
    return correct

  results = []
  with jax.set_mesh(mesh):
    for length in lengths:
      run_len = lengths_lib.padded_length(model_cfg, ring, length)  # padded at each row's end
      sharding = NamedSharding(mesh, shd.logical_to_spec(("batch", "length"), mesh=mesh,
                                                         shape=(rows, run_len)))
      for task in tasks:
        correct = answers = 0.0
        chance = None
        for k in range(batches):
          batch, chance = make_rows(config, task, length, rows, seed * 1000 + k, tokenizer)
          batch = data_lib.to_layout_np(data_lib.pad_rows(batch, run_len), model_cfg.layout,
                                        ring)
          answers += float(batch["loss_mask"].sum())
          correct += float(hits(params, jax.device_put(batch, sharding)))
        row = dict(task=task, length=length, accuracy=correct / max(answers, 1.0),
                   answers=int(answers), chance=chance)
        results.append(row)
        log(f"{task:8s} L={length:6d}: accuracy {row['accuracy']:.3f} over {int(answers)} "
            "answers")
  if workdir:
    write_outputs(results, workdir)
  return results


def table(results) -> str:
  tasks = sorted({r["task"] for r in results}, key=TASKS.index)
  lengths = sorted({r["length"] for r in results})
  acc = {(r["task"], r["length"]): r["accuracy"] for r in results}
  lines = ["| length | " + " | ".join(tasks) + " |", "|---:|" + "---:|" * len(tasks)]
  for length in lengths:
    lines.append(f"| {length} | " + " | ".join(f"{acc[(t, length)]:.3f}" for t in tasks) + " |")
  return "\n".join(lines)


def write_outputs(results, workdir: str) -> tuple[str, str]:
  """``eval_lengths.jsonl`` and ``eval_lengths.png`` in ``workdir``; returns their paths."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  os.makedirs(workdir, exist_ok=True)
  jsonl = os.path.join(workdir, "eval_lengths.jsonl")
  with open(jsonl, "w") as f:
    for row in results:
      f.write(json.dumps(row) + "\n")
  fig, ax = plt.subplots(figsize=(5, 3.5))
  for task in sorted({r["task"] for r in results}, key=TASKS.index):
    rows = sorted((r for r in results if r["task"] == task), key=lambda r: r["length"])
    ax.plot([r["length"] for r in rows], [r["accuracy"] for r in rows], "o-", label=task)
    ax.axhline(rows[0]["chance"], ls=":", color=ax.lines[-1].get_color(), lw=1,
               label=f"{task} chance")
  ax.set_xscale("log", base=2)
  ax.set_xlabel("context length (tokens)")
  ax.set_ylabel("retrieval accuracy")
  ax.set_ylim(0, 1.02)
  ax.legend(fontsize=8)
  ax.grid(alpha=0.3)
  fig.tight_layout()
  png = os.path.join(workdir, "eval_lengths.png")
  fig.savefig(png, dpi=120)
  plt.close(fig)
  return jsonl, png


def parse_lengths(text: str) -> list[int]:
  try:
    lengths = [int(x) for x in text.split(",") if x.strip()]
  except ValueError:
    raise UsageError(f"--lengths takes comma-separated ints, got {text!r}.") from None
  if not lengths or min(lengths) < 1:
    raise UsageError(f"--lengths needs positive lengths, got {text!r}.")
  return lengths


_FLAGS: dict = {}


def define_flags() -> dict:
  """Flags, defined only when run as a script (tests import train.py next to this module)."""
  return dict(
      config=config_flags.DEFINE_config_file(
          "config", os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs",
                                 "tiny.py"), "ml_collections config (as train.py).",
          lock_config=True),
      workdir=flags.DEFINE_string("workdir", None, "train.py workdir (newest checkpoint); "
                                  "outputs are written here."),
      hf_dir=flags.DEFINE_string("hf_dir", None, "A local Hugging Face LLaMA directory to "
                                 "evaluate instead of --workdir's checkpoint (its tokenizer "
                                 "too); outputs go to --workdir if given."),
      lengths=flags.DEFINE_string("lengths", "512,1024,2048,4096", "Comma-separated lengths."),
      tasks=flags.DEFINE_string("tasks", None, "Comma-separated subset of kv,passkey; default "
                                "both for kv models, passkey for text models."),
      batch_size=flags.DEFINE_integer("batch_size", None, "Rows per batch; default "
                                      "eval_batch_size."),
      batches=flags.DEFINE_integer("batches", 2, "Batches per length and task."),
      seed=flags.DEFINE_integer("seed", 0, "Seed of the evaluation rows."),
  )


def main(argv) -> None:
  v = flags_lib.start_script(argv, _FLAGS)
  config = v["config"]
  try:
    tasks = (v["tasks"].split(",") if v["tasks"] else
             list(TASKS) if config.data.kind == "kv_retrieval" and not v["hf_dir"]
             else ["passkey"])
    results = evaluate(config, v["workdir"], parse_lengths(v["lengths"]), tasks,
                       hf_dir=v["hf_dir"], batch_size=v["batch_size"], batches=v["batches"],
                       seed=v["seed"])
  except (UsageError, ConfigError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr, flush=True)
    sys.exit(EXIT_USAGE)
  print(table(results))
  if v["workdir"]:
    print(f"wrote {os.path.join(v['workdir'], 'eval_lengths.jsonl')} and eval_lengths.png",
          file=sys.stderr)


if __name__ == "__main__":
  _FLAGS.update(define_flags())
  app.run(main)
