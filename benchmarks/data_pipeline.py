"""The streamed text pipeline: host memory and time to the first batch vs corpus size, tokens/s.

  PYTHONPATH=. python benchmarks/data_pipeline.py --sizes-mb 100,1000 --train-steps 40 \\
      --out benchmarks/results/data_pipeline_cpu.json

Writes its own JSONL corpus (made-up words, documents of 20..2000 words, files of at most
``--file-mb``) under ``--dir`` (default: a new /tmp directory, deleted after) at each
``--sizes-mb``, then, in a fresh process per (size, tokenizer) so the peak RSS is that run's
alone, builds ``training.data.make_dataset`` as ``train.py`` does (configs/tiny.py:text, data=2
x sequence=4 on 8 fake CPU devices, zigzag) and reports ``peak_rss_mib`` (``ru_maxrss`` at the
end, imports included; ``rss_before_mib`` before the pipeline), ``first_batch_s`` (building
the pipeline up to the first batch) and ``tokens_per_s`` (packed tokens per second of the
pipeline alone over ``--batches`` batches). Both should stay flat when the corpus grows 10x:
the reader streams. Tokenizers: bytes, and a byte-level BPE (``tokenizers``, vocab
``--bpe-vocab``) trained on a sample. ``--train-steps N`` also runs ``train.py`` on the corpus
for N steps and reads its ``train/tokens_per_s`` from ``metrics.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks import common  # noqa: E402


def write_corpus(directory: str, size_mb: int, file_mb: int, seed: int = 0) -> list[str]:
  """JSONL files totalling ``size_mb`` MiB of random-word documents; returns the paths."""
  import numpy as np

  os.makedirs(directory, exist_ok=True)
  rng = np.random.default_rng(seed)
  # 8000 made-up words of 2..9 letters drawn with Zipf-like frequencies (p ~ 1/rank), so
  # a BPE tokenizer has a realistic amount of merging to do.
  letters = np.asarray(list("abcdefghijklmnopqrstuvwxyz"))
  words = np.asarray(["".join(rng.choice(letters, int(rng.integers(2, 10))))
                      for _ in range(8000)])
  p = 1.0 / np.arange(1, len(words) + 1)
  p /= p.sum()
  # One block of distinct documents, written again with a running document number.
  block = []
  for _ in range(400):
    n = int(rng.integers(20, 2000))
    block.append(" ".join(words[rng.choice(len(words), n, p=p)]))
  target, written, paths, doc = size_mb << 20, 0, [], 0
  while written < target:
    path = os.path.join(directory, f"part{len(paths):04d}.jsonl")
    paths.append(path)
    with open(path, "w") as f:
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

  texts = []
  with open(corpus_file) as f:
    size = 0
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


def _config(path: str, tokenizer: str, seq_len: int, batch: int, vocab: int):
  from configs import tiny

  config = tiny.get_config("text")
  config.data.path, config.data.tokenizer, config.data.seq_len = path, tokenizer, seq_len
  # The layout results/data_pipeline_cpu.json was measured in; model.layout="auto" (what
  # train.py runs) picks "document" for text: benchmarks/layout_host_time.py times its cost.
  config.model.layout = "zigzag"
  config.batch_size = config.eval_batch_size = batch
  config.model.vocab_size = max(config.model.vocab_size, -(-vocab // 8) * 8)
  return config


def measure(path: str, tokenizer: str, seq_len: int, batch: int, batches: int) -> dict:
  """One (corpus, tokenizer) in this process: RSS, time to the first batch, tokens/s."""
  common.fake_cpu_devices()
  import jax

  from training import batch as batch_lib
  from training import data as data_lib
  from training import mesh as mesh_lib

  jax.config.update("jax_platforms", "cpu")
  vocab = data_lib.load_tokenizer(tokenizer).vocab_size
  config = _config(path, tokenizer, seq_len, batch, vocab)
  mesh = mesh_lib.make_mesh(config.mesh)
  sharding = batch_lib.sharding(mesh)
  rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
  t0 = time.perf_counter()
  it = data_lib.make_iterator(data_lib.make_dataset(config, sharding, config.mesh.sequence,
                                                    split="train"), prefetch=0)
  first = next(it)
  first_s = time.perf_counter() - t0
  t1 = time.perf_counter()
  real = 0
  for _ in range(batches):
    real += int((next(it)["segment_ids"] > 0).sum())
  elapsed = time.perf_counter() - t1
  return dict(tokenizer="byte" if tokenizer == "byte" else "bpe", vocab_size=vocab,
              rss_before_mib=round(rss_before, 1),
              peak_rss_mib=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
              first_batch_s=round(first_s, 3), tokens_per_s=round(real / elapsed),
              batch_shape=list(first["tokens"].shape), batches=batches)


def train_consumption(path: str, steps: int, workdir: str) -> dict:
  """tokens/s the tiny text train step consumes (train.py's own metrics.jsonl)."""
  cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--config",
         os.path.join(ROOT, "configs", "tiny.py") + ":text", f"--config.data.path={path}",
         f"--workdir={workdir}", f"--config.total_steps={steps}",
         f"--config.log_every={max(1, steps // 2)}", f"--config.eval_every={steps}",
         f"--config.checkpoint_every={steps}", "--config.optim.warmup_steps=0",
         "--config.eval_batches=1"]
  proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
  if proc.returncode:
    raise RuntimeError(f"train.py failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
  rows = [json.loads(l) for l in open(os.path.join(workdir, "metrics.jsonl"))]
  last = [r for r in rows if "train/tokens_per_s" in r][-1]
  return dict(config="configs/tiny.py:text (byte tokenizer, seq_len 512, batch 8, "
                     "data=2 x sequence=4 on 8 fake CPU devices)",
              steps=steps, tokens_per_s=round(last["train/tokens_per_s"]),
              step_time_s=last.get("train/step_time_s"))


def main(argv=None) -> dict:
  p = common.parser(__doc__, out="")
  p.add_argument("--sizes-mb", default="10,100", help="corpus sizes (MiB), comma-separated")
  p.add_argument("--file-mb", type=int, default=100, help="largest corpus file (MiB)")
  p.add_argument("--seq-len", type=int, default=2048)
  p.add_argument("--batch", type=int, default=8, help="rows per batch (global)")
  p.add_argument("--batches", type=int, default=50, help="batches timed after the first")
  p.add_argument("--tokenizers", default="byte,bpe")
  p.add_argument("--bpe-vocab", type=int, default=4096)
  p.add_argument("--train-steps", type=int, default=0,
                 help="also run train.py on configs/tiny.py:text for this many steps")
  p.add_argument("--dir", default=None, help="where the corpus is written (deleted after)")
  p.add_argument("--_measure", nargs=2, metavar=("PATH", "TOKENIZER"), help=argparse.SUPPRESS)
  args = p.parse_args(argv)

  if args._measure:  # The child process of one measurement.
    print(json.dumps(measure(*args._measure, args.seq_len, args.batch, args.batches)))
    return {}

  base = args.dir or tempfile.mkdtemp(prefix="data_pipeline_", dir="/tmp")
  results = dict(seq_len=args.seq_len, batch=args.batch, runs=[])  # the command: in meta
  try:
    bpe_dir = None
    for size in [int(s) for s in args.sizes_mb.split(",")]:
      corpus = os.path.join(base, f"corpus_{size}mb")
      t0 = time.perf_counter()
      paths = write_corpus(corpus, size, args.file_mb)
      print(f"corpus {size} MiB: {len(paths)} file(s) in {time.perf_counter() - t0:.1f}s",
            flush=True)
      for name in args.tokenizers.split(","):
        if name == "bpe" and bpe_dir is None:
          bpe_dir = train_bpe(paths[0], os.path.join(base, "bpe"), args.bpe_vocab)
        spec = "byte" if name == "byte" else bpe_dir
        cmd = [sys.executable, os.path.abspath(__file__), "--_measure", corpus, spec,
               f"--seq-len={args.seq_len}", f"--batch={args.batch}", f"--batches={args.batches}"]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=1800)
        if proc.returncode:
          raise RuntimeError(f"measurement failed:\n{proc.stderr[-2000:]}")
        run = dict(corpus_mb=size, files=len(paths), **json.loads(proc.stdout.splitlines()[-1]))
        results["runs"].append(run)
        print(json.dumps(run), flush=True)
      if args.train_steps and size == int(args.sizes_mb.split(",")[0]):
        results["train_step"] = train_consumption(corpus, args.train_steps,
                                                  os.path.join(base, "train_run"))
        print("train step:", json.dumps(results["train_step"]), flush=True)
      shutil.rmtree(corpus)
  finally:
    if args.dir is None:
      shutil.rmtree(base, ignore_errors=True)
  if args.out:
    results = dict(results, meta=common.run_meta(argv, __file__))
    common.write_result(args.out, results)
  return results


if __name__ == "__main__":
  main()
