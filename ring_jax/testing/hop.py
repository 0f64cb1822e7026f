"""One hop of a ring_jax ``HopKernel``, called directly, against the float64 oracle.

A ring hides a kernel's per-hop errors behind the merge; here the kernel meets one
(query shard, key/value shard) pair of a ring of 4 (``HOP_SHARDS``: the diagonal, a shard in
the past, one in the future) with the masks the ring would build, and must return that
hop's ``(out_h, lse_h)`` (forward) and add that hop's ``(dq, dk, dv)`` to the accumulators it
is given (backward, from the final out / lse). Positions are the kit's own
(:func:`ring_jax.testing.oracle.layout_permutation`), not the library's.
"""

from __future__ import annotations

import time

import numpy as np

from ring_jax.testing import cases as cases_lib
from ring_jax.testing import oracle
from ring_jax.testing.runner import FAIL, NOT_SUPPORTED, PASS, Report, Row, _first_line, tolerance

#: (query shard, key/value shard) of a ring of 4 met at one hop.
HOP_SHARDS = ((0, 0), (2, 1), (1, 3))
HOP_RING = 4
#: The cases that differ at one hop (ring size, mesh and input order do not reach a hop).
HOP_CASES = ("full", "causal", "causal-zigzag", "zigzag", "causal-striped", "striped",
             "window-short", "window-zigzag", "window-two-sided", "segments-zigzag",
             "segments-striped", "masked-rows", "gqa", "mqa-causal", "t-ne-s", "value-head-dim",
             "soft-cap")


def unsupported(case: cases_lib.Case) -> str:
  """Why one hop cannot run ``case`` (its variant is a ring-level keyword), or ''."""
  if case.sinks is not None:
    return "a ring-level case (sinks apply once to the ring's result, not per hop)"
  if case.growth or case.dtype != "float32" or case.inputs_in_layout:
    return "a ring-level case (growth, dtype or input order)"
  if case.segments == "crossing":
    return "a ring-level case (segments crossing shards)"
  return ""


def run_hop_case(kernel, case: cases_lib.Case | str, shards=(0, 0), *, local_len: int = 256,
                 block: int = 128) -> Row:
  """``kernel``'s forward and backward at one hop of ``case`` -> a :class:`Row` named
  ``<case>@q<i>-kv<j>``."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  from ring_jax.hop import (  # noqa: PLC0415
      HopGrads, HopMasks, HopResiduals, HopSpec, lse_for_backward)

  case = cases_lib.CASES[case] if isinstance(case, str) else case
  qd, kd = shards
  name = f"{case.name}@q{qd}-kv{kd}"
  why = unsupported(case)
  if why:
    return Row(name, "hop", NOT_SUPPORTED, message=why)
  tol = tolerance("float32")
  start = time.perf_counter()
  rng = np.random.default_rng(qd * HOP_RING + kd)
  local_kv = local_len
  local_q = int(round(local_len * case.q_len))
  n, kh = case.heads
  b, h = case.batch, case.head_dim
  hv = case.value_head_dim or h
  normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)
  q, k, v = normal(b, local_q, n, h), normal(b, local_kv, kh, h), normal(b, local_kv, kh, hv)
  do, dlse = normal(b, local_q, n, hv), normal(b, local_q, n)
  layout = case.layout or "contiguous"
  pos = lambda length, d: oracle.layout_permutation(layout, HOP_RING, HOP_RING * length)[
      d * length:(d + 1) * length]
  q_pos, kv_pos = pos(local_q, qd), pos(local_kv, kd)
  q_seg = case.segment_ids(b, local_q, 1, rng)
  # The key shard's ids: the same documents, shifted, so that some are shared.
  kv_seg = None if q_seg is None else np.roll(q_seg, (kd - qd) * 37, axis=1)
  window = case.window_tokens(local_len)
  vis = oracle.visibility(q_pos, kv_pos, case.is_causal, window, q_seg, kv_seg)
  scale = h ** -0.5
  q = q * np.float32(case.input_scale)  # large scores (as the ring cases draw them)
  want = oracle.attention(q, k, v, vis, scale, do, dlse, soft_cap=case.soft_cap)
  spec = HopSpec(scale=scale, is_causal=case.is_causal, window=window, block_q=block,
                 block_kv=block, logits_soft_cap=case.soft_cap,
                 value_head_dim=case.value_head_dim)
  q5 = q.reshape(b, local_q, kh, n // kh, h)
  try:
    kernel.check(q5.shape, k.shape, jnp.float32, spec)
  except ValueError as e:  # the kernel refuses this case, naming why: not a wrong result
    return Row(name, "hop", NOT_SUPPORTED, message=_first_line(e))
  try:
    masks = HopMasks.build(spec, jnp.asarray(q_pos, jnp.int32), jnp.asarray(kv_pos, jnp.int32),
                           None if q_seg is None else jnp.asarray(q_seg),
                           None if kv_seg is None else jnp.asarray(kv_seg))
    out_h, lse_h = jax.jit(kernel.forward, static_argnums=4)(q5, k, v, masks, spec)
    if out_h.dtype != jnp.float32 or lse_h.dtype != jnp.float32:
      raise ValueError(f"forward returned {out_h.dtype} / {lse_h.dtype}, expected float32")
    lse = want["lse"]
    out_final = jnp.asarray(want["out"].reshape(*q5.shape[:-1], hv), jnp.float32)
    lse_final = lse_for_backward(jnp.asarray(lse.reshape(b, local_q, kh, n // kh), jnp.float32))
    dlse5 = jnp.asarray(np.where(np.isfinite(lse), dlse, 0.0).reshape(lse_final.shape),
                        jnp.float32)
    accs = [rng.standard_normal(x.shape).astype(np.float32) for x in (q5, k, v)]
    grads = jax.jit(kernel.backward, static_argnums=4)(
        q5, k, v, masks, spec, HopResiduals(out_final, lse_final, do.reshape(out_final.shape),
                                            dlse5),
        HopGrads(*map(jnp.asarray, accs)))
    if not isinstance(grads, HopGrads):
      raise TypeError(f"backward returned {type(grads).__name__}, expected HopGrads")
    if any(g.dtype != jnp.float32 for g in grads):
      raise ValueError("backward returned non-float32 accumulators")
  except Exception as e:  # noqa: BLE001 -- the case fails with the error; the run goes on
    return Row(name, "hop", FAIL, tol, message=_first_line(e),
               seconds=time.perf_counter() - start)
  from ring_jax.testing.runner import relative_errors  # noqa: PLC0415
  # The accumulators (magnitude ~1) must come back plus this hop's gradients.
  got = dict(out=np.asarray(out_h).reshape(want["out"].shape),
             lse=np.asarray(lse_h).reshape(lse.shape),
             **{name_: (np.asarray(g, np.float64) - acc).reshape(want[name_].shape)
                for name_, g, acc in zip(("dq", "dk", "dv"), grads, accs)})
  errors, note = relative_errors(got, want)
  over = [f"{q_} {e:.2g} > {tol:.2g}" for q_, e in errors.items() if e > tol]
  status = FAIL if over or note else PASS
  return Row(name, "hop", status, tol, errors, "; ".join(filter(None, [note] + over)),
             time.perf_counter() - start)


def run_hop(kernel, cases=None, shards=HOP_SHARDS, *, local_len: int = 256, block: int = 128,
            name: str | None = None) -> Report:
  """:func:`run_hop_case` for each named case (default: ``HOP_CASES``) at each of
  ``shards``."""
  selected = cases_lib.select(HOP_CASES if cases is None else cases)
  rows = [run_hop_case(kernel, c, s, local_len=local_len, block=block)
          for c in selected for s in shards]
  return Report(name or f"HopKernel {getattr(kernel, 'name', type(kernel).__name__)} (one hop)",
                rows)
