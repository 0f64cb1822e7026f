"""Tokenizers: byte, a BPE tokenizer.json trained here, a SentencePiece model trained here."""

import json

import numpy as np
import pytest

from model_utils import tiny_config
from training import data as data_lib
from training import errors
from training.tokenizer import load_tokenizer
from training import validation as val_lib

tokenizers = pytest.importorskip("tokenizers")
sentencepiece = pytest.importorskip("sentencepiece")

CORPUS = [
    "Ring attention passes key and value blocks around a ring of devices.",
    "Each device holds one chunk of the sequence and computes blockwise attention.",
    "The zigzag layout balances causal work: chunk d and chunk 2n-1-d share a device.",
    "Packed documents carry segment ids, so attention never crosses a document.",
    "def add(a, b):\n    return a + b\n",
] * 20
TEXT = "Each device passes attention blocks around the ring."


def _train_bpe(directory, *, template: bool, config: dict | None = None):
  from tokenizers import decoders, models, pre_tokenizers, processors, trainers

  tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
      vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  if template:  # What a LLaMA-3 style tokenizer.json does: BOS from the post-processor.
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
  directory.mkdir(exist_ok=True)
  tok.save(str(directory / "tokenizer.json"))
  if config is not None:
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
  return directory


def _train_sentencepiece(directory, config: dict | None = None):
  directory.mkdir(exist_ok=True)
  sentencepiece.SentencePieceTrainer.train(
      sentence_iterator=iter(CORPUS), model_prefix=str(directory / "tokenizer"),
      vocab_size=100, model_type="bpe", character_coverage=1.0, bos_id=1, eos_id=2, unk_id=0,
      pad_id=-1, minloglevel=2)
  if config is not None:
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
  return directory


def test_byte_tokenizer_is_the_default():
  tok = load_tokenizer("byte")
  assert tok.vocab_size == data_lib.BYTE_VOCAB_SIZE == 259
  byte_ids = np.frombuffer(TEXT.encode("utf-8"), np.uint8) + 3  # past PAD, BOS, EOS
  np.testing.assert_array_equal(tok.encode_document(TEXT),
                                [data_lib.BOS_ID, *byte_ids, data_lib.EOS_ID])
  assert tok.decode(tok.encode_document(TEXT)) == TEXT
  assert tiny_config().data.tokenizer == "byte"


def test_bpe_tokenizer_json_with_tokenizer_config(tmp_path):
  d = _train_bpe(tmp_path / "bpe", template=False, config=dict(
      add_bos_token=True, add_eos_token=True, bos_token={"content": "<s>"}, eos_token="</s>"))
  for spec in (d / "tokenizer.json", d):  # the file, or the model directory holding it
    tok = load_tokenizer(str(spec))
    assert tok.kind == "tokenizers" and tok.vocab_size == 300
    assert (tok.bos_id, tok.eos_id, tok.add_bos, tok.add_eos) == (1, 2, True, True)
    ids = tok.encode_document(TEXT)
    assert ids[0] == 1 and ids[-1] == 2 and 2 not in ids[1:-1] and len(ids) < 0.6 * len(TEXT)
    assert tok.decode(ids) == TEXT
    np.testing.assert_array_equal(tok.encode_document(TEXT, bos=False, eos=False), ids[1:-1])


def test_bpe_bos_from_the_post_processor_matches_transformers(tmp_path):
  transformers = pytest.importorskip("transformers")
  d = _train_bpe(tmp_path / "bpe", template=True)
  tok = load_tokenizer(str(d))
  assert (tok.bos_id, tok.add_bos, tok.add_eos) == (1, True, False)
  theirs = transformers.PreTrainedTokenizerFast(tokenizer_file=str(d / "tokenizer.json"))
  assert tok.encode_document(TEXT).tolist() == theirs(TEXT)["input_ids"]
  # The tokenizer config, when present, decides.
  (d / "tokenizer_config.json").write_text(json.dumps(dict(add_bos_token=False,
                                                           add_eos_token=True,
                                                           eos_token="</s>")))
  tok = load_tokenizer(str(d / "tokenizer.json"))  # (another spec: not the cached one)
  ids = tok.encode_document(TEXT)
  assert ids[0] != 1 and ids[-1] == 2


def test_sentencepiece_model(tmp_path):
  d = _train_sentencepiece(tmp_path / "sp")
  tok = load_tokenizer(str(d / "tokenizer.model"))
  assert tok.kind == "sentencepiece" and tok.vocab_size == 100
  assert (tok.bos_id, tok.eos_id, tok.add_bos, tok.add_eos) == (1, 2, True, True)
  ids = tok.encode_document(TEXT)
  assert ids[0] == 1 and ids[-1] == 2 and ids.max() < 100
  assert tok.decode(ids) == TEXT
  # A LLaMA-2 style directory: tokenizer.model + a config that adds BOS only.
  d2 = _train_sentencepiece(tmp_path / "sp2", config=dict(add_bos_token=True,
                                                          add_eos_token=False))
  tok = load_tokenizer(str(d2))
  assert tok.add_bos and not tok.add_eos and tok.encode_document(TEXT)[-1] != 2


def test_bad_tokenizer_specs_are_clear_errors(tmp_path):
  with pytest.raises(ValueError, match="without tokenizer.json or tokenizer.model"):
    load_tokenizer(str(tmp_path))
  with pytest.raises(ValueError, match="neither 'byte' nor an existing"):
    load_tokenizer(str(tmp_path / "missing.json"))


def test_vocab_larger_than_the_embedding_is_a_config_error(tmp_path):
  d = _train_bpe(tmp_path / "bpe", template=True)
  (tmp_path / "c.jsonl").write_text(json.dumps({"text": TEXT}) + "\n")
  config = tiny_config(**{"data.kind": "text", "data.path": str(tmp_path / "c.jsonl"),
                          "data.tokenizer": str(d), "model.vocab_size": 264})
  with pytest.raises(errors.ConfigError, match=r"needs model.vocab_size >= 300, got 264"):
    val_lib.validate_config(config, num_devices=8)
  config.model.vocab_size = 304
  val_lib.validate_config(config, num_devices=8)
  config.data.tokenizer = str(tmp_path / "nothing_here")
  with pytest.raises(errors.ConfigError, match="data.tokenizer=.*does not load"):
    val_lib.validate_config(config, num_devices=8)


def test_text_pipeline_with_a_bpe_tokenizer(tmp_path):
  d = _train_bpe(tmp_path / "bpe", template=True)
  corpus = tmp_path / "corpus.jsonl"
  corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in CORPUS[:5]))
  config = tiny_config(**{"data.kind": "text", "data.path": str(corpus),
                          "data.tokenizer": str(d), "data.eval_fraction": 0.2})
  documents = data_lib.text_documents(config, "train")
  documents.repeat = False
  tok = load_tokenizer(str(d))
  got = [tok.decode(doc["tokens"]) for doc in documents]
  assert got == CORPUS[:4]  # the fifth is the held-out tail
  assert all(doc["tokens"][0] == tok.bos_id for doc in documents)


def test_a_document_that_tokenises_to_nothing_is_counted_and_resumes_exactly(tmp_path):
  """SentencePiece without BOS/EOS turns whitespace into no ids: an empty document."""
  from training import sources

  d = _train_sentencepiece(tmp_path / "sp", config=dict(add_bos_token=False,
                                                        add_eos_token=False))
  tok = load_tokenizer(str(d))
  assert len(tok.encode_document("   ")) == 0
  path = tmp_path / "c.jsonl"
  path.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["ring one", "   ",
                                                                  "ring two"]))
  ds = sources.DocumentDataset([sources.Span(str(path), 0, path.stat().st_size)], tok)
  it = iter(ds)
  assert tok.decode(next(it)["tokens"]) == "ring one"
  state = json.loads(json.dumps(it.get_state()))
  assert state["bad_records"] == {"counts": {"empty": 1}, "first": {"empty": [f"{path}:2"]}}
  want = [tok.decode(next(it)["tokens"]) for _ in range(3)]
  assert want == ["ring two", "ring one", "ring two"]  # (and the next epoch)
  resumed = iter(ds)
  resumed.set_state(state)
  assert [tok.decode(next(resumed)["tokens"]) for _ in range(3)] == want
  assert resumed.get_state()["bad_records"]["counts"] == {"empty": 2}  # seen again in epoch 1


def test_train_on_text_with_a_bpe_tokenizer(tmp_path):
  """train.py's loop on a (data=2, sequence=4) ring with the BPE tokenizer; the spec is in the
  saved config, so the run's tokenizer loads back from it."""
  import math

  import train as train_script

  d = _train_bpe(tmp_path / "bpe", template=True)
  corpus = tmp_path / "corpus.jsonl"
  corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in CORPUS))
  config = tiny_config(**{
      "data.kind": "text", "data.path": str(corpus), "data.tokenizer": str(d),
      "model.vocab_size": 304, "model.dim": 32, "model.mlp_dim": 64, "data.seq_len": 64,
      "batch_size": 8, "eval_batch_size": 8, "eval_batches": 1, "total_steps": 3,
      "optim.warmup_steps": 0, "log_every": 1, "eval_every": 1000, "checkpoint_every": 1000,
      "async_checkpointing": False})
  result = train_script.train(config, str(tmp_path / "run"))
  assert len(result.history) == 3 and all(math.isfinite(r["loss"]) for r in result.history)
  rows = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  assert [r["train/data/bad_records"] for r in rows if "train/loss" in r] == [0, 0, 0]
  saved = json.loads(config.to_json_best_effort())
  assert load_tokenizer(saved["data"]["tokenizer"]).vocab_size == 300
