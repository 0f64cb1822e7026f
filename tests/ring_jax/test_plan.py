"""ring_jax.plan: the cost model's formulas, its choices and reasons, the device table, and
the predictions docs/performance.md shows."""

import os
import re

import numpy as np
import pytest

import ring_jax
from ring_jax import hardware

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
GQA = dict(batch=1, heads=32, kv_heads=8, head_dim=128, dtype="bfloat16", is_causal=True,
           layout="zigzag")


def test_ring_threshold_is_the_documented_one():
  """l* = b/(2c) (K/N) F/W forward, (b+4)/(5c) (K/N) F/W with the backward
  (docs/performance.md), and 'hidden' flips exactly there."""
  spec = hardware.lookup("H200")
  w = spec.link_bandwidth * spec.links
  fwd = 2 / (2 * 0.5) * (8 / 32) * spec.peak_bf16_flops / w
  bwd = (2 + 4) / (5 * 0.5) * (8 / 32) * spec.peak_bf16_flops / w
  for backward, want in ((False, fwd), (True, bwd)):
    plan = lambda local: ring_jax.plan(seq_len=8 * local, sequence=8, device="H200",
                                       backward=backward, **GQA).estimate("ring")
    assert plan(2048).min_local_len == pytest.approx(want)
    below, above = plan(int(want) - 16), plan(int(want) + 16)
    assert not below.hidden and above.hidden
    # Hidden: only the dK/dV going home after the last hop is exposed.
    home = 2 * (int(want) + 16) * 8 * 128 * 4 / w if backward else 0.0
    assert above.exposed_comm_s == pytest.approx(home, rel=1e-6, abs=1e-12)
    assert below.exposed_comm_s > home + 1e-7


def test_flops_and_balance():
  """Every strategy does the same causal work with a balanced layout; a contiguous causal
  ring's busiest device does 1 - 1/(2n) of the full square, as ring_jax.schedule counts."""
  p = ring_jax.plan(seq_len=65536, sequence=8, device="TPU v5p", **GQA)
  flops = {e.name: e.flops for e in p.estimates if e.feasible}
  assert len(set(np.round(list(flops.values()), -3))) == 1, flops
  full = 4 * 65536 / 8 * 65536 * 32 * 128 * 3.5  # fwd + bwd (2.5x), no mask
  assert flops["ring"] == pytest.approx(full / 2)
  contiguous = ring_jax.plan(seq_len=65536, sequence=8, device="TPU v5p",
                             **dict(GQA, layout="contiguous")).estimate("ring")
  s = ring_jax.schedule("contiguous", 8, 64, 2, 2, is_causal=True)
  scheduled = s.critical_path() * 2 * 2 / (64 * 8 * 64)
  assert contiguous.flops / full == pytest.approx(scheduled, rel=0.02)


def test_memory_and_bytes():
  """all_gather holds the whole K/V: its memory grows with L at a fixed local length; the
  ring's does not. Ulysses moves (u-1)/u of q, k, v, out (both ways with the backward)."""
  def mem(strategy, n):
    p = ring_jax.plan(seq_len=4096 * n, sequence=n, device="TPU v5p", **GQA)
    return p.estimate(strategy).memory_bytes
  assert mem("ring", 32) == pytest.approx(mem("ring", 8))
  # The whole K/V (bf16) and its float32 gradients: 2 B L K d (2 + 4) bytes.
  whole = lambda n: 2 * (4096 * n) * 8 * 128 * (2 + 4)
  assert mem("all_gather", 32) - mem("all_gather", 8) == pytest.approx(whole(32) - whole(8))
  est = ring_jax.plan(seq_len=8192, sequence=8, device="H200", **GQA).estimate("ulysses")
  local = 1024 * 128 * 2 * (2 * 32 + 2 * 8)
  assert est.bytes_moved == pytest.approx(2 * local * 7 / 8)


def test_choice_reasons_and_constraints():
  # 64 H200s span 8 NVLink nodes: the ring's hops cross the network and stay exposed; the
  # hybrid keeps its all_to_all inside a node.
  p = ring_jax.plan(seq_len=131072, sequence=64, device="H200", **GQA)
  assert p.strategy == "hybrid" and p.split == (8, 8)
  assert not p.estimate("ring").hidden
  assert not p.estimate("ulysses").feasible
  assert "not divisible by 64" in p.estimate("ulysses").why_not
  text = repr(p)
  assert "-> hybrid8x8: fastest predicted" in text and "ruled out: ulysses" in text
  # One node, long context: the ring hides its transfer and wins.
  p = ring_jax.plan(seq_len=1 << 20, sequence=8, device="NVIDIA H200", **GQA)
  assert p.strategy == "ring" and "hides behind compute" in " ".join(p.reasons)
  # A pair is a two-axis mesh: the two-level ring, the flat ring and all-gather over both
  # axes, and the hybrid (tests/ring_jax/test_two_level.py checks the choice).
  p = ring_jax.plan(seq_len=65536, sequence=(2, 4), device="TPU v5p", **GQA)
  assert [e.name for e in p.estimates] == ["ring2x4", "ring", "all_gather", "hybrid2x4"]


def test_memory_budget_and_explicit_figures():
  small = ring_jax.plan(seq_len=1 << 20, sequence=8, device="TPU v5e", **GQA)
  assert not small.estimate("all_gather").feasible
  assert "GiB >" in small.estimate("all_gather").why_not
  with pytest.raises(ValueError, match="no strategy can run"):
    ring_jax.plan(seq_len=1 << 20, sequence=8, device="TPU v5e", memory_bytes=1e6, **GQA)
  custom = ring_jax.plan(seq_len=65536, sequence=8, peak_flops=1e15, link_bandwidth=1e11,
                         **GQA)
  # fwd+bwd threshold (2 + 4) / (5 c) (K/N) F/W with c = 1/2, K/N = 1/4
  assert custom.estimate("ring").min_local_len == pytest.approx(6 / 2.5 * 0.25 * 1e15 / 1e11)
  with pytest.raises(ValueError, match="unknown device"):
    ring_jax.plan(seq_len=65536, sequence=8, device="Abacus", **GQA)
  with pytest.raises(ValueError, match="pass device="):
    ring_jax.plan(seq_len=65536, sequence=8, **GQA)


@pytest.mark.parametrize("name", ["TPU v4", "TPU v5e", "TPU v5p", "TPU v6e", "A100", "H100",
                                  "H200", "cpu"])
def test_device_table(name):
  spec = hardware.lookup(name)
  assert spec is not None and spec.source
  for field in ("peak_bf16_flops", "memory_bytes", "hbm_bandwidth", "link_bandwidth", "links",
                "topology", "fast_domain"):
    assert getattr(spec, field), (name, field)
  # Runtime device_kind strings find the same entries.
  kinds = {"TPU v5e": "TPU v5 lite", "TPU v6e": "TPU v6 lite", "H200": "NVIDIA H200",
           "A100": "NVIDIA A100-SXM4-80GB"}
  if name in kinds:
    assert hardware.lookup(kinds[name]) is spec
  assert hardware.peak_flops("cpu") is None  # the CPU entry stays out of the MFU table


def _block_after(text, start, lang):
  m = re.compile(r"^```" + lang + r"\n(.*?)^```", re.S | re.M).search(text, start)
  return m.group(1), m.end()


def _doc_code_and_tables(marker, tables):
  """The python block after ``marker`` in docs/performance.md, run with its prints
  silenced, and the ``tables`` text blocks that follow it."""
  with open(os.path.join(ROOT, "docs", "performance.md")) as f:
    doc = f.read()
  code, end = _block_after(doc, doc.index(marker), "python")
  texts = []
  for _ in range(tables):
    text, end = _block_after(doc, end, "text")
    texts.append(text.rstrip())
  namespace = {"ring_jax": ring_jax}
  exec(compile(code.replace("print(", "str("), "performance.md", "exec"), namespace)
  return namespace, texts


@pytest.mark.parametrize("marker,functions", [
    ("<!-- plan-tables -->", ("device_table", "plan_table")),
    ("<!-- plan-tables-two-level -->", ("two_level_table",))])
def test_doc_tables_are_plans_output(marker, functions):
  """docs/performance.md's device table and predictions (one link level and two) are what
  its code prints now."""
  namespace, texts = _doc_code_and_tables(marker, len(functions))
  for fn, text in zip(functions, texts):
    assert namespace[fn]().rstrip() == text, fn


def test_window():
  """A window of one shard's length: the work shrinks to the window's band, but the ring
  still sends K/V around all n - 1 hops (no hop pruning), so its transfer is exposed, while
  all-gather and Ulysses only pay their collectives once."""
  local = 4096
  kw = dict(GQA, is_causal=True, local_window_size=local)
  p = ring_jax.plan(seq_len=8 * local, sequence=8, device="TPU v5p", **kw)
  full = ring_jax.plan(seq_len=8 * local, sequence=8, device="TPU v5p", **GQA)
  ring = p.estimate("ring")
  assert ring.flops == pytest.approx(full.estimate("ring").flops * (local + 1) / (8 * local) * 2)
  assert not ring.hidden and ring.exposed_comm_s > 0.5 * ring.comm_s
  assert "window (4096, 4096)" in p.setting


def test_window_prunes_contiguous_ring():
  """With the contiguous layout the windowed ring runs only the hops holding visible keys
  (ring_jax.routing.hop_range): one K/V transfer for a one-shard causal window; routed
  (the default there), 7 of the 8 devices send it (device 0 needs no wrap-around shard)."""
  local = 4096
  kw = dict(GQA, is_causal=True, local_window_size=local, layout="contiguous")
  kv = 2 * local * 8 * 128 * 2
  full = kv + kv + 2 * kv * 4 / 2  # fwd, bwd K/V, dK/dV
  for routing, fraction in ((False, 1.0), (None, 7 / 8)):
    ring = ring_jax.plan(seq_len=8 * local, sequence=8, device="TPU v5p",
                         causal_routing=routing, **kw).estimate("ring")
    assert ring.bytes_moved == pytest.approx(fraction * full), routing


@pytest.mark.parametrize("kwargs, want, why", [
    (dict(ring_size=1, packed=True), "contiguous", "ring of 1"),
    (dict(ring_size=8, packed=True, is_causal=False), "contiguous", "not causal"),
    # A window of one shard reaches one device back: contiguous runs 2 of the 8 hops.
    (dict(ring_size=8, packed=True, local_window_size=512, local_len=512), "contiguous",
     "runs 2 of the 8 hops"),
    # (left, right) as ring_attention takes it; causal: only the left side reaches back.
    (dict(ring_size=8, packed=False, local_window_size=(1024, 1024), local_len=512),
     "contiguous", "runs 3 of the 8 hops"),
    # A window over 7 shards reaches the whole ring; packed rows cannot take "document".
    (dict(ring_size=8, packed=True, local_window_size=7 * 512, local_len=512), "zigzag",
     "document layout takes no window"),
    (dict(ring_size=8, packed=True), "document", "several documents per row"),
    (dict(ring_size=8, packed=False), "zigzag", "one sequence per row"),
])
def test_choose_layout_branches(kwargs, want, why):
  """Each branch of ring_jax.planning.choose_layout, with the reason it gives."""
  from ring_jax.planning import choose_layout

  layout, reason = choose_layout(**kwargs)
  assert (layout, why in reason) == (want, True), reason


def test_choose_layout_window_agrees_with_the_hops_the_ring_runs():
  """choose_layout's window rule is hop_range's: "contiguous" exactly when the contiguous
  ring skips hops, and a window then needs the local length."""
  from ring_jax import routing
  from ring_jax.planning import choose_layout

  for window in (1, 512, 513, 6 * 512, 6 * 512 + 1):
    first, last = routing.hop_range("contiguous", 8, 512, True, (window, window))
    skips = last - first + 1 < 8
    assert (choose_layout(8, packed=False, local_window_size=window, local_len=512)[0]
            == ("contiguous" if skips else "zigzag")), window
  with pytest.raises(ValueError, match="needs local_len"):
    choose_layout(8, packed=True, local_window_size=512)


@pytest.mark.parametrize("device,platform,block", [("cpu", "cpu", 128), ("TPU v5p", "tpu", 512),
                                                   ("H200", "gpu", 128)])
def test_table_names_the_platforms_default_block(device, platform, block):
  """plan()'s first line names the hop kernel's block at the ring's local length: the
  platform's default (ring_jax.ring.BLOCK_TARGETS), or the one passed."""
  kw = dict(batch=1, seq_len=65536, heads=8, kv_heads=8, head_dim=64, sequence=8,
            device=device)
  assert f"block {block} ({platform} default)," in ring_jax.plan(**kw).table().splitlines()[0]
  assert "block 64," in ring_jax.plan(**kw, block=64).table().splitlines()[0]
  # The score tiles of a bigger block are part of the memory estimate.
  assert (ring_jax.plan(**kw, block=1024).estimate("ring").memory_bytes >
          ring_jax.plan(**kw).estimate("ring").memory_bytes)
