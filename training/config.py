"""Config plumbing for train.py: gin overrides, mesh construction, up-front validation.

There is one source of truth for settings: the ``ml_collections.ConfigDict``
returned by ``configs/<name>.py:get_config(arg)``. Gin files and ``--gin_param``
bindings are only another *syntax* for overriding fields of that ConfigDict
(``model.num_layers = 4`` sets ``config.model.num_layers``); nothing is
registered as a gin configurable and gin holds no settings of its own.

Every check in :func:`validate_config` looks at static numbers only, so a bad
config fails with a message naming the fix before anything is traced or
compiled.
"""

from __future__ import annotations

import math
import os
import sys
from typing import Any, Iterable, Sequence

import jax
import ml_collections
import numpy as np

from models import attention as attn_lib
from models import lengths
from models import pipeline as pipeline_lib
from models.attention import ATTENTION_BACKENDS
from models import sharding as shd
from models.sharding import MESH_AXES
from ring_jax import kernels, layouts
from ring_jax.strategies import attention_axes
from training import stages as stages_lib
from training.errors import EXIT_USAGE, ConfigError, UsageError  # noqa: F401 (cfg_lib.* names)

DATA_KINDS: tuple[str, ...] = ("kv_retrieval", "text")




# ----------------------------------------------------------------------------
# Gin syntax -> ConfigDict overrides
# ----------------------------------------------------------------------------


class _RejectingDelegate:
  """Gin parser delegate: ``@references`` and ``%macros`` have no ConfigDict meaning."""

  def configurable_reference(self, name, evaluate):
    raise ConfigError(
        f"gin reference '@{name}' is not supported: gin bindings here only override "
        "ConfigDict fields with literal values (e.g. `model.num_layers = 4`).")

  def macro(self, name):
    raise ConfigError(
        f"gin macro '%{name}' is not supported: gin bindings here only override ConfigDict "
        "fields with literal values.")


def parse_gin_bindings(text: str, source: str = "<gin_param>") -> list[tuple[str, Any]]:
  """Parses gin binding syntax into ``(dotted.config.path, value)`` pairs.

  ``model.num_layers = 4`` -> ``("model.num_layers", 4)``;
  ``optim.lr = 1e-3`` -> ``("optim.lr", 0.001)``. A top-level field is written
  with the ``config.`` prefix (``config.total_steps = 100``) because a gin
  binding always needs a ``selector.name`` pair. ``include 'other.gin'`` is
  followed relative to the including file.
  """
  from gin import config_parser  # Imported lazily: only needed when gin is used.

  parser = config_parser.ConfigParser(text, _RejectingDelegate())
  out: list[tuple[str, Any]] = []
  for statement in parser:
    if isinstance(statement, config_parser.BindingStatement):
      if statement.scope:
        raise ConfigError(
            f"{source}: gin scopes ('{statement.scope}/...') are not supported; bind the "
            "ConfigDict field directly, e.g. `model.num_layers = 4`.")
      selector = statement.selector
      if selector == "config":
        path = statement.arg_name
      elif selector.startswith("config."):
        path = f"{selector[len('config.'):]}.{statement.arg_name}"
      else:
        path = f"{selector}.{statement.arg_name}"
      out.append((path, statement.value))
    elif isinstance(statement, config_parser.IncludeStatement):
      base = os.path.dirname(source) if os.path.exists(source) else os.getcwd()
      inc = statement.filename
      inc = inc if os.path.isabs(inc) else os.path.join(base, inc)
      with open(inc) as f:
        out.extend(parse_gin_bindings(f.read(), inc))
    else:
      raise ConfigError(
          f"{source}: unsupported gin statement {type(statement).__name__}; only "
          "`field.path = value` bindings and `include` are accepted.")
  return out


def apply_overrides(config: ml_collections.ConfigDict,
                    overrides: Iterable[tuple[str, Any]]) -> ml_collections.ConfigDict:
  """Sets dotted paths on ``config``; unknown fields and wrong types raise ConfigError."""
  for path, value in overrides:
    *parents, leaf = path.split(".")
    node = config
    for i, name in enumerate(parents):
      if name not in node:
        raise ConfigError(f"gin binding `{path}`: config has no field "
                          f"'{'.'.join(parents[:i + 1])}'.")
      node = node[name]
    if not isinstance(node, ml_collections.ConfigDict) or leaf not in node:
      raise ConfigError(f"gin binding `{path}`: config has no field '{path}'. Known fields "
                        f"here: {sorted(node.keys()) if hasattr(node, 'keys') else '-'}.")
    if isinstance(value, list):
      value = tuple(value)
    try:
      node[leaf] = value
    except TypeError as e:  # ConfigDict's type safety: an int field cannot take a str.
      raise ConfigError(f"gin binding `{path} = {value!r}`: {e}") from None
  return config


def apply_gin(config: ml_collections.ConfigDict, gin_files: Sequence[str] = (),
              gin_params: Sequence[str] = ()) -> ml_collections.ConfigDict:
  """Applies gin files, then gin parameter strings, onto ``config`` (in that order)."""
  for path in gin_files:
    if not os.path.exists(path):
      raise ConfigError(f"--gin_file {path!r} does not exist.")
    with open(path) as f:
      apply_overrides(config, parse_gin_bindings(f.read(), path))
  for text in gin_params:
    apply_overrides(config, parse_gin_bindings(text))
  return config


# ----------------------------------------------------------------------------
# Mesh
# ----------------------------------------------------------------------------


def mesh_shape(mesh_config, num_devices: int) -> dict[str, int]:
  """Resolves the ``config.mesh`` sizes; one axis may be -1 (= the remaining devices)."""
  sizes = {axis: int(mesh_config.get(axis, 1)) for axis in MESH_AXES}
  unknown = set(mesh_config.keys()) - set(MESH_AXES)
  if unknown:
    raise ConfigError(f"config.mesh has unknown axes {sorted(unknown)}; axes are {MESH_AXES}.")
  fill = [a for a, s in sizes.items() if s == -1]
  if len(fill) > 1:
    raise ConfigError(f"config.mesh: at most one axis may be -1, got {fill}.")
  bad = [a for a, s in sizes.items() if s < 1 and s != -1]
  if bad:
    raise ConfigError(f"config.mesh sizes must be >= 1 or -1, got {sizes}.")
  fixed = math.prod(s for s in sizes.values() if s != -1)
  if fill:
    if num_devices % fixed:
      raise ConfigError(
          f"config.mesh={sizes}: the fixed axes multiply to {fixed}, which does not divide "
          f"the {num_devices} devices, so '{fill[0]}=-1' cannot fill the rest.")
    sizes[fill[0]] = num_devices // fixed
  if math.prod(sizes.values()) != num_devices:
    raise ConfigError(
        f"config.mesh={sizes} needs {math.prod(sizes.values())} devices but "
        f"{num_devices} are available ({jax.default_backend()}). Set one axis to -1 to "
        "use all devices, or change the sizes.")
  return sizes


def make_mesh(mesh_config, devices=None) -> jax.sharding.Mesh:
  """A ``(data, pipeline, sequence_outer, sequence, tensor)`` mesh (:data:`MESH_AXES`) with
  Auto axis types.

  Auto (not Explicit) axes: the trainer states shardings at the jit boundary
  and lets XLA propagate inside; the model adds its own constraints.
  ``jax.make_mesh`` orders devices for the physical topology (ICI rings on
  TPU), so ring neighbours on ``sequence`` are physical neighbours, and the
  ``sequence_outer`` groups (the two-level ring's outer level) the farther devices.
  """
  devices = jax.devices() if devices is None else list(devices)
  sizes = mesh_shape(mesh_config, len(devices))
  shape = tuple(sizes[a] for a in MESH_AXES)
  auto = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
  if devices == jax.devices():
    return jax.make_mesh(shape, MESH_AXES, axis_types=auto)
  return jax.sharding.Mesh(np.asarray(devices).reshape(shape), MESH_AXES, axis_types=auto)


def simulate_cpu_devices(config, num_processes: int = 1) -> None:
  """Asks the CPU backend for enough devices to build ``config.mesh`` on a laptop.

  ``jax_num_cpu_devices`` only sizes the *CPU* client: on a GPU/TPU host JAX
  still uses the accelerators as its default devices, so setting it is
  harmless there and we need not (and cannot, without starting the backends)
  find out the platform first. An explicit
  ``--xla_force_host_platform_device_count`` in ``XLA_FLAGS`` wins. With
  several CPU processes each one simulates its share of the mesh; with an axis
  of -1, ``config.cpu_devices`` in all.
  """
  if "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
    return
  sizes = [int(config.mesh.get(a, 1)) for a in config.mesh.keys()]
  count = math.prod(sizes) if all(s > 0 for s in sizes) else int(config.cpu_devices)
  count = max(1, count // num_processes)
  try:
    jax.config.update("jax_num_cpu_devices", count)
  except RuntimeError:  # Backends already up (e.g. called from a notebook): keep them.
    print("note: JAX backends already initialised; not changing the CPU device count",
          file=sys.stderr, flush=True)


def start_script(argv: Sequence[str], script_flags: dict) -> dict:
  """The start of generate.py's and evaluate.py's ``main``: no stray arguments (else one
  line, exit :data:`EXIT_USAGE`), Orbax's INFO logs off unless ``-v``, and enough CPU
  devices for ``--config``'s mesh. Returns ``{flag name: value}`` of ``script_flags``."""
  from absl import flags
  from absl import logging

  if len(argv) > 1:
    print(f"error: unexpected arguments {list(argv[1:])}; flags are written --name=value.",
          file=sys.stderr)
    sys.exit(EXIT_USAGE)
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  values = {name: flag.value for name, flag in script_flags.items()}
  simulate_cpu_devices(values["config"])
  return values


# ----------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------


def check_seq_len(model_config, ring: int, seq_len: int) -> int:
  """:func:`models.lengths.check_length` for ``data.seq_len``; returns the local length.

  ``model_config``: ``config.model`` or a ``LlamaConfig`` (the same fields).

  Raises:
    ConfigError: naming the field and the fix.
  """
  try:
    return lengths.check_length(model_config, ring, seq_len, what="data.seq_len")
  except ValueError as e:
    raise ConfigError(f"data.seq_len={seq_len} with model.layout={model_config.layout!r} on the "
                      f"ring of {ring} devices (mesh sequence_outer x sequence): {e}") from None


def check_model_parallelism(model_config, sizes: dict[str, int], seq_len: int) -> None:
  """The ``config.model`` fields that depend on the mesh beyond the heads: the attention
  strategy's head and axis rules, and tensor sequence parallelism's local length.

  Raises:
    ConfigError: naming the field and the fix.
  """
  m, ring, tensor = model_config, shd.ring_size(sizes), sizes["tensor"]
  if sizes["sequence_outer"] > 1:  # the length rule's pair: the two-level ring
    try:
      attn_lib.check_sequence_axes(m.attention, shd.length_axes())
    except ValueError as e:
      raise ConfigError(str(e)) from None
  heads_here = m.num_heads // tensor
  kv_here = m.num_kv_heads // tensor if m.num_kv_heads % tensor == 0 else m.num_kv_heads
  if m.attention == "ulysses" and ring > 1 and (
      heads_here % ring or (kv_here % ring and ring % kv_here)):
    raise ConfigError(
        f"model.attention='ulysses' over the mesh 'sequence' axis ({ring}) needs the query heads "
        f"per tensor shard ({heads_here}) divisible by it and the key/value heads ({kv_here}) "
        "a multiple or a divisor of it; use model.attention='ring' or 'hybrid', or other sizes.")
  if m.attention == "hybrid":
    axes = tuple(m.get("hybrid_axes", ("sequence", "tensor")))
    if len(axes) != 2 or axes[0] != "sequence" or axes[1] not in sizes or axes[1] == axes[0]:
      raise ConfigError(
          f"model.hybrid_axes={axes} must be ('sequence', <another mesh axis>): the ring runs "
          f"over 'sequence', Ulysses over the second (mesh axes: {tuple(sizes)}).")
    u = sizes[axes[1]]
    heads, kv = (m.num_heads, m.num_kv_heads) if axes[1] == "tensor" else (heads_here, kv_here)
    if heads % u or (kv % u and u % kv):
      raise ConfigError(
          f"model.attention='hybrid' with Ulysses over '{axes[1]}' ({u}) needs {heads} query "
          f"heads divisible by it and {kv} key/value heads a multiple or a divisor of it.")
  tsp = m.get("tensor_sequence_parallel", None)
  if tsp is not False and tensor > 1 and m.get("ffn_chunk_size") and seq_len % (ring * tensor) == 0:
    local = seq_len // (ring * tensor)
    if local % m.ffn_chunk_size:
      raise ConfigError(
          f"model.ffn_chunk_size={m.ffn_chunk_size} must divide the residual stream's local "
          f"length {local} (data.seq_len {seq_len} / sequence {ring} / tensor {tensor}: tensor "
          "sequence parallelism splits it over both); use a divisor of it, or "
          "model.tensor_sequence_parallel=False.")


def resolve_attention(config: ml_collections.ConfigDict, model_cfg, mesh):
  """``(model_cfg, line)``: ``model.attention="auto"`` decided once for the run's shapes
  (:func:`models.attention.resolve_attention`: ``ring_jax.plan`` for a microbatch of
  ``batch_size / microbatches`` rows of ``data.seq_len`` tokens on ``mesh``) and the startup
  line saying what it chose and why; any other strategy: unchanged, ``line=None``."""
  rows = config.batch_size // config.microbatches
  resolved, chosen = attn_lib.resolve_attention(model_cfg, mesh, rows, config.data.seq_len)
  if resolved is model_cfg:
    return model_cfg, None
  why = ("no sequence axis (falls back to dense)" if chosen is None
         else "; ".join(chosen.reasons))
  return resolved, f"attention=auto -> {resolved.attention} (ring_jax.plan): {why}"


def profile_steps(config: ml_collections.ConfigDict) -> range | None:
  """``config.profile_steps`` (``"START:STOP"``: steps START to STOP-1) as a ``range``;
  None when unset or empty (no profile).

  Raises:
    ConfigError: not two integers ``1 <= START < STOP``, or no step of it runs.
  """
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


def validate_distributed(config: ml_collections.ConfigDict) -> None:
  """Checks ``config.distributed`` (read before ``jax.distributed.initialize``).

  Raises:
    ConfigError: a timeout that is not a whole number of seconds in range.
  """
  dist = config.distributed
  for name, low in (("heartbeat_timeout_s", 2), ("initialization_timeout_s", 1)):
    value = dist[name]
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
      raise ConfigError(f"distributed.{name}={value!r} must be a whole number of seconds "
                        f">= {low}; e.g. --config.distributed.{name}=60.")


def check_pipeline(config: ml_collections.ConfigDict, sizes: dict[str, int]) -> None:
  """The ``pipeline`` axis must divide the layers, and its microbatches the rows.

  Rows per pipeline microbatch: ``batch_size / microbatches /
  model.pipeline_microbatches`` (the default number: :func:`models.pipeline.
  default_microbatches`), which must divide over the ``data`` axis; the eval
  step pipelines ``eval_batch_size`` rows the same way.

  Raises:
    ConfigError: naming the field and the fix.
  """
  m, stages, data_par = config.model, sizes["pipeline"], sizes["data"]
  micro = m.get("pipeline_microbatches")
  if micro is not None and micro < 1:
    raise ConfigError(f"model.pipeline_microbatches={micro} must be >= 1 (or None: the "
                      "default, 2 x mesh.pipeline when the batch allows).")
  if stages == 1:
    return
  if m.num_layers % stages:
    divisors = [d for d in range(1, m.num_layers + 1) if m.num_layers % d == 0]
    raise ConfigError(f"mesh.pipeline={stages} stages do not divide model.num_layers="
                      f"{m.num_layers}; choose mesh.pipeline from {divisors}.")
  for name, rows in (("batch_size", config.batch_size // config.microbatches),
                     ("eval_batch_size", config.eval_batch_size)):
    try:
      pipeline_lib.resolve_microbatches(micro, rows, stages, data_par)
    except ValueError as e:
      raise ConfigError(f"{name}={config[name]} on mesh.pipeline={stages}: {e} Set "
                        "model.pipeline_microbatches to a divisor of the rows, or change "
                        f"{name}.") from None


def validate_config(config: ml_collections.ConfigDict, num_devices: int) -> dict[str, int]:
  """Checks everything knowable without tracing; returns the resolved mesh sizes.

  Raises:
    ConfigError: naming the offending field(s) and how to fix them.
  """
  m, d = config.model, config.data
  sizes = mesh_shape(config.mesh, num_devices)
  ring, tensor, data_par = shd.ring_size(sizes), sizes["tensor"], sizes["data"]
  validate_stages(config, num_devices)  # first: its errors name the stage

  if m.attention not in ATTENTION_BACKENDS:
    raise ConfigError(f"model.attention={m.attention!r} is unknown; choose one of "
                      f"{sorted(ATTENTION_BACKENDS)}.")
  hop_kernel = m.get("hop_kernel", "auto")
  if hop_kernel not in kernels.kernel_names():
    raise ConfigError(f"model.hop_kernel={hop_kernel!r} is unknown; choose one of "
                      f"{kernels.kernel_names()}.")
  if m.layout not in layouts.ALL_LAYOUTS:
    raise ConfigError(
        f"model.layout={m.layout!r} is unknown; choose one of {layouts.ALL_LAYOUTS}.")
  routing = m.get("causal_routing")
  if routing is not None and not isinstance(routing, bool):
    raise ConfigError(f"model.causal_routing must be unset (the library's default), True or "
                      f"False, got {routing!r}.")
  if routing and sizes["sequence_outer"] > 1 and m.attention == "ring":
    raise ConfigError("model.causal_routing=True: the two-level ring (mesh.sequence_outer > 1) "
                      "does not route; unset it or use mesh.sequence_outer=1.")
  if m.num_heads % m.num_kv_heads:
    raise ConfigError(f"model.num_heads={m.num_heads} must be a multiple of "
                      f"model.num_kv_heads={m.num_kv_heads} (GQA groups).")
  try:  # heads are sharded over 'tensor' (a single key/value head, MQA, is replicated)
    attention_axes(sizes, batch=1, heads=m.num_heads, kv_heads=m.num_kv_heads, batch_axis=None,
                   head_axis="tensor", names=("batch", "model.num_heads", "model.num_kv_heads"))
  except ValueError as e:
    raise ConfigError(str(e)) from None
  if m.mlp_dim % tensor or m.vocab_size % tensor:
    raise ConfigError(f"model.mlp_dim={m.mlp_dim} and model.vocab_size={m.vocab_size} must be "
                      f"divisible by the mesh 'tensor' axis ({tensor}).")

  check_seq_len(m, ring, d.seq_len)
  validate_distributed(config)
  check_model_parallelism(m, sizes, d.seq_len)

  for name in ("batch_size", "eval_batch_size"):
    batch, micro = config[name], (config.microbatches if name == "batch_size" else 1)
    if batch % micro:
      raise ConfigError(f"{name}={batch} is not divisible by microbatches={micro}.")
    if (batch // micro) % data_par:
      raise ConfigError(
          f"{name}={batch} / microbatches={micro} = {batch // micro} rows per microbatch is not "
          f"divisible by the mesh 'data' axis ({data_par}).")
    # No rule per process: each process loads the rectangular (rows x sequence)
    # block its devices hold (data.process_slices), so hosts may share rows.
  check_pipeline(config, sizes)

  if d.kind not in DATA_KINDS:
    raise ConfigError(f"data.kind={d.kind!r} is unknown; choose one of {DATA_KINDS}.")
  if d.kind == "text":
    check_text_data(d, m)
  else:
    from training import data as data_lib
    task = data_lib.KVRetrievalTask.from_config(d)
    if m.vocab_size < task.vocab_size:
      raise ConfigError(f"the kv_retrieval task needs model.vocab_size >= {task.vocab_size}, "
                        f"got {m.vocab_size}.")
    try:
      task.check()
    except ValueError as e:
      raise ConfigError(str(e)) from None

  for name in ("total_steps", "log_every", "eval_every", "checkpoint_every"):
    if config[name] < 1:
      raise ConfigError(f"{name} must be >= 1, got {config[name]}.")
  profile_steps(config)
  if config.optim.warmup_steps > config.total_steps:
    raise ConfigError(f"optim.warmup_steps={config.optim.warmup_steps} exceeds "
                      f"total_steps={config.total_steps}.")
  return sizes


def validate_stages(config: ml_collections.ConfigDict, num_devices: int) -> None:
  """Checks each of ``config.stages`` (training/stages.py) as a config of its own: its
  seq_len obeys :func:`check_seq_len` on the mesh, its batch the mesh's 'data' axis, its
  RoPE fields the model's rules, and ``steps >= 1``, ``warmup_steps <= steps``.

  Raises:
    ConfigError: prefixed with the stage (its number and fields) it is about.
  """
  if not stages_lib.stage_dicts(config):
    return
  for stage in stages_lib.plan(config):
    c = stage.config
    where = (f"config.stages stage {stage.index + 1} (seq_len={c.data.seq_len}, "
             f"steps={stage.steps})")
    try:
      if c.optim.warmup_steps > stage.steps:
        raise ConfigError(f"warmup_steps={c.optim.warmup_steps} exceeds the stage's "
                          f"steps={stage.steps}; each stage warms up anew (set the stage's "
                          "warmup_steps=, or --config.optim.warmup_steps=).")
      validate_config(c, num_devices)  # c.stages is None: no recursion.
      llama_config(c)
    except ConfigError as e:
      raise ConfigError(f"{where}: {e}") from None


# ----------------------------------------------------------------------------
# init.hf_dir: the model config of a Hugging Face checkpoint
# ----------------------------------------------------------------------------


def hf_init_dir(config) -> str:
  """``config.init.hf_dir``, or "" (also for configs saved before the field existed)."""
  init = config.get("init")
  return (init.get("hf_dir") if init is not None else None) or ""


def resolve_hf_init(config: ml_collections.ConfigDict, log=None) -> ml_collections.ConfigDict:
  """``config`` with the model fields of ``init.hf_dir/config.json`` filled in (a copy).

  For each field of :data:`models.convert_hf.HF_FIELDS` (vocabulary, dims,
  heads, kv heads, head_dim, mlp_dim, rope_theta, rope_scaling, norm_eps,
  tie_embeddings), ``config.model``'s value decides:

  * None ("not set", as ``configs/finetune.py`` leaves them all): config.json's value;
  * a value: an override of config.json's (``log`` gets one line per differing
    field), except for the shape fields
    (:data:`models.convert_hf.HF_SHAPE_FIELDS`), which the weights fix: a
    different value there is a ConfigError.

  ``data.tokenizer`` None (``configs/finetune.py``'s default) becomes ``init.hf_dir``:
  the tokenizer files of the Hugging Face directory.

  Idempotent (a resolved config resolves to itself), so train.py can resolve
  before saving the run's config and again inside :func:`train.train`.
  Without ``init.hf_dir`` the config is returned unchanged.

  Raises:
    ConfigError: no such directory, no config.json or weights in it, a model
      this LLaMA is not, or a shape field that contradicts config.json.
  """
  hf_dir = hf_init_dir(config)
  if not hf_dir:
    return config
  from models import convert_hf  # Local: keeps this module importable without Flax.

  if not os.path.isdir(hf_dir):
    raise ConfigError(f"init.hf_dir={hf_dir!r} is not a directory; pass a local Hugging Face "
                      "LLaMA directory (config.json + *.safetensors, as save_pretrained writes).")
  if not any(os.path.exists(os.path.join(hf_dir, name))
             for name in (convert_hf.SINGLE_FILE, convert_hf.INDEX_FILE)):
    raise ConfigError(f"init.hf_dir={hf_dir!r} holds neither {convert_hf.SINGLE_FILE} nor "
                      f"{convert_hf.INDEX_FILE}; save the model with "
                      "save_pretrained(..., safe_serialization=True).")
  try:
    fields = convert_hf.hf_model_fields(hf_dir)
  except (OSError, ValueError, KeyError) as e:
    what = f"config.json lacks {e}" if isinstance(e, KeyError) else str(e)
    raise ConfigError(f"init.hf_dir={hf_dir!r}: {what}") from None
  config = config.copy_and_resolve_references()
  if config.data.get("tokenizer") is None:
    config.data.tokenizer = hf_dir
  for name, value in fields.items():
    current = config.model.get(name)
    if current is None:
      config.model[name] = value
    elif name in convert_hf.HF_SHAPE_FIELDS:
      if current != value:
        raise ConfigError(
            f"model.{name}={current!r} contradicts {hf_dir}/config.json ({value!r}), whose "
            f"weights fix it; leave model.{name} unset (None, as configs/finetune.py does).")
    elif current != value and log is not None:
      log(f"model.{name}={current!r} overrides {value!r} of {hf_dir}/config.json")
  return config


def check_text_data(d: ml_collections.ConfigDict, m: ml_collections.ConfigDict) -> None:
  """The ``data.*`` fields of ``data.kind='text'``: files, tokenizer, vocabulary, split."""
  if not d.path:
    raise ConfigError("data.kind='text' needs data.path (a .jsonl/.txt/.parquet/.arrayrecord "
                      "file, a directory or a glob), e.g. "
                      "--config.data.path=/path/to/corpus.jsonl.")
  from training import data as data_lib  # Local: data imports grain, config must not.
  if not data_lib.list_data_files(d.path):
    raise ConfigError(f"data.path={d.path!r} matches no "
                      f"{'/'.join(data_lib.sources.DATA_EXTS)} files.")
  if not 0 < d.eval_fraction < 1:
    raise ConfigError(f"data.eval_fraction={d.eval_fraction} must be in (0, 1): the eval "
                      "split is the last files (or a single file's tail).")
  if d.tokenizer is None:
    raise ConfigError("data.tokenizer is unset (configs/finetune.py takes the tokenizer of "
                      "init.hf_dir): pass --config.init.hf_dir=DIR or --config.data.tokenizer="
                      "(a tokenizer.json, a SentencePiece .model, a directory, or 'byte').")
  try:
    tokenizer = data_lib.load_tokenizer(d.tokenizer)
  except ImportError as e:
    raise ConfigError(f"data.tokenizer={d.tokenizer!r} needs the `hf` extra "
                      f"(pip install -e '.[hf]'): {e}") from None
  except Exception as e:  # ValueError naming the fix, or the package's own parse error.
    raise ConfigError(f"data.tokenizer={d.tokenizer!r} does not load: {e}") from None
  if tokenizer.vocab_size > m.vocab_size:
    raise ConfigError(f"the {tokenizer.name} tokenizer needs model.vocab_size >= "
                      f"{tokenizer.vocab_size}, got {m.vocab_size}: raise "
                      "--config.model.vocab_size (the embedding must cover every token id).")


def llama_config(config: ml_collections.ConfigDict):
  """``config.model`` (a ConfigDict) -> the model's frozen ``LlamaConfig``."""
  from models.llama import LlamaConfig  # Local: keeps this module importable without Flax.

  fields = config.model.to_dict()
  unknown = set(fields) - {f for f in LlamaConfig.__dataclass_fields__}
  if unknown:
    raise ConfigError(f"config.model has fields LlamaConfig does not know: {sorted(unknown)}.")
  try:
    return LlamaConfig.from_dict(fields)
  except ValueError as e:
    raise ConfigError(f"config.model: {e}") from None
