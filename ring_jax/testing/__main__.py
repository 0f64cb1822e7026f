"""``python -m ring_jax.testing MODULE:FUNCTION [--cases ...] [--mesh ...]``: the kit's CLI.

Prints the table of pass / fail / not supported per case and exits 1 if a case failed
(2 for bad arguments). ``MODULE:FUNCTION`` names a function of the calling convention
(see ``ring_jax.testing``), or a HopKernel instance / class / registry name
(``ring_jax.kernels:XlaHopKernel``). The fake CPU devices are set up before JAX starts.
"""

from __future__ import annotations

import os
import sys

_DEVICES = 8


def _fake_devices(count: int) -> None:
  """CPU platform with ``count`` fake devices, set before JAX creates a backend."""
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  flags = os.environ.get("XLA_FLAGS", "")
  if "--xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()


def main(argv=None) -> int:
  import argparse  # noqa: PLC0415
  ap = argparse.ArgumentParser(prog="python -m ring_jax.testing",
                               description=__doc__.split("\n")[0])
  ap.add_argument("function", nargs="?", help="MODULE:FUNCTION (or MODULE:HopKernelClass)")
  ap.add_argument("--cases", help="comma-separated case names (default: all; 'ci': the CI subset)")
  ap.add_argument("--mesh", help="comma-separated ring sizes to run every case at instead of "
                  "its own (e.g. 2,4,8; growth cases keep theirs)")
  ap.add_argument("--local-len", type=int, default=64, help="tokens per device (default 64)")
  ap.add_argument("--features", default="", help="capabilities no keyword announces, "
                  "comma-separated: value_head_dim")
  ap.add_argument("--devices", type=int, default=_DEVICES, help="fake CPU devices (default 8)")
  ap.add_argument("--json", help="also write the report as JSON to this file")
  ap.add_argument("--list", action="store_true", help="list the cases and what each catches")
  args = ap.parse_args(argv)
  _fake_devices(args.devices)

  import importlib  # noqa: PLC0415
  import json  # noqa: PLC0415

  from ring_jax import testing  # noqa: PLC0415
  if args.list:
    for case in testing.CASES.values():
      mark = "*" if case.name in testing.CI_CASES else " "
      print(f"{mark} {case.name:24s} ring {','.join(map(str, case.rings())):4s} {case.catches}")
    print("(* = in CI_CASES)")
    return 0
  if not args.function or ":" not in args.function:
    ap.error("give the function as MODULE:FUNCTION")
  module_name, _, attr = args.function.partition(":")
  sys.path.insert(0, os.getcwd())
  try:
    target = importlib.import_module(module_name)
    for part in attr.split("."):
      target = getattr(target, part)
  except (ImportError, AttributeError) as e:
    ap.error(f"cannot load {args.function}: {e}")
  if isinstance(target, type):  # a HopKernel class
    target = target()
  cases = None
  if args.cases:
    cases = list(testing.CI_CASES) if args.cases == "ci" else args.cases.split(",")
  rings = [int(r) for r in args.mesh.split(",")] if args.mesh else None
  try:
    testing.select(cases)
  except ValueError as e:
    ap.error(str(e))
  report = testing.run(target, cases, rings=rings, local_len=args.local_len,
                       features=[f for f in args.features.split(",") if f],
                       name=args.function,
                       progress=lambda r: print(f"{r.case:24s} ring {r.ring:5s} {r.status}"
                                                f"{': ' + r.message if r.status == 'fail' else ''}",
                                                file=sys.stderr, flush=True))
  print(report.table())
  if args.json:
    with open(args.json, "w") as f:
      json.dump(report.to_dict(), f, indent=1)
  if report.failed:
    print(report.failures(), file=sys.stderr)
  return 0 if report.ok else 1


if __name__ == "__main__":
  sys.exit(main())
