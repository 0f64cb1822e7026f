r"""Retrieval accuracy vs context length for a trained checkpoint.

  python evaluate.py --config configs/tiny.py --workdir /tmp/tiny --lengths 512,1024,2048,4096
  python evaluate.py --config configs/tiny.py:text --config.data.path=... --workdir /tmp/text \
      --lengths 512,1024 --tasks passkey

Two tasks, each at every length (one full forward pass per batch, with the
model's attention: the ring over the mesh's ``sequence`` axis, rows over
``data``; the next-token predictions are read at the answer tokens only):

* ``kv``: training/data.py's key/value retrieval task at ``seq_len = length``
  (the config's ``data.kv`` settings): accuracy of predicting each queried
  value. Needs the kv task's vocabulary (``data.kind='kv_retrieval'`` configs).
* ``passkey``: one needle in filler at a random depth, asked for at the end of
  the row. For kv-task models the needle is a key/value pair among filler
  tokens, followed by ``QUERY key`` (predict the value); for byte-level text
  models it is ``The pass key is 48213.`` in repeated filler sentences,
  followed by ``What is the pass key? The pass key is 48213`` (accuracy over
  the five digits, each predicted from the text before it).

Prints a table (length x task) to stdout, and writes ``eval_lengths.jsonl``
(one row per length and task) and ``eval_lengths.png`` (accuracy vs length,
with chance level) to the workdir. Every length must pass the model's length
rule (``models/lengths.py``: it splits over the ring in the model's layout, e.g.
a multiple of 8 for zigzag on 4 devices, and the ring blocks, FFN chunk and loss
chunk divide each device's share), checked before anything loads: a bad one is
one error line, exit status 2.
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
from training import config as cfg_lib
from training import data as data_lib
from training import loading
from training import step as step_lib
from training.config import EXIT_USAGE, UsageError

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


def text_passkey_rows(length: int, rows: int, seed: int) -> dict[str, np.ndarray]:
  """Byte-level: a 5-digit pass key in filler text, asked for at the end (mask: the digits)."""
  rng = np.random.default_rng([seed, length])
  out = {k: np.zeros((rows, length), v) for k, v in data_lib.DTYPES.items()}
  for r in range(rows):
    key = "".join(str(d) for d in rng.integers(0, 10, 5))
    needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
    question = f"What is the pass key? The pass key is {key}"
    budget = length - 1 - len(needle) - len(question)  # bytes of filler (BOS first)
    if budget < 0:
      raise ValueError(f"length {length} is too short for the passkey text; use >= "
                       f"{length - budget}.")
    filler = (FILLER_TEXT * (budget // len(FILLER_TEXT) + 1))[:budget]
    cut = int(rng.integers(0, budget + 1))
    text = filler[:cut] + needle + filler[cut:] + question
    tokens = data_lib.byte_tokenize(text)[:-1]  # BOS + bytes
    assert len(tokens) == length
    out["tokens"][r] = tokens
    out["positions"][r] = np.arange(length)
    out["segment_ids"][r] = 1
    out["labels"][r, :-1] = tokens[1:]
    out["loss_mask"][r, length - 6:length - 1] = 1.0  # predicting each of the 5 digits
  return out


def make_rows(config, task: str, length: int, rows: int, seed: int):
  """``(batch, chance accuracy)`` of ``task`` at ``length``."""
  if config.data.kind == "kv_retrieval":
    chance = 1.0 / config.data.kv.num_values
    if task == "kv":
      return kv_rows(config, length, rows, seed), chance
    return kv_passkey_rows(config, length, rows, seed), chance
  if task == "kv":
    raise ValueError("the kv task needs a kv_retrieval model (its token ids); with a text "
                     "model use --tasks passkey.")
  return text_passkey_rows(length, rows, seed), 0.1


# ----------------------------------------------------------------------------------------------
# Evaluation
# ----------------------------------------------------------------------------------------------


def check_lengths(model_cfg, mesh, lengths) -> None:
  """The model's length rule (:mod:`models.lengths`: layout, ring blocks, FFN and loss
  chunks) for every length, before anything loads or compiles."""
  ring = mesh.shape["sequence"] if "sequence" in mesh.axis_names else 1
  for length in lengths:
    try:
      lengths_lib.check_length(model_cfg, ring, length, what="length")
    except ValueError as e:
      raise UsageError(f"--lengths: {e}") from None


def evaluate(config, workdir: str, lengths, tasks=TASKS, *, batch_size: int | None = None,
             batches: int = 2, seed: int = 0, log=lambda m: print(m, file=sys.stderr,
                                                                    flush=True)):
  """Accuracy rows ``{task, length, accuracy, answers, chance}``; also written to the workdir."""
  for task in tasks:
    if task not in TASKS:
      raise UsageError(f"--tasks: unknown task {task!r}; choose from {TASKS}.")
  if config.data.kind != "kv_retrieval" and "kv" in tasks:
    raise UsageError("the kv task needs a kv_retrieval model (its token ids); with a "
                              "text model pass --tasks passkey.")
  mesh = cfg_lib.make_mesh(config.mesh)
  model_cfg = cfg_lib.llama_config(config)
  check_lengths(model_cfg, mesh, lengths)
  rows = batch_size or config.eval_batch_size
  data = mesh.shape["data"]
  if rows % data:
    raise UsageError(f"--batch_size={rows} is not divisible by the mesh 'data' axis "
                              f"({data}).")
  model_cfg, params = loading.load_model(config, mesh, workdir=workdir, log=log)
  graphdef, _, _ = step_lib.abstract_model(model_cfg, mesh)
  ring = mesh.shape["sequence"]

  @jax.jit
  def hits(params, batch):
    model = nnx.merge(graphdef, params)
    _, correct = model.nll_sums(batch["tokens"], batch["positions"], batch["segment_ids"],
                                batch["labels"], batch["loss_mask"])
    return correct

  results = []
  with jax.set_mesh(mesh):
    for length in lengths:
      sharding = NamedSharding(mesh, shd.logical_to_spec(("batch", "length"), mesh=mesh,
                                                         shape=(rows, length)))
      for task in tasks:
        correct = answers = 0.0
        chance = None
        for k in range(batches):
          batch, chance = make_rows(config, task, length, rows, seed * 1000 + k)
          batch = data_lib.to_layout_np(batch, model_cfg.layout, ring)
          answers += float(batch["loss_mask"].sum())
          correct += float(hits(params, jax.device_put(batch, sharding)))
        row = dict(task=task, length=length, accuracy=correct / max(answers, 1.0),
                   answers=int(answers), chance=chance)
        results.append(row)
        log(f"{task:8s} L={length:6d}: accuracy {row['accuracy']:.3f} over {int(answers)} "
            "answers")
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
      lengths=flags.DEFINE_string("lengths", "512,1024,2048,4096", "Comma-separated lengths."),
      tasks=flags.DEFINE_string("tasks", None, "Comma-separated subset of kv,passkey; default "
                                "both for kv models, passkey for text models."),
      batch_size=flags.DEFINE_integer("batch_size", None, "Rows per batch; default "
                                      "eval_batch_size."),
      batches=flags.DEFINE_integer("batches", 2, "Batches per length and task."),
      seed=flags.DEFINE_integer("seed", 0, "Seed of the evaluation rows."),
  )


def main(argv) -> None:
  v = cfg_lib.start_script(argv, _FLAGS)
  config = v["config"]
  try:
    if not v["workdir"]:
      raise UsageError("pass --workdir (a train.py run directory).")
    tasks = (v["tasks"].split(",") if v["tasks"] else
             list(TASKS) if config.data.kind == "kv_retrieval" else ["passkey"])
    results = evaluate(config, v["workdir"], parse_lengths(v["lengths"]), tasks,
                       batch_size=v["batch_size"], batches=v["batches"], seed=v["seed"])
  except (UsageError, cfg_lib.ConfigError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr, flush=True)
    sys.exit(EXIT_USAGE)
  print(table(results))
  print(f"wrote {os.path.join(v['workdir'], 'eval_lengths.jsonl')} and eval_lengths.png",
        file=sys.stderr)


if __name__ == "__main__":
  _FLAGS.update(define_flags())
  app.run(main)
