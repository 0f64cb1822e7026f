"""What a compiled program does while its transfers are in flight, read from its schedule.

A compiler that runs a collective asynchronously splits it into a start and a done
(``collective-permute-start`` / ``-done``, ``all-gather-start`` / ``-done``,
``all-reduce-start`` / ``-done``, ``send`` / ``send-done``, ``recv`` / ``recv-done``, or
an ``async-start`` / ``async-done`` wrapping a ``reduce-scatter``, ``all-to-all`` ...);
the instructions scheduled between the two run while the data moves. A transfer is
*in flight during compute* when at least one of them is compute: a ``dot``, a
``convolution``, a compute ``custom-call`` (a Mosaic / Triton kernel, a library matmul),
or a ``fusion``, ``call``, ``while`` or ``conditional`` whose called computations contain
one, at any depth. Otherwise it is *exposed*: nothing useful hides its latency. A
collective the compiler runs synchronously (no start/done pair: XLA:CPU's) is exposed too.

:func:`overlap_report` reads a scheduled HLO module (``compiled.as_text()`` of a
``jax.jit(...).lower(...).compile()``, whose instruction order in each computation is its
schedule; the TPU compiler's, compiled deviceless for a topology, is the one that
matters) and needs no accelerator and no compiler plugin: the text is parsed into
computations and instructions (names, opcodes, operands, called computations, the
``op_name`` metadata naming the JAX name scope). A pair inside a loop body counts once,
whatever the loop's trip count; :func:`executions` says how often each computation runs.

Ring transfers are recognised by the name scopes :mod:`ring_jax.ring` and
:mod:`ring_jax.two_level` give them (:data:`SCOPE_KINDS`); other transfers are grouped
by collective (e.g. a trainer's FSDP all-gathers and reduce-scatters).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import re

# The JAX name scope (one op_name path component) of each transfer of ring_jax's, and its kind
# (the ring's kinds start with "ring"; the natural-order <-> layout reorder of
# ring_attention_sharded's shards is ring_jax.layouts').
SCOPE_KINDS = (
    ("send_kv", "ring K/V"),
    ("send_outer", "ring K/V (outer)"),
    ("send_dkv", "ring dK/dV"),
    ("outer_dkv", "ring dK/dV (outer)"),
    ("dkv_home", "ring dK/dV home"),
    ("to_layout", "layout reorder"),
    ("from_layout", "layout reorder"),
)

# start opcode -> done opcode of the asynchronous pairs (async-start: its wrapped op names it)
_PAIRS = {
    "collective-permute-start": "collective-permute-done",
    "all-gather-start": "all-gather-done",
    "all-reduce-start": "all-reduce-done",
    "send": "send-done",
    "recv": "recv-done",
    "async-start": "async-done",
}
_COLLECTIVES = ("collective-permute", "all-gather", "all-reduce", "reduce-scatter",
                "all-to-all", "ragged-all-to-all", "collective-broadcast")
_COMPUTE = ("dot", "convolution", "ragged-dot", "scaled-dot")
_CALLERS = ("fusion", "call", "while", "conditional", "async-start")
# custom-call targets that move or label data rather than compute
_NOT_COMPUTE_TARGETS = frozenset((
    "AllocateBuffer", "Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape",
    "MoveToHost", "MoveToDevice", "LayoutConstraint", "annotate_device_placement",
    "PadToStatic", "SliceToDynamic", "AssumeGatherIndicesInBound", "X64Combine",
    "X64SplitLow", "X64SplitHigh", "InspectSharding", "xla_python_cpu_callback",
    "xla_ffi_python_cpu_callback"))


@dataclasses.dataclass(frozen=True)
class Instruction:
  """One HLO instruction: ``name = shape opcode(operands), attributes``."""
  name: str
  opcode: str
  operands: tuple[str, ...]
  called: tuple[str, ...]     # computations it calls (fusion, loop body/condition, branches)
  op_name: str                # JAX op_name metadata ('' if none)
  custom_call_target: str = ""
  wrapped: str = ""           # async-start: the opcode of the op it runs asynchronously
  shape: str = ""
  trip_count: int | None = None  # a while loop's known_trip_count (backend config), if any
  source_target_pairs: tuple[tuple[int, int], ...] = ()  # a collective-permute's


@dataclasses.dataclass(frozen=True)
class Transfer:
  """One asynchronous (or synchronous) collective of the schedule.

  ``compute``: the names of the compute instructions scheduled between its start and its
  done (empty: exposed). ``kind``: a ring kind of :data:`SCOPE_KINDS` or the collective's
  name. ``scope``: the op_name path without the ``jit(...)`` prefix."""
  name: str
  collective: str
  kind: str
  scope: str
  computation: str
  asynchronous: bool
  compute: tuple[str, ...]

  @property
  def in_flight(self) -> bool:
    """Whether some block compute runs while this transfer is in flight."""
    return bool(self.compute)


@dataclasses.dataclass(frozen=True)
class OverlapReport:
  """Every transfer of a compiled program and what overlaps it (:func:`overlap_report`)."""
  transfers: tuple[Transfer, ...]

  def kinds(self) -> dict[str, tuple[int, int]]:
    """``{kind: (in flight, total)}``, ring kinds first (in :data:`SCOPE_KINDS` order)."""
    counts = collections.OrderedDict()
    order = [k for _, k in SCOPE_KINDS]
    for t in sorted(self.transfers, key=lambda t: (t.kind not in order,
                                                   order.index(t.kind) if t.kind in order
                                                   else 0, t.kind)):
      hidden, total = counts.get(t.kind, (0, 0))
      counts[t.kind] = (hidden + t.in_flight, total + 1)
    return dict(counts)

  def exposed(self, kind: str | None = None) -> tuple[Transfer, ...]:
    """The transfers with no compute in flight (of ``kind`` only, if given)."""
    return tuple(t for t in self.transfers
                 if not t.in_flight and (kind is None or t.kind == kind))

  def ring(self) -> tuple[int, int]:
    """``(in flight, total)`` over the ring's transfers (the kinds starting with ``ring``)."""
    ring = [t for t in self.transfers if t.kind.startswith("ring")]
    return sum(t.in_flight for t in ring), len(ring)

  def summary_lines(self) -> list[str]:
    """One line per kind, ``ring K/V: 10 of 10 in flight during block compute``, then one
    line per exposed transfer scope (``exposed ring dK/dV: ring_bwd/last_hop/send_dkv
    (x2)``)."""
    lines = []
    for kind, (hidden, total) in self.kinds().items():
      what = "block compute" if kind.startswith("ring") else "compute"
      sync = sum(1 for t in self.transfers if t.kind == kind and not t.asynchronous)
      note = f" ({sync} synchronous)" if sync else ""
      lines.append(f"{kind}: {hidden} of {total} in flight during {what}{note}")
    for kind in self.kinds():
      scopes = collections.Counter(t.scope for t in self.exposed(kind))
      for scope, count in scopes.items():
        lines.append(f"exposed {kind}: {scope}" + (f" (x{count})" if count > 1 else ""))
    return lines


# ----------------------------------------------------------------------------
# Parsing
# ----------------------------------------------------------------------------

_COMMENT = re.compile(r"/\*.*?\*/")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_NAME_EQ = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_OPCODE = re.compile(r"([a-z][\w\-]*)\(")
_OP_NAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')
_TARGET = re.compile(r'custom_call_target="((?:[^"\\]|\\.)*)"')
_CALLED_ONE = re.compile(
    r"\b(?:calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)")
_CALLED_MANY = re.compile(r"\b(?:branch_computations|called_computations|calls)=\{([^}]*)\}")
_OPERAND = re.compile(r"%([\w.\-]+)")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_PAIRS_ATTR = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")


def _balanced(text: str, start: int) -> int:
  """Index just past the bracket group opening at ``text[start]`` (quotes respected)."""
  pairs = {"(": ")", "{": "}", "[": "]"}
  stack, i, quoted = [], start, False
  while i < len(text):
    c = text[i]
    if quoted:
      if c == "\\":
        i += 1
      elif c == '"':
        quoted = False
    elif c == '"':
      quoted = True
    elif c in pairs:
      stack.append(pairs[c])
    elif stack and c == stack[-1]:
      stack.pop()
      if not stack:
        return i + 1
    i += 1
  raise ValueError(f"unbalanced HLO text: {text[start:start + 80]!r}")


def _without_strings(text: str) -> str:
  return re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)


def parse_instruction(line: str) -> Instruction | None:
  """The instruction on one line of HLO text, or None when the line holds none."""
  line = _COMMENT.sub("", line)
  m = _NAME_EQ.match(line)
  if not m:
    return None
  rest = line[m.end():]
  # the shape: a (possibly nested) tuple, or one array shape token (with its layout)
  if rest.startswith("("):
    end = _balanced(rest, 0)
  else:
    end = 0
    while end < len(rest) and not rest[end].isspace():
      end = _balanced(rest, end) if rest[end] in "[{" else end + 1
  shape, rest = rest[:end], rest[end:].lstrip()
  op = _OPCODE.match(rest)
  if not op:
    return None
  close = _balanced(rest, op.end() - 1)
  operands = tuple(_OPERAND.findall(_without_strings(rest[op.end():close - 1])))
  attrs = rest[close:]
  meta = _OP_NAME.search(attrs)
  target = _TARGET.search(attrs)
  plain = _without_strings(attrs)
  called = []
  for group in _CALLED_MANY.findall(plain):
    called += _OPERAND.findall(group) or [g.strip() for g in group.split(",") if g.strip()]
  called += [c for c in _CALLED_ONE.findall(plain) if c not in called]
  trips, pairs = _TRIPS.search(attrs), _PAIRS_ATTR.search(plain)
  return Instruction(name=m.group(1), opcode=op.group(1), operands=operands,
                     called=tuple(called), op_name=meta.group(1) if meta else "",
                     custom_call_target=target.group(1) if target else "", shape=shape,
                     trip_count=int(trips.group(1)) if trips else None,
                     source_target_pairs=tuple(
                         (int(a), int(b)) for a, b in
                         re.findall(r"\{(\d+),(\d+)\}", pairs.group(1))) if pairs else ())


def parse_module(text: str) -> dict[str, list[Instruction]]:
  """``{computation name: its instructions in schedule order}`` of HLO module text (several
  modules' text may be concatenated)."""
  comps: dict[str, list[Instruction]] = {}
  current = None
  for line in text.splitlines():
    stripped = _COMMENT.sub("", line).strip()
    if current is None:
      m = _HEADER.match(stripped)
      if m and not stripped.startswith("HloModule"):
        current = comps.setdefault(m.group(2), [])
      continue
    if stripped == "}":
      current = None
      continue
    inst = parse_instruction(line)
    if inst is not None:
      current.append(inst)
  return comps


def executions(comps: dict[str, list[Instruction]]) -> collections.Counter:
  """How often each computation of :func:`parse_module`'s ``comps`` runs per program run.

  A computation no instruction calls (the entry) runs once; a ``while``'s body and condition
  ``trip_count`` times per run of the loop (once without a known trip count; the condition's
  extra check not counted); a ``conditional``'s branches, when it sits in a loop body of as
  many trips as it has branches (more than one), once per run of that loop each (the routed
  rings' ``lax.switch`` on the step, ``ring_jax.ring.hop_send``); anything else called (other
  conditionals' branches too: an upper bound) once per run of its caller.
  """
  callers = collections.Counter(c for insts in comps.values() for i in insts for c in i.called)
  order = [c for c in comps if not callers[c]]
  runs, loop_trips = collections.Counter(order), {}
  for name in order:  # a computation joins once every call of it is counted (acyclic graph)
    for inst in comps.get(name, ()):
      trips = inst.trip_count if inst.opcode == "while" else None
      switch = inst.opcode == "conditional" and loop_trips.get(name) == len(inst.called) > 1
      for callee in inst.called:
        if trips:
          loop_trips[callee] = trips
        runs[callee] += runs[name] // len(inst.called) if switch else runs[name] * (trips or 1)
        callers[callee] -= 1
        if not callers[callee]:
          order.append(callee)
  return runs


def _wrapped_ops(comps, inst: Instruction) -> list[Instruction]:
  """The instructions an ``async-start`` runs (its called computation's)."""
  return [i for c in inst.called for i in comps.get(c, ())]


class _Compute:
  """Memoised: does a computation contain compute, at any depth."""

  def __init__(self, comps):
    self.comps, self.memo = comps, {}

  def instruction(self, inst: Instruction) -> bool:
    if inst.opcode in _COMPUTE:
      return True
    if inst.opcode == "custom-call":
      return inst.custom_call_target not in _NOT_COMPUTE_TARGETS
    if inst.opcode in _CALLERS:
      return any(self.computation(c) for c in inst.called)
    return False

  def computation(self, name: str) -> bool:
    if name not in self.memo:
      self.memo[name] = False  # a cycle (none in valid HLO) reads as no compute
      self.memo[name] = any(self.instruction(i) for i in self.comps.get(name, ()))
    return self.memo[name]


def _scope(op_name: str) -> str:
  parts = op_name.split("/")
  if parts and parts[0].startswith("jit("):
    parts = parts[1:]
  return "/".join(parts)


def _kind(collective: str, op_name: str) -> str:
  parts = set(op_name.split("/"))
  for scope, kind in SCOPE_KINDS:
    if scope in parts:
      return kind
  return collective


def _collective_of(comps, inst: Instruction) -> str | None:
  op = inst.opcode
  if op == "async-start":
    for i in _wrapped_ops(comps, inst):
      if i.opcode in _COLLECTIVES:
        return i.opcode
    return None
  if op in ("send", "recv"):
    return op
  base = op.removesuffix("-start")
  return base if base in _COLLECTIVES else None


def overlap_report(compiled) -> OverlapReport:
  """The transfers of a compiled program and the compute in flight during each.

  ``compiled``: a ``jax.stages.Compiled`` (its ``as_text()`` is read) or scheduled HLO
  module text. Each asynchronous collective's start is matched to its done through the
  done's operand (``async-update`` links followed); the instructions between them in
  their computation's schedule are checked for compute (module docstring). A collective
  without a start/done pair counts as synchronous and exposed.
  """
  text = compiled if isinstance(compiled, str) else compiled.as_text()
  comps = parse_module(text)
  compute = _Compute(comps)
  transfers = []
  wrapped = {c for insts in comps.values() for i in insts if i.opcode == "async-start"
             for c in i.called}
  for cname, insts in comps.items():
    if cname in wrapped:  # an async-start's own computation: its op is the start's
      continue
    links = {}  # an async-update's name -> the start it continues
    for inst in insts:
      if inst.opcode == "async-update" and inst.operands:
        links[inst.name] = links.get(inst.operands[0], inst.operands[0])
    done_of = {}
    for n, inst in enumerate(insts):
      if inst.opcode in _PAIRS.values() and inst.operands:
        start = links.get(inst.operands[0], inst.operands[0])
        done_of[start] = n
    for n, inst in enumerate(insts):
      if inst.opcode in _PAIRS:
        collective = _collective_of(comps, inst)
        if collective is None or inst.name not in done_of:
          continue
        between = insts[n + 1:done_of[inst.name]]
        busy = tuple(i.name for i in between if compute.instruction(i))
        transfers.append(Transfer(inst.name, collective, _kind(collective, inst.op_name),
                                  _scope(inst.op_name), cname, True, busy))
      elif inst.opcode in _COLLECTIVES:
        transfers.append(Transfer(inst.name, inst.opcode, _kind(inst.opcode, inst.op_name),
                                  _scope(inst.op_name), cname, False, ()))
  return OverlapReport(tuple(transfers))


MOSAIC_CALL = 'custom_call_target="tpu_custom_call"'
# A Mosaic call's serialized kernel in its backend config (JSON, quotes escaped or not).
_BODY = re.compile(r'\\?"body\\?"\s*:\s*\\?"([^"\\]*)')


def mosaic_kernels(compiled) -> collections.Counter:
  """The Mosaic (Pallas TPU) kernels of a compiled TPU program: per distinct kernel body
  (the serialized module a ``tpu_custom_call`` carries, keyed by its SHA-1), how many custom
  calls run it. Calls with equal bodies differ only in their operands (splash's mask
  metadata, the K/V shard); each call is compiled on its own all the same.
  ``compiled``: an executable or its ``as_text()``."""
  text = compiled if isinstance(compiled, str) else compiled.as_text()
  bodies = collections.Counter()
  at = text.find(MOSAIC_CALL)
  while at >= 0:
    nxt = text.find(MOSAIC_CALL, at + len(MOSAIC_CALL))
    body = _BODY.search(text, at, len(text) if nxt < 0 else nxt)
    bodies[hashlib.sha1((body.group(1) if body else "").encode()).hexdigest()] += 1
    at = nxt
  return bodies
