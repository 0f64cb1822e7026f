"""Test setup: 8 fake CPU devices, compiled without LLVM's optimisation passes.

Must run before JAX initialises a backend, hence the environment variables set
at import time of the conftest (before anything imports jax).

Most of the suite's time is XLA:CPU compiling many small programs. The tests
compile at LLVM -O0 (``--xla_backend_optimization_level=0``, as one builds unit
tests in debug mode): the same HLO programs, passes and buffer assignment
(memory figures are unchanged), but machine code that is slower to run and much
faster to produce (about -30% of the suite's time). Set ``XLA_FLAGS`` with your
own ``--xla_backend_optimization_level`` to test optimised code. The ``train.py`` and
benchmark subprocesses some tests start compile the same way (``tests/train_procs.env``
passes them these flags minus the device count: they size their own devices).

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
}


def pytest_collection_modifyitems(items):
  """Orders whole files (a module's fixtures stay set up once) for pytest-xdist's
  ``--dist worksteal`` with 2 workers: worker 0 starts with the first half of the list,
  worker 1 with the second, and an idle worker steals the end of the other's queue. So
  the slow files, split between the halves by time (longest first), start each half and
  the quick files fill the ends: the run does not end waiting on one long test while the
  other worker idles."""
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
