"""Every field train.py reads, with the tiny CPU defaults; the configs override these.

Kept in one place so ``tiny.py``, ``llama_1b.py`` and ``llama_7b.py`` list only
what they change, and so every config has the same fields (``--config.x=...``
and gin bindings can address any of them). The valid range of each numeric field is
``training/validation.py:NUMERIC_RANGES``, checked before anything compiles.
"""

import types
import typing

import ml_collections
from ml_collections import config_dict

from models.llama import LlamaConfig

_MODEL_TYPES = typing.get_type_hints(LlamaConfig)


def model_field_type(name: str) -> type:
  """The type of ``LlamaConfig``'s field ``name`` (``int`` for ``int | None``, ``tuple`` for
  ``tuple[str, ...] | None``)."""
  hint = _MODEL_TYPES[name]
  if typing.get_origin(hint) in (typing.Union, types.UnionType):
    (hint,) = (t for t in typing.get_args(hint) if t is not type(None))
  return typing.get_origin(hint) or hint


def model_config(**values) -> ml_collections.ConfigDict:
  """``config.model``: every field of ``models.llama.LlamaConfig``, its default or ``values``'s;
  a None is a placeholder of the field's type, so ``--config.model.<field>=`` and gin
  bindings parse to it."""
  fields = {**LlamaConfig().to_dict(), **values}
  return ml_collections.ConfigDict({
      name: config_dict.placeholder(model_field_type(name)) if value is None else value
      for name, value in fields.items()})


def base_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.seed = 0

  # Mesh axis sizes; at most one may be -1 (= all remaining devices). The product must
  # equal the device count. On CPU, train.py simulates prod(mesh) devices, or
  # `cpu_devices` when an axis is -1. pipeline > 1 splits the layers into that many stages
  # (GPipe over model.pipeline_microbatches; docs/training.md, "Choosing the mesh").
  # sequence_outer > 1 splits the sequence devices into that many groups of `sequence` on
  # slower links (nodes,
  # slices): model.attention="ring" is then the two-level ring over a ring of
  # sequence_outer x sequence devices (docs/training.md "Two-level ring").
  config.mesh = ml_collections.ConfigDict(dict(data=2, pipeline=1, sequence_outer=1, sequence=4,
                                               tensor=1))
  config.cpu_devices = 8

  # models.llama.LlamaConfig's fields with its defaults (the model's schema lives there), but
  # for a model of the tiny CPU size and the layout train.py decides at startup ("auto":
  # training/validation.py:resolve_layout).
  config.model = model_config(vocab_size=72,  # the kv task's 67 ids, rounded up to 8
                              dim=64, mlp_dim=128, layout="auto")

  # Where the parameters of a fresh run come from (a resumed run restores its checkpoint).
  # init.hf_dir: a local Hugging Face LLaMA directory (config.json + *.safetensors); empty:
  # random initialisation from `seed`. With it, model fields left None take config.json's
  # values (configs/finetune.py leaves all of them None); see training/hf_init.py:resolve_hf_init.
  config.init = ml_collections.ConfigDict(dict(hf_dir=""))

  config.data = ml_collections.ConfigDict(dict(
      kind="kv_retrieval",  # or "text"
      seq_len=128,
      # kind="text": a .jsonl/.json/.txt/.parquet/.arrayrecord file, a directory or a glob,
      # streamed (training/sources.py); each process reads only its data shard.
      path=config_dict.placeholder(str),
      text_field="text",  # .jsonl / parquet column / ArrayRecord JSON: the document's field
      eval_fraction=0.05,  # text: the last files (or a single file's tail) held out for eval
      # "byte", a tokenizer.json, a SentencePiece .model, or a directory holding one (a
      # Hugging Face model dir); training/tokenizer.py:load_tokenizer.
      tokenizer="byte",
      strict=False,  # text: stop at the first bad record instead of counting and skipping it
      # text: rows of these lengths (sorted, <= seq_len) on rings of sequence * L_b / seq_len
      # devices, the rest data parallel (training/buckets.py); () = one ring of seq_len.
      length_buckets=(),
      # kind="kv_retrieval": see training/data.py:KVRetrievalTask.
      kv=dict(num_pairs=8, num_queries=8, num_keys=32, num_values=16, num_filler=16,
              docs_per_row=2),
  ))

  config.batch_size = 16  # global, over the 'data' axis and all processes
  config.microbatches = 1  # gradient accumulation: microbatches per update
  config.eval_batch_size = 16
  config.eval_batches = 4

  config.total_steps = 600
  # Progressive context extension (training/stages.py, docs/context_extension.md): stages
  # run in order in one workdir, e.g. --config.stages="256:300,512:300:rope_theta=1e5" or
  # a list of dict(seq_len=, steps=, rope_theta=, rope_scaling=, batch_size=, lr=,
  # warmup_steps=) in a config file. total_steps is then their sum. None or empty: one
  # stage made of the top-level fields.
  config.stages = config_dict.placeholder(object)
  config.optim = ml_collections.ConfigDict(dict(
      lr=3e-3, warmup_steps=40, min_lr_ratio=0.1, weight_decay=0.1, b1=0.9, b2=0.95,
      eps=1e-8, grad_clip=1.0))

  config.log_every = 20
  config.eval_every = 100
  config.checkpoint_every = 200
  config.keep_checkpoints = 2
  config.async_checkpointing = True
  # "START:STOP": a jax.profiler trace of steps START to STOP-1 in <workdir>/profile
  # (docs/training.md, "Profiling"). None or "": off.
  config.profile_steps = config_dict.placeholder(str)

  # Multi-process runs (docs/training.md, "When a process dies"): a process whose liveness
  # counter stops for heartbeat_timeout_s is declared lost, and every survivor exits with
  # status 75 and one line saying how to resume (JAX's own heartbeat timeout, its C++
  # backstop, is set to 4x this). initialization_timeout_s: how long
  # jax.distributed.initialize waits for all processes to connect.
  config.distributed = ml_collections.ConfigDict(dict(
      heartbeat_timeout_s=60, initialization_timeout_s=300))

  # MFU denominator. None: look the device kind up (training/metrics.py). A CPU has
  # no such figure; MFU is then reported against the nominal value below, and says so.
  config.peak_flops_per_device = config_dict.placeholder(float)
  config.cpu_peak_flops_per_device = 25e9  # ~200 GFLOP/s f32 on 2 cores / 8 fake devices
  return config
