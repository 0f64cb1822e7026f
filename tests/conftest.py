"""Test setup: 8 fake CPU devices, compiled without LLVM's optimisation passes.

Must run before JAX initialises a backend, hence the environment variables set
at import time of the conftest (before anything imports jax).

Most of the suite's time is XLA:CPU compiling many small programs. The tests
compile at LLVM -O0 (``--xla_backend_optimization_level=0``, as one builds unit
tests in debug mode): the same HLO programs, passes and buffer assignment
(memory figures are unchanged), machine code slower to run and faster to produce. The
XLA:CPU settings in COMPILE_SPEED_FLAGS shorten compiles further where the jaxlib knows
them. Set ``XLA_FLAGS`` with your own ``--xla_backend_optimization_level`` (or any of
those flags) to test other code. The ``train.py`` and
benchmark subprocesses some tests start compile the same way (``tests/train_procs.env``
passes them these flags minus the device count: they size their own devices).

Many programs are compiled more than once in a run: the tiny train step of
``tests/train_procs.py`` by every ``train.py`` subprocess, the same model and ring
programs by both pytest-xdist workers and by tests that build them anew. So the run
shares JAX's persistent compilation cache: a fresh directory per run, made by the
process pytest starts, inherited through the environment by the workers and every
subprocess, removed when the run ends (set ``JAX_COMPILATION_CACHE_DIR`` to keep one
yourself). Fresh per run, no entry outlives the code, flags or jax that made it; an
executable loaded from it is the one the compiler produced (same HLO, same memory
plan: ``memory_analysis`` and ``as_text`` read the same).

Runs of several ``jax.distributed`` processes use a cache directory of their own
(``train_procs.env``): on CPU, JAX's cache key does not tell a 2-process program on 2x4
devices from a 1-process one on 8 (same HLO, same device ids), and
``tests/training/test_multiprocess.py`` runs both of one config, so a shared cache would hand a
2-process ``train.py`` run the 1-process train step. Among themselves the 2-process runs share
theirs as a multi-host job shares one (process 0 writes, every process reads), so a resumed
2-process run loads its step.
"""
import atexit
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import pytest

# XLA:CPU settings that shorten compiles without changing the HLO or its memory plan
# (``memory_analysis`` of a ring's fwd+bwd is byte-equal with and without them), kept only
# where this jaxlib knows them: an XLA flag a jaxlib does not know aborts the process
# ("Unknown flag in XLA_FLAGS"), and these come and go between releases.
COMPILE_SPEED_FLAGS = (
    "--xla_cpu_use_fusion_emitters=false",  # the older elemental emitters (gone from 0.12)
    "--xla_cpu_use_xnnpack=false",  # no XNNPACK fusions to outline and compile
    "--xla_cpu_parallel_codegen_split_count=1",  # 2 shared cores gain nothing from splitting
)


def _known_xla_flags(candidates, env):
  """The ``candidates`` this jaxlib accepts: one child process per flag, in parallel."""
  probe = "import jax; jax.devices()"
  procs = {f: subprocess.Popen([sys.executable, "-c", probe], env={**env, "XLA_FLAGS": f},
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
           for f in candidates}
  return [f for f, p in procs.items() if p.wait() == 0]


os.environ.setdefault("JAX_PLATFORMS", "cpu")
flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
  flags += " --xla_force_host_platform_device_count=8"
if "xla_backend_optimization_level" not in flags:
  flags += " --xla_backend_optimization_level=0"
if "RING_JAX_TESTS_FLAGS_PROBED" not in os.environ:  # the first process of the run: probe
  os.environ["RING_JAX_TESTS_FLAGS_PROBED"] = "1"    # (the xdist workers inherit the result)
  wanted = [f for f in COMPILE_SPEED_FLAGS if f.split("=")[0] not in flags]
  flags += "".join(" " + f for f in _known_xla_flags(wanted, dict(os.environ)))
os.environ["XLA_FLAGS"] = flags.strip()

if "JAX_COMPILATION_CACHE_DIR" not in os.environ:  # the first process of the run: make it
  _cache_dir = tempfile.mkdtemp(prefix="ring_jax_tests_jax_cache_")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache_dir
  atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
# Every program, however fast to compile (JAX's defaults keep only those of >= 1 s).
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
# libtpu (the TPU compiler of the tpu_compiler tests) takes a lock file per process unless
# told that several processes may load it: the xdist workers do (TPU-COMPILE-NOTES).
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

# The tpu_compiler tests compile for TPU topologies with the real TPU compiler (libtpu, the
# [tpu] extra) and no TPU. Without a matching libtpu they are skipped, except where
# REQUIRE_TPU_COMPILER is set (.ci/run's leg 1, which installs the extra): there a missing
# or mismatched libtpu fails them, so CI cannot skip them silently.
REQUIRE_TPU_COMPILER = "RING_JAX_REQUIRE_TPU_COMPILER"


# About how many CPU seconds the slowest files take (user+sys of `pytest -n 0 FILE` on 2
# shared cores, jax 0.10; those of test_convert_hf, test_notebook and test_benchmarks are
# guesses); the files not named here take under ~30 s. Only the order of the tests
# depends on these figures, not which tests run.
SLOW_FILES = {
    "test_pipeline.py": 270, "test_multiprocess.py": 240, "test_train.py": 230,
    "test_fit.py": 175, "test_reliability.py": 130, "test_export_hf.py": 115,
    "test_docs.py": 115, "test_generate.py": 110, "test_convert_hf.py": 50,
    "test_notebook.py": 50, "test_benchmarks.py": 50, "test_stages.py": 40,
    "test_checkpoint.py": 20,
    # with libtpu (leg 1): the TPU compiles of the tpu_compiler tests
    "test_compile_only.py": 90, "test_topology.py": 40,
}


# Leg 2 of .ci/run (Python 3.12, the newest jax on PyPI) runs `pytest -m newest_jax`: the
# tests whose outcome depends on the JAX version. Leg 1 (Python 3.11, jax 0.10) runs every
# test. The layout says which: every test under these folders of tests/ -- the pure-JAX
# library (ring_jax/, the kernels in interpret mode included), the model and its sharding
# (models/), the docs' and the notebook's code (docs/) -- is marked newest_jax here, except
# the tpu_compiler tests (leg 1 has the libtpu that runs them) and a test marked leg1_only,
# which says why next to it. Elsewhere a test joins leg 2 with its own
# @pytest.mark.newest_jax: one end-to-end `python train.py`, the checkpoint round trips, the
# hardware-check script the accelerator image runs. The trainer's scenarios (resume,
# signals, divergence, several processes, stages, fit.py, Hugging Face import/export,
# generation) test our own control flow on top of the same compiled step and the same
# checkpoints; they run on leg 1. A test that needs a newer jax than leg 1's (say tokamax,
# jax >= 0.11) belongs on leg 2 too.
TESTS = pathlib.Path(__file__).resolve().parent
NEWEST_JAX_FOLDERS = ("ring_jax", "models", "docs")


def pytest_configure(config):
  config.addinivalue_line(
      "markers", "newest_jax: what leg 2 of .ci/run runs on the newest jax: every test under "
      f"tests/{{{','.join(NEWEST_JAX_FOLDERS)}}}/, and those marked elsewhere (tests/conftest.py)")
  config.addinivalue_line(
      "markers", "leg1_only: a test of a newest_jax folder that leg 2 of .ci/run leaves out")
  config.addinivalue_line(
      "markers", "tpu_compiler: compiles for a TPU topology with libtpu (the [tpu] extra); "
      f"skipped without it unless {REQUIRE_TPU_COMPILER}=1 (tests/conftest.py)")


def pytest_runtest_setup(item):
  """A tpu_compiler test without a matching libtpu: skipped, or failed where CI requires it."""
  if item.get_closest_marker("tpu_compiler") is None:
    return
  from ring_jax import topology
  try:
    topology.check_libtpu()
  except topology.TopologyError as e:
    if os.environ.get(REQUIRE_TPU_COMPILER) == "1":
      pytest.fail(f"{REQUIRE_TPU_COMPILER}=1 but {e}", pytrace=False)
    pytest.skip(str(e))


def _mark_newest_jax(items):
  """Marks leg 2's selection: the tests under NEWEST_JAX_FOLDERS but for tpu_compiler and
  leg1_only ones. A newest_jax marker inside those folders or a leg1_only one outside them
  says nothing and is an error (the folder decides there, the test elsewhere)."""
  misplaced = []
  for item in items:
    path = item.path.resolve()
    inside = TESTS in path.parents and path.relative_to(TESTS).parts[0] in NEWEST_JAX_FOLDERS
    leg1_only = item.get_closest_marker("leg1_only") is not None
    if inside and item.get_closest_marker("newest_jax") or not inside and leg1_only:
      misplaced.append(item.nodeid)
    elif inside and not leg1_only and item.get_closest_marker("tpu_compiler") is None:
      item.add_marker(pytest.mark.newest_jax)
  if misplaced:
    raise pytest.UsageError(
        f"newest_jax inside tests/{{{','.join(NEWEST_JAX_FOLDERS)}}}/ or leg1_only outside "
        f"them (tests/conftest.py): {misplaced[:5]}")


@pytest.hookimpl(tryfirst=True)  # before -m deselects by the markers set here
def pytest_collection_modifyitems(items):
  """Marks leg 2's selection (NEWEST_JAX_FOLDERS), then orders whole files (a module's
  fixtures stay set up once) for pytest-xdist's ``--dist worksteal`` with 2 workers: worker 0
  starts with the first half of the list, worker 1 with the second, and an idle worker steals
  the end of the other's queue. So the slow files, split between the halves by time (longest
  first), start each half and the quick files fill the ends: the run does not end waiting on
  one long test while the other worker idles."""
  _mark_newest_jax(items)
  by_file: dict[str, list] = {}
  for item in items:
    by_file.setdefault(item.path.name, []).append(item)
  halves, seconds = ([], []), [0, 0]
  for name in sorted((n for n in by_file if n in SLOW_FILES), key=SLOW_FILES.get,
                     reverse=True):
    i = seconds.index(min(seconds))
    halves[i].extend(by_file[name])
    seconds[i] += SLOW_FILES[name]
  quick = [item for name, group in by_file.items() if name not in SLOW_FILES for item in group]
  fill = max(0, len(items) // 2 - len(halves[0]))
  items[:] = halves[0] + quick[:fill] + halves[1] + quick[fill:]

