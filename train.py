r"""Train a LLaMA whose attention is a ring over the mesh's ``sequence`` axis (the two-level
ring over ``sequence_outer`` x ``sequence`` when ``mesh.sequence_outer > 1``).

  python train.py --config configs/tiny.py --workdir /tmp/tiny
  python train.py --config configs/tiny.py:text --config.data.path=corpus.jsonl
  python train.py --config configs/tiny.py --config.model.num_layers=4 \
      --gin_param='optim.lr = 1e-3' --gin_file=overrides.gin
  python train.py --config configs/llama_1b.py --workdir /mnt/shared/run1   # accelerators
  python train.py --config configs/tiny.py --config.mesh.data=1 --config.mesh.sequence_outer=2
  python train.py --config configs/llama_7b.py --compile_only --topology v5p:4x4x4  # fits?

The workdir is a local or shared-filesystem path (e.g. NFS or a gcsfuse mount on
multi-host runs); object-store URLs such as gs:// are not supported.

Reading order: flags -> process/device setup -> ``train()``: (1) mesh and
config checks, (2) the train step (``training.step.build_train_step``), (3)
resume from the latest checkpoint or initialise sharded, (4) data, (5)
compile, (6) the loop (step, log, eval, checkpoint; ``training.metrics``
fetches metrics one step behind and checks them for divergence, and traces
``config.profile_steps``); sections 3-6 are the methods of ``_Run``, in that order.
Helpers live in ``training/``.

``--compile_only`` (:func:`compile_only`) stops after (5): it builds and compiles each
stage's train step as the run would, from abstract values only, and prints per device its
memory against the chip's HBM, the compile time, the hop kernel and the overlap of its
transfers; with ``--topology v5p:4x4x4`` (``--topology_slices N``) it compiles for that TPU
slice with the real TPU compiler and no TPU attached (the ``[tpu]`` extra,
:mod:`training.compile_only`).

Re-running the same command with the same ``--workdir`` resumes from the
latest checkpoint there, including the data iterator position, so the loss
curve continues exactly as if the run had not stopped.

Stopping and failing (docs/training.md, "When things go wrong"): SIGTERM or
SIGINT finishes the current step on every process, saves, and exits 0 with the
command that resumes; a non-finite loss or gradient norm stops the run with
exit status 3 and no checkpoint of the diverged state; a checkpoint that cannot
be written stops it with status 4; a corrupt newest checkpoint is moved aside
and the one before it restored; config and flag errors are one line, status 2;
on a multi-process run, a process that dies makes every survivor exit with
status 75 and one line naming it and the command that resumes
(``training.distributed``; docs/training.md, "When a process dies"), process 0
included: each process of such a run is a child of ``training.supervisor``.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import shlex
import signal
import sys
import threading
import time
from typing import Any

from training import supervisor as supervisor_lib  # imports no JAX

if __name__ == "__main__" and supervisor_lib.wanted(sys.argv):
  # A multi-process run: this process only supervises a copy of itself, so that a dead
  # process 0 (and JAX's C++ abort of this one) still ends in one line and status 75.
  # Before JAX is imported: the supervisor holds no devices and no connection.
  sys.exit(supervisor_lib.supervise())

import jax
import numpy as np
from absl import app
from absl import flags
from absl import logging
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
from training import step as step_lib
from training import validation as val_lib

_HERE = os.path.dirname(os.path.abspath(__file__))

_DEFAULT_CONFIG = os.path.join(_HERE, "configs", "tiny.py")
# No default here: ml_collections would load it (and apply --config.* overrides) while this
# module is imported, where a typo could only end in a traceback. parse_flags() puts the
# default on the command line instead.
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

# Exit statuses besides 0 (done, or stopped cleanly by a signal / --stop_at_step).
EXIT_USAGE = errors.EXIT_USAGE  # bad flag, config, gin binding, data, or no checkpoint restores
EXIT_DIVERGED = 3  # non-finite loss or gradient norm
EXIT_CHECKPOINT_WRITE = 4  # a checkpoint could not be written (disk full, quota, I/O)
EXIT_PEER_LOST = distributed_lib.EXIT_PEER_LOST  # 75: another process of the run died
EXIT_COMPILE_FAILED = 1  # --compile_only: the compiler refused the step

# Which launchers make this a multi-process run (training/supervisor.py, imported above).
multiprocess_launch_detected = supervisor_lib.multiprocess_launch_detected


# ----------------------------------------------------------------------------
# Process and device setup (before JAX starts its backends)
# ----------------------------------------------------------------------------


def initialize_distributed(mode: str, distributed_config) -> int:
  """Calls ``jax.distributed.initialize()`` if asked/detected; returns the process count.

  Starts no backend (so the CPU device count can still be set afterwards). On a
  CPU-only multi-process run (``JAX_PLATFORMS=cpu``) cross-process collectives
  go through gloo. ``distributed_config`` (``config.distributed``) sets the
  heartbeat and start-up timeouts.
  """
  launcher = multiprocess_launch_detected()
  if mode == "off" or (mode == "auto" and launcher is None):
    return 1
  kwargs = {}
  if os.environ.get("JAX_NUM_PROCESSES"):
    kwargs["num_processes"] = int(os.environ["JAX_NUM_PROCESSES"])
  if os.environ.get("JAX_PROCESS_ID"):
    kwargs["process_id"] = int(os.environ["JAX_PROCESS_ID"])
  if os.environ.get("JAX_PLATFORMS", "") == "cpu":
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  distributed_lib.initialize(distributed_config, **kwargs)
  print(f"jax.distributed initialised ({launcher or 'forced by --distributed=on'})",
        flush=True)
  for name in ("JAX_NUM_PROCESSES", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
    if os.environ.get(name):
      return int(os.environ[name])
  return 1  # Unknown here (e.g. TPU metadata): only used to size simulated CPU devices.


# ----------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------


class StopRequest:
  """SIGTERM / SIGINT -> finish the current step, agree on it, save, exit cleanly.

  One process: our own handler sets a flag that the loop reads after each step.
  Several processes (``jax.distributed``): JAX's coordination service already
  listens to SIGTERM (its preemption notifier) and propagates the notice to
  every process; :meth:`reached` is then
  ``multihost_utils.reached_preemption_sync_point(step)``, True on every process
  at the same step (the largest step any process had reached, plus one). A
  SIGINT there is forwarded to ourselves as SIGTERM so it takes the same path.
  A second signal of the same kind (that reaches our handler: SIGINT, or SIGTERM
  on one process) restores the previous handler and re-sends it, so a second
  Ctrl-C exits at once.
  """

  SIGNALS = (signal.SIGTERM, signal.SIGINT)

  def __init__(self):
    self.received: str | None = None
    self._previous: dict[int, Any] = {}
    self._multi = jax.process_count() > 1
    self._jax_notice = self._multi and bool(jax.config.jax_enable_preemption_service)

  def install(self) -> "StopRequest":
    if threading.current_thread() is not threading.main_thread():
      return self  # signal.signal only works there (e.g. train() called from a worker thread)
    for sig in self.SIGNALS:
      if self._jax_notice and sig == signal.SIGTERM:
        continue  # JAX's C++ handler; replacing it would hide the notice from other processes.
      self._previous[sig] = signal.signal(sig, self._handle)
    return self

  def uninstall(self) -> None:
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
    self._previous.clear()

  def _handle(self, signum, frame) -> None:
    name = signal.Signals(signum).name
    if self.received is not None:  # Second signal: give up on the clean stop.
      signal.signal(signum, self._previous.pop(signum, signal.SIG_DFL))
      os.kill(os.getpid(), signum)
      return
    self.received = name
    print(f"{name} received: finishing the current step, then saving a checkpoint and "
          f"exiting (send {name} again to exit at once without saving)", file=sys.stderr,
          flush=True)
    if self._jax_notice:
      os.kill(os.getpid(), signal.SIGTERM)  # Hand it to JAX's preemption notifier.

  def reached(self, step: int) -> bool:
    """Whether to stop after ``step`` (called once per step, same steps on every process)."""
    if self._jax_notice:
      from jax.experimental import multihost_utils
      if multihost_utils.reached_preemption_sync_point(step):
        self.received = self.received or "SIGTERM (preemption notice)"
        return True
      return False
    if self._multi:  # Preemption service disabled: agree through a collective each step.
      from jax.experimental import multihost_utils
      return bool(np.max(multihost_utils.process_allgather(np.int32(self.received is not None))))
    return self.received is not None


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
  """Trains (or resumes) per ``config`` in ``workdir``; see the module docstring.

  Raises:
    ConfigError: a setting that cannot work (before anything compiles).
    NoRestorableCheckpointError: ``workdir`` has checkpoints and none restores.
    metrics.Diverged: a non-finite loss or gradient norm (no checkpoint of it is written).
    CheckpointWriteError: a checkpoint could not be written (earlier ones intact).
  """
  log = metrics_lib.log
  if stop_at_step is not None and stop_at_step < 1:
    raise errors.ConfigError(f"stop_at_step must be >= 1, got {stop_at_step}.")

  # --- 1. Mesh and config checks: fail before anything is compiled -------------------------
  config = hf_init_lib.resolve_hf_init(config, log=log)  # model fields from init.hf_dir
  config = stages_lib.resolve(config)  # explicit stages; total_steps = their sum
  config, warmup_line = val_lib.clamp_warmup(config)  # a run shorter than its warmup
  if warmup_line:
    log(warmup_line)
  config = resolve_layout(config, jax.device_count())  # "auto": every reader sees the name
  sizes = val_lib.validate_config(config, jax.device_count())  # and each stage's
  if buckets_lib.lengths_of(config) and jax.process_count() > 1:
    raise errors.ConfigError("data.length_buckets run in one process (every process would "
                             "have to fill the same bucket first); drop the buckets.")
  mesh = mesh_lib.make_mesh(config.mesh)
  ring_size = shd.ring_size(sizes)  # sequence_outer x sequence: the layouts span both
  first = stages_lib.plan(config)[0].config  # attention="auto" is decided per stage's shapes
  model_cfg, attention_line = val_lib.resolve_attention(first, val_lib.llama_config(first), mesh)
  log(f"devices: {jax.device_count()} x {jax.devices()[0].device_kind} "
      f"({jax.process_count()} process(es)); mesh {sizes}; attention={model_cfg.attention} "
      f"layout={model_cfg.layout} ring={ring_size}"
      + (f" (two-level: {sizes['sequence_outer']} groups of {sizes['sequence']})"
         if sizes["sequence_outer"] > 1 else ""))
  if attention_line:
    log(attention_line)
  if sizes["pipeline"] > 1:
    micro = pipeline_lib.resolve_microbatches(
        model_cfg.pipeline_microbatches, config.batch_size // config.microbatches,
        sizes["pipeline"], sizes["data"])
    log(f"pipeline: {sizes['pipeline']} stages x {model_cfg.num_layers // sizes['pipeline']} "
        f"layers, GPipe over {micro} microbatches, bubble fraction "
        f"{pipeline_lib.bubble_fraction(sizes['pipeline'], micro):.3f}")

  # Installed early: a signal during compilation still ends in a clean stop after one step.
  stop = StopRequest().install()
  try:
    return _train(config, workdir, stop_at_step, stop, mesh, ring_size)
  finally:
    stop.uninstall()


def compile_only(config, topology: str | None = None, slices: int = 1) -> list[dict]:
  """Builds and compiles each stage's train step (:func:`build_stage`, the run's) for the
  attached devices or for ``slices`` slices of TPU ``topology`` (compile-only devices,
  :mod:`ring_jax.topology`), from abstract values only; logs per device the memory against
  the chip's HBM, the compile seconds, the hop kernel and the overlap summary, and returns
  one row per stage (:func:`training.compile_only.memory_lines`' dict, with ``seq_len`` and
  ``overlap``, the summary's lines).

  Raises:
    ConfigError: before anything compiles: an unknown topology, libtpu missing or not the
      one jax pins, a mesh that does not fit the chips, a kernel that cannot compile there,
      or any check :func:`train` makes.
    training.compile_only.CompileFailed: the compiler refused the step (one line).
  """
  log = metrics_lib.log
  where = compile_lib.target(topology, slices)
  config = hf_init_lib.resolve_hf_init(config)
  config = stages_lib.resolve(config)
  compile_lib.check_config(config, where)  # the mesh on the chips, the kernel's platform
  compile_lib.check_libtpu(where)
  where = where.resolve()
  config = resolve_layout(config, where.chips)
  sizes = val_lib.validate_config(config, where.chips)
  mesh = mesh_lib.make_mesh(config.mesh, where.devices)
  log(f"compile only, for {where.label} ({where.devices[0].device_kind}): mesh {sizes}"
      + (f"; libtpu {ring_jax.topology.check_libtpu()}" if where.name else ""))
  rows = []
  with jax.set_mesh(mesh):
    for stage in stages_lib.plan(config):
      setup = build_stage(stage, mesh)
      c = stage.config
      if stage.index == 0:
        _, line = val_lib.resolve_attention(c, val_lib.llama_config(c), mesh)
        if line:
          log(line)
      m = setup.model_cfg
      log(f"{stage.describe() + ': ' if len(stages_lib.plan(config)) > 1 else ''}train step of "
          f"{m.num_params() / 1e6:,.2f}M params, batch {setup.train_shape[0]} x "
          f"{setup.train_shape[1]} tokens, attention={m.attention} layout={m.layout} "
          f"remat_policy={m.remat_policy}")
      t0 = time.perf_counter()
      with compile_lib.compiling(where):
        compiled = setup.train_step.compile(setup.train_shape)
      lines, row = compile_lib.memory_lines(compiled, where, time.perf_counter() - t0)
      for line in lines:
        log(line)
      buckets = buckets_lib.plan(c, m, mesh)
      if buckets:  # every bucket's program, as the run compiles them
        log(buckets_lib.describe(buckets))
        with compile_lib.compiling(where):
          count = len(buckets_lib.compile_steps(setup.train_step, buckets[:-1], c.microbatches))
        log(buckets_lib.compiled_count_line(count + 1))
      if m.attention != "dense":
        log(ring_jax.kernels.describe(m.hop_kernel, platform=where.platform))
        log(attn_lib.describe_routing(m, mesh))
      overlap = compile_lib.overlap_lines(compiled)
      for line in overlap:
        log(line)
      rows.append(dict(row, seq_len=c.data.seq_len, overlap=overlap))
  return rows


def resolve_layout(config, num_devices: int):
  """``config`` with ``model.layout="auto"`` decided for its data on the ring its mesh makes
  of ``num_devices`` devices (:func:`training.validation.resolve_config`), the decision
  logged in one line; a named layout: ``config`` unchanged. :func:`main` resolves it before
  :func:`train`, which saves the resolved config (:func:`save_run_config`, so config.json names
  the layout that ran); :func:`train` resolves again for callers that skip main (a no-op on a
  resolved config).

  Raises:
    ConfigError: ``config.mesh`` does not fit ``num_devices`` devices.
  """
  if config.model.layout != val_lib.AUTO_LAYOUT:
    return config
  sizes = mesh_lib.mesh_shape(config.mesh, num_devices)
  config, line = val_lib.resolve_config(config, shd.ring_size(sizes))
  metrics_lib.log(line)
  return config


@dataclasses.dataclass
class StageSetup:
  """What one stage (training/stages.py) builds: its step, schedule and batch shapes."""
  stage: stages_lib.Stage
  model_cfg: Any
  train_step: step_lib.TrainStep
  schedule: Any  # learning rate at the stage's update count (0 at its first step)
  train_shape: tuple[int, int]
  eval_shape: tuple[int, int]


def build_stage(stage: stages_lib.Stage, mesh) -> StageSetup:
  """The train step of ``stage``: its model (RoPE) and an optimizer whose warmup + cosine
  schedule spans the stage's steps, its batches ``[rows, run length]``
  (:func:`training.validation.run_length`: ``data.seq_len`` padded to what the ring splits;
  logged when it pads). Abstract only; parameter shapes are the same in every stage, so any
  stage's step restores a checkpoint of any other."""
  c = stage.config
  model_cfg, attention_line = val_lib.resolve_attention(c, val_lib.llama_config(c), mesh)
  if attention_line and stage.index > 0:  # train() logs the first stage's
    metrics_lib.log(attention_line)
  ring = shd.ring_size(mesh.shape)
  padding_line = val_lib.padding_line(model_cfg, ring, c.data.seq_len)
  if padding_line:
    metrics_lib.log(padding_line)
  run_len = val_lib.run_length(model_cfg, ring, c.data.seq_len)  # data.seq_len, padded
  train_step = _train_step(model_cfg, mesh, c.optim, stage.steps, c.microbatches, c.seed)
  return StageSetup(stage=stage, model_cfg=model_cfg, train_step=train_step,
                    schedule=step_lib.make_schedule(c.optim, stage.steps),
                    train_shape=(c.batch_size, run_len),
                    eval_shape=(c.eval_batch_size, run_len))


# The train steps of the last few (model, mesh, optimizer) triples this process built. A
# second train() of the same setup in one process (a resumed run in a notebook, the next stage
# of a schedule seen before, a sweep over data) reuses the jitted step, so JAX's caches hand
# back its compiled program instead of compiling it again.
_TRAIN_STEPS: collections.OrderedDict = collections.OrderedDict()
_TRAIN_STEPS_KEPT = 4


def _train_step(model_cfg, mesh, optim, steps: int, microbatches: int,
                seed: int) -> step_lib.TrainStep:
  """``build_train_step`` with an optimizer over ``steps``, or the same one built before:
  the key holds everything the step's program depends on (the model config and mesh are
  hashable values; the optimizer by its settings)."""
  key = (model_cfg, mesh, optim.to_json(), steps, microbatches, seed)
  if key in _TRAIN_STEPS:
    _TRAIN_STEPS.move_to_end(key)
    return _TRAIN_STEPS[key]
  tx = step_lib.make_optimizer(optim, steps)
  built = step_lib.build_train_step(model_cfg, mesh, tx, microbatches=microbatches, seed=seed)
  _TRAIN_STEPS[key] = built
  while len(_TRAIN_STEPS) > _TRAIN_STEPS_KEPT:
    _TRAIN_STEPS.popitem(last=False)
  return built


def _train(config, workdir, stop_at_step, stop, mesh, ring_size) -> TrainResult:
  """Sections 2-6 of :func:`train` under ``mesh``: the first stage's step, then resume or
  initialise, then each stage that is left (its step, data, compiled program and loop),
  then the final checkpoint. Every exit path closes the checkpointer and the writers, but
  one: a collective that lost a peer process's connection (main() then ends the process with
  the lost-peer line), where closing would wait on the dead peer's save barrier."""
  stages = stages_lib.plan(config)  # one stage unless config.stages is set
  with jax.set_mesh(mesh):
    # --- 2. Model and optimizer: the step and its state's shapes and shardings -------------
    # Built from abstract values, as benchmarks/fit.py builds it to plan context lengths.
    setup = build_stage(stages[0], mesh)
    metrics_lib.log(f"model: {setup.model_cfg.num_params() / 1e6:.2f}M params, "
                    f"{setup.model_cfg.flops_per_token(config.data.seq_len) / 1e6:.2f} "
                    f"MFLOP/token at {config.data.seq_len} tokens (train, with attention)")
    run = _Run(config, workdir, mesh, ring_size, stop)  # opens the checkpointer
    try:
      run.resume(setup, stop_at_step)  # 3. from the newest checkpoint, or initialised
      for stage in stages:
        if stage.end <= run.step or run.step >= run.end_step or run.stopped_by is not None:
          continue  # done before this call, or this call stops before it
        run.enter_stage(stage, multistage=len(stages) > 1)  # its step, 4. data, 5. compile
        run.run_stage(stage)  # 6. the loop: step, log, eval, checkpoint
      run.finish()  # the final checkpoint
    except BaseException as e:
      if distributed_lib.collective_lost_peer(e) is None:
        run.abort()
      raise
    finally:
      run.close_writers()
  return run.result()


class _Run:
  """One :func:`train` call's state, shared by its sections: where the run stands (step,
  parameters, optimizer state, the stage's step and data) and what it writes to (the
  checkpointer, metric writers, profile).

  Sections, in order: :meth:`resume` (3), then per stage :meth:`enter_stage` (its step,
  4: data, 5: compile) and :meth:`run_stage` (6: the loop), then :meth:`finish`.
  """

  def __init__(self, config, workdir: str, mesh, ring_size: int, stop: StopRequest):
    self.config = config  # the whole run's: intervals, total_steps
    self.stage_config = config  # the running stage's (its learning rate for the message)
    self.workdir, self.mesh, self.ring_size, self.stop = workdir, mesh, ring_size, stop
    self.checkpointer = ckpt_lib.Checkpointer(workdir, every=config.checkpoint_every,
                                              keep=config.keep_checkpoints,
                                              async_save=config.async_checkpointing)
    # Orbax runs background threads from here on: every exit path closes the checkpointer.
    self.writer = None
    self.profile = metrics_lib.Profile(val_lib.profile_steps(config),
                                       os.path.join(workdir, "profile"))
    self.evals: list[dict[str, float]] = []
    self.stopped_by: str | None = None
    self.setup: StageSetup | None = None
    self.train_iter = None

  def resume(self, setup: StageSetup, stop_at_step: int | None) -> None:
    """--- 3. Resume or initialise: the newest checkpoint that restores, else a fresh (or ``init.hf_dir``) state; the
    step this call ends at; the MFU line; the metric writers, which continue the run's."""
    config, log = self.config, metrics_lib.log
    self.setup = setup
    try:
      self.start_step, self.params, self.opt_state, self.data_state = resume_or_init(
          self.checkpointer, setup.train_step, hf_init_lib.hf_init_dir(config))
    except ckpt_lib.NoRestorableCheckpointError as e:
      raise ckpt_lib.NoRestorableCheckpointError(
          f"{e} {saved_config_hint(config, self.workdir)}") from None
    if self.start_step:  # a config that differs from the saved one, yet restores
      loading_lib.warn_model_differences(config, self.workdir, log)
    save_run_config(config, self.workdir)  # now that the checkpoint restored under it
    self.step = self.start_step
    self.end_step = config.total_steps if stop_at_step is None else min(stop_at_step,
                                                                        config.total_steps)
    self.peak_flops, peak_source = metrics_lib.peak_flops_per_device(config)
    log(f"MFU counted against {self.peak_flops:.3g} FLOP/s per device: {peak_source}")
    self.writer = metrics_lib.MetricWriter(self.workdir, resume_step=self.start_step)
    self.progress = metrics_lib.Progress(self.end_step, self.start_step)
    self.step_metrics = metrics_lib.StepMetrics(
        explain=lambda row: divergence_message(self.stage_config, row, self.checkpointer))
    self.batch_sharding = batch_lib.sharding(self.mesh)

  def enter_stage(self, stage: stages_lib.Stage, multistage: bool) -> None:
    """The stage's train step (fresh AdamW state when the stage starts now), its data
    pipelines (resumed inside the stage from the checkpoint's iterator state) and its
    step compiled ahead of time, with the lines saying so."""
    log, c = metrics_lib.log, stage.config
    self.stage_config = c
    if self.setup.stage is not stage:
      self.setup = build_stage(stage, self.mesh)
    if multistage:
      log(stage.describe())
    if stage.index > 0 and self.step == stage.start:
      # A new stage: fresh AdamW moments and update count (training/stages.py says why).
      self.opt_state = step_lib.init_opt_state(self.setup.train_step.tx, self.params,
                                               self.setup.train_step.opt_shardings)

    # --- 4. Data: this process's rows, in the ring's layout, sharded (data, sequence) -------
    # With data.length_buckets: whole batches per bucket, each on its own re-split mesh.
    self.buckets = buckets_lib.plan(c, self.setup.model_cfg, self.mesh)
    if self.buckets:
      log(buckets_lib.describe(self.buckets))
      self.train_iter = buckets_lib.BucketedBatches(data_lib.text_documents(c, "train"),
                                                    self.buckets, c.model.layout)
    else:
      self.train_iter = data_lib.make_iterator(
          data_lib.make_dataset(c, self.batch_sharding, self.ring_size, split="train"))
    if self.data_state is not None and self.step > stage.start:  # the checkpoint's stage
      self.train_iter.set_state(self.data_state)
    self.data_state = None
    self.eval_dataset = data_lib.make_dataset(c, self.batch_sharding, self.ring_size,
                                              split="eval")

    # --- 5. Compile ahead of time (clean step timings; memory report) ------------------------
    t0 = time.perf_counter()
    self.compiled_step = self.setup.train_step.compile(self.setup.train_shape, self.params,
                                                       self.opt_state)
    if self.buckets:  # one program per bucket (the full ring's is compiled_step's own)
      self.bucket_steps = buckets_lib.compile_steps(
          self.setup.train_step, self.buckets[:-1], c.microbatches, self.params,
          self.opt_state) + [self.compiled_step]
      log(buckets_lib.compiled_count_line(len(self.bucket_steps)))
    self.eval_step = self.setup.train_step.eval_step()
    memory = self.compiled_step.memory_analysis()
    log(f"compiled train step in {time.perf_counter() - t0:.1f}s"
        + (f"; per-device temp {memory.temp_size_in_bytes / 2**20:.1f} MiB, arguments "
           f"{memory.argument_size_in_bytes / 2**20:.1f} MiB" if memory is not None else ""))
    if self.setup.model_cfg.attention != "dense":  # what "auto" chose, and its self-check
      log(ring_jax.kernels.describe(self.setup.model_cfg.hop_kernel))
      log(attn_lib.describe_routing(self.setup.model_cfg, self.mesh))

  def run_stage(self, stage: stages_lib.Stage) -> None:
    """--- 6. The loop: the stage's steps up to its end (or this call's), each one run,
    logged on the interval, evaluated and checkpointed; ends after the step in which a
    stop request (a signal) is agreed on."""
    c = stage.config
    throughput = metrics_lib.Throughput(
        tokens_per_step=c.batch_size * c.data.seq_len,
        flops_per_token=self.setup.model_cfg.flops_per_token(c.data.seq_len),
        peak_flops=self.peak_flops, num_devices=jax.device_count())
    stage_end = min(stage.end, self.end_step)
    for step in range(self.step + 1, stage_end + 1):
      self.step = step
      self._step(step, throughput)
      stopping = self.stop.reached(step)  # Exactly once per step, on every process.
      logged = step % self.config.log_every == 0 or step == stage_end or stopping
      if logged:
        window = self.step_metrics.window(step)  # Blocks on this step: times are real.
        window.update(throughput.window(),
                      learning_rate=float(self.setup.schedule(step - 1 - stage.start)))
        window.update(data_lib.bad_record_counts(self.train_iter.get_state()))  # text: skipped
        self.writer.write(step, window, prefix="train/")
        self.progress.log(step, window)
      if stopping:
        self.stopped_by = self.stop.received
        return
      self._evaluate_and_save(stage, step)
      if logged:
        throughput.reset()  # Exclude eval/checkpoint time from the next window.

  def _step(self, step: int, throughput) -> None:
    """One train step on the next batch; its metrics are fetched one step behind, so the
    device keeps a step queued, and a failed background save stops the run here."""
    distributed_lib.note_step(step)  # For the line if a peer process dies.
    with self.profile.step(step) as outputs:
      compiled, sharding, shape = self.compiled_step, self.batch_sharding, self.setup.train_shape
      local = next(self.train_iter)
      if self.buckets:  # (bucket, batch): that bucket's program, batch split and shape
        index, local = local
        bucket = self.buckets[index]
        compiled, sharding, shape = self.bucket_steps[index], bucket.sharding, bucket.shape
      batch = data_lib.to_global(local, sharding, shape)
      self.params, self.opt_state, metrics = compiled(self.params, self.opt_state, batch)
      outputs.append(metrics)
    throughput.tick()
    self.step_metrics.add(step, metrics)
    self.checkpointer.check_for_errors()  # A failed background save stops the run here.
    self.step_metrics.fetch(step - 1)  # One step behind: the device keeps a step queued.

  def _evaluate_and_save(self, stage: stages_lib.Stage, step: int) -> None:
    """The eval on its interval and at each stage's end; the checkpoint on its interval,
    and at each stage's last step but the run's (the next stage starts from it)."""
    c = stage.config
    if step % self.config.eval_every == 0 or step == stage.end:  # also each stage's end
      result = evaluate(self.eval_step, self.params, self.eval_dataset, c,
                        self.batch_sharding, self.setup.eval_shape)
      self.evals.append(dict(step=step, **result))
      self.writer.write(step, result, prefix="eval/")
      metrics_lib.log(f"eval @ {step}: " + " | ".join(f"{k} {v:.4f}" for k, v in result.items()))
    save(c, self.checkpointer, self.step_metrics, step, self.params, self.opt_state,
         self.train_iter, force=step == stage.end and step != self.config.total_steps)

  def finish(self) -> None:
    """The final checkpoint (also when stopped early), then the wait for async writes."""
    self.step_metrics.fetch(self.step)
    if self.step > self.start_step and self.checkpointer.last_saved != self.step:
      save(self.stage_config, self.checkpointer, self.step_metrics, self.step, self.params,
           self.opt_state, self.train_iter, force=True)
    self.checkpointer.close()

  def abort(self) -> None:
    """On any exception: lets good in-flight saves land; their errors are secondary."""
    try:
      self.checkpointer.close()
    except Exception:
      pass

  def close_writers(self) -> None:
    """The profile and the metric writers, on every exit path."""
    self.profile.close()
    if self.writer is not None:
      self.writer.close()

  def result(self) -> TrainResult:
    return TrainResult(history=self.step_metrics.history, evals=self.evals, params=self.params,
                       opt_state=self.opt_state, step=self.step, mesh=self.mesh,
                       stopped_by=self.stopped_by, checkpoint_dir=self.checkpointer.directory)


def resume_or_init(checkpointer, train_step, hf_dir: str = ""):
  """``(step, params, opt_state, data_state)`` of the newest checkpoint that restores (onto
  the step's shardings), else step 0 with a fresh state and no data state: the weights of
  ``hf_dir`` (``config.init.hf_dir``) if given, else initialised from the step's seed."""
  restored = checkpointer.restore_latest(train_step.abstract_params,
                                         train_step.abstract_opt_state, warn=metrics_lib.log)
  if restored is not None:
    metrics_lib.log(f"resumed from step {restored[0]} in {checkpointer.directory}")
    return restored
  if not hf_dir:
    return (0, *train_step.init_state(), None)
  from models import convert_hf
  t0 = time.perf_counter()
  with jax.set_mesh(train_step.mesh):
    params = convert_hf.load_hf_params(hf_dir, train_step.model_cfg,
                                       shardings=train_step.param_shardings)
    opt_state = step_lib.init_opt_state(train_step.tx, params, train_step.opt_shardings)
  metrics_lib.log(f"initialised from {hf_dir} in {time.perf_counter() - t0:.1f}s")
  return 0, params, opt_state, None


def save_run_config(config, workdir: str) -> None:
  """Writes ``config`` to the run's ``config.json`` (:func:`training.loading.run_config_path`;
  on process 0, replacing the file in one rename). Called once the workdir's checkpoint has
  restored under ``config`` (or there was none), so a run that cannot resume leaves the
  config its checkpoints were written under as it was (export_hf.py, generate.py and
  evaluate.py read it)."""
  if jax.process_index() != 0:
    return
  path = loading_lib.run_config_path(workdir)
  os.makedirs(workdir, exist_ok=True)
  with open(path + ".tmp", "w") as f:
    f.write(config.to_json_best_effort(indent=2))
  os.replace(path + ".tmp", path)


def saved_config_hint(config, workdir: str) -> str:
  """The end of the error of a run whose workdir holds no checkpoint that restores: the
  saved config the checkpoints were written under, what differs, and how to rerun with it."""
  path = loading_lib.run_config_path(workdir)
  diffs = loading_lib.model_differences(config, workdir)
  if not diffs:
    return f"This run wrote nothing into {workdir}."
  scalar = (bool, int, float, str)
  flags = " ".join(f"--config.model.{name}={saved}" for name, saved, _ in diffs
                   if isinstance(saved, scalar))
  return (f"The checkpoints were written under the config saved in {path}, which differs in "
          + ", ".join(f"model.{name} ({saved!r} there, {value!r} here)"
                      for name, saved, value in diffs)
          + ": rerunning with the saved values resumes"
          + (f" (e.g. add {flags})" if flags else "")
          + f". This run wrote nothing into {workdir}.")


def save(config, checkpointer, step_metrics, step: int, params, opt_state, train_iter, *,
         force: bool = False) -> None:
  """Checkpoints ``step`` if it is on the interval (or ``force``), never a diverged state.

  Raises:
    Diverged: the step's metrics, or the state itself, are non-finite (nothing written).
  """
  if force or step % config.checkpoint_every == 0:
    step_metrics.fetch(step)  # Never save the state of a diverged step.
  try:
    checkpointer.save(step, params, opt_state, train_iter.get_state(), force=force)
  except ckpt_lib.NonFiniteStateError:  # Finite metrics, non-finite state: still diverged.
    raise metrics_lib.Diverged(divergence_message(config, step_metrics.last_row, checkpointer,
                                                  state=True)) from None


def divergence_message(config, row, checkpointer, state=False) -> str:
  """What diverged, what was kept, and which settings to change."""
  what = ("the parameters or optimizer state became non-finite" if state else
          f"loss {row['loss']:.4g}, grad_norm {row['grad_norm']:.4g}")
  last_saved = checkpointer.last_saved
  kept = (f"the newest checkpoint is step {last_saved} in {checkpointer.directory}; rerunning "
          f"resumes from it" if last_saved else "no checkpoint was written; rerunning starts "
          "afresh")
  o = config.optim
  return (f"training diverged at step {row['step']} ({what}). No checkpoint of a diverged "
          f"state is written; {kept}. Lower --config.optim.lr (now {o.lr:g}), tighten "
          f"--config.optim.grad_clip (now {o.grad_clip:g}) or lengthen "
          f"--config.optim.warmup_steps (now {o.warmup_steps}).")


def evaluate(eval_step, params, dataset, config, sharding, shape) -> dict[str, float]:
  """Loss / perplexity / accuracy over the first ``config.eval_batches`` held-out batches.

  For the kv task the loss mask covers only answer tokens, so the accuracy is
  the retrieval accuracy (``retrieval_accuracy``, next to ``chance_accuracy``);
  for text it is next-byte ``accuracy``.
  """
  iterator = data_lib.make_iterator(dataset, prefetch=0)  # Fresh: same batches every eval.
  totals = {"loss_sum": 0.0, "tokens": 0.0, "correct": 0.0}
  for _ in range(config.eval_batches):
    out = jax.device_get(eval_step(params, data_lib.to_global(next(iterator), sharding, shape)))
    for k in totals:
      totals[k] += float(out[k])
  tokens = max(totals["tokens"], 1.0)
  loss = totals["loss_sum"] / tokens
  result = dict(loss=loss, perplexity=float(np.exp(min(loss, 50.0))),
                accuracy=totals["correct"] / tokens)
  if config.data.kind == "kv_retrieval":  # The loss mask covers exactly the answers.
    result["retrieval_accuracy"] = result.pop("accuracy")
    result["chance_accuracy"] = data_lib.KVRetrievalTask.from_config(config.data).chance_accuracy
  return result


# ----------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------


def _fail(status: int, message: str) -> None:
  print(message, file=sys.stderr, flush=True)
  sys.exit(status)


def _drop_orbax_tracebacks(record) -> bool:
  """Logging filter: keep Orbax's error lines, drop the tracebacks attached to them."""
  if record.exc_info and f"{os.sep}orbax{os.sep}" in record.pathname:
    record.exc_info, record.exc_text = None, None
  return True


def _drop_closed_loop_callbacks(unraisable) -> None:
  """``sys.unraisablehook``: drops the leftovers of a failed Orbax read
  (:func:`training.checkpoint.is_failed_read_leftover`), passes others on; ``-v`` shows
  them too."""
  if not ckpt_lib.is_failed_read_leftover(unraisable):
    sys.__unraisablehook__(unraisable)


def _config_path(argv) -> str | None:
  for i, arg in enumerate(argv):
    if arg.startswith("--config="):
      return arg.split("=", 1)[1]
    if arg == "--config" and i + 1 < len(argv):
      return argv[i + 1]
  return None


def _unknown_field(argv, name: str) -> str:
  """The dotted path, as the command line wrote it, of the unknown config field ``name``."""
  for arg in argv:
    if arg.startswith("--config."):
      parts = arg[len("--config."):].split("=", 1)[0].split(".")
      if name in parts:
        return ".".join(parts[:parts.index(name) + 1])
  return name


def parse_flags(argv: list[str]) -> list[str]:
  """absl flag parsing that reports a bad flag or config in one line, exit status 2."""
  argv = list(argv)
  if _config_path(argv) is None:  # The default, before any --config.* override.
    argv[1:1] = ["--config", _DEFAULT_CONFIG]
    sys.argv[:] = argv  # ml_collections reads its overrides from sys.argv.
  path = _config_path(argv).split(":", 1)[0]
  if not os.path.isfile(path):
    _fail(EXIT_USAGE, f"config error: --config file {path!r} does not exist; pass a config "
                      "file such as configs/tiny.py.")
  try:
    return flags.FLAGS(argv)
  except Exception as e:  # absl flag errors, and whatever the config file or an override raised
    if isinstance(e, AttributeError) and e.args and isinstance(e.args[0], KeyError):
      e = e.args[0]  # ml_collections: an unknown field below the top (--config.data.seqlen)
    text = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
    lines = [l.strip() for l in text.strip().splitlines() if l.strip()]
    if isinstance(e, KeyError) and lines:  # ConfigDict: "'modell'\nDid you mean ...?"
      field = _unknown_field(argv, lines[0].strip("'"))
      lines[0] = f"the config has no field {field!r}."
    # Tracebacks embedded in the message (ml_collections does that): keep the last line.
    message = lines[-1] if any(l.startswith("Traceback") for l in lines) else " ".join(lines)
    _fail(EXIT_USAGE, f"config error: {message} (see --helpfull for the flags; config fields "
                      "are listed in configs/common.py)")


def main(argv) -> None:
  if len(argv) > 1:
    _fail(EXIT_USAGE, f"config error: unexpected arguments {argv[1:]}; flags are written "
                      "--name=value.")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # Orbax logs every save step at INFO.
    # A failed background save makes Orbax log a traceback from each of its threads; the
    # run reports the failure itself in one line (CheckpointWriteError). -v shows them.
    logging.get_absl_logger().addFilter(_drop_orbax_tracebacks)
    sys.unraisablehook = _drop_closed_loop_callbacks
  try:
    config = _CONFIG.value
    # Gin is only another syntax for the same ConfigDict fields (applied after --config.*).
    config = flags_lib.apply_gin(config, _GIN_FILE.value, _GIN_PARAM.value)
    # Resolved before train() saves it: the workdir's config.json names the model's real shape.
    config = hf_init_lib.resolve_hf_init(config)
    config = stages_lib.resolve(config)  # config.stages explicit; top level = the last stage
    val_lib.validate_distributed(config)  # Needed before the processes connect.
    if (_TOPOLOGY.value or _TOPOLOGY_SLICES.present) and not _COMPILE_ONLY.value:
      raise errors.ConfigError("--topology names devices that are not attached: it needs "
                               "--compile_only.")
  except Exception as e:  # ConfigError, or gin's parser on bad syntax (SyntaxError, ...)
    prefix = "" if isinstance(e, errors.ConfigError) else f"gin: {type(e).__name__}: "
    _fail(EXIT_USAGE, f"config error: {prefix}{' '.join(str(e).split())}")
  if _COMPILE_ONLY.value:
    if not _TOPOLOGY.value:
      mesh_lib.simulate_cpu_devices(config)
    try:
      compile_only(config, _TOPOLOGY.value, _TOPOLOGY_SLICES.value)
    except errors.ConfigError as e:
      _fail(EXIT_USAGE, f"config error: {e}")
    except compile_lib.CompileFailed as e:  # e.g. a kernel's VMEM: the step cannot run there
      _fail(EXIT_COMPILE_FAILED, f"error: {e}")
    return
  num_processes = initialize_distributed(_DISTRIBUTED.value, config.distributed)
  mesh_lib.simulate_cpu_devices(config, num_processes)
  workdir = _WORKDIR.value or os.path.join(
      "runs", os.path.splitext(os.path.basename(config_flags.get_config_filename(
          flags.FLAGS["config"])))[0])
  distributed_lib.start_watchdog(  # A no-op on one process.
      config.distributed, ckpt_lib.checkpoint_directory(workdir),
      shlex.join(_resume_command()), steps=ckpt_lib.complete_steps)
  try:  # Resolved before train() saves it: config.json names the layout the run trains in.
    config = resolve_layout(config, jax.device_count())
  except errors.ConfigError as e:
    _fail(EXIT_USAGE, f"config error: {e}")
  t0 = time.perf_counter()
  try:
    result = train(config, workdir, stop_at_step=_STOP_AT_STEP.value)
  except errors.ConfigError as e:
    _fail(EXIT_USAGE, f"config error: {e}")
  except ckpt_lib.NoRestorableCheckpointError as e:
    _fail(EXIT_USAGE, f"error: {e}")
  except data_lib.DataError as e:  # a bad record with data.strict=True, or an empty shard
    _fail(EXIT_USAGE, f"data error: {e}")
  except metrics_lib.Diverged as e:
    _fail(EXIT_DIVERGED, f"error: {e}")
  except ckpt_lib.CheckpointWriteError as e:
    distributed_lib.exit_if_peer_lost(e)  # A dead peer can fail a save: report that instead,
    distributed_lib.wait_for_verdict()  # whether a collective or the watchdog found it.
    _fail(EXIT_CHECKPOINT_WRITE, f"error: {e}")
  except Exception as e:
    # On several processes a dead peer surfaces here first, as a collective's error (gloo:
    # "Connection reset by peer", from a step's metrics or a save): its line and 75 at once.
    # Any other error waits for the watchdog's verdict before its traceback.
    distributed_lib.exit_if_peer_lost(e)
    distributed_lib.wait_for_verdict()
    raise
  distributed_lib.finish()  # A clean end: the other processes stop expecting this one.
  if jax.process_index() != 0:
    return
  wall = f"wall {time.perf_counter() - t0:.1f}s"
  if result.stopped_by is not None:
    print(f"stopped by {result.stopped_by} after step {result.step}; checkpoint saved in "
          f"{result.checkpoint_dir}. Resume with: {shlex.join(_resume_command())}",
          flush=True)
    return
  if not result.history:
    print(f"done: nothing to do, the checkpoint in {result.checkpoint_dir} is already at step "
          f"{result.step} (total_steps or --stop_at_step); {wall}", flush=True)
    return
  final_eval = result.evals[-1] if result.evals else {}
  print(f"done: step {result.step}, train loss {result.history[0]['loss']:.4f} -> "
        f"{result.history[-1]['loss']:.4f}"
        + (", final eval " + ", ".join(f"{k} {v:.4f}" for k, v in final_eval.items()
                                       if k != "step") if final_eval else "")
        + f", {wall}", flush=True)


def _resume_command() -> list[str]:
  """This process's command line: running it again resumes."""
  return ["python", *_ORIGINAL_ARGV]


_ORIGINAL_ARGV = list(sys.argv)

if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
