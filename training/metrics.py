"""Throughput/MFU accounting (model FLOP/s from ``LlamaConfig.flops_per_token``, attention
included, forward + backward, over :func:`peak_flops_per_device`), metric sinks (TensorBoard,
JSONL, console), the one-step-behind step metrics with their divergence check, the profile
of ``config.profile_steps``, the eval."""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import sys
import time
from typing import Any, Callable

import jax
import numpy as np

from ring_jax import hardware


def peak_flops_per_device(config, device=None) -> tuple[float, str]:
  """(peak FLOP/s per device, where the number came from) for MFU: the config's, the nominal
  CPU figure on CPU, else :mod:`ring_jax.hardware`'s (dense bf16, by ``device_kind``)."""
  device = device or jax.devices()[0]
  if config.get("peak_flops_per_device"):
    return float(config.peak_flops_per_device), "config.peak_flops_per_device"
  if device.platform == "cpu":
    return float(config.cpu_peak_flops_per_device), (
        "nominal CPU peak (config.cpu_peak_flops_per_device), not a hardware figure")
  spec = hardware.device_spec(device.device_kind)
  if spec is not None:
    return spec.peak_bf16_flops, f"table entry {spec.match!r} (dense bf16; {spec.source})"
  raise ValueError(
      f"no peak FLOP/s known for device kind {device.device_kind!r}; set "
      "--config.peak_flops_per_device=<dense bf16 FLOP/s per device>.")


class Throughput:
  """Tokens/s, step time and MFU over the window since the last log (the caller blocks on
  the step's outputs first, so the time includes the device's work)."""

  def __init__(self, *, tokens_per_step: int, flops_per_token: float, peak_flops: float,
               num_devices: int):
    self.tokens_per_step, self.flops_per_token = tokens_per_step, flops_per_token
    self.peak_total = peak_flops * num_devices
    self.reset()

  def reset(self) -> None:
    self._t0, self._steps = time.perf_counter(), 0

  def tick(self) -> None:
    self._steps += 1

  def window(self) -> dict[str, float]:
    step_time = (time.perf_counter() - self._t0) / max(self._steps, 1)
    tokens_per_s = self.tokens_per_step / step_time
    out = dict(step_time_s=step_time, tokens_per_s=tokens_per_s,
               mfu=tokens_per_s * self.flops_per_token / self.peak_total)
    self.reset()
    return out


def _summary_writer():
  """tensorboardX's ``SummaryWriter``, imported without its optional ``import torch``
  (scalars need none)."""
  blocked = "torch" not in sys.modules
  if blocked:
    sys.modules["torch"] = None  # `import torch` raises ImportError while tensorboardX loads
  try:
    from tensorboardX import SummaryWriter
  finally:
    if blocked:
      del sys.modules["torch"]
  return SummaryWriter


_WRITERS = itertools.count()  # one event file per MetricWriter of a process


class MetricWriter:
  """TensorBoard event files (tensorboardX's ``SummaryWriter``, a new file per writer) +
  ``metrics.jsonl`` in the workdir, written by process 0 and on disk when :meth:`write`
  returns; one curve per workdir: a run resumed from ``resume_step`` drops the JSONL rows past
  it and purges TensorBoard's events from ``resume_step + 1`` on (``purge_step``)."""

  def __init__(self, workdir: str, *, resume_step: int = 0, enabled: bool | None = None):
    self.enabled = jax.process_index() == 0 if enabled is None else enabled
    if self.enabled:
      os.makedirs(workdir, exist_ok=True)
      path = os.path.join(workdir, "metrics.jsonl")
      dropped = truncate_jsonl(path, resume_step)
      self._tb = _summary_writer()(
          os.path.join(workdir, "tensorboard"), purge_step=resume_step + 1 if dropped else None,
          filename_suffix=f".{os.getpid()}.{next(_WRITERS)}")
      self._tb.flush()
      self._jsonl = open(path, "a")  # Rows carry their step; a resumed run appends.

  def write(self, step: int, metrics: dict[str, Any], prefix: str = "") -> None:
    if not self.enabled:
      return
    scalars = {f"{prefix}{k}": float(v) for k, v in metrics.items()}
    for tag, value in scalars.items():
      self._tb.add_scalar(tag, value, step)
    self._tb.flush()
    self._jsonl.write(json.dumps({"step": step, **scalars}) + "\n")
    self._jsonl.flush()

  def close(self) -> None:
    if self.enabled:
      self._tb.close()
      self._jsonl.close()


def truncate_jsonl(path: str, last_step: int) -> int:
  """Drops the rows of ``path`` past ``last_step`` and those that do not parse
  (:func:`replace_file`); returns how many."""
  if not os.path.exists(path):
    return 0
  with open(path) as f:
    lines = f.read().splitlines()
  kept = []
  for line in lines:
    try:
      row = json.loads(line)
    except json.JSONDecodeError:
      continue
    if isinstance(row, dict) and row.get("step", 0) <= last_step:
      kept.append(line)
  if len(kept) == len(lines):
    return 0
  replace_file(path, "".join(l + "\n" for l in kept))
  return len(lines) - len(kept)


def replace_file(path: str, text: str) -> None:
  """Writes ``text`` to ``path`` through ``path.tmp`` and one rename (never half a file)."""
  with open(path + ".tmp", "w") as f:
    f.write(text)
  os.replace(path + ".tmp", path)


class Progress:
  """One console line per log step with ETA (process 0 only)."""

  def __init__(self, total_steps: int, start_step: int):
    self.total, self.start = total_steps, start_step
    self._t0 = time.perf_counter()

  def log(self, step: int, m: dict[str, float]) -> None:
    eta = (time.perf_counter() - self._t0) / max(step - self.start, 1) * (self.total - step)
    h, rem = divmod(max(0, int(eta)), 3600)
    eta_text = f"{h}h{rem // 60:02d}m{rem % 60:02d}s" if h else f"{rem // 60}m{rem % 60:02d}s"
    log(f"step {step:>6}/{self.total} | loss {m['loss']:.4f} | acc {m['accuracy']:.3f} | "
        f"lr {m['learning_rate']:.2e} | gnorm {m['grad_norm']:.3f} | "
        f"{m['tokens_per_s']:,.0f} tok/s | {m['step_time_s'] * 1e3:.0f} ms/step | "
        f"MFU {100 * m['mfu']:.2f}% | ETA {eta_text}")


def log(message: str | None) -> None:
  """Console message from process 0 only; None: none."""
  if message is not None and jax.process_index() == 0:
    print(message, flush=True)


class Diverged(RuntimeError):
  """A step produced a non-finite loss or gradient norm; the run stops without saving it."""


class StepMetrics:
  """The train step's metrics, fetched one step behind (``fetch(step - 1)`` after dispatching
  ``step`` keeps one step queued on the device); a non-finite ``loss`` or ``grad_norm``
  raises :class:`Diverged` with ``explain(row)``. ``history``: every fetched row."""

  WINDOW_KEYS = ("loss", "accuracy", "grad_norm")

  def __init__(self, explain: Callable[[dict[str, float]], str]):
    self._explain = explain
    self._pending: list[tuple[int, Any]] = []  # (step, metrics still on the device)
    self.history: list[dict[str, float]] = []
    self._window_start = 0  # the first row of history in the next window

  def add(self, step: int, metrics) -> None:
    """Queues the (on-device, not yet fetched) metrics of ``step``."""
    self._pending.append((step, metrics))

  def fetch(self, upto: int) -> None:
    """Fetches the metrics of the queued steps ``<= upto``; raises Diverged on a bad one."""
    while self._pending and self._pending[0][0] <= upto:
      step, metrics = self._pending.pop(0)
      row = dict(step=step, **{k: float(v) for k, v in jax.device_get(metrics).items()})
      self.history.append(row)
      if not (math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"])):
        raise Diverged(self._explain(row))

  def window(self, step: int) -> dict[str, float]:
    """Means of :data:`WINDOW_KEYS` over the steps since the last window, up to ``step``
    (fetched first: this blocks until ``step`` is done, so window times are real)."""
    self.fetch(step)
    rows, self._window_start = self.history[self._window_start:], len(self.history)
    return {k: float(np.mean([r[k] for r in rows])) for k in self.WINDOW_KEYS}


class Profile:
  """A ``jax.profiler`` trace of the train steps in ``steps`` (a ``range``; None: off) into
  ``logdir``: :meth:`step` wraps each step in a ``StepTraceAnnotation``; the trace stops once
  the range's last step's outputs are ready, or at :meth:`close`."""

  def __init__(self, steps: range | None, logdir: str):
    self.steps, self.logdir = steps, logdir
    self._tracing = False

  @contextlib.contextmanager
  def step(self, step: int):
    """Context of one train step; yields a list the caller appends the step's outputs to."""
    traced = self.steps is not None and step in self.steps
    if traced and not self._tracing:
      jax.profiler.start_trace(self.logdir)
      self._tracing = True
      log(f"profiling steps {self.steps.start} to {self.steps.stop - 1} into {self.logdir}")
    outputs: list = []
    with jax.profiler.StepTraceAnnotation("train", step_num=step):
      yield outputs
    if traced and step == self.steps.stop - 1:
      jax.block_until_ready(outputs)
      self.close()

  def close(self) -> None:
    """Stops a trace still running (the loop ended inside the range) and writes it."""
    if self._tracing:
      self._tracing = False
      jax.profiler.stop_trace()
      log(f"wrote the profile to {self.logdir} (tensorboard --logdir {self.logdir})")


def evaluate(eval_step, params, dataset, config, sharding, shape) -> dict[str, float]:
  """Loss / perplexity / accuracy over the first ``config.eval_batches`` held-out batches
  (kv task: ``retrieval_accuracy``, the mask covers the answers, and ``chance_accuracy``)."""
  from training import data as data_lib  # Local: Grain only where a run evaluates.

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
