"""The kit's cases: named, stable, each aimed at a bug class seen in context-parallel attention.

A :class:`Case` fixes everything but the local length (``local_len``, tokens per device,
chosen by the run): ring size, mesh axes, mask, segments, heads, dtype, the keywords it
passes. Lengths, windows and document boundaries scale with ``local_len`` so the same case
runs at 64 tokens per device on XLA and at 256 (blocks of 128) on TPU kernels.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Case:
  """One conformance case. ``window`` and ``q_len`` are in units of the local length."""
  name: str
  catches: str                    # the bug class this case is there for (one line)
  ring: int = 4                   # devices on the sequence axis
  tensor: int = 1                 # devices on a "tensor" axis (heads), before "sequence"
  explicit: bool = False          # the mesh's axes are AxisType.Explicit (else Auto)
  layout: str | None = None       # passed as layout= (None: the function's own default)
  inputs_in_layout: bool = False  # inputs given (and output expected) in layout order
  is_causal: bool = False
  window: tuple[float, float] | None = None
  segments: str | None = None     # "packed" | "crossing" | "pad-rows"
  heads: tuple[int, int] = (4, 2)  # query heads, key/value heads
  head_dim: int = 32
  value_head_dim: int | None = None  # V's head size when it differs from Q/K's
  q_len: float = 1.0              # query length / key length (T != S without masks)
  batch: int = 2
  dtype: str = "float32"
  sinks: float | None = None      # sink logits: this offset + N(0, 0.5) per query head
  soft_cap: float | None = None   # logits_soft_cap
  input_scale: float = 1.0        # q is drawn N(0, input_scale^2): large scores
  cotangent: str = "random"       # "random" | "last-shard" (dO only on the last shard's rows)
  growth: tuple[int, ...] | None = None  # ring sizes whose errors are compared (bf16 growth)
  growth_bound: float | None = None  # the largest ring's error / the first's (None: GROWTH)

  def keywords(self) -> tuple[str, ...]:
    """Keywords beyond the always-passed ones that this case needs the function to take."""
    kw = []
    if self.layout is not None:
      kw.append("layout")
    if self.inputs_in_layout:
      kw.append("inputs_in_layout")
    if self.window is not None:
      kw.append("local_window_size")
    if self.sinks is not None:
      kw.append("sinks")
    if self.soft_cap is not None:
      kw.append("logits_soft_cap")
    return tuple(kw)

  def features(self) -> tuple[str, ...]:
    """Capabilities no keyword announces; a function declares them (``run(features=)``)."""
    return ("value_head_dim",) if self.value_head_dim else ()

  def rings(self) -> tuple[int, ...]:
    return self.growth or (self.ring,)

  def window_tokens(self, local_len: int):
    if self.window is None:
      return None
    return tuple(int(round(w * local_len)) for w in self.window)

  def segment_ids(self, batch: int, length: int, ring: int, rng) -> np.ndarray | None:
    """int32 ``[B, L]`` in natural order, or None."""
    if self.segments is None:
      return None
    local = length // ring
    seg = np.zeros((batch, length), np.int32)
    for r in range(batch):
      if self.segments == "crossing":
        # Documents that start half a shard in and end half a shard later: every shard
        # boundary is inside a document; ids repeat no value; no padding (masked-rows has it).
        cuts = [0] + [i * local + local // 2 for i in range(ring)] + [length]
        for i, (a, e) in enumerate(zip(cuts[:-1], cuts[1:])):
          seg[r, a:e] = i + 1 + r
        continue
      if r == 1:  # a row of pure padding: every query of it sees nothing
        continue
      pos, doc = 0, 1
      end = length - int(rng.integers(1, max(2, length // 8)))
      while pos < end:
        step = int(rng.integers(max(1, length // 32), max(2, length // 3)))
        seg[r, pos:min(end, pos + step)] = doc
        pos, doc = pos + step, doc + 1
      if self.segments == "pad-rows":  # padding inside the row too, not only at its end
        seg[r, local // 2: local // 2 + local // 4] = 0
    return seg


def _case(name, catches, **kw):
  return Case(name=name, catches=catches, **kw)


_ALL = [
    # Masks and layouts.
    _case("full", "non-causal attention over the whole ring, GQA (4 query heads, 2 K/V)"),
    _case("causal", "causal mask under grad (which hops are skipped, masked, unmasked)",
          is_causal=True),
    _case("causal-zigzag", "causal mask in the zigzag layout", is_causal=True,
          layout="zigzag"),
    _case("causal-striped", "causal mask in the striped layout", is_causal=True,
          layout="striped"),
    _case("zigzag", "non-causal zigzag, head dim 64", layout="zigzag", heads=(2, 2),
          head_dim=64),
    _case("striped", "non-causal striped, MQA", layout="striped", heads=(2, 1)),
    _case("in-layout-zigzag", "inputs in layout order vs natural order (a missed or doubled "
          "permutation)", is_causal=True, layout="zigzag", inputs_in_layout=True),
    _case("in-layout-striped", "inputs in layout order, striped", is_causal=True,
          layout="striped", inputs_in_layout=True, heads=(2, 1)),
    _case("first-last-hop", "gradients of the first and last hop: dO only on the last shard's "
          "rows, so shard 0's dK/dV come from the last hop alone", is_causal=True,
          cotangent="last-shard"),
    # Windows.
    _case("window-short", "a causal window shorter than a shard (hops past it are skipped)",
          is_causal=True, window=(0.6, 0.0)),
    _case("window-zigzag", "a causal window in the zigzag layout", is_causal=True,
          layout="zigzag", window=(0.6, 0.0)),
    _case("window-two-sided", "a two-sided window (left short, right over a shard)",
          window=(0.16, 1.17)),
    # Segments and padding.
    _case("segments-crossing", "documents crossing every shard boundary (ids must travel with "
          "K/V and compare globally)", is_causal=True, segments="crossing", heads=(2, 1)),
    _case("segments-zigzag", "packed documents with padding, causal zigzag", is_causal=True,
          layout="zigzag", segments="packed", heads=(2, 1)),
    _case("segments-striped", "packed documents with padding, striped", layout="striped",
          segments="packed", heads=(2, 2)),
    _case("masked-rows", "fully masked rows (a padding row, padding inside rows): output 0, "
          "zero gradients, no NaN", is_causal=True, segments="pad-rows"),
    # Heads and shapes.
    _case("gqa", "grouped queries, 3 query heads per K/V head (dK/dV summed over the group)",
          is_causal=True, heads=(6, 2)),
    _case("mqa-causal", "one K/V head for all query heads", is_causal=True, heads=(4, 1)),
    _case("t-ne-s", "query length half the key length (cross attention)", q_len=0.5,
          heads=(2, 1)),
    _case("value-head-dim", "V's head size differs from Q/K's (MLA: Dv != D)",
          is_causal=True, value_head_dim=16),
    # Ring sizes and meshes.
    _case("ring1", "a ring of one device (no hop at all)", ring=1, is_causal=True,
          segments="packed"),
    _case("ring2-causal-zigzag", "a ring of two", ring=2, is_causal=True, layout="zigzag"),
    _case("ring2-segments-striped", "a ring of two with packed documents", ring=2,
          layout="striped", segments="packed", heads=(2, 2)),
    _case("ring2-t-ne-s", "a ring of two, T != S", ring=2, q_len=0.5, heads=(2, 1)),
    _case("odd-ring", "an odd ring size (3): hop arithmetic that assumes even rings",
          ring=3, is_causal=True, segments="packed"),
    _case("odd-ring-zigzag", "an odd ring size in zigzag", ring=3, is_causal=True,
          layout="zigzag"),
    _case("ring8", "a ring of eight with documents", ring=8, is_causal=True,
          segments="crossing"),
    _case("tensor2", "heads sharded too (mesh tensor=2 x sequence=4)", tensor=2,
          is_causal=True),
    _case("explicit-mesh", "a mesh with Explicit axes (jax.make_mesh's default)",
          explicit=True, is_causal=True),
    # Sinks and soft-cap.
    _case("sinks+10", "attention sinks at +10: the sink counted once, not per hop",
          is_causal=True, sinks=10.0),
    _case("sinks-10", "attention sinks at -10", is_causal=True, sinks=-10.0),
    _case("sinks-masked-rows", "sinks with fully masked rows (a sink-only row: out 0)",
          is_causal=True, sinks=2.0, segments="pad-rows"),
    _case("soft-cap", "logit soft-cap c*tanh(s/c) before the mask, large scores",
          is_causal=True, soft_cap=5.0, input_scale=4.0),
    # V's own head size with the rest.
    _case("value-head-dim-sinks-cap", "V's head size of its own with sinks and a soft-cap, "
          "causal zigzag, packed documents (each correction on [.., Dv] outputs)",
          is_causal=True, layout="zigzag", segments="packed", value_head_dim=16, sinks=3.0,
          soft_cap=5.0),
    _case("value-head-dim-ring8", "V's head size larger than Q/K's on a ring of eight, "
          "documents crossing shards (K and V travel as two buffers of different sizes)",
          ring=8, is_causal=True, segments="crossing", head_dim=16, value_head_dim=48),
    # Precision.
    _case("bf16", "bfloat16 inputs: error at the dtype's level", is_causal=True,
          segments="packed", dtype="bfloat16"),
    _case("bf16-growth", "bfloat16 error growth with ring size: ring 8's error within "
          "GROWTH x ring 1's", is_causal=True, dtype="bfloat16", growth=(1, 8)),
    _case("f32-growth", "float32 error growth with ring size", is_causal=True,
          growth=(1, 8)),
    _case("bf16-growth-variants", "bfloat16 error growth with sinks, a soft-cap and V's own "
          "head size (each correction rounded per hop): ring 8 within 1.2x ring 1's",
          is_causal=True, layout="zigzag", dtype="bfloat16", growth=(1, 8), sinks=3.0,
          soft_cap=5.0, value_head_dim=16, growth_bound=1.2),
]

#: Every case, by name, in a stable order.
CASES: dict[str, Case] = {c.name: c for c in _ALL}

#: The subset CI runs on every function it checks (one of each bug class, small rings).
CI_CASES: tuple[str, ...] = (
    "full", "causal", "causal-zigzag", "in-layout-zigzag", "first-last-hop", "window-short",
    "segments-crossing", "masked-rows", "gqa", "t-ne-s", "odd-ring", "sinks+10", "sinks-10",
    "soft-cap", "value-head-dim", "bf16-growth")

#: bfloat16 / float32 error at the largest ring of a growth case over the error at ring 1
#: (a case's ``growth_bound`` where it sets one).
GROWTH = 1.5


def case_names() -> list[str]:
  """The names of all cases, in the order they run."""
  return list(CASES)


def select(names=None) -> list[Case]:
  """The named cases (all when ``names`` is None); unknown names raise, listing the known."""
  if names is None:
    return list(CASES.values())
  unknown = [n for n in names if n not in CASES]
  if unknown:
    raise ValueError(f"unknown case(s) {unknown}; the cases are: {', '.join(CASES)}")
  return [CASES[n] for n in names]
