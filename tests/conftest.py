"""Test setup: 8 fake CPU devices, compiled without LLVM's optimisation passes.

Must run before JAX initialises a backend, hence the environment variables set
at import time of the conftest (before anything imports jax).

Most of the suite's time is XLA:CPU compiling many small programs. The tests
compile at LLVM -O0 (``--xla_backend_optimization_level=0``, as one builds unit
tests in debug mode): the same HLO programs, passes and buffer assignment
(memory figures are unchanged), but machine code that is slower to run and much
faster to produce (about -30% of the suite's time). Set ``XLA_FLAGS`` with your
own ``--xla_backend_optimization_level`` to test optimised code. The ``train.py``
subprocesses some tests start compile as users get it (their environment drops
``XLA_FLAGS``).

JAX's persistent compilation cache is deliberately not used: with jax 0.10.2
on CPU, the train step of ``train.py`` loaded from it computed different
values and then aborted (found while trying it for CI time).
"""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
  flags += " --xla_force_host_platform_device_count=8"
if "xla_backend_optimization_level" not in flags:
  flags += " --xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = flags.strip()
