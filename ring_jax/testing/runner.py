"""Running the cases: inputs, the call, the comparison with the oracle, the report."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import time
import traceback
import zlib

import numpy as np

from ring_jax.testing import cases as cases_lib
from ring_jax.testing import oracle

#: What each compared quantity is called in reports.
QUANTITIES = ("out", "lse", "dq", "dk", "dv", "dsinks")

PASS, FAIL, NOT_SUPPORTED = "pass", "fail", "not supported"


def tolerance(dtype) -> float:
  """The error a case may show in ``dtype``: ``max(eps(dtype), 2**-16)``.

  The error of a quantity is ``max |got - oracle| / max |oracle|`` (over finite oracle
  entries; lse: over ``max(1, max |lse|)``), so the bound is one unit in the last place at
  the tensor's largest entry for 16-bit types (bfloat16 2**-7, float16 2**-10), and 2**-16
  (~1.5e-5, 128 float32 ulps) for float32, room for the sums over a few thousand keys.
  """
  import jax.numpy as jnp  # noqa: PLC0415
  return max(float(jnp.finfo(jnp.dtype(dtype)).eps), 2.0 ** -16)


@dataclasses.dataclass
class Row:
  """The outcome of one case: status, per-quantity error against the oracle, the bound."""
  case: str
  ring: str
  status: str
  tolerance: float | None = None
  errors: dict = dataclasses.field(default_factory=dict)
  message: str = ""
  seconds: float = 0.0

  def worst(self) -> tuple[str, float] | None:
    if not self.errors:
      return None
    name = max(self.errors, key=lambda k: self.errors[k])
    return name, self.errors[name]


@dataclasses.dataclass
class Report:
  """Rows of one run, in case order. ``ok``: no case failed (not-supported ones do not)."""
  function: str
  rows: list

  @property
  def failed(self) -> list:
    return [r for r in self.rows if r.status == FAIL]

  @property
  def ok(self) -> bool:
    return not self.failed

  def failures(self) -> str:
    """One line per failed case: ``FAIL <case> (ring <n>): <what was wrong>``."""
    return "\n".join(f"FAIL {r.case} (ring {r.ring}): {r.message}" for r in self.failed)

  def table(self) -> str:
    """A plain-text table: case, ring, status, each quantity's error, the bound, the reason."""
    head = (f"{'case':30s} {'ring':>5s} {'status':13s} " +
            " ".join(f"{q:>8s}" for q in QUANTITIES) + f" {'tol':>8s}  message")
    lines = [f"# {self.function}", head]
    for r in self.rows:
      errs = " ".join(f"{r.errors[q]:8.1e}" if q in r.errors else f"{'-':>8s}"
                      for q in QUANTITIES)
      tol = f"{r.tolerance:8.1e}" if r.tolerance else f"{'-':>8s}"
      lines.append(f"{r.case:30s} {r.ring:>5s} {r.status:13s} {errs} {tol}  {r.message}")
    n = {s: sum(r.status == s for r in self.rows) for s in (PASS, FAIL, NOT_SUPPORTED)}
    lines.append(f"{n[PASS]} passed, {n[FAIL]} failed, {n[NOT_SUPPORTED]} not supported")
    return "\n".join(lines)

  def to_dict(self) -> dict:
    return dict(function=self.function, ok=self.ok,
                rows=[dataclasses.asdict(r) for r in self.rows])


# --- The function under test ------------------------------------------------------------------

def accepted_keywords(fn) -> set | None:
  """Keyword names ``fn`` takes, or None when it takes ``**kwargs`` (or has no signature)."""
  try:
    params = inspect.signature(fn).parameters.values()
  except (TypeError, ValueError):
    return None
  if any(p.kind is p.VAR_KEYWORD for p in params):
    return None
  return {p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}


def function_name(fn) -> str:
  base = fn.func if isinstance(fn, functools.partial) else fn
  return f"{getattr(base, '__module__', '?')}:{getattr(base, '__qualname__', repr(base))}"


def build_mesh(case: cases_lib.Case, ring: int):
  """The case's mesh over the first fake devices: ("sequence",) or ("tensor", "sequence")."""
  import jax  # noqa: PLC0415
  from jax.sharding import AxisType  # noqa: PLC0415
  shape, names = ((case.tensor, ring), ("tensor", "sequence")) if case.tensor > 1 else (
      (ring,), ("sequence",))
  need = int(np.prod(shape))
  if jax.device_count() < need:
    raise RuntimeError(
        f"case {case.name!r} needs {need} devices, JAX has {jax.device_count()}: run with "
        f"XLA_FLAGS=--xla_force_host_platform_device_count={max(8, need)} (the CLI sets it).")
  kind = AxisType.Explicit if case.explicit else AxisType.Auto
  return jax.make_mesh(shape, names, axis_types=(kind,) * len(shape),
                       devices=jax.devices()[:need])


@dataclasses.dataclass
class _Inputs:
  q: object
  k: object
  v: object
  do: np.ndarray
  dlse: np.ndarray
  seg: np.ndarray | None
  sinks: np.ndarray | None
  want: dict
  scale: float
  window: tuple | None


def make_inputs(case: cases_lib.Case, ring: int, local_len: int, with_lse: bool) -> _Inputs:
  """Random inputs in the case's dtype, and the oracle's answer for exactly those inputs."""
  import jax.numpy as jnp  # noqa: PLC0415
  rng = np.random.default_rng(zlib.crc32(case.name.encode()) + ring)
  s_len = ring * local_len
  t_len = int(round(s_len * case.q_len))
  n, kh = case.heads
  h, hv, b = case.head_dim, case.value_head_dim or case.head_dim, case.batch
  dtype = jnp.dtype(case.dtype)
  normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)
  q, k, v = (jnp.asarray(x).astype(dtype) for x in (
      normal(b, t_len, n, h) * case.input_scale, normal(b, s_len, kh, h), normal(b, s_len, kh, hv)))
  do, dlse = normal(b, t_len, n, hv), normal(b, t_len, n)
  if case.cotangent == "last-shard":
    do[:, :t_len - t_len // ring] = 0.0
    dlse[:, :t_len - t_len // ring] = 0.0
  seg = case.segment_ids(b, s_len, ring, rng)
  sinks = None
  if case.sinks is not None:
    sinks = (case.sinks + 0.5 * rng.standard_normal(n)).astype(np.float32)
  scale = h ** -0.5
  window = case.window_tokens(local_len)
  vis = oracle.visibility(np.arange(t_len), np.arange(s_len), case.is_causal, window, seg, seg)
  as64 = lambda x: np.asarray(jnp.asarray(x, jnp.float32), np.float64)
  want = oracle.attention(as64(q), as64(k), as64(v), vis, scale, do,
                          dlse if with_lse else None, sinks, case.soft_cap)
  if not with_lse:
    want.pop("lse")
  if case.inputs_in_layout:
    perm = oracle.layout_permutation(case.layout, ring, s_len)
    q, k, v = (x[:, perm] for x in (q, k, v))
    do, dlse = do[:, perm], dlse[:, perm]
    seg = None if seg is None else seg[:, perm]
    want = {name: (x if name == "dsinks" else x[:, perm]) for name, x in want.items()}
  return _Inputs(q, k, v, do, dlse, seg, sinks, want, scale, window)


def relative_errors(got: dict, want: dict) -> tuple[dict, str]:
  """``max |got - want| / max |want|`` per quantity (lse: over ``max(1, max |want|)``, and
  its ``-inf`` rows must be ``-inf``), and a message for non-finite or misplaced values."""
  errors, notes = {}, []
  for name, expected in want.items():
    actual = np.asarray(got[name], np.float64)
    fin = np.isfinite(expected)
    if not np.isfinite(actual[fin]).all():
      errors[name] = float("inf")
      notes.append(f"{name}: non-finite where the oracle is finite")
      continue
    if (~fin).any() and not (actual[~fin] < -1e20).all():
      errors[name] = float("inf")
      notes.append(f"{name}: finite where the oracle is -inf (rows with no visible key)")
      continue
    denom = np.abs(expected[fin]).max() if fin.any() else 0.0
    if name == "lse":
      denom = max(1.0, denom)
    err = np.abs(actual[fin] - expected[fin]).max() if fin.any() else 0.0
    errors[name] = float(err / max(denom, 1e-30))
  return errors, "; ".join(notes)


def _first_line(e: BaseException) -> str:
  text = str(e).strip().splitlines()
  return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def call_case(fn, case: cases_lib.Case, ring: int, local_len: int, takes_lse: bool):
  """Runs ``fn`` forward and backward on the case; returns ``(got, want)`` dicts."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  mesh = build_mesh(case, ring)
  x = make_inputs(case, ring, local_len, takes_lse)
  kwargs = dict(is_causal=case.is_causal, scale=x.scale, mesh=mesh)
  if x.seg is not None:
    kwargs["segment_ids"] = jnp.asarray(x.seg)
  if case.layout is not None:
    kwargs["layout"] = case.layout
  if case.inputs_in_layout:
    kwargs["inputs_in_layout"] = True
  if x.window is not None:
    kwargs["local_window_size"] = x.window
  if case.soft_cap is not None:
    kwargs["logits_soft_cap"] = case.soft_cap
  if takes_lse:
    kwargs["return_lse"] = True
  b, t_len, n, _ = x.q.shape
  hv = x.v.shape[-1]
  do, dlse = jnp.asarray(x.do), jnp.asarray(x.dlse)

  def loss(q, k, v, *sinks):
    extra = dict(sinks=sinks[0]) if sinks else {}
    result = fn(q, k, v, **kwargs, **extra)
    out, lse = result if takes_lse else (result, None)
    if out.shape != (b, t_len, n, hv):
      raise ValueError(f"returned shape {tuple(out.shape)}, expected {(b, t_len, n, hv)}")
    if out.dtype != q.dtype:
      raise ValueError(f"returned {out.dtype} for {q.dtype} inputs")
    total = jnp.sum(out.astype(jnp.float32) * do)
    if lse is not None:
      if lse.shape != (b, t_len, n):
        raise ValueError(f"returned lse shape {tuple(lse.shape)}, expected {(b, t_len, n)}")
      total += jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * dlse)
    return total, (out, lse)

  args = (x.q, x.k, x.v) + ((jnp.asarray(x.sinks),) if x.sinks is not None else ())
  grad_fn = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(args))), has_aux=True))
  with jax.set_mesh(mesh):
    (_, (out, lse)), grads = grad_fn(*args)
  got = dict(out=np.asarray(out.astype(jnp.float32)), dq=grads[0], dk=grads[1], dv=grads[2])
  if lse is not None:
    got["lse"] = np.asarray(lse)
  if x.sinks is not None:
    got["dsinks"] = grads[3]
  got = {k: np.asarray(jnp.asarray(v).astype(jnp.float32)) for k, v in got.items()}
  return got, x.want


def unsupported(case: cases_lib.Case, keywords: set | None, features) -> str:
  """Why ``case`` cannot run on a function taking ``keywords`` (None: it can)."""
  need = list(case.keywords()) + (["segment_ids"] if case.segments else [])
  missing = [k for k in need if keywords is not None and k not in keywords]
  if missing:
    return f"takes no {', '.join(missing)}"
  lacking = [f for f in case.features() if f not in features]
  if lacking:
    return f"not declared: {', '.join(lacking)} (run(features=...) / --features)"
  return ""


def run_case(fn, case: cases_lib.Case | str, *, ring: int | None = None, local_len: int = 64,
             features=()) -> Row:
  """One case (at ``ring``, default the case's own ring sizes) -> its :class:`Row`."""
  case = cases_lib.CASES[case] if isinstance(case, str) else case
  keywords = accepted_keywords(fn)
  rings = (ring,) if ring is not None and not case.growth else case.rings()
  label = ",".join(map(str, rings))
  why = unsupported(case, keywords, set(features))
  if why:
    return Row(case.name, label, NOT_SUPPORTED, message=why)
  takes_lse = keywords is not None and "return_lse" in keywords
  tol = tolerance(case.dtype)
  start = time.perf_counter()
  per_ring = []
  try:
    for r in rings:
      got, want = call_case(fn, case, r, local_len, takes_lse)
      per_ring.append(relative_errors(got, want))
  except Exception as e:  # noqa: BLE001 -- a failing function fails its case, the run goes on
    tb = traceback.extract_tb(e.__traceback__)
    where = f" ({tb[-1].filename.rsplit('/', 1)[-1]}:{tb[-1].lineno})" if tb else ""
    return Row(case.name, label, FAIL, tol, message=_first_line(e) + where,
               seconds=time.perf_counter() - start)
  seconds = time.perf_counter() - start
  errors = {q: max(e[q] for e, _ in per_ring) for q in per_ring[0][0]}
  notes = [n for _, n in per_ring if n]
  over = [f"{q} {e:.2g} > {tol:.2g}" for q, e in errors.items() if e > tol]
  if case.growth:
    floor = tol / 16
    first = max(max(per_ring[0][0].values()), floor)
    last = max(per_ring[-1][0].values())
    ratio = last / first
    errors = {q: per_ring[-1][0][q] for q in per_ring[-1][0]}
    bound = case.growth_bound or cases_lib.GROWTH
    msg = f"ring {rings[-1]} / ring {rings[0]} error {ratio:.2f} (bound {bound})"
    if ratio > bound:
      over.append(msg)
    elif not over:
      notes.append(msg)
  if over or any("non-finite" in n or "-inf" in n for n in notes):
    return Row(case.name, label, FAIL, tol, errors, "; ".join(notes + over), seconds)
  return Row(case.name, label, PASS, tol, errors, "; ".join(notes), seconds)


def run(fn, cases=None, *, rings=None, local_len: int = 64, features=(), name=None,
        progress=None) -> Report:
  """Runs the named cases (default: all) on ``fn`` and returns the :class:`Report`.

  ``fn`` follows the calling convention (module docstring), or is a ring_jax ``HopKernel``
  (wrapped by :func:`hop_kernel_attention`). ``rings``: ring sizes to run every case at
  instead of its own (growth cases keep theirs). ``features``: capabilities no keyword
  announces that ``fn`` has (``"value_head_dim"``). ``progress``: called with each row.
  """
  if _is_hop_kernel(fn):
    name = name or f"HopKernel {getattr(fn, 'name', type(fn).__name__)}"
    fn = hop_kernel_attention(fn)
  rows = []
  for case in cases_lib.select(cases):
    for r in (rings if rings and not case.growth else [None]):
      row = run_case(fn, case, ring=r, local_len=local_len, features=features)
      rows.append(row)
      if progress:
        progress(row)
  return Report(name or function_name(fn), rows)


# --- HopKernels -------------------------------------------------------------------------------

def _is_hop_kernel(obj) -> bool:
  return all(callable(getattr(obj, m, None)) for m in ("check", "forward", "backward"))


def hop_kernel_attention(kernel, *, block: int | None = None, check_vma: bool = True):
  """A ring_jax ``HopKernel`` as a function of the calling convention: the ring
  (``ring_attention``) with this kernel at every hop, blocks of ``block`` tokens.

  ``check_vma=False`` runs the ring in a ``shard_map(check_vma=False)`` of the sequence axis
  (Pallas TPU kernels then run in the generic interpreter on CPU, several times faster than
  the TPU interpreter ``check_vma=True`` needs; the arithmetic is the same).
  """
  import jax  # noqa: PLC0415
  import ring_jax  # noqa: PLC0415
  from jax.sharding import PartitionSpec as P  # noqa: PLC0415

  def attention(query, key, value, *, is_causal=False, segment_ids=None, scale=None,
                mesh=None, local_window_size=None, layout="contiguous",
                inputs_in_layout=False, return_lse=False, sinks=None, logits_soft_cap=None):
    common = dict(is_causal=is_causal, scale=scale, local_window_size=local_window_size,
                  layout=layout, block_q=block, block_kv=block, hop_kernel=kernel,
                  logits_soft_cap=logits_soft_cap)
    if check_vma:
      return ring_jax.ring_attention_sharded(query, key, value, mesh=mesh,
                                             segment_ids=segment_ids, sinks=sinks,
                                             return_lse=return_lse,
                                             inputs_in_layout=inputs_in_layout, **common)
    ring = mesh.shape["sequence"]
    order = (lambda x: x) if inputs_in_layout else functools.partial(
        ring_jax.to_layout, layout=layout, ring_size=ring)
    back = (lambda x: x) if inputs_in_layout else functools.partial(
        ring_jax.from_layout, layout=layout, ring_size=ring)
    spec = P(None, "sequence")
    args = [order(x) for x in (query, key, value)]
    if segment_ids is not None:
      args.append(order(segment_ids))
    local = lambda q, k, v, *s: ring_jax.ring_attention(
        q, k, v, axis_name="sequence", segment_ids=s[0] if s else None,
        return_lse=return_lse or sinks is not None, **common)
    out = jax.shard_map(local, mesh=mesh, in_specs=(spec,) * len(args),
                        out_specs=(spec, spec) if return_lse or sinks is not None else spec,
                        check_vma=False)(*args)
    out = tuple(map(back, out)) if return_lse or sinks is not None else back(out)
    return ring_jax.ring.with_sinks(out, sinks, return_lse)

  attention.__qualname__ = f"hop_kernel_attention({getattr(kernel, 'name', kernel)!r})"
  return attention
