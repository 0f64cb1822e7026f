"""Up-front checks of the run's ConfigDict (static numbers only: a bad config fails in one
line naming the fix before anything is traced), the decisions of ``"auto"`` fields, and the
model's ``LlamaConfig`` made of ``config.model``."""

from __future__ import annotations

import math

import jax
import ml_collections

from models import attention as attn_lib
from models import lengths
from models import pipeline as pipeline_lib
from models import sharding as shd
from ring_jax import layouts, planning
from ring_jax.strategies import attention_axes
from training import buckets as buckets_lib
from training import hf_init as hf_init_lib
from training import mesh as mesh_lib
from training import stages as stages_lib
from training.errors import ConfigError, reraise_as
from training import tokenizer as tokenizer_lib

DATA_KINDS: tuple[str, ...] = ("kv_retrieval", "text")
#: Every value ``model.layout`` takes: a ``ring_jax`` layout, or "auto" (:func:`resolve_layout`).
LAYOUT_CHOICES: tuple[str, ...] = ("auto",) + layouts.ALL_LAYOUTS


def run_length(model_config, ring: int, seq_len: int) -> int:
  """The row length ``data.seq_len`` runs at on a ring of ``ring`` devices
  (:func:`models.lengths.padded_length`); ConfigError for ``seq_len < 1``."""
  with reraise_as(ConfigError, "data.seq_len: "):
    return lengths.padded_length(model_config, ring, int(seq_len))


def padding_line(model_config, ring: int, seq_len: int) -> str | None:
  """The startup line saying how ``data.seq_len`` is padded on this ring (None: it is not)."""
  run = run_length(model_config, ring, seq_len)
  if run == seq_len:
    return None
  return (f"data.seq_len={seq_len} runs as rows of {run} tokens on the ring of {ring} "
          f"(model.layout={model_config.layout!r} and the model's blocks split multiples of "
          f"{lengths.length_multiple(model_config, ring)}): {run - seq_len} padding tokens per "
          f"row ({(run - seq_len) / run:.1%} of each row), masked out of attention and the loss")


def check_model_parallelism(model_cfg, sizes: dict[str, int], seq_len: int) -> None:
  """The fields of ``model_cfg`` (a LlamaConfig) that depend on the mesh beyond the heads:
  the attention strategy's axis and head rules (:func:`models.attention.check_mesh`), and
  tensor sequence parallelism's local length."""
  m, ring, tensor = model_cfg, shd.ring_size(sizes), sizes["tensor"]
  with reraise_as(ConfigError):
    attn_lib.check_mesh(m, jax.sharding.AbstractMesh(tuple(sizes.values()), tuple(sizes)))
  tsp = m.tensor_sequence_parallel
  if tsp is not False and tensor > 1 and m.ffn_chunk_size and seq_len % (ring * tensor) == 0:
    local = seq_len // (ring * tensor)
    if local % m.ffn_chunk_size:
      raise ConfigError(
          f"model.ffn_chunk_size={m.ffn_chunk_size} must divide the residual stream's local "
          f"length {local} (row length {seq_len} / sequence {ring} / tensor {tensor}: tensor "
          "sequence parallelism splits it over both); use a divisor of it, or "
          "model.tensor_sequence_parallel=False.")


def check_pipeline(config: ml_collections.ConfigDict, sizes: dict[str, int]) -> None:
  """The ``pipeline`` axis must divide the layers, and its microbatches the rows
  (``batch_size / microbatches`` and ``eval_batch_size``) over the ``data`` axis
  (``LlamaConfig`` has checked ``pipeline_microbatches`` is None or >= 1)."""
  m, stages, data_par = config.model, sizes["pipeline"], sizes["data"]
  micro = m.get("pipeline_microbatches")
  if stages == 1:
    return
  if m.num_layers % stages:
    divisors = [d for d in range(1, m.num_layers + 1) if m.num_layers % d == 0]
    raise ConfigError(f"mesh.pipeline={stages} stages do not divide model.num_layers="
                      f"{m.num_layers}; choose mesh.pipeline from {divisors}.")
  for name, rows in (("batch_size", config.batch_size // config.microbatches),
                     ("eval_batch_size", config.eval_batch_size)):
    with reraise_as(ConfigError, f"{name}={config[name]} on mesh.pipeline={stages}: ",
                    suffix=" Set model.pipeline_microbatches to a divisor of the rows, or "
                    f"change {name}."):
      pipeline_lib.resolve_microbatches(micro, rows, stages, data_par)


def check_text_data(d: ml_collections.ConfigDict, m: ml_collections.ConfigDict) -> None:
  """The ``data.*`` fields of ``data.kind='text'``: files, tokenizer, vocabulary, split."""
  if not d.path:
    raise ConfigError("data.kind='text' needs data.path (a .jsonl/.txt/.parquet/.arrayrecord "
                      "file, a directory or a glob), e.g. "
                      "--config.data.path=/path/to/corpus.jsonl.")
  from training import sources  # Local: sources imports grain, validation must not.
  with reraise_as(ConfigError):
    sources.list_data_files(d.path)
  if not d.tokenizer:
    raise ConfigError(tokenizer_lib.UNSET)
  with reraise_as(ConfigError, f"data.tokenizer={d.tokenizer!r} "):
    tokenizer = tokenizer_lib.load_explained(d.tokenizer)
  if tokenizer.vocab_size > m.vocab_size:
    raise ConfigError(f"the {tokenizer.name} tokenizer needs model.vocab_size >= "
                      f"{tokenizer.vocab_size}, got {m.vocab_size}: raise "
                      "--config.model.vocab_size (the embedding must cover every token id).")


#: The valid range of each numeric field (``"> 0"``, ``">= 0"``, ``"[0, 1)"``; ``"int ..."``: a
#: whole number), checked by :func:`check_ranges`; an unset or absent field is not checked. The
#: fields ``LlamaConfig``, :func:`training.mesh.mesh_shape` or the kv task check are theirs.
NUMERIC_RANGES: dict[str, str] = {
    # AdamW with global-norm clipping and warmup + cosine decay (training/step.py).
    "optim.lr": "> 0",
    "optim.warmup_steps": "int >= 0",
    "optim.min_lr_ratio": "[0, 1]",
    "optim.weight_decay": ">= 0",
    "optim.b1": "[0, 1)",
    "optim.b2": "[0, 1)",
    "optim.eps": "> 0",
    "optim.grad_clip": "> 0",
    # Model fields LlamaConfig leaves unchecked (or, rope_theta, lets inf through).
    "model.rope_theta": "> 0",
    "model.norm_eps": "> 0",
    "model.init_std": "> 0",
    "model.rope_scaling.factor": "> 0",
    "model.rope_scaling.original_max_position_embeddings": "int >= 1",
    "model.rope_scaling.low_freq_factor": "> 0",
    "model.rope_scaling.high_freq_factor": "> 0",
    "model.rope_scaling.beta_fast": "> 0",
    "model.rope_scaling.beta_slow": "> 0",
    "model.rope_scaling.attention_factor": "> 0",
    "data.seq_len": "int >= 1",
    "data.eval_fraction": "(0, 1)",  # text: the held-out share
    "data.kv.num_pairs": "int >= 1",
    "data.kv.num_queries": "int >= 1",
    "data.kv.num_keys": "int >= 1",
    "data.kv.num_values": "int >= 1",
    "data.kv.num_filler": "int >= 1",
    "batch_size": "int >= 1",
    "microbatches": "int >= 1",
    "eval_batch_size": "int >= 1",
    "eval_batches": "int >= 1",
    "total_steps": "int >= 1",
    "log_every": "int >= 1",
    "eval_every": "int >= 1",
    "checkpoint_every": "int >= 1",
    "keep_checkpoints": "int >= 1",
    "cpu_devices": "int >= 1",
    "peak_flops_per_device": "> 0",
    "cpu_peak_flops_per_device": "> 0",
    "distributed.heartbeat_timeout_s": "int >= 2",  # seconds
    "distributed.initialization_timeout_s": "int >= 1",
}


def _in_range(value: float, rule: str) -> bool:
  """Whether the finite number ``value`` obeys ``rule`` (without its ``int`` prefix)."""
  if rule[0] == ">":
    op, bound = rule.split()
    return value > float(bound) if op == ">" else value >= float(bound)
  low, high = (float(x) for x in rule[1:-1].split(","))
  return ((low < value if rule[0] == "(" else low <= value)
          and (value < high if rule[-1] == ")" else value <= high))


def check_ranges(config: ml_collections.ConfigDict, prefix: str = "") -> None:
  """Each :data:`NUMERIC_RANGES` field (under ``prefix`` only, if given) is a finite number
  in its range; else ConfigError naming the first field out of range."""
  for path, rule in NUMERIC_RANGES.items():
    if not path.startswith(prefix):
      continue
    node = config
    for name in path.split("."):  # None once a parent is absent
      node = node.get(name) if hasattr(node, "get") else None
    if node is None:
      continue
    whole = rule.startswith("int ")
    bounds = rule[4:] if whole else rule
    number = not isinstance(node, bool) and isinstance(node, (int, float))
    finite = number and (isinstance(node, int) or (not whole and math.isfinite(node)))
    if not (finite and _in_range(node, bounds)):
      what = bounds if bounds[0] == ">" else f"in {bounds}"
      what = (f"a whole number {what}" if whole else what if finite
              else f"a finite number {what}")
      raise ConfigError(f"{path}={node!r} must be {what}.")


def profile_steps(config: ml_collections.ConfigDict) -> range | None:
  """``config.profile_steps`` (``"START:STOP"``: steps START to STOP-1) as a ``range``;
  None when unset (no profile). ConfigError unless ``1 <= START < STOP <= total_steps``."""
  text = config.get("profile_steps")
  if not text:
    return None
  start, sep, stop = str(text).partition(":")
  try:
    steps = range(int(start), int(stop)) if sep else None
  except ValueError:
    steps = None
  if steps is None or not 1 <= steps.start < steps.stop:
    raise ConfigError(f"profile_steps={text!r} must be 'START:STOP' with 1 <= START < STOP "
                      "(profiles steps START to STOP-1), e.g. --config.profile_steps=10:13.")
  if steps.start > config.total_steps:
    raise ConfigError(f"profile_steps={text!r} starts after total_steps={config.total_steps}; "
                      "no step of it would run.")
  return steps


def validate_config(config: ml_collections.ConfigDict, num_devices: int) -> dict[str, int]:
  """Checks everything knowable without tracing, each of ``config.stages`` as a config of its
  own (its ConfigError names the stage); returns the resolved mesh sizes."""
  check_ranges(config)
  sizes = mesh_lib.mesh_shape(config.mesh, num_devices)
  ring, tensor, data_par = shd.ring_size(sizes), sizes["tensor"], sizes["data"]
  if config.model.layout not in LAYOUT_CHOICES:
    raise ConfigError(
        f"model.layout={config.model.layout!r} is unknown; choose one of {LAYOUT_CHOICES}.")
  config, _ = resolve_layout(config, ring)  # "auto": checked as it resolves on this ring
  m, d = config.model, config.data
  for stage in stages_lib.plan(config) if stages_lib.stage_dicts(config) else ():
    c = stage.config  # c.stages is None: validate_config(c) does not recurse
    with reraise_as(ConfigError, f"config.stages stage {stage.index + 1} "
                    f"(seq_len={c.data.seq_len}, steps={stage.steps}): ", catch=ConfigError):
      if c.optim.warmup_steps > stage.steps:
        raise ConfigError(f"warmup_steps={c.optim.warmup_steps} exceeds the stage's "
                          f"steps={stage.steps}; each stage warms up anew (set the stage's "
                          "warmup_steps=, or --config.optim.warmup_steps=).")
      validate_config(c, num_devices)

  with reraise_as(ConfigError):  # heads over 'tensor' (one K/V head, MQA, is replicated)
    attention_axes(sizes, batch=1, heads=m.num_heads, kv_heads=m.num_kv_heads, batch_axis=None,
                   head_axis="tensor", names=("batch", "model.num_heads", "model.num_kv_heads"))
  if m.mlp_dim % tensor or m.vocab_size % tensor:
    raise ConfigError(f"model.mlp_dim={m.mlp_dim} and model.vocab_size={m.vocab_size} must be "
                      f"divisible by the mesh 'tensor' axis ({tensor}).")

  model_cfg = llama_config(config)  # the model's own checks (attention, kernel, GQA heads)
  check_model_parallelism(model_cfg, sizes, run_length(m, ring, d.seq_len))

  for name in ("batch_size", "eval_batch_size"):
    batch, micro = config[name], (config.microbatches if name == "batch_size" else 1)
    if batch % micro:
      raise ConfigError(f"{name}={batch} is not divisible by microbatches={micro}.")
    if (batch // micro) % data_par:
      raise ConfigError(
          f"{name}={batch} / microbatches={micro} = {batch // micro} rows per microbatch is not "
          f"divisible by the mesh 'data' axis ({data_par}).")
  check_pipeline(config, sizes)
  buckets_lib.check(config, sizes)

  if d.kind not in DATA_KINDS:
    raise ConfigError(f"data.kind={d.kind!r} is unknown; choose one of {DATA_KINDS}.")
  if d.kind == "text":
    check_text_data(d, m)
  else:
    from training import data as data_lib
    with reraise_as(ConfigError):
      data_lib.KVRetrievalTask.from_config(d).check(m.vocab_size)

  profile_steps(config)
  if config.optim.warmup_steps > config.total_steps:
    raise ConfigError(f"optim.warmup_steps={config.optim.warmup_steps} exceeds "
                      f"total_steps={config.total_steps}.")
  return sizes


def clamp_warmup(config: ml_collections.ConfigDict
                 ) -> tuple[ml_collections.ConfigDict, str | None]:
  """``(config, line)``: a run of one stage whose ``optim.warmup_steps`` exceeds
  ``total_steps`` warms up over all of them (a copy, and the line saying so); otherwise
  ``(config, None)``. A stage's warmup longer than the stage stays an error."""
  warmup, total = config.optim.warmup_steps, config.total_steps
  if stages_lib.stage_dicts(config) or not (isinstance(warmup, int) and isinstance(total, int)
                                            and 1 <= total < warmup):
    return config, None
  config = config.copy_and_resolve_references()
  config.optim.warmup_steps = total
  return config, (f"optim.warmup_steps={warmup} exceeds total_steps={total}: warming up over "
                  f"all {total} steps (optim.warmup_steps={total})")


def llama_config(config: ml_collections.ConfigDict):
  """``config.model`` (a ConfigDict) -> the model's frozen ``LlamaConfig``."""
  from models.llama import LlamaConfig  # Local: keeps this module importable without Flax.

  fields = config.model.to_dict()
  if fields.get("layout") == "auto":
    raise ConfigError("model.layout='auto' is decided for the run's data and ring by "
                      "training.validation.resolve_layout (train.py does it at startup): "
                      "resolve the config first, or name a layout.")
  unknown = set(fields) - {f for f in LlamaConfig.__dataclass_fields__}
  if unknown:
    raise ConfigError(f"config.model has fields LlamaConfig does not know: {sorted(unknown)}.")
  with reraise_as(ConfigError, "config.model: "):
    return LlamaConfig.from_dict(fields)


def resolve_attention(config: ml_collections.ConfigDict, mesh):
  """``(model_cfg, line)``: ``config``'s :func:`llama_config` with ``model.attention="auto"``
  decided for a microbatch of the run on ``mesh`` (:func:`models.attention.resolve_attention`)
  and the line saying why; any other strategy: ``(model_cfg, None)``."""
  model_cfg, rows = llama_config(config), config.batch_size // config.microbatches
  run_len = run_length(model_cfg, shd.ring_size(mesh.shape), config.data.seq_len)
  resolved, chosen = attn_lib.resolve_attention(model_cfg, mesh, rows, run_len)
  if resolved is model_cfg:
    return model_cfg, None
  why = ("no sequence axis (falls back to dense)" if chosen is None
         else "; ".join(chosen.reasons))
  return resolved, f"attention=auto -> {resolved.attention} (ring_jax.plan): {why}"


def resolve_config(config: ml_collections.ConfigDict, ring_size: int, *, hf_dir: str | None = None,
                   log=None) -> tuple[ml_collections.ConfigDict, str | None]:
  """``(config, line)``: the model that will run decided, each step needing the one before:
  ``init.hf_dir``'s model fields (overrides to ``log``), a script's ``hf_dir`` (the model
  ``--hf_dir`` loads), ``config.stages``, then ``model.layout="auto"`` on a ring of
  ``ring_size`` (:func:`resolve_layout`'s line). Idempotent."""
  config = hf_init_lib.resolve_hf_init(config, log=log)
  if hf_dir:
    config = hf_init_lib.with_hf_model(config, hf_dir)
  config = stages_lib.resolve(config)
  return resolve_layout(config, ring_size)


def resolve_layout(config: ml_collections.ConfigDict,
                   ring_size: int) -> tuple[ml_collections.ConfigDict, str | None]:
  """``(config, line)``: ``model.layout="auto"`` decided for the run's data on a ring of
  ``ring_size`` devices by :func:`ring_jax.planning.choose_layout` (a copy naming the
  layout, and the line saying why); a named layout: ``(config, None)``. Rows of several
  documents (text; the kv task's ``docs_per_row > 1``) count as packed; attention is causal,
  with the model's sliding window if a layer has one. Idempotent; stages keep the layout."""
  if config.model.layout != "auto":
    return config, None
  d = config.data
  if d.kind == "text":
    packed, what = True, "data.kind='text' packs documents end to end"
  elif d.kind == "kv_retrieval":
    packed = int(d.kv.docs_per_row) > 1
    what = f"data.kind='kv_retrieval' with data.kv.docs_per_row={int(d.kv.docs_per_row)}"
  else:
    packed, what = False, f"data.kind={d.kind!r}"
  window = config.model.get("sliding_window")
  types = config.model.get("layer_types")
  if types is not None and "sliding_attention" not in tuple(types):
    window = None  # a window no layer applies
  layout, why = planning.choose_layout(
      ring_size, packed=packed, is_causal=True,
      local_window_size=None if window is None else (int(window) - 1, 0),
      local_len=-(-int(config.data.seq_len) // ring_size))
  config = config.copy_and_resolve_references()
  config.model.layout = layout
  return config, f"layout: auto -> {layout} ({why}; {what}; ring of {ring_size})"


def resolve_run(config: ml_collections.ConfigDict, num_devices: int,
                log=None) -> ml_collections.ConfigDict:
  """The config a run of ``num_devices`` devices trains: :func:`resolve_config` on the ring
  ``config.mesh`` makes of them, the layout's line to ``log``. Idempotent."""
  ring = shd.ring_size(mesh_lib.mesh_shape(config.mesh, num_devices))
  config, line = resolve_config(config, ring, log=log)
  if log is not None and line:
    log(line)
  return config
