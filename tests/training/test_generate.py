"""generate.py end to end: a tiny byte-level train run, then greedy ring == greedy dense."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest

import evaluate
import generate
import train as train_script
from model_utils import tiny_config

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
# The Hugging Face helpers (random HF models, transformers' greedy decoding) live beside the
# HF tests; this file imports them when run on its own too.
sys.path.insert(0, os.path.join(ROOT, "tests", "hf"))
TEXT = ("def add(a, b):\n    return a + b\n\n\nclass Point:\n    def __init__(self, x, y):\n"
        "        self.x = x\n        self.y = y\n") * 40


def text_config(path, **overrides):
  settings = {
      "data.kind": "text", "data.path": str(path), "model.vocab_size": 264,
      "model.dim": 32, "model.mlp_dim": 64, "data.seq_len": 64, "batch_size": 8,
      "eval_batch_size": 8, "eval_batches": 1, "total_steps": 3, "optim.warmup_steps": 0,
      "log_every": 1, "eval_every": 1000, "checkpoint_every": 1000,
      "async_checkpointing": False,
  }
  settings.update(overrides)
  return tiny_config(**settings)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """(config, workdir) of a 3-step byte-level run on a data=2 x sequence=4 zigzag ring."""
  tmp = tmp_path_factory.mktemp("gen")
  corpus = tmp / "corpus"
  corpus.mkdir()
  for i in range(4):
    (corpus / f"doc{i}.txt").write_text(TEXT)
  config = text_config(corpus)
  workdir = str(tmp / "run")
  train_script.train(config, workdir)
  return config, workdir


def _run(config, workdir, prompts, **kw):
  out, logs = io.StringIO(), []
  settings = dict(max_new_tokens=12, temperature=0.0, top_p=1.0, seed=0)
  settings.update(kw)
  texts = generate.run(config, workdir=workdir, prompts=prompts, out=out, log=logs.append,
                       **settings)
  return texts, out.getvalue(), logs


def test_greedy_ring_equals_dense_and_batch_equals_single(trained):
  config, workdir = trained
  ring_texts, ring_out, logs = _run(config, workdir, ["def add("])
  assert any("restored step 3" in l for l in logs)
  assert ring_out == ring_texts[0] + "\n"  # stdout holds the generated text only
  dense = text_config(config.data.path, **{"model.attention": "dense"})
  dense_texts, _, _ = _run(dense, workdir, ["def add("])
  assert ring_texts == dense_texts
  assert len(ring_texts[0]) > 0
  # A batch (left padded, two lengths) gives each prompt its single-prompt text.
  batch_texts, batch_out, _ = _run(config, workdir, ["def add(", "class Point:\n    def"])
  single_texts, _, _ = _run(config, workdir, ["class Point:\n    def"])
  assert batch_texts == ring_texts + single_texts
  assert batch_out.splitlines() == [t.replace("\n", "\\n") for t in batch_texts]


def test_sampling_is_seeded(trained):
  config, workdir = trained
  a, _, _ = _run(config, workdir, ["def "], temperature=0.8, top_p=0.95, seed=1)
  b, _, _ = _run(config, workdir, ["def "], temperature=0.8, top_p=0.95, seed=1)
  assert a == b


@pytest.mark.parametrize("prompts,kw,match", [
    (["x" * 70], {}, "longer than the cache"),
    (["def"], {"max_new_tokens": 100}, "past the cache"),
    (["a", "b", "c"], {}, "do not split over the mesh 'data' axis"),
    (["def"], {"workdir": "EMPTY"}, "no checkpoints/ directory"),
])
def test_bad_input_fails_before_compiling(trained, tmp_path, prompts, kw, match):
  config, workdir = trained
  if kw.get("workdir") == "EMPTY":
    kw["workdir"] = str(tmp_path)
  with pytest.raises(generate.UsageError, match=match):
    _run(config, kw.pop("workdir", workdir), prompts, **kw)


def test_tokens_outside_the_vocabulary(trained):
  config, workdir = trained
  kv = tiny_config(**{"model.dim": 32, "model.mlp_dim": 64})  # vocab 72 < the 259 byte ids
  with pytest.raises(generate.UsageError, match="outside the model's vocabulary"):
    _run(kv, workdir, ["def"])
  with pytest.raises(generate.UsageError, match="outside the model's vocabulary"):
    _run(config, workdir, ["1 2 999"], tokenizer="ids")


def test_cli_streams_text_to_stdout_only(trained):
  config, workdir = trained
  cmd = [sys.executable, "generate.py", "--config", "configs/tiny.py:text",
         f"--config.data.path={config.data.path}", "--config.model.dim=32",
         "--config.model.mlp_dim=64", "--config.data.seq_len=64", f"--workdir={workdir}",
         "--prompt=def add(", "--max_new_tokens=12", "--temperature=0"]
  env = dict(os.environ, PYTHONPATH=ROOT)
  proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr
  texts, _, _ = _run(config, workdir, ["def add("])
  assert proc.stdout == texts[0] + "\n"
  assert "restored step 3" in proc.stderr
  bad = subprocess.run(cmd[:-2] + ["--max_new_tokens=500"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
  assert bad.returncode == generate.EXIT_USAGE and bad.stdout == ""
  assert "--cache_len" in bad.stderr and "Traceback" not in bad.stderr


# ----------------------------------------------------------------------------------------------
# evaluate.py
# ----------------------------------------------------------------------------------------------


def _check_outputs(workdir, results, tasks, lengths):
  rows = [json.loads(l) for l in open(os.path.join(workdir, "eval_lengths.jsonl"))]
  assert rows == results
  assert sorted((r["task"], r["length"]) for r in rows) == sorted(
      (t, n) for t in tasks for n in lengths)
  assert all(0.0 <= r["accuracy"] <= 1.0 and r["answers"] > 0 for r in rows)
  with open(os.path.join(workdir, "eval_lengths.png"), "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  text = evaluate.table(results)
  assert all(f"| {n} |" in text for n in lengths)


def test_evaluate_passkey_text_ring_equals_dense(trained):
  config, workdir = trained
  results = evaluate.evaluate(config, workdir, [128, 256], ["passkey"], batch_size=2,
                              batches=1, log=lambda m: None)
  _check_outputs(workdir, results, ["passkey"], [128, 256])
  assert [r["answers"] for r in results] == [10, 10]  # 2 rows x 5 digits
  dense = text_config(config.data.path, **{"model.attention": "dense"})
  again = evaluate.evaluate(dense, workdir, [128, 256], ["passkey"], batch_size=2, batches=1,
                            log=lambda m: None)
  assert again == results


def test_evaluate_kv_task(tmp_path):
  config = tiny_config(**{"model.dim": 32, "model.mlp_dim": 64, "data.seq_len": 64,
                          "batch_size": 8, "eval_batch_size": 8, "eval_batches": 1,
                          "data.kv.num_pairs": 4, "data.kv.num_queries": 4, "total_steps": 2,
                          "optim.warmup_steps": 0, "eval_every": 1000,
                          "checkpoint_every": 1000, "async_checkpointing": False})
  workdir = str(tmp_path / "kv")
  train_script.train(config, workdir)
  results = evaluate.evaluate(config, workdir, [64, 128], ["kv", "passkey"], batch_size=2,
                              batches=1, log=lambda m: None)
  _check_outputs(workdir, results, ["kv", "passkey"], [64, 128])
  answers = {(r["task"], r["length"]): r["answers"] for r in results}
  assert answers[("kv", 64)] == 2 * 2 * 4  # rows x docs_per_row x num_queries
  assert answers[("passkey", 128)] == 2
  with pytest.raises(generate.UsageError, match="positive int, got 0"):
    evaluate.evaluate(config, workdir, [60, 0], ["kv"], log=lambda m: None)


def test_evaluate_cli_bad_length_is_one_line(tmp_path):
  """evaluate.py at a length below 1: exit 2 with one error line, before anything loads (any
  length >= 1 runs: padded to the model's length rule,
  tests/training/test_trainer_any_length.py)."""
  cmd = [sys.executable, "evaluate.py", "--config", "configs/tiny.py",
         f"--workdir={tmp_path}", "--lengths=256,0"]
  proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT),
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == generate.EXIT_USAGE, proc.stderr[-2000:]
  assert "Traceback" not in proc.stderr and proc.stdout == ""
  errors = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
  assert errors == ["error: --lengths needs positive lengths, got '256,0'."], proc.stderr


def test_hf_dir_greedy_matches_transformers_generate(tmp_path):
  """--hf_dir: a random HF LLaMA (GQA) decoded on the ring == transformers' greedy generate."""
  torch = pytest.importorskip("torch")
  pytest.importorskip("transformers")
  from test_convert_hf import _hf_greedy, _hf_model

  model, path = _hf_model(tmp_path, tie=False, rope_scaling=None, shard=False, seed=1)
  prompt = [5, 9, 17, 33, 2, 8, 41]
  want = _hf_greedy(model, prompt, 16)
  config = tiny_config(**{"data.seq_len": 64})  # mesh data=2 x sequence=4, zigzag
  texts, _, logs = _run(config, None, [" ".join(map(str, prompt))], hf_dir=path,
                        tokenizer="ids", max_new_tokens=16)
  assert [int(t) for t in texts[0].split()] == want
  assert any(f"loaded {path}" in l for l in logs)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "mistral"])
def test_hf_dir_family_greedy_matches_transformers_generate(tmp_path, family):
  """--hf_dir of each family (test_convert_hf.FAMILY_CASES: qwen2's biases and window on one
  layer, qwen3's q/k norms with YaRN, mistral's window on all) decoded on the ring with the
  sharded KV cache == transformers' greedy generate; 8 + 16 tokens pass the windows of 8, so
  decoding reads only the cache inside them. (qwen2's dynamic NTK stays at its original 32
  positions here: transformers rescales per step past it, we at the cache length.)
  model.layout="auto" with packed kv rows: "document" for --config's windowless model, but
  resolved for --hf_dir's model, whose window rules it out."""
  pytest.importorskip("torch")
  pytest.importorskip("transformers")
  from test_convert_hf import _hf_greedy, hf_family_model

  model = hf_family_model(family, str(tmp_path / family), seed=3)
  prompt = [5, 9, 17, 33, 2, 8, 41, 7]
  want = _hf_greedy(model, prompt, 16)
  config = tiny_config(**{"data.seq_len": 64, "model.layout": "auto"})
  texts, _, logs = _run(config, None, [" ".join(map(str, prompt))],
                        hf_dir=str(tmp_path / family), tokenizer="ids", max_new_tokens=16,
                        cache_len=32)
  assert [int(t) for t in texts[0].split()] == want
  # qwen3 has no window: packed rows on the ring of 4 keep "document"; a window of 8 on
  # 16-token shards runs 2 of the 4 hops in "contiguous".
  layout = "document" if family == "qwen3" else "contiguous"
  assert f"attention=ring layout={layout}" in " ".join(logs), logs


@pytest.mark.parametrize("kind", ["byte", "bpe"])
def test_text_passkey_rows_are_tokenizer_text(tmp_path, kind):
  """The passkey row is text encoded with the model's tokenizer: exactly ``length`` tokens,
  BOS first, the needle inside, the loss mask on the key's tokens (labels = the key)."""
  from training.tokenizer import load_tokenizer
  if kind == "bpe":
    pytest.importorskip("tokenizers")
    from scripts import make_tiny_hf
    spec = make_tiny_hf.write_tokenizer(str(tmp_path / "tok"), make_tiny_hf.corpus_texts(400),
                                        vocab_size=320)
  else:
    spec = "byte"
  tok = load_tokenizer(spec)
  for length in (128, 256):
    rows = evaluate.text_passkey_rows(tok, length, rows=3, seed=1)
    assert rows["tokens"].shape == (3, length)
    for r in range(3):
      tokens, mask = rows["tokens"][r], rows["loss_mask"][r] > 0
      assert tokens[0] == tok.bos_id
      key = tok.decode(rows["labels"][r][mask])
      assert len(key) == 5 and key.isdigit()
      text = tok.decode(tokens)
      assert f"The pass key is {key}. Remember it." in text
      assert text.endswith(f"What is the pass key? The pass key is {key}")
      assert mask.sum() == len(tok.encode(key))
  chance = evaluate.text_passkey_chance(tok)
  assert chance == pytest.approx(0.1) if kind == "byte" else 0 < chance <= 0.1
  with pytest.raises(ValueError, match="too short"):
    evaluate.text_passkey_rows(tok, 16, rows=1, seed=0)


def test_run_tokenizer_and_model_come_from_the_saved_config(tmp_path):
  """loading.py: a workdir's saved data.tokenizer wins over --config's; --hf_dir names its own;
  none at all is a UsageError naming the fix; a model field differing from the run's warns."""
  from configs import finetune
  from training.errors import UsageError as Usage
  from training import loading
  config = finetune.get_config()
  workdir = tmp_path / "run"
  workdir.mkdir()
  with pytest.raises(Usage, match=r"^no tokenizer: data.tokenizer is unset .*init.hf_dir=DIR"):
    loading.run_tokenizer_spec(config, workdir=str(workdir))
  saved = json.loads(config.to_json_best_effort())
  saved["data"]["tokenizer"] = "/models/llama"
  saved["model"].update(rope_theta=20000.0, attention="ring")
  (workdir / "config.json").write_text(json.dumps(saved))
  logs = []
  assert loading.run_tokenizer_spec(config, workdir=str(workdir), log=logs.append) == \
      "/models/llama"
  assert loading.run_tokenizer_spec(config, hf_dir="/other") == "/other"
  config.model.rope_theta = 500.0
  config.model.attention = "dense"  # an inference choice: no warning
  loading.warn_model_differences(config, str(workdir), log=logs.append)
  assert logs == [f"warning: model.rope_theta=500.0 differs from the run's 20000.0 "
                  f"({workdir}/config.json); pass --config.model.rope_theta=... to match it"]
