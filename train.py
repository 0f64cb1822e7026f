r"""Train a LLaMA whose attention is a ring over the mesh's ``sequence`` axis (the two-level
ring over ``sequence_outer`` x ``sequence`` when ``mesh.sequence_outer > 1``).

  python train.py --config configs/tiny.py --workdir /tmp/tiny
  python train.py --config configs/tiny.py:text --config.data.path=corpus.jsonl
  python train.py --config configs/tiny.py --config.model.num_layers=4 \
      --gin_param='optim.lr = 1e-3' --gin_file=overrides.gin
  python train.py --config configs/llama_1b.py --workdir /mnt/shared/run1   # accelerators
  python train.py --config configs/tiny.py --config.mesh.data=1 --config.mesh.sequence_outer=2
  python train.py --config configs/llama_7b.py --compile_only --topology v5p:4x4x4  # fits?

The workdir is a local or shared-filesystem path (NFS, a gcsfuse mount), not a gs:// URL;
rerunning the same command resumes from its newest checkpoint, data iterator included.
``--compile_only`` compiles each stage's step for the attached devices or a TPU slice and
reports its memory (:mod:`training.compile_only`). How a run stops and fails, and its exit
statuses (:data:`EXIT_STATUS`): docs/training.md, "When things go wrong".
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shlex
import sys
import time
from typing import Any

from training import supervisor as supervisor_lib  # imports no JAX

if __name__ == "__main__" and supervisor_lib.wanted(sys.argv):
  # A multi-process run: this process only supervises a copy of itself, so that a dead
  # process 0 (and JAX's C++ abort of this one) still ends in one line and status 75.
  # Before JAX is imported: the supervisor holds no devices and no connection.
  sys.exit(supervisor_lib.supervise())

import jax
from absl import app
from absl import flags
from ml_collections import config_flags

# Importing these starts no JAX backend, so devices can still be configured in main().
import ring_jax
from models import attention as attn_lib
from models import pipeline as pipeline_lib
from models import sharding as shd
from training import batch as batch_lib
from training import buckets as buckets_lib
from training import checkpoint as ckpt_lib
from training import compile_only as compile_lib
from training import data as data_lib
from training import distributed as distributed_lib
from training import errors
from training import flags as flags_lib
from training import hf_init as hf_init_lib
from training import loading as loading_lib
from training import mesh as mesh_lib
from training import metrics as metrics_lib
from training import stages as stages_lib
from training import validation as val_lib

_HERE = os.path.dirname(os.path.abspath(__file__))
#: This process's command line as given (parse_flags may add --config): rerunning it resumes.
_RESUME_COMMAND = shlex.join(["python", *sys.argv])

_DEFAULT_CONFIG = os.path.join(_HERE, "configs", "tiny.py")
# No default here: ml_collections would load it (and apply --config.* overrides) while this
# module is imported, where a typo could only end in a traceback. flags_lib.parse_flags()
# puts the default on the command line instead.
_CONFIG = config_flags.DEFINE_config_file(
    "config", None,
    "ml_collections config file (`path.py` or `path.py:arg`); override fields with "
    "--config.<field>=<value>.",
    lock_config=True)
flags.FLAGS["config"].default_as_str = repr(os.path.relpath(_DEFAULT_CONFIG, _HERE))  # --help
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Checkpoints, metrics.jsonl and TensorBoard events; an existing run here "
    "is resumed. Default: runs/<config file name>.")
_GIN_FILE = flags.DEFINE_multi_string(
    "gin_file", [], "Gin files of `field.path = value` bindings applied onto the config.")
_GIN_PARAM = flags.DEFINE_multi_string(
    "gin_param", [], "Gin bindings applied onto the config after --gin_file, e.g. "
    "'model.num_layers = 4' (top-level fields: 'config.total_steps = 10').")
_DISTRIBUTED = flags.DEFINE_enum(
    "distributed", "auto", ["auto", "on", "off"],
    "jax.distributed.initialize(): 'auto' calls it when a multi-process launch is detected "
    "(JAX_COORDINATOR_ADDRESS, SLURM with >1 task, Open MPI with >1 rank, GKE multi-host "
    "TPU); 'on' always calls it (e.g. Cloud TPU pod slices, where JAX reads the TPU metadata "
    "server); 'off' never.")
_STOP_AT_STEP = flags.DEFINE_integer(
    "stop_at_step", None, "Stop (with a checkpoint) after this step although the schedule "
    "runs to total_steps: simulates preemption; rerun to resume.", lower_bound=1)
_COMPILE_ONLY = flags.DEFINE_bool(
    "compile_only", False, "Build and compile each stage's train step as the run would, print "
    "its memory per device against the chip's HBM, the compile time and the overlap of its "
    "transfers, and exit: nothing is allocated or run, no workdir is written.")
_TOPOLOGY = flags.DEFINE_string(
    "topology", None, "With --compile_only: compile for this TPU slice instead of the attached "
    "devices, with the real TPU compiler and no TPU (needs the [tpu] extra): "
    f"{ring_jax.topology.FORMS}.")
_TOPOLOGY_SLICES = flags.DEFINE_integer(
    "topology_slices", 1, "With --topology: this many such slices, over the data center "
    "network (config.mesh's sequence_outer, data, pipeline axes span them, in that order).")

EXIT_USAGE = errors.EXIT_USAGE  # 2: bad flag, config, gin binding, data, no restorable step
#: The errors that end a run in one line: type -> (exit status, the line's start). Any other
#: error ends in its traceback; 0 is done or stopped cleanly (a signal, --stop_at_step), 75
#: another process of the run died (distributed_lib.EXIT_PEER_LOST).
EXIT_STATUS = {
    errors.ConfigError: (EXIT_USAGE, "config error: "),
    ckpt_lib.NoRestorableCheckpointError: (EXIT_USAGE, "error: "),
    data_lib.DataError: (EXIT_USAGE, "data error: "),  # a bad record (data.strict), no document
    metrics_lib.Diverged: (3, "error: "),  # non-finite loss or gradient norm
    ckpt_lib.CheckpointWriteError: (4, "error: "),  # disk full, quota, I/O
    compile_lib.CompileFailed: (1, "error: "),  # --compile_only: e.g. a kernel's VMEM
}


@dataclasses.dataclass
class TrainResult:
  """What :func:`train` leaves behind besides the files in the workdir."""
  history: list[dict[str, float]]  # one row per step run in this call
  evals: list[dict[str, float]]
  params: Any  # nnx.State of the final parameters (sharded jax.Arrays)
  opt_state: Any
  step: int
  mesh: Any
  stopped_by: str | None = None  # the signal that stopped the run early, if any
  checkpoint_dir: str | None = None


def train(config, workdir: str, *, stop_at_step: int | None = None) -> TrainResult:
  """Trains (or resumes) per ``config`` in ``workdir``, up to ``stop_at_step`` if given.

  Raises:
    ConfigError: a setting that cannot work (before anything compiles).
    NoRestorableCheckpointError: ``workdir`` has checkpoints and none restores.
    metrics.Diverged: a non-finite loss or gradient norm (no checkpoint of it is written).
    CheckpointWriteError: a checkpoint could not be written (earlier ones intact).
  """
  log = metrics_lib.log
  if stop_at_step is not None and stop_at_step < 1:
    raise errors.ConfigError(f"stop_at_step must be >= 1, got {stop_at_step}.")
  config, mesh, stages = _config_and_mesh(config)  # resolved once, before anything compiles
  end_step = min(stop_at_step or config.total_steps, config.total_steps)
  # Installed first: a signal while compiling still ends in a clean stop after one step.
  with (distributed_lib.StopRequest() as stop, jax.set_mesh(mesh),
        contextlib.ExitStack() as closing):  # closes the profile and metric writers
    setup = stages_lib.build_stage(stages[0], mesh)  # abstract: the state's shardings
    log(f"model: {setup.model_cfg.num_params() / 1e6:.2f}M params, "
        f"{setup.model_cfg.flops_per_token(config.data.seq_len) / 1e6:.2f} "
        f"MFLOP/token at {config.data.seq_len} tokens (train, with attention)")
    checkpointer = ckpt_lib.Checkpointer(workdir, every=config.checkpoint_every,
                                         keep=config.keep_checkpoints,
                                         async_save=config.async_checkpointing)
    profile = metrics_lib.Profile(val_lib.profile_steps(config), os.path.join(workdir, "profile"))
    closing.callback(profile.close)
    try:  # Orbax runs threads from here on: every exit path closes the checkpointer.
      start_step, params, opt_state, data_state = _resume_or_init(config, workdir,
                                                                  checkpointer, setup)
      peak_flops, peak_source = metrics_lib.peak_flops_per_device(config)
      log(f"MFU counted against {peak_flops:.3g} FLOP/s per device: {peak_source}")
      writer = metrics_lib.MetricWriter(workdir, resume_step=start_step)
      closing.callback(writer.close)
      progress = metrics_lib.Progress(end_step, start_step)
      step, stage_config, evals, stopped_by = start_step, config, [], None
      step_metrics = metrics_lib.StepMetrics(  # the running stage's settings in its message
          explain=lambda row: ckpt_lib.divergence_message(stage_config, row, checkpointer))

      for stage in stages:  # the outer loop: each stage's step, data and programs
        if stage.end <= step or step >= end_step or stopped_by is not None:
          continue  # done before this call, or this call stops before it
        c = stage_config = stage.config
        if setup.stage is not stage:
          setup = stages_lib.build_stage(stage, mesh)
        if len(stages) > 1:
          log(stage.describe())
        if stage.index > 0 and step == stage.start:  # fresh AdamW state: docs/context_extension.md
          opt_state = setup.train_step.init_opt_state(params)
        run = _StageRun(setup, mesh, params, opt_state,
                        data_state if step > stage.start else None, peak_flops)
        data_state, stage_end = None, min(stage.end, end_step)
        for step in range(step + 1, stage_end + 1):  # run, log, eval, checkpoint
          distributed_lib.note_step(step)  # For the line if a peer process dies.
          with profile.step(step) as outputs:
            params, opt_state, metrics = run.step(params, opt_state)
            outputs.append(metrics)
          step_metrics.add(step, metrics)
          checkpointer.check_for_errors()  # A failed background save stops the run here.
          step_metrics.fetch(step - 1)  # One step behind: the device keeps a step queued.
          stopping = stop.reached(step)  # Exactly once per step, on every process.
          logged = step % config.log_every == 0 or step == stage_end or stopping
          if logged:
            window = step_metrics.window(step)  # Blocks on this step: times are real.
            window.update(run.throughput.window(),
                          learning_rate=float(setup.schedule(step - 1 - stage.start)))
            window.update(data_lib.bad_record_counts(run.batches.get_state()))
            writer.write(step, window, prefix="train/")
            progress.log(step, window)
          if stopping:
            stopped_by = stop.received
            break
          if step % config.eval_every == 0 or step == stage.end:  # also each stage's end
            result = metrics_lib.evaluate(setup.train_step.eval_step, params, run.eval_dataset, c,
                                          run.batch_sharding, setup.eval_shape)
            evals.append(dict(step=step, **result))
            writer.write(step, result, prefix="eval/")
            log(f"eval @ {step}: " + " | ".join(f"{k} {v:.4f}" for k, v in result.items()))
          # On its interval, and at each stage's last step but the run's (the next starts there).
          ckpt_lib.save(c, checkpointer, step_metrics, step, params, opt_state, run.batches,
                        force=step == stage.end and step != config.total_steps)
          if logged:
            run.throughput.reset()  # Exclude eval/checkpoint time from the next window.

      step_metrics.fetch(step)  # The final checkpoint (also when stopped early) and its wait.
      if step > start_step and checkpointer.last_saved != step:
        ckpt_lib.save(stage_config, checkpointer, step_metrics, step, params, opt_state,
                      run.batches, force=True)
      checkpointer.close()
    except BaseException as e:
      # A collective that lost a peer: main() ends the process; closing would wait on it.
      # Else closing lets good in-flight saves land; its errors are secondary.
      if distributed_lib.collective_lost_peer(e) is None:
        with contextlib.suppress(Exception):
          checkpointer.close()
      raise
  return TrainResult(history=step_metrics.history, evals=evals, params=params,
                     opt_state=opt_state, step=step, mesh=mesh, stopped_by=stopped_by,
                     checkpoint_dir=checkpointer.directory)


def _config_and_mesh(config):
  """The config resolved once (``init.hf_dir``, stages, ``"auto"`` fields) and checked, the
  mesh and the stages, and the startup lines that describe them."""
  log, count = metrics_lib.log, jax.device_count()
  config = val_lib.resolve_run(config, count, log)
  config, warmup_line = val_lib.clamp_warmup(config)  # a run shorter than its warmup
  log(warmup_line)
  sizes = val_lib.validate_config(config, count)  # and each stage's
  if buckets_lib.lengths_of(config) and jax.process_count() > 1:
    raise errors.ConfigError("data.length_buckets run in one process (every process would "
                             "have to fill the same bucket first); drop the buckets.")
  mesh, stages = mesh_lib.make_mesh(config.mesh), stages_lib.plan(config)
  model_cfg, attention_line = val_lib.resolve_attention(stages[0].config, mesh)  # per stage
  log(f"devices: {count} x {jax.devices()[0].device_kind} "
      f"({jax.process_count()} process(es)); mesh {sizes}; attention={model_cfg.attention} "
      f"layout={model_cfg.layout} ring={shd.ring_size(sizes)}"
      + (f" (two-level: {sizes['sequence_outer']} groups of {sizes['sequence']})"
         if sizes["sequence_outer"] > 1 else ""))
  log(attention_line)
  if sizes["pipeline"] > 1:
    micro = pipeline_lib.resolve_microbatches(
        model_cfg.pipeline_microbatches, config.batch_size // config.microbatches,
        sizes["pipeline"], sizes["data"])
    log(f"pipeline: {sizes['pipeline']} stages x {model_cfg.num_layers // sizes['pipeline']} "
        f"layers, GPipe over {micro} microbatches, bubble fraction "
        f"{pipeline_lib.bubble_fraction(sizes['pipeline'], micro):.3f}")
  return config, mesh, stages


def _resume_or_init(config, workdir, checkpointer, setup):
  """``(step, params, opt_state, data_state)``: the newest checkpoint that restores (onto the
  step's shardings), else step 0 with a fresh state and no data state: the weights of
  ``init.hf_dir`` if set, else initialised from the step's seed. Then the run's config is
  saved beside it."""
  log, train_step, hf_dir = metrics_lib.log, setup.train_step, hf_init_lib.hf_init_dir(config)
  try:
    restored = checkpointer.restore_latest(train_step.abstract_params,
                                           train_step.abstract_opt_state, warn=log)
  except ckpt_lib.NoRestorableCheckpointError as e:
    raise ckpt_lib.NoRestorableCheckpointError(
        f"{e} {loading_lib.saved_config_hint(config, workdir)}") from None
  if restored is not None:
    log(f"resumed from step {restored[0]} in {checkpointer.directory}")
    loading_lib.warn_model_differences(config, workdir, log)  # differs, yet restores
  elif hf_dir:
    from models import convert_hf  # Local: only a run that starts from Hugging Face weights.
    t0 = time.perf_counter()
    params = convert_hf.load_hf_params(hf_dir, train_step.model_cfg,
                                       shardings=train_step.param_shardings)
    restored = (0, params, train_step.init_opt_state(params), None)
    log(f"initialised from {hf_dir} in {time.perf_counter() - t0:.1f}s")
  else:
    restored = (0, *train_step.init_state(), None)
  loading_lib.save_run_config(config, workdir)  # now that the checkpoint restored under it
  return restored


class _StageRun:
  """A stage's data and its train step's programs, compiled ahead of time: ``programs[i]``
  runs a batch of bucket ``i`` (one program, ``buckets=()``, without ``data.length_buckets``)."""

  def __init__(self, setup, mesh, params, opt_state, data_state, peak_flops):
    log, c, self.setup = metrics_lib.log, setup.stage.config, setup
    # This process's rows in the ring's layout, sharded (data, sequence); with
    # data.length_buckets whole batches per bucket, each on its own re-split mesh.
    self.batch_sharding, ring_size = batch_lib.sharding(mesh), shd.ring_size(mesh.shape)
    self.buckets = buckets_lib.plan(c, setup.model_cfg, mesh)
    if self.buckets:
      log(buckets_lib.describe(self.buckets))
      self.batches = buckets_lib.BucketedBatches(data_lib.text_documents(c, "train"),
                                                 self.buckets, c.model.layout)
    else:
      self.batches = data_lib.make_iterator(
          data_lib.make_dataset(c, self.batch_sharding, ring_size, split="train"))
    if data_state is not None:  # resumed inside the stage
      self.batches.set_state(data_state)
    self.eval_dataset = data_lib.make_dataset(c, self.batch_sharding, ring_size, split="eval")
    t0 = time.perf_counter()
    self.programs = [setup.train_step.compile(setup.train_shape, params, opt_state)]
    if self.buckets:  # one program per bucket; the full ring's is the run's own
      self.programs[:0] = buckets_lib.compile_steps(setup.train_step, self.buckets[:-1],
                                                    c.microbatches, params, opt_state)
      log(buckets_lib.compiled_count_line(len(self.programs)))
    memory = self.programs[-1].memory_analysis()
    log(f"compiled train step in {time.perf_counter() - t0:.1f}s"
        + (f"; per-device temp {memory.temp_size_in_bytes / 2**20:.1f} MiB, arguments "
           f"{memory.argument_size_in_bytes / 2**20:.1f} MiB" if memory is not None else ""))
    if setup.model_cfg.attention != "dense":  # what "auto" chose, and its self-check
      log(ring_jax.kernels.describe(setup.model_cfg.hop_kernel))
      log(attn_lib.describe_routing(setup.model_cfg, mesh))
    self.throughput = metrics_lib.Throughput(
        tokens_per_step=c.batch_size * c.data.seq_len,
        flops_per_token=setup.model_cfg.flops_per_token(c.data.seq_len),
        peak_flops=peak_flops, num_devices=jax.device_count())

  def step(self, params, opt_state):
    """One train step on the next batch: ``(params, opt_state, metrics)``."""
    local, shape, sharding, index = next(self.batches), self.setup.train_shape, None, -1
    if self.buckets:  # that bucket's program, batch split and shape
      index, local = local
      shape, sharding = self.buckets[index].shape, self.buckets[index].sharding
    batch = data_lib.to_global(local, sharding or self.batch_sharding, shape)
    self.throughput.tick()
    return self.programs[index](params, opt_state, batch)


def main(argv) -> None:
  if len(argv) > 1:
    flags_lib.fail(EXIT_USAGE, f"config error: unexpected arguments {argv[1:]}; flags are "
                               "written --name=value.")
  flags_lib.quiet_orbax()  # unless -v
  try:  # Gin is only another syntax for the same ConfigDict fields (applied after --config.*).
    config = flags_lib.apply_gin(_CONFIG.value, _GIN_FILE.value, _GIN_PARAM.value)
    val_lib.check_ranges(config, prefix="distributed.")  # Before the processes connect.
    if (_TOPOLOGY.value or _TOPOLOGY_SLICES.present) and not _COMPILE_ONLY.value:
      raise errors.ConfigError("--topology names devices that are not attached: it needs "
                               "--compile_only.")
  except Exception as e:  # ConfigError, or gin's parser on bad syntax (SyntaxError, ...)
    prefix = "" if isinstance(e, errors.ConfigError) else f"gin: {type(e).__name__}: "
    flags_lib.fail(EXIT_USAGE, f"config error: {prefix}{' '.join(str(e).split())}")
  try:
    if _COMPILE_ONLY.value:
      if not _TOPOLOGY.value:
        mesh_lib.simulate_cpu_devices(config)
      compile_lib.compile_stages(config, _TOPOLOGY.value, _TOPOLOGY_SLICES.value)
      return
    num_processes = distributed_lib.start(_DISTRIBUTED.value, config.distributed)
    mesh_lib.simulate_cpu_devices(config, num_processes)
    workdir = _WORKDIR.value or os.path.join(
        "runs", os.path.splitext(os.path.basename(config_flags.get_config_filename(
            flags.FLAGS["config"])))[0])
    distributed_lib.start_watchdog(  # A no-op on one process.
        config.distributed, ckpt_lib.checkpoint_directory(workdir), _RESUME_COMMAND)
    t0 = time.perf_counter()
    result = train(config, workdir, stop_at_step=_STOP_AT_STEP.value)
  except Exception as e:
    status, start = next((v for t, v in EXIT_STATUS.items() if isinstance(e, t)), (None, ""))
    if status is None or isinstance(e, ckpt_lib.CheckpointWriteError):
      # On several processes a dead peer surfaces first as a collective's error (gloo:
      # "Connection reset by peer", from a step's metrics or a save): its line and 75 at
      # once. A failed save, or any other error, waits for the watchdog's verdict first.
      distributed_lib.exit_if_peer_lost(e)
    if status is None:
      raise
    flags_lib.fail(status, f"{start}{e}")
  distributed_lib.finish()  # A clean end: the other processes stop expecting this one.
  if jax.process_index() != 0:
    return
  wall = f"wall {time.perf_counter() - t0:.1f}s"
  if result.stopped_by is not None:
    print(f"stopped by {result.stopped_by} after step {result.step}; checkpoint saved in "
          f"{result.checkpoint_dir}. Resume with: {_RESUME_COMMAND}", flush=True)
    return
  if not result.history:
    print(f"done: nothing to do, the checkpoint in {result.checkpoint_dir} is already at step "
          f"{result.step} (total_steps or --stop_at_step); {wall}", flush=True)
    return
  final = [f"{k} {v:.4f}" for k, v in (result.evals or [{}])[-1].items() if k != "step"]
  print(f"done: step {result.step}, train loss {result.history[0]['loss']:.4f} -> "
        f"{result.history[-1]['loss']:.4f}"
        + (", final eval " + ", ".join(final) if final else "") + f", {wall}", flush=True)


if __name__ == "__main__":
  app.run(main, flags_parser=lambda argv: flags_lib.parse_flags(argv, _DEFAULT_CONFIG))
