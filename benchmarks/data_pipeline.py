"""The streamed text pipeline: host memory and time to the first batch vs corpus size, tokens/s.

  PYTHONPATH=. python benchmarks/data_pipeline.py --sizes-mb 100,1000 --train-steps 40 \\
      --out benchmarks/results/data_pipeline_cpu.json

Per corpus size (its own JSONL corpus under ``--dir``, deleted after) and tokenizer (bytes, a
byte-level BPE trained on a sample), in a fresh process so the peak RSS is that run's alone:
``training.data.make_dataset`` as ``train.py`` builds it, its peak RSS, time to the first batch
and tokens/s; ``--train-steps N``: also ``train.py``'s own tokens/s on the corpus.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import common  # noqa: E402
from benchmarks.common import ROOT  # noqa: E402


def write_corpus(directory: str, size_mb: int, file_mb: int, seed: int = 0) -> list[str]:
  """JSONL files of at most ``file_mb`` MiB totalling ``size_mb`` MiB: 400 distinct documents
  of 20..2000 words, repeated with a running id; returns the paths. The 8000 made-up words of
  2..9 letters are drawn with Zipf-like frequencies (p ~ 1/rank), so a BPE tokenizer has a
  realistic amount of merging to do."""
  import numpy as np

  os.makedirs(directory, exist_ok=True)
  rng = np.random.default_rng(seed)
  letters = np.asarray(list("abcdefghijklmnopqrstuvwxyz"))
  words = np.asarray(["".join(rng.choice(letters, int(rng.integers(2, 10))))
                      for _ in range(8000)])
  p = 1.0 / np.arange(1, len(words) + 1)
  p /= p.sum()
  block = [" ".join(words[rng.choice(len(words), int(rng.integers(20, 2000)), p=p)])
           for _ in range(400)]
  target, written, paths, doc = size_mb << 20, 0, [], 0
  while written < target:
    paths.append(os.path.join(directory, f"part{len(paths):04d}.jsonl"))
    with open(paths[-1], "w") as f:
      file_bytes = 0
      while file_bytes < (file_mb << 20) and written + file_bytes < target:
        line = json.dumps({"id": doc, "text": block[doc % len(block)]}) + "\n"
        doc += 1
        f.write(line)
        file_bytes += len(line)
    written += file_bytes
  return paths


def train_bpe(corpus_file: str, out_dir: str, vocab: int) -> str:
  """A byte-level BPE tokenizer.json trained on the first 2 MiB of ``corpus_file``."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

  texts, size = [], 0
  with open(corpus_file) as f:
    for line in f:
      texts.append(json.loads(line)["text"])
      size += len(line)
      if size > 2 << 20:
        break
  tok = Tokenizer(models.BPE(unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(texts, trainers.BpeTrainer(
      vocab_size=vocab, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  tok.post_processor = processors.TemplateProcessing(
      single="<s> $A </s>", special_tokens=[("<s>", 1), ("</s>", 2)])
  os.makedirs(out_dir, exist_ok=True)
  tok.save(os.path.join(out_dir, "tokenizer.json"))
  return out_dir


def measure(path: str, tokenizer: str, seq_len: int, batch: int, batches: int) -> dict:
  """One (corpus, tokenizer) in this process: configs/tiny.py:text's pipeline (data=2 x
  sequence=4 on 8 fake CPU devices) built as ``train.py`` does; RSS before it and at the end,
  seconds to its first batch, packed tokens/s over ``batches`` more."""
  common.fake_cpu_devices()
  import jax

  from configs import tiny
  from training import batch as batch_lib
  from training import data as data_lib
  from training import mesh as mesh_lib

  jax.config.update("jax_platforms", "cpu")
  vocab = data_lib.load_tokenizer(tokenizer).vocab_size
  config = tiny.get_config("text")
  config.data.path, config.data.tokenizer, config.data.seq_len = path, tokenizer, seq_len
  # The layout results/data_pipeline_cpu.json was measured in; model.layout="auto" (what
  # train.py runs) picks "document" for text: benchmarks/layout_host_time.py times its cost.
  config.model.layout = "zigzag"
  config.batch_size = config.eval_batch_size = batch
  config.model.vocab_size = max(config.model.vocab_size, -(-vocab // 8) * 8)
  sharding = batch_lib.sharding(mesh_lib.make_mesh(config.mesh))
  rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
  t0 = time.perf_counter()
  it = data_lib.make_iterator(data_lib.make_dataset(config, sharding, config.mesh.sequence,
                                                    split="train"), prefetch=0)
  first = next(it)
  first_s = time.perf_counter() - t0
  t1 = time.perf_counter()
  real = sum(int((next(it)["segment_ids"] > 0).sum()) for _ in range(batches))
  elapsed = time.perf_counter() - t1
  return dict(tokenizer="byte" if tokenizer == "byte" else "bpe", vocab_size=vocab,
              rss_before_mib=round(rss_before, 1),
              peak_rss_mib=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
              first_batch_s=round(first_s, 3), tokens_per_s=round(real / elapsed),
              batch_shape=list(first["tokens"].shape), batches=batches)


def train_consumption(path: str, steps: int, workdir: str) -> dict:
  """tokens/s the tiny text train step consumes (train.py's own metrics.jsonl)."""
  common.run_python([
      os.path.join(ROOT, "train.py"), "--config", os.path.join(ROOT, "configs", "tiny.py") +
      ":text", f"--config.data.path={path}", f"--workdir={workdir}",
      f"--config.total_steps={steps}", f"--config.log_every={max(1, steps // 2)}",
      f"--config.eval_every={steps}", f"--config.checkpoint_every={steps}",
      "--config.optim.warmup_steps=0", "--config.eval_batches=1"])
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    last = [r for r in map(json.loads, f) if "train/tokens_per_s" in r][-1]
  return dict(config="configs/tiny.py:text (byte tokenizer, seq_len 512, batch 8, "
                     "data=2 x sequence=4 on 8 fake CPU devices)",
              steps=steps, tokens_per_s=round(last["train/tokens_per_s"]),
              step_time_s=last.get("train/step_time_s"))


def main(argv=None) -> dict:
  p = common.parser(__doc__, out="")
  p.add_argument("--sizes-mb", type=common.ints, default=[10, 100], help="corpus sizes (MiB)")
  p.add_argument("--file-mb", type=int, default=100, help="largest corpus file (MiB)")
  p.add_argument("--seq-len", type=int, default=2048)
  p.add_argument("--batch", type=int, default=8, help="rows per batch (global)")
  p.add_argument("--batches", type=int, default=50, help="batches timed after the first")
  p.add_argument("--bpe-vocab", type=int, default=4096)
  p.add_argument("--train-steps", type=int, default=0,
                 help="also run train.py on configs/tiny.py:text for this many steps")
  p.add_argument("--dir", default=None, help="where the corpus is written (deleted after)")
  p.add_argument("--_measure", nargs=2, metavar=("PATH", "TOKENIZER"), help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  sizes = [f"--seq-len={args.seq_len}", f"--batch={args.batch}", f"--batches={args.batches}"]
  if args._measure:  # The child process of one measurement.
    print(json.dumps(measure(*args._measure, args.seq_len, args.batch, args.batches)))
    return {}

  results = dict(seq_len=args.seq_len, batch=args.batch, runs=[])  # the command: in meta
  bpe_dir = None
  with (contextlib.nullcontext(args.dir) if args.dir else tempfile.TemporaryDirectory(
      prefix="data_pipeline_", dir="/tmp", ignore_cleanup_errors=True)) as base:
    for size in args.sizes_mb:
      corpus = os.path.join(base, f"corpus_{size}mb")
      t0 = time.perf_counter()
      paths = write_corpus(corpus, size, args.file_mb)
      print(f"corpus {size} MiB: {len(paths)} file(s) in {time.perf_counter() - t0:.1f}s",
            flush=True)
      bpe_dir = bpe_dir or train_bpe(paths[0], os.path.join(base, "bpe"), args.bpe_vocab)
      for tokenizer in ("byte", bpe_dir):  # each measured in a fresh process
        out = common.run_python([os.path.abspath(__file__), "--_measure", corpus, tokenizer,
                                 *sizes])
        run = dict(corpus_mb=size, files=len(paths), **json.loads(out.splitlines()[-1]))
        results["runs"].append(run)
        print(json.dumps(run), flush=True)
      if args.train_steps and size == args.sizes_mb[0]:
        results["train_step"] = train_consumption(corpus, args.train_steps,
                                                  os.path.join(base, "train_run"))
        print("train step:", json.dumps(results["train_step"]), flush=True)
      shutil.rmtree(corpus)
  return (common.save(args.out, dict(results, meta=common.run_meta(argv, __file__)))
          if args.out else results)


if __name__ == "__main__":
  main()
