"""Throughput/MFU accounting and metric sinks (TensorBoard, JSONL, console).

MFU = model FLOPs per second actually achieved / peak FLOPs per second of the
devices. Model FLOPs come from ``LlamaConfig.flops_per_token(seq_len)``, which
counts the attention score/value matmuls (causal: half of ``L^2``) as well as
the dense weights, forward + backward. Peak FLOP/s per device come from
:mod:`ring_jax.hardware` (dense bf16 tensor-core/MXU peak from vendor data
sheets, matched by ``device.device_kind``) unless ``config.peak_flops_per_device`` is
set. A CPU has no meaningful table entry: MFU is then reported against the
configurable nominal ``config.cpu_peak_flops_per_device`` and labelled as such.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import jax

from ring_jax import hardware


def peak_flops_per_device(config, device=None) -> tuple[float, str]:
  """(peak FLOP/s per device, where the number came from) for MFU."""
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


def format_duration(seconds: float) -> str:
  seconds = max(0, int(seconds))
  h, rem = divmod(seconds, 3600)
  m, s = divmod(rem, 60)
  return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


class Throughput:
  """Tokens/s, step time and MFU over the window since the last log.

  The caller blocks on the step's outputs before :meth:`window`, so the wall
  time includes device execution, not just async dispatch.
  """

  def __init__(self, *, tokens_per_step: int, flops_per_token: float, peak_flops: float,
               num_devices: int):
    self.tokens_per_step = tokens_per_step
    self.flops_per_token = flops_per_token
    self.peak_total = peak_flops * num_devices
    self._t0 = time.perf_counter()
    self._steps = 0

  def reset(self) -> None:
    self._t0, self._steps = time.perf_counter(), 0

  def tick(self) -> None:
    self._steps += 1

  def window(self) -> dict[str, float]:
    elapsed = time.perf_counter() - self._t0
    steps = max(self._steps, 1)
    step_time = elapsed / steps
    tokens_per_s = self.tokens_per_step / step_time
    out = dict(step_time_s=step_time, tokens_per_s=tokens_per_s,
               mfu=tokens_per_s * self.flops_per_token / self.peak_total)
    self.reset()
    return out


class MetricWriter:
  """TensorBoard event files + ``metrics.jsonl`` in the workdir; only process 0 writes.

  One curve per workdir: a run resumed from step ``resume_step`` first drops
  the ``metrics.jsonl`` rows past that step (rows of steps the resumed run
  does again, written before the stop), and TensorBoard is told to purge its
  events from ``resume_step + 1`` on (``purge_step``), so neither holds two
  values for one step. A fresh run (``resume_step=0``) in a workdir with old
  rows but no checkpoint starts both afresh the same way.
  """

  def __init__(self, workdir: str, *, resume_step: int = 0, enabled: bool | None = None):
    self.enabled = jax.process_index() == 0 if enabled is None else enabled
    self._tb = None
    self._jsonl = None
    if self.enabled:
      os.makedirs(workdir, exist_ok=True)
      path = os.path.join(workdir, "metrics.jsonl")
      dropped = truncate_jsonl(path, resume_step)
      from tensorboardX import SummaryWriter  # Lazy: only process 0 needs it.
      self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"),
                               purge_step=resume_step + 1 if dropped else None)
      self._jsonl = open(path, "a")  # Rows carry their step; a resumed run appends.

  def write(self, step: int, metrics: dict[str, Any], prefix: str = "") -> None:
    if not self.enabled:
      return
    scalars = {f"{prefix}{k}": float(v) for k, v in metrics.items()}
    for name, value in scalars.items():
      self._tb.add_scalar(name, value, step)
    self._jsonl.write(json.dumps({"step": step, **scalars}) + "\n")
    self._jsonl.flush()

  def close(self) -> None:
    if self.enabled:
      self._tb.close()
      self._jsonl.close()


def truncate_jsonl(path: str, last_step: int) -> int:
  """Drops the rows of ``path`` whose ``step`` is past ``last_step``; returns how many.

  Lines that do not parse (a row cut short by a kill) are dropped too. The
  file is replaced atomically, so a crash here leaves the old file.
  """
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
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    f.write("".join(l + "\n" for l in kept))
  os.replace(tmp, path)
  return len(lines) - len(kept)


class Progress:
  """One console line per log step with ETA (process 0 only)."""

  def __init__(self, total_steps: int, start_step: int, *, enabled: bool | None = None):
    self.total, self.start = total_steps, start_step
    self.enabled = jax.process_index() == 0 if enabled is None else enabled
    self._t0 = time.perf_counter()

  def line(self, step: int, m: dict[str, float]) -> str:
    done = step - self.start
    elapsed = time.perf_counter() - self._t0
    eta = elapsed / max(done, 1) * (self.total - step)
    return (f"step {step:>6}/{self.total} | loss {m['loss']:.4f} | acc {m['accuracy']:.3f} | "
            f"lr {m['learning_rate']:.2e} | gnorm {m['grad_norm']:.3f} | "
            f"{m['tokens_per_s']:,.0f} tok/s | {m['step_time_s'] * 1e3:.0f} ms/step | "
            f"MFU {100 * m['mfu']:.2f}% | ETA {format_duration(eta)}")

  def log(self, step: int, metrics: dict[str, float]) -> None:
    if self.enabled:
      print(self.line(step, metrics), flush=True)


def log(message: str) -> None:
  """Console message from process 0 only."""
  if jax.process_index() == 0:
    print(message, flush=True)
