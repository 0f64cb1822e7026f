"""``hop_kernel="auto"``: the platform's maintained fused kernel, once it has checked itself
on the device.

A fused kernel that compiles is not yet a kernel that is right on this device, this jax
and this dtype (the fused kernels here have passed their conformance suite in interpret
mode; a Mosaic or Triton miscompile would still give wrong attention without an error).
So before ``auto`` hands a fused kernel to a ring, :func:`verdict` runs one small hop,
forward and backward, with that kernel and with the XLA kernel on the device, in the
dtype and with the features the call uses (a causal offset, packed segments with padding,
grouped heads), and compares them. The verdict is cached per (platform, kernel, dtype,
features) for the process: the check runs once. On a mismatch or any error it says so in
one warning (kernel, reason, how to force it) and ``auto`` runs the XLA kernel.

Several processes (``jax.distributed``) must compile the same program, so they take the
verdict together: the kernel is used only if it passed on every process.

The check runs eagerly even when ``ring_attention`` is being traced inside the user's
``jit`` / ``shard_map``: it runs in a short-lived thread of its own (JAX's trace state and
context managers such as ``jax.set_mesh`` are per thread), on its own small concrete
arrays on one device of the platform. (``jax.ensure_compile_time_eval`` is not enough:
inside it splash's index maps capture constants and fail to trace.)
"""

from __future__ import annotations

import dataclasses
import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from ring_jax import hop

# max |kernel - xla| / max |xla| allowed per output (out, lse, dq, dk, dv). Matmuls at the
# platform's default precision (bf16 passes for float32 on TPU) differ between two correct
# kernels by ~1e-2 of the largest value; a wrong mask, scale or lse is off by O(1).
TOLERANCE = {"float32": 2e-2, "bfloat16": 5e-2}

# The check's hop: one batch row, two query blocks against two key blocks of 128 (the TPU
# tile), the queries 128 positions after the keys (a causal diagonal at an offset: blocks
# fully visible, partly masked and skipped), K/V heads 2, head dim 128.
_BLOCK, _HEADS, _HEAD_DIM = 128, 2, 128


@dataclasses.dataclass(frozen=True)
class Verdict:
  """A fused kernel's self-check result: ``ok``, and if not, why (one line); ``skipped``:
  not run because no device of the platform is attached (a compile-only process, e.g.
  for a TPU topology, :mod:`ring_jax.topology`), where the kernel is taken as it would be
  on the device and nothing runs."""
  kernel: str
  platform: str
  dtype: str
  ok: bool
  reason: str = ""
  skipped: bool = False


_VERDICTS: dict[tuple, Verdict] = {}


def verdicts() -> tuple[Verdict, ...]:
  """Every self-check verdict this process reached, in order."""
  return tuple(_VERDICTS.values())


def reset() -> None:
  """Forgets the cached verdicts (tests; a process that changed devices)."""
  _VERDICTS.clear()


def verdict(name: str, kernel, platform: str, dtype, *, is_causal: bool, segments: bool,
            grouped: bool) -> Verdict:
  """The cached self-check of ``kernel`` (registered as ``name``) on ``platform`` for this
  dtype and these features; runs it the first time (module docstring)."""
  dtype = jnp.dtype(dtype).name
  key = (platform, name, dtype, bool(is_causal), bool(segments), bool(grouped))
  if key in _VERDICTS:
    return _VERDICTS[key]
  if platform != jax.default_backend():  # compiling for devices that are not attached
    _VERDICTS[key] = Verdict(kernel=name, platform=platform, dtype=dtype, ok=True,
                             skipped=True)
    return _VERDICTS[key]
  try:
    reason = _in_own_thread(_compare, kernel, platform, dtype, bool(is_causal), bool(segments),
                            bool(grouped))
  except Exception as e:  # noqa: BLE001
    # any failure (lowering, compile, run) means "not this kernel"
    reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
  reason = _agree(reason)
  result = Verdict(kernel=name, platform=platform, dtype=dtype, ok=not reason, reason=reason)
  _VERDICTS[key] = result
  if not result.ok:
    warnings.warn(
        f"hop_kernel='auto': {name!r} failed its self-check on {platform} ({dtype}): {reason}; "
        f"running the 'xla' hop kernel instead (hop_kernel={name!r} forces it, "
        "hop_kernel='xla' chooses XLA without a check).", RuntimeWarning, stacklevel=2)
  return result


def _in_own_thread(fn, *args):
  """``fn(*args)`` in a fresh thread (no enclosing trace); its exception is re-raised here."""
  result: dict = {}

  def target():
    try:
      result["value"] = fn(*args)
    except BaseException as e:  # noqa: BLE001 - handed to the caller
      result["error"] = e

  thread = threading.Thread(target=target, name="ring_jax-hop-kernel-self-check")
  thread.start()
  thread.join()
  if "error" in result:
    raise result["error"]
  return result["value"]


def _agree(reason: str) -> str:
  """The verdict of every process of a multi-process run: passed only if it passed on each."""
  if jax.process_count() == 1:
    return reason
  from jax.experimental import multihost_utils
  failed = np.asarray(_in_own_thread(multihost_utils.process_allgather,
                                     np.int32(bool(reason)))).reshape(-1)
  if not failed.any():
    return ""
  return reason or f"failed on process(es) {np.nonzero(failed)[0].tolist()}"


def _inputs(dtype: str, is_causal: bool, segments: bool, grouped: bool):
  rng = np.random.default_rng(0)
  t = s = 2 * _BLOCK
  groups = 2 if grouped else 1
  f = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
  q, k, v = f(1, t, _HEADS, groups, _HEAD_DIM), f(1, s, _HEADS, _HEAD_DIM), f(1, s, _HEADS,
                                                                             _HEAD_DIM)
  do, dlse = f(1, t, _HEADS, groups, _HEAD_DIM), f(1, t, _HEADS, groups)
  spec = hop.HopSpec(scale=_HEAD_DIM ** -0.5, is_causal=is_causal, window=None,
                     block_q=_BLOCK, block_kv=_BLOCK)
  q_pos, kv_pos = np.arange(t, dtype=np.int32) + _BLOCK, np.arange(s, dtype=np.int32)
  q_seg = kv_seg = None
  if segments:  # two documents and trailing padding, ids as the data pipeline makes them
    q_seg = np.concatenate([np.full(100, 1), np.full(120, 2), np.zeros(t - 220)])[None]
    kv_seg = np.concatenate([np.full(60, 1), np.full(150, 2), np.zeros(s - 210)])[None]
    q_seg, kv_seg = q_seg.astype(np.int32), kv_seg.astype(np.int32)
  cast = lambda x: x.astype(jnp.dtype(dtype))  # noqa: E731
  return spec, (cast(q), cast(k), cast(v), cast(do), dlse, q_pos, kv_pos, q_seg, kv_seg)


def _compare(kernel, platform: str, dtype: str, is_causal: bool, segments: bool,
             grouped: bool) -> str:
  """"" if ``kernel`` matches the XLA kernel on one hop (forward and backward) on a device of
  ``platform``, else what differs."""
  from ring_jax.kernels.xla import XlaHopKernel

  spec, args = _inputs(dtype, is_causal, segments, grouped)
  args = jax.device_put(args, jax.devices(platform)[0])
  q, k = args[0], args[1]
  kernel.check(q.shape, k.shape, q.dtype, spec)

  def run(kern, q, k, v, do, dlse, q_pos, kv_pos, q_seg, kv_seg):
    masks = hop.HopMasks.build(spec, q_pos, kv_pos, q_seg, kv_seg)
    out, lse = kern.forward(q, k, v, masks, spec)
    # The backward takes a ring's final out/lse: this hop's own (a ring of one).
    res = hop.HopResiduals(out.astype(q.dtype), hop.lse_for_backward(lse), do,
                           jnp.where(jnp.isfinite(lse), dlse, 0.0))
    grads = kern.backward(q, k, v, masks, spec, res, hop.zero_grads(q, k, v))
    return (out, lse, *grads)

  got = jax.device_get(jax.jit(run, static_argnums=0)(kernel, *args))
  want = jax.device_get(jax.jit(run, static_argnums=0)(XlaHopKernel(), *args))
  tol = TOLERANCE.get(dtype, TOLERANCE["float32"])
  problems = []
  for what, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
    g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
    if not np.array_equal(np.isneginf(g), np.isneginf(w)):
      problems.append(f"{what}: rows without a visible key differ")
      continue
    finite = np.isfinite(w)
    if not np.isfinite(g[finite]).all():
      problems.append(f"{what}: non-finite where the XLA kernel is finite")
      continue
    err = np.abs(g[finite] - w[finite]).max(initial=0.0)
    scale = max(np.abs(w[finite]).max(initial=0.0), 1.0 if what == "lse" else 1e-30)
    if err > tol * scale:
      problems.append(f"{what}: max error {err / scale:.3g} of its largest value > {tol:g}")
  return "; ".join(problems)
