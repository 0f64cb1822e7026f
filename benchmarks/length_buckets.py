"""Length buckets vs one ring: the shipped train step on a fixed mixed-length corpus.

  PYTHONPATH=. python benchmarks/length_buckets.py --out benchmarks/results/length_buckets_cpu.json

One corpus (:func:`write_corpus`, from ``--seed``), read by the trainer's text pipeline (byte
tokenizer), trained on from the same initial parameters with ``train.py``'s step and state,
once on one ring (``data.length_buckets=()``) and once with ``--buckets`` (one program per
bucket, each on its ring): :func:`run_config` says what is recorded. A timed step is the
batch's transfer plus the step. docs/training.md, "Length buckets (mixed-length data)".
"""

from __future__ import annotations

import collections
import json
import os
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import common  # noqa: E402
from benchmarks import two_level  # noqa: E402
from ring_jax import analysis  # noqa: E402

common.fake_cpu_devices()

# A tiny LLaMA over the byte tokenizer's ids (configs/tiny.py:text's vocabulary).
MODEL = {"model.vocab_size": 264, "model.dim": 64, "model.mlp_dim": 128, "model.num_heads": 4,
         "model.num_kv_heads": 2, "model.num_layers": 2}
RING_SCOPES = frozenset(scope for scope, kind in analysis.SCOPE_KINDS if kind.startswith("ring"))


def document_lengths(rng: np.random.Generator, docs: int, seq_len: int,
                     short_fraction: float) -> np.ndarray:
  """Token counts: ``short_fraction`` of ``docs`` uniform in ``[16, seq_len / 8]``, the rest
  uniform in ``(seq_len / 8, seq_len]``, shuffled."""
  short = int(round(short_fraction * docs))
  cut = seq_len // 8
  out = np.concatenate([rng.integers(16, cut + 1, short),
                        rng.integers(cut + 1, seq_len + 1, docs - short)])
  return rng.permutation(out)


def write_corpus(path: str, seed: int, docs: int, seq_len: int, short_fraction: float) -> list[int]:
  """A JSON-lines corpus at ``path``; returns each document's token count (byte tokenizer:
  its characters plus BOS and EOS). A document is words drawn from its own few of a shared
  word list, so attention back into the document predicts what comes."""
  rng = np.random.default_rng(seed)
  letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
  words = ["".join(rng.choice(letters, int(rng.integers(2, 8)))) for _ in range(256)]
  lengths = document_lengths(rng, docs, seq_len, short_fraction)
  with open(path, "w") as fh:
    for n in lengths:
      own = rng.choice(len(words), 8, replace=False)
      text = ""
      while len(text) < n - 2:
        text += words[own[int(rng.integers(0, 8))]] + " "
      fh.write(json.dumps({"text": text[:n - 2]}) + "\n")
  return [int(n) for n in lengths]


def permutes_per_step(hlo: str, num_devices: int) -> dict[str, dict[str, int]]:
  """``{"ring": {count, bytes}, "other": {count, bytes}}``: the collective-permutes one run
  of the compiled program ``hlo`` executes, per device, loop trip counts included
  (:func:`benchmarks.two_level.permute_traffic`: the layer scan, the ring's hop loop); a
  permute under one of ``ring_jax.ring``'s hop scopes (:data:`ring_jax.analysis.SCOPE_KINDS`)
  is the ring's, any other (e.g. a layout reorder) counts apart."""
  out = {k: {"count": 0, "bytes": 0} for k in ("ring", "other")}
  for op in two_level.permute_traffic(hlo, (num_devices,)):
    kind = "ring" if RING_SCOPES & set(op["scope"].split("/")) else "other"
    out[kind]["count"] += op["runs"]
    out[kind]["bytes"] += op["runs"] * op["bytes"]
  return out


def run_config(args, corpus: str, buckets: tuple[int, ...]) -> dict:
  """One configuration (configs/tiny.py:text with :data:`MODEL` and the flags): its programs
  compiled (per bucket its ring, rows, collective-permutes per step and device, temp bytes),
  then unless ``--no-steps`` its batches drawn on the host and its steps run: per step the
  bucket, real tokens, loss and (unless ``--no-timing``) wall and CPU seconds; totals, padding
  and tokens/s."""
  from configs import tiny
  from training import buckets as buckets_lib
  from training import data as data_lib
  from training import flags as flags_lib
  from training import mesh as mesh_lib
  from training import stages as stages_lib
  from training import validation as val_lib

  overrides = dict(MODEL, **{
      "data.path": corpus, "data.seq_len": args.seq_len, "data.length_buckets": buckets,
      "batch_size": args.batch, "eval_batch_size": args.batch,
      "mesh.data": 1, "mesh.sequence": args.ring, "model.layout": args.layout,
      "optim.warmup_steps": 0, "optim.lr": args.lr, "total_steps": args.steps + 1,
      "seed": args.seed})
  config = val_lib.resolve_run(flags_lib.apply_overrides(tiny.get_config("text"),
                                                         overrides.items()), jax.device_count())
  sizes = val_lib.validate_config(config, jax.device_count())
  mesh = mesh_lib.make_mesh(config.mesh)
  with jax.set_mesh(mesh):
    setup = stages_lib.build_stage(stages_lib.plan(config)[0], mesh)
  plan = buckets_lib.plan(config, setup.model_cfg, mesh)
  if plan:
    batches = buckets_lib.BucketedBatches(data_lib.text_documents(config, "train"), plan,
                                          config.model.layout)
  else:  # one ring: the run's own step, as a bucket of the full length on the whole mesh
    plan = (buckets_lib.Bucket(0, config.data.seq_len, sizes["sequence"], *setup.train_shape,
                               mesh),)
    dataset = data_lib.make_dataset(config, plan[0].sharding, plan[0].ring, split="train")
    batches = ((0, b) for b in data_lib.make_iterator(dataset, prefetch=0))
  compiled = buckets_lib.compile_steps(setup.train_step, plan, config.microbatches)
  rows = []
  for b, exe in zip(plan, compiled):
    per_step = permutes_per_step(exe.as_text(), b.mesh.devices.size)
    rows.append(dict(length=b.length, ring=b.ring, rows=b.rows, run_length=b.run_length,
                     mesh={axis: int(b.mesh.shape[axis]) for axis in ("data", "sequence")},
                     ring_permute_bytes_per_step=per_step["ring"]["bytes"],
                     ring_permutes_per_step=per_step["ring"]["count"],
                     other_permute_bytes_per_step=per_step["other"]["bytes"],
                     temp_bytes_per_device=common.compiled_memory(exe).get("temp_size_in_bytes")))
    print(f"  bucket {b.length:>6} on a ring of {b.ring}: {b.rows} x {b.run_length}, ring "
          f"collective-permutes {per_step['ring']['count']} per step, "
          f"{per_step['ring']['bytes'] / common.MIB:.2f} MiB/device/step", flush=True)
  result = dict(length_buckets=list(buckets), compiled_programs=len(compiled), buckets=rows)
  if args.no_steps:
    return result

  host = [next(batches) for _ in range(args.steps)]
  params, opt_state = setup.train_step.init_state()
  for exe, b in zip(compiled, plan):  # each program's first call, untimed, on a copy of the
    with jax.set_mesh(b.mesh):  # state (discarded)
      empty = {k: np.zeros(b.shape, v.dtype) for k, v in host[0][1].items()}
      jax.block_until_ready(exe(jax.tree.map(jnp.copy, params), jax.tree.map(jnp.copy, opt_state),
                                data_lib.to_global(empty, b.sharding, b.shape)))
  steps = []
  for index, batch in host:
    b = plan[index]
    with jax.set_mesh(b.mesh):
      wall, cpu, (params, opt_state, metrics) = common.timed_call(
          lambda x: compiled[index](params, opt_state, data_lib.to_global(x, b.sharding, b.shape)),
          batch)
    steps.append(dict(bucket=b.length, real_tokens=int((batch["segment_ids"] > 0).sum()),
                      slots=int(np.prod(b.shape)), loss=float(metrics["loss"]),
                      target_tokens=int(metrics["target_tokens"]),
                      **({} if args.no_timing else dict(wall_s=wall, cpu_s=cpu))))
  real, slots = sum(s["real_tokens"] for s in steps), sum(s["slots"] for s in steps)
  per_step = {r["length"]: r["ring_permute_bytes_per_step"] for r in rows}
  result.update(steps=len(steps), step_rows=steps,
                steps_per_bucket=dict(collections.Counter(str(s["bucket"]) for s in steps)),
                real_tokens=real, token_slots=slots, padding_fraction=1 - real / slots,
                ring_permute_bytes=sum(per_step[s["bucket"]] for s in steps))
  if not args.no_timing:
    wall, cpu = sum(s["wall_s"] for s in steps), sum(s["cpu_s"] for s in steps)
    result.update(wall_s=wall, cpu_s=cpu, real_tokens_per_s=real / wall,
                  tokens_per_s=slots / wall, real_tokens_per_cpu_s=real / cpu)
  return result


def main(argv=None):
  ap = common.parser(__doc__, out="", ring=8)
  ap.add_argument("--seq-len", type=int, default=2048)
  ap.add_argument("--buckets", type=common.ints, default=None,
                  help="comma-separated bucket lengths (default seq_len/8, /4, /2)")
  ap.add_argument("--batch", type=int, default=1, help="rows of seq_len per step")
  ap.add_argument("--layout", default="zigzag")
  ap.add_argument("--docs", type=int, default=2000)
  ap.add_argument("--short-fraction", type=float, default=0.8)
  ap.add_argument("--steps", type=int, default=60, help="steps per configuration (each "
                  "compiled program is first run once on a copy of the state, untimed)")
  ap.add_argument("--lr", type=float, default=1e-3)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--no-timing", action="store_true",
                  help="run the steps (losses, tokens) but record no times: a host that is "
                       "not quiet")
  ap.add_argument("--no-steps", action="store_true",
                  help="compile only: programs, ring bytes per step")
  args = ap.parse_args(argv)
  buckets = tuple(args.buckets or [args.seq_len // d for d in (8, 4, 2)])

  with tempfile.TemporaryDirectory(prefix="length_buckets_") as tmp:
    corpus = os.path.join(tmp, "corpus.jsonl")
    lengths = np.asarray(write_corpus(corpus, args.seed, args.docs, args.seq_len,
                                      args.short_fraction))
    print(f"jax {jax.__version__} {jax.default_backend()}, {jax.device_count()} devices; "
          f"seq_len {args.seq_len}, ring {args.ring}, buckets {buckets}; corpus {args.docs} "
          f"documents, {np.mean(lengths <= args.seq_len // 8):.0%} <= seq_len/8, "
          f"{lengths.sum()} tokens", flush=True)
    results = []
    for name, b in (("one ring", ()), ("buckets", buckets)):
      print(f"{name}:", flush=True)
      r = dict(config=name, **run_config(args, corpus, b))
      if "steps" in r:
        print(f"  {r['compiled_programs']} compiled programs, {r['steps']} steps "
              f"{r['steps_per_bucket']}, padding {r['padding_fraction']:.1%}, loss "
              f"{r['step_rows'][0]['loss']:.3f} -> {r['step_rows'][-1]['loss']:.3f}"
              + ("" if args.no_timing else
                 f", {r['real_tokens_per_s']:.0f} real tokens/s, {r['tokens_per_s']:.0f} "
                 f"tokens/s"), flush=True)
      results.append(r)
  if "steps" in results[0]:
    last = min(10, args.steps)
    print("mean loss of the last {} steps: ".format(last) + ", ".join(
        f"{r['config']} {np.mean([s['loss'] for s in r['step_rows'][-last:]]):.3f}"
        for r in results), flush=True)
    if "tokens_per_s" in results[0]:
      print(f"buckets / one ring: real tokens/s "
            f"{results[1]['real_tokens_per_s'] / results[0]['real_tokens_per_s']:.2f}x",
            flush=True)
  common.save(args.out, dict(
      meta=common.run_meta(argv, __file__),
      settings=dict(vars(args), buckets=",".join(map(str, buckets)), model=MODEL),
      corpus=dict(documents=args.docs, tokens=int(lengths.sum()),
                  short_fraction=float(np.mean(lengths <= args.seq_len // 8)),
                  max_length=int(lengths.max())),
      results=results))
  return results


if __name__ == "__main__":
  main()
