"""Test setup: 8 fake CPU devices.

Must run before JAX initialises a backend, hence the environment variable and
config update at import time of the conftest.
"""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
  os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()


