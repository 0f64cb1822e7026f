"""Causal routing (ring_jax.routing.routes): K/V parts travel only to the devices that see them.

Exactness against the float64 oracle (forward and every gradient) over the layouts, masks,
packed documents, GQA and ring sizes 2-8 (odd ones on sub-meshes of the 8 fake devices), and
the bytes of every collective-permute the compiled programs execute (loop trips included).
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import ring_jax
from attn_utils import assert_close, grads, make_mesh, out_and_grads, packed_segments, qkv
from ring_jax import routing


def test_routes_move_what_the_causal_mask_uses():
  """Contiguous: shard j stops at device n-1 (half the transfers) and its dK/dV goes home from
  there; zigzag: both chunks travel backward (d -> d-1), early chunks around the whole ring,
  late chunks only j hops (0.75x the bytes); striped: every device sees every shard."""
  n = 8
  con = routing.routes("contiguous", n, 16, True)
  (stream,) = con.streams
  assert [len(p) for p in stream.arrive] == [0, 7, 6, 5, 4, 3, 2, 1]
  assert stream.home[1:] == tuple(((n - 1, n - 1 - h),) for h in range(1, n))
  assert con.kv_fraction() == 0.5 and con.max_chunks_per_link() == 1.0
  zig = routing.routes("zigzag", n, 16, True)
  early, late = zig.streams
  assert (early.step, late.step) == (-1, -1)
  assert [len(p) for p in early.arrive] == [0] + [n] * (n - 1)
  assert [len(p) for p in late.arrive] == [0, 7, 6, 5, 4, 3, 2, 1]
  assert all(dst == (src - 1) % n for s in zig.streams for pairs in s.arrive
             for src, dst in pairs)
  # Both chunks share a link at the first hops (a whole shard, as the full rotation's).
  assert zig.kv_fraction() == 0.75 and zig.max_chunks_per_link() == 1.0
  assert not routing.routes("striped", n, 16, True).routed
  assert not routing.routes("contiguous", n, 16, False).routed
  # The default (None): routed for causal contiguous rings only.
  assert routing.check_routing(None, "contiguous", True)
  assert not any(routing.check_routing(None, lay, True) for lay in ("zigzag", "document"))
  assert not routing.check_routing(None, "contiguous", False)
  assert not routing.check_routing(None, "striped", True)
  assert routing.check_routing(True, "striped", True)
  assert not routing.check_routing(False, "contiguous", True)
  with pytest.raises(TypeError, match="causal_routing must be None"):
    routing.check_routing("yes", "contiguous", True)
  default = ring_jax.schedule("contiguous", n, 16, 4, 4, True)
  assert default.routes is not None and default.routes.streams == con.streams


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_backward_rotation_ends_on_each_owner(n):
  """The full rotation's backward: every shard moves d -> d-1 at each of the hops 1..n (n
  K/V transfers, the first before any compute), device d holds shard d + h at hop h, and the
  last hop holds each device's own shard: its dK/dV accumulators need no transfer home."""
  bwd = routing.backward_rotation("zigzag", n, 16)
  (stream,) = bwd.streams
  if n == 1:
    assert bwd == routing.rotation("zigzag", 1, 16)
    return
  assert bwd.hops == (1, n) and stream.step == -1 and not bwd.routed
  ring = tuple(sorted((j, (j - 1) % n) for j in range(n)))
  assert stream.arrive == (ring,) * n
  assert [stream.source(d, h, n) for h in range(1, n + 1) for d in range(n)] == [
      (d + h) % n for h in range(1, n + 1) for d in range(n)]
  assert stream.home == ((),) * n
  assert stream.done_home == ((),) * (n - 1) + (tuple(range(n)),)
  # The float32 accumulators: n - 1 transfers travel with K/V, none goes home.
  assert bwd.dkv_fraction() == (n - 1) / n and bwd.kv_fraction() == 1.0


def test_routed_zigzag_schedule_keeps_every_hops_work():
  """The routed zigzag schedule computes every device's causal pairs once, and at every hop
  each device does the work it does in the full rotation: device d holds the chunks of
  d + h at hop h, whose late chunk its late queries see while d + h < n and whose early chunk
  its early queries see from the wrap on, one or the other (docs/performance.md)."""
  for n in (2, 3, 8):
    full = ring_jax.schedule("zigzag", n, 16, 4, 4, True, causal_routing=False)
    routed = ring_jax.schedule("zigzag", n, 16, 4, 4, True, causal_routing=True)
    assert full.routes is None and routed.routes is not None
    np.testing.assert_array_equal(routed.work_per_device(), full.work_per_device())
    np.testing.assert_array_equal(routed.num_pairs.max(axis=0), full.num_pairs.max(axis=0))
    assert routed.critical_path() == full.critical_path()
  assert full.critical_path() == 66


def _float64_oracle(q, k, v, cot, **kw):
  with jax.enable_x64(True):
    q, k, v, cot = (jnp.asarray(np.asarray(x), jnp.float64) for x in (q, k, v, cot))
    ref = functools.partial(ring_jax.reference_attention, **kw)
    return ref(q, k, v), grads(ref, q, k, v, cot)


CASES = [  # (layout, ring size, causal, window, packed segments, GQA, overlap_dkv)
    ("contiguous", 8, True, None, True, True, False),
    ("contiguous", 5, True, 9, False, True, True),
    ("contiguous", 4, False, (7, 5), True, False, False),  # window-pruned hops -1..1
    ("zigzag", 2, True, None, False, True, False),
    ("zigzag", 3, True, 13, True, True, True),
    ("zigzag", 6, True, None, True, False, False),
]


@pytest.mark.parametrize("layout,n,causal,window,packed,gqa,overlap", CASES)
def test_routed_ring_matches_the_float64_oracle(layout, n, causal, window, packed, gqa, overlap):
  mesh = make_mesh((n,), ("sequence",))
  length = 8 * n
  q, k, v = qkv(n, 2, length, 4, 2 if gqa else 4, 8)
  seg = packed_segments(2, length, seed=n, pad_rows=(1,)) if packed else None
  kw = dict(is_causal=causal, local_window_size=window, segment_ids=seg)
  fn = functools.partial(ring_jax.ring_attention_sharded, mesh=mesh, layout=layout,
                         batch_axis=None, block_q=2, block_kv=2, overlap_dkv=overlap,
                         causal_routing=True, **kw)
  cot = jax.random.normal(jax.random.key(n), q.shape, jnp.float32)
  want_out, want_grads = _float64_oracle(q, k, v, cot, **kw)
  out, got = out_and_grads(fn, q, k, v, cot)  # one program: compiling dominates these shapes
  assert_close(out, want_out, what="out")
  for name, g, w in zip("qkv", got, want_grads):
    assert_close(g, w, what=f"d{name}")


def _permute_bytes(hlo: str, scope: str = ""):
  """Bytes (summed over devices) of every collective-permute a compiled program executes, as
  a list (one entry per execution): operand bytes x source-target pairs, loop bodies
  counted ``known_trip_count`` times; only those whose op name holds ``scope``.

  A routed ring's loop picks each hop's transfer with a ``lax.switch`` on the loop counter,
  one branch per trip (ring_jax.ring.hop_send): a conditional with collective-permutes in
  its branches must sit in a loop with as many trips as branches, and each branch is
  counted once per execution of that loop (anything else fails here, not silently)."""
  comps, name = {}, None
  for line in hlo.splitlines():
    head = re.match(r"(?:ENTRY )?%(\S+) .*\{$", line)
    if head:
      name = head.group(1)
      comps[name] = []
      if line.startswith("ENTRY"):
        entry = name
    elif name is not None:
      comps[name].append(line)
  sizes = {"f32": 4, "s32": 4, "bf16": 2, "f16": 2, "pred": 1, "f64": 8}

  def run(comp, times, trips=None):
    out = []
    for line in comps[comp]:
      cp = re.search(r"= (\w+)\[([\d,]*)\]\S* collective-permute\("
                     r".*source_target_pairs=\{(.*?)\}\}", line)
      if cp and scope in line:
        dtype, dims, pairs = cp.groups()
        elems = int(np.prod([int(d) for d in dims.split(",") if d]))
        out += [elems * sizes[dtype] * pairs.count("{")] * times
      loop = re.search(r"while\(.*body=%([\w.\-]+).*\"known_trip_count\":\{\"n\":\"(\d+)\"", line)
      cond = re.search(r"conditional\(.*branch_computations=\{([^}]*)\}", line)
      if loop:
        out += run(loop.group(1), times * int(loop.group(2)), int(loop.group(2)))
      elif cond:
        branches = re.findall(r"%([\w.\-]+)", cond.group(1))
        per_branch = [run(b, 1) for b in branches]
        if any(per_branch):
          assert trips == len(branches), (comp, trips, len(branches))
          out += [x * (times // trips) for b in per_branch for x in b]
      elif "collective-permute" not in line:
        for callee in re.findall(r"(?:to_apply|calls|body)=%([\w.\-]+)", line):
          if callee in comps:
            out += run(callee, times)
    return out

  return run(entry, 1)


@pytest.mark.parametrize("n", [2, 4])
def test_full_rotation_backward_starts_where_the_forward_ends(n):
  """The full rotation's compiled fwd+bwd: the forward moves K/V n - 1 times; the backward
  starts on the parts the forward's last hop held (no K/V transfer before its first hop),
  moves them n - 1 times with their dK/dV accumulators, and sends none home: exactly
  (n - 1) x (K/V + dK/dV) bytes per device in the backward (float32 inputs: XLA:CPU would
  move bfloat16 as float32)."""
  mesh = make_mesh((n,), ("sequence",))
  length, heads, dim = 8 * n, 2, 8
  q, k, v = qkv(0, 1, length, heads, heads, dim)
  spec = P(None, "sequence", None, None)
  fn = jax.shard_map(functools.partial(
      ring_jax.ring_attention, axis_name="sequence", is_causal=True, layout="zigzag",
      block_q=4, block_kv=4, causal_routing=False), mesh=mesh, in_specs=(spec,) * 3,
      out_specs=spec)
  loss = lambda q, k, v: fn(q, k, v).sum()  # noqa: E731
  hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile().as_text()
  shard = length // n * heads * dim  # elements of one device's K (or V) shard
  fwd, bwd = _permute_bytes(hlo, "/ring_fwd/"), _permute_bytes(hlo, "/ring_bwd/")
  assert sum(fwd) == (n - 1) * n * 2 * shard * 4  # K and V, every device
  assert sum(bwd) == (n - 1) * n * 2 * shard * (4 + 4)  # K/V and dK/dV
  assert _permute_bytes(hlo, "dkv_home") == []


@pytest.mark.parametrize("layout,limit", [("contiguous", 0.55), ("zigzag", 0.80)])
def test_routed_rings_move_fewer_bytes_in_the_compiled_program(layout, limit):
  """Ring of 8: the collective-permute bytes of the causal (routed) ring over those of the
  non-causal (full rotation) ring, forward and forward+backward, from the compiled HLO.
  Contiguous runs with the default ``causal_routing`` (routed when causal, full when not),
  zigzag with it on."""
  n = 8
  mesh = make_mesh((n,), ("sequence",))
  q, k, v = qkv(0, 1, 16 * n, 4, 2, 8)
  spec = P(None, "sequence", None, None)
  moved = {}
  for causal in (True, False):
    fn = jax.shard_map(functools.partial(
        ring_jax.ring_attention, axis_name="sequence", is_causal=causal, layout=layout,
        block_q=4, block_kv=4, causal_routing=None if layout == "contiguous" else causal),
        mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
    fwd_bwd = jax.grad(lambda q, k, v: fn(q, k, v).sum(), argnums=(0, 1, 2))
    hlo = jax.jit(fwd_bwd).lower(q, k, v).compile().as_text()
    # The forward's transfers are the ones named ring_fwd (the program holds both passes).
    moved[causal, "fwd"] = _permute_bytes(hlo, "/ring_fwd/")
    moved[causal, "fwd+bwd"] = _permute_bytes(hlo)
  for what in ("fwd", "fwd+bwd"):
    routed, full = moved[True, what], moved[False, what]
    assert full and sum(routed) <= limit * sum(full), (what, sum(routed) / sum(full))
    if layout == "zigzag":  # one chunk per transfer: half a full transfer
      assert max(routed) <= 0.55 * max(full), what
