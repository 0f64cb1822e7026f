"""Per-device hardware figures, one table: compute, memory and interconnect by device kind.

Used for MFU by ``training/metrics.py`` and the benchmarks (``peak_bf16_flops``)
and by the cost model :func:`ring_jax.plan` (everything). Entries are matched
against ``jax.Device.device_kind`` by case-insensitive substring, in table
order (the first match wins, so more specific names come first, e.g.
``"H100 PCIe"`` before ``"H100"``); :func:`lookup` also accepts the
marketing name (``"TPU v5e"``, ``"H200"``) and ``"cpu"``.

Figures are nominal vendor numbers per chip (TPU) or per GPU: dense (no
structured sparsity) bf16 tensor-core / MXU peak, HBM capacity and bandwidth,
and the inter-chip links: ``link_bandwidth`` is one link in ONE direction
(vendors quote bidirectional totals per chip; we halve them and divide by the
number of links), ``links`` the links (TPU ICI ports, NVLinks) per device.
``topology`` says how a collective uses them (see :mod:`ring_jax.plan`):
``"torus"`` (TPU ICI: a mesh axis is a ring of neighbours), ``"switch"``
(NVLink through NVSwitch: every GPU of a node reaches every other at the full
NVLink bandwidth), ``"host"`` (fake CPU devices: copies in host memory).
``fast_domain`` is how many devices share those links (a TPU slice, an
8-GPU node); beyond it traffic goes over ``network_bandwidth`` per device (data
center network / InfiniBand, one direction). These are the two link levels
:func:`ring_jax.plan` gives a pair of sequence axes ``(outer, inner)`` (the
two-level ring, :mod:`ring_jax.two_level`): the inner axis on the links, the
outer one on the network once the devices span more than ``fast_domain``
(``plan(fast_domain=)`` sets it to a TPU slice of a multislice job: the v5p
pod's 8,960 chips share ICI, but one slice is at most 6,144 chips, and
multislice jobs talk over DCN, 50 Gb/s per chip; H100/H200 nodes: NVLink inside,
one 400 Gb/s InfiniBand NDR NIC per GPU between). A ``None`` field is not known;
:func:`ring_jax.plan` then asks for the figure explicitly. Each entry names its
sources. Pure Python: no JAX or Flax import.
"""

from __future__ import annotations

import dataclasses

GB = 1e9
GIB = 2 ** 30


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
  """What is known about one kind of device.

  Attributes:
    match: case-insensitive substring of ``device.device_kind``.
    peak_bf16_flops: dense bf16 peak FLOP/s of one device (chip or GPU).
    source: where the numbers come from (vendor data sheet or docs page).
    name: the usual (marketing) name, e.g. ``"TPU v5e"``; also accepted by :func:`lookup`.
    memory_bytes: HBM (device memory) capacity in bytes.
    hbm_bandwidth: HBM bandwidth in bytes/s.
    link_bandwidth: one inter-chip link (ICI port / NVLink), one direction, bytes/s.
    links: inter-chip links per device.
    topology: ``"torus"``, ``"switch"`` or ``"host"`` (see the module docstring).
    fast_domain: devices connected by those links (TPU slice / pod, GPU node).
    network_bandwidth: per device, one direction, bytes/s, beyond the fast domain.
  """
  match: str
  peak_bf16_flops: float
  source: str
  name: str = ""
  memory_bytes: float | None = None
  hbm_bandwidth: float | None = None
  link_bandwidth: float | None = None
  links: int | None = None
  topology: str | None = None
  fast_domain: int | None = None
  network_bandwidth: float | None = None

  @property
  def label(self) -> str:
    return self.name or self.match

  @property
  def platform(self) -> str | None:
    """The JAX platform of this kind of device: ``"cpu"``, ``"tpu"`` or ``"gpu"`` (None for
    figures given by hand, ``match="custom"``)."""
    if self.match in ("cpu", "custom"):
      return None if self.match == "custom" else "cpu"
    return "tpu" if self.match.lower().startswith("tpu") else "gpu"


_GCP = "Google Cloud TPU docs (cloud.google.com/tpu/docs/"
_NV = "NVIDIA data sheet"

DEVICES: tuple[DeviceSpec, ...] = (
    DeviceSpec(
        "TPU v6 lite", 918e12, name="TPU v6e", memory_bytes=32 * GB, hbm_bandwidth=1638 * GB,
        link_bandwidth=100 * GB, links=4, topology="torus", fast_domain=256,
        network_bandwidth=None,
        source=_GCP + "v6e): 918 TFLOP/s bf16, 32 GB HBM at 1638 GB/s, 800 GB/s bidirectional "
        "ICI per chip over 4 ports (100 GB/s per port and direction), 2D torus, 256-chip pod"),
    DeviceSpec(
        "TPU v5 lite", 197e12, name="TPU v5e", memory_bytes=16 * GB, hbm_bandwidth=819 * GB,
        link_bandwidth=50 * GB, links=4, topology="torus", fast_domain=256,
        network_bandwidth=25e9 / 8,
        source=_GCP + "v5e): 197 TFLOP/s bf16, 16 GB HBM2 at 819 GB/s, 400 GB/s bidirectional "
        "ICI per chip over 4 ports (50 GB/s per port and direction), 2D torus, 256-chip pod, "
        "2 x 100 Gbps NIC per 8-chip host (25 Gb/s per chip)"),
    DeviceSpec(
        "TPU v5p", 459e12, name="TPU v5p", memory_bytes=95 * GIB, hbm_bandwidth=2765 * GB,
        link_bandwidth=100 * GB, links=6, topology="torus", fast_domain=8960,
        network_bandwidth=50e9 / 8,
        source=_GCP + "v5p): 459 TFLOP/s bf16, 95 GiB HBM2e at 2765 GB/s, 1200 GB/s "
        "bidirectional ICI per chip over 6 links of the 3D torus (100 GB/s per link and "
        "direction), 8960-chip pod, 50 Gbps DCN per chip"),
    # Some runtimes report a v5p chip as plain "TPU v5".
    DeviceSpec(
        "TPU v5", 459e12, name="TPU v5p (as 'TPU v5')", memory_bytes=95 * GIB,
        hbm_bandwidth=2765 * GB, link_bandwidth=100 * GB, links=6, topology="torus",
        fast_domain=8960, network_bandwidth=50e9 / 8,
        source=_GCP + "v5p): as 'TPU v5p'"),
    DeviceSpec(
        "TPU v4", 275e12, name="TPU v4", memory_bytes=32 * GIB, hbm_bandwidth=1200 * GB,
        link_bandwidth=45 * GB, links=6, topology="torus", fast_domain=4096,
        network_bandwidth=None,
        source=_GCP + "v4): 275 TFLOP/s bf16, 32 GiB HBM2 at 1200 GB/s, 4096-chip pod, 3D "
        "torus with 6 ICI links per chip (Jouppi et al., 'TPU v4', ISCA 2023); 45 GB/s per "
        "link and direction is the figure docs/performance.md assumes"),
    DeviceSpec("TPU v3", 123e12, "Google Cloud TPU v3 docs: 123 TFLOP/s bf16", name="TPU v3"),
    DeviceSpec("GB200", 2.5e15,
               "NVIDIA GB200 NVL72 data sheet: 5 PFLOP/s bf16 per GPU with sparsity, half dense"),
    DeviceSpec("B200", 2.25e15,
               "NVIDIA HGX B200 data sheet: 4.5 PFLOP/s bf16 per GPU with sparsity, half dense"),
    DeviceSpec(
        "H200", 989e12, name="H200", memory_bytes=141 * GB, hbm_bandwidth=4.8e12,
        link_bandwidth=25 * GB, links=18, topology="switch", fast_domain=8,
        network_bandwidth=50 * GB,
        source=_NV + " (H200 SXM): 1979 TFLOP/s bf16 with sparsity (989 dense), 141 GB HBM3e "
        "at 4.8 TB/s, NVLink 900 GB/s bidirectional over 18 links (25 GB/s per link and "
        "direction) through NVSwitch in an 8-GPU HGX node; 400 Gb/s InfiniBand NIC per GPU "
        "(DGX H200)"),
    DeviceSpec("H100 PCIe", 756e12, name="H100 PCIe", memory_bytes=80 * GB,
               hbm_bandwidth=2.0e12,
               source=_NV + " (H100 PCIe): 1513 TFLOP/s bf16 with sparsity, half dense; 80 GB "
               "HBM2e at 2 TB/s"),
    DeviceSpec(
        "H100", 989e12, name="H100", memory_bytes=80 * GB, hbm_bandwidth=3.35e12,
        link_bandwidth=25 * GB, links=18, topology="switch", fast_domain=8,
        network_bandwidth=50 * GB,
        source=_NV + " (H100 SXM): 1979 TFLOP/s bf16 with sparsity (989 dense), 80 GB HBM3 at "
        "3.35 TB/s, NVLink 900 GB/s bidirectional over 18 links through NVSwitch in an 8-GPU "
        "node; 400 Gb/s InfiniBand NIC per GPU (DGX H100)"),
    DeviceSpec(
        "A100", 312e12, name="A100", memory_bytes=80 * GB, hbm_bandwidth=2.039e12,
        link_bandwidth=25 * GB, links=12, topology="switch", fast_domain=8,
        network_bandwidth=25 * GB,
        source=_NV + " (A100 SXM 80GB): 312 TFLOP/s bf16 dense, 80 GB HBM2e at 2039 GB/s, "
        "NVLink 600 GB/s bidirectional over 12 links through NVSwitch in an 8-GPU node; "
        "200 Gb/s InfiniBand NIC per GPU (DGX A100)"),
    DeviceSpec("L4", 121e12,
               "NVIDIA L4 data sheet: 242 TFLOP/s bf16 with sparsity, half dense", name="L4"),
)

#: Fake CPU devices (``--xla_force_host_platform_device_count``), for :func:`ring_jax.plan`
#: only: nominal figures of this project's 2-core CI machine shared by 8 fake devices, not a
#: hardware spec; deliberately not in :data:`DEVICES`, so :func:`peak_flops` gives None.
CPU = DeviceSpec(
    "cpu", 25e9, name="CPU (fake device)", memory_bytes=4 * GIB, hbm_bandwidth=2.5 * GB,
    link_bandwidth=2.5 * GB, links=1, topology="host", fast_domain=1 << 30,
    network_bandwidth=2.5 * GB,
    source="nominal: ~200 GFLOP/s f32 matmul and ~20 GB/s memory copy, measured on this "
    "project's 2-core CI machine, split over 8 fake devices (configs/common.py's "
    "cpu_peak_flops_per_device)")


def device_spec(device_kind: str) -> DeviceSpec | None:
  """The first table entry whose ``match`` is a substring of ``device_kind``, or None."""
  kind = device_kind.lower()
  for spec in DEVICES:
    if spec.match.lower() in kind:
      return spec
  return None


def lookup(device_kind: str) -> DeviceSpec | None:
  """:func:`device_spec`, or the entry whose ``name`` is ``device_kind``, or :data:`CPU`.

  Accepts ``jax.Device.device_kind`` strings (``"NVIDIA H200"``, ``"TPU v5
  lite"``) and the names of the table (``"TPU v5e"``, ``"H200"``).
  """
  kind = device_kind.strip().lower()
  for spec in DEVICES:
    if spec.name and spec.name.lower() == kind:
      return spec
  spec = device_spec(device_kind)
  if spec is None and "cpu" in kind:
    return CPU
  return spec


def peak_flops(device_kind: str) -> float | None:
  """Dense bf16 peak FLOP/s of one device of ``device_kind``; None if the table lacks it.

  ``device_kind`` is ``jax.devices()[0].device_kind`` (e.g. ``"NVIDIA H200"``,
  ``"TPU v5 lite"``). A CPU is never in the table: it has no meaningful peak.
  """
  spec = device_spec(device_kind)
  return None if spec is None else spec.peak_bf16_flops
