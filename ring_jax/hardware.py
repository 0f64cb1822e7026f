"""Per-device hardware figures, one table: dense bf16 peak FLOP/s by device kind.

Used for MFU by ``training/metrics.py`` and the benchmarks. Entries are
matched against ``jax.Device.device_kind`` by case-insensitive substring, in
table order (the first match wins, so more specific names come first, e.g.
``"H100 PCIe"`` before ``"H100"``). Figures are the vendors' dense (no
structured sparsity) bf16 tensor-core / MXU peaks per chip (TPU) or per GPU;
each entry names its source. Pure Python: no JAX or Flax import.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
  """What is known about one kind of device.

  Attributes:
    match: case-insensitive substring of ``device.device_kind``.
    peak_bf16_flops: dense bf16 peak FLOP/s of one device (chip or GPU).
    source: where the number comes from (vendor data sheet or docs page).
  """
  match: str
  peak_bf16_flops: float
  source: str


DEVICES: tuple[DeviceSpec, ...] = (
    DeviceSpec("TPU v6 lite", 918e12, "Google Cloud TPU v6e (Trillium) docs: 918 TFLOP/s bf16"),
    DeviceSpec("TPU v5 lite", 197e12, "Google Cloud TPU v5e docs: 197 TFLOP/s bf16"),
    DeviceSpec("TPU v5p", 459e12, "Google Cloud TPU v5p docs: 459 TFLOP/s bf16"),
    # Some runtimes report a v5p chip as plain "TPU v5".
    DeviceSpec("TPU v5", 459e12, "Google Cloud TPU v5p docs: 459 TFLOP/s bf16"),
    DeviceSpec("TPU v4", 275e12, "Google Cloud TPU v4 docs: 275 TFLOP/s bf16"),
    DeviceSpec("TPU v3", 123e12, "Google Cloud TPU v3 docs: 123 TFLOP/s bf16"),
    DeviceSpec("GB200", 2.5e15,
               "NVIDIA GB200 NVL72 data sheet: 5 PFLOP/s bf16 per GPU with sparsity, half dense"),
    DeviceSpec("B200", 2.25e15,
               "NVIDIA HGX B200 data sheet: 4.5 PFLOP/s bf16 per GPU with sparsity, half dense"),
    DeviceSpec("H200", 989e12,
               "NVIDIA H200 SXM data sheet: 1979 TFLOP/s bf16 with sparsity, half dense"),
    DeviceSpec("H100 PCIe", 756e12,
               "NVIDIA H100 PCIe data sheet: 1513 TFLOP/s bf16 with sparsity, half dense"),
    DeviceSpec("H100", 989e12,
               "NVIDIA H100 SXM data sheet: 1979 TFLOP/s bf16 with sparsity, half dense"),
    DeviceSpec("A100", 312e12, "NVIDIA A100 data sheet: 312 TFLOP/s bf16 dense"),
    DeviceSpec("L4", 121e12,
               "NVIDIA L4 data sheet: 242 TFLOP/s bf16 with sparsity, half dense"),
)


def device_spec(device_kind: str) -> DeviceSpec | None:
  """The first table entry whose ``match`` is a substring of ``device_kind``, or None."""
  kind = device_kind.lower()
  for spec in DEVICES:
    if spec.match.lower() in kind:
      return spec
  return None


def peak_flops(device_kind: str) -> float | None:
  """Dense bf16 peak FLOP/s of one device of ``device_kind``; None if the table lacks it.

  ``device_kind`` is ``jax.devices()[0].device_kind`` (e.g. ``"NVIDIA H200"``,
  ``"TPU v5 lite"``). A CPU is never in the table: it has no meaningful peak.
  """
  spec = device_spec(device_kind)
  return None if spec is None else spec.peak_bf16_flops
