"""Test setup: 8 fake CPU devices, and one JAX compilation cache for the whole run.

Must run before JAX initialises a backend, hence the environment variables and
config update at import time of the conftest (before anything imports jax).
"""
import importlib.metadata
import os
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
  os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()

# Many tests compile the same programs (the same ring in several test files, the same train
# step in every train.py subprocess), so the run shares JAX's persistent compilation cache:
# both pytest-xdist workers and the subprocesses they start (environment variables are
# inherited). Entries are keyed by the program, the compile options and the jax/jaxlib
# versions, so a stale entry cannot be hit; a cache hit runs the same executable the compiler
# would have produced. Set JAX_COMPILATION_CACHE_DIR to use another directory.
_CACHE_GIB = 2
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _dir = os.path.join(tempfile.gettempdir(), "ring_jax_tests_jax_cache_" +
                      importlib.metadata.version("jax"))
  os.makedirs(_dir, exist_ok=True)
  try:  # keep a long-lived cache (a developer's machine) bounded: drop week-old entries
    _entries = list(os.scandir(_dir))
    if sum(e.stat().st_size for e in _entries) > _CACHE_GIB * 2 ** 30:
      for e in _entries:
        if e.stat().st_mtime < time.time() - 7 * 86400:
          os.remove(e.path)
  except OSError:
    pass
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _dir
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
