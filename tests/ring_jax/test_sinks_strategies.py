"""Attention sinks (and the logit soft-cap with them) in every strategy of attention_sharded
(all_gather, ulysses, hybrid, the two-level ring, auto) and in the in-shard_map strategy
functions, on 8 fake devices, against the float64 oracles: forward, lse and the gradients of
q, k, v and the sinks. Large sink offsets (|s| up to 10) and rows that see no key (a whole
padding row: sink-only rows), GQA."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import ring_jax
from attn_utils import assert_close, make_mesh, packed_segments, qkv
from ring_jax.testing import oracle

B, L, N, K, H = 2, 32, 8, 2, 8  # GQA: 4 query heads per key/value head
SINKS = np.array([10.0, -10.0, 3.0, -4.0, 0.5, 7.0, -2.0, 1.0], np.float32)
CAP = 2.0


def inputs(seed):
  """q, k, v; segment ids with row 1 all padding (every query of it sees no key: its rows
  are the sinks' only) and trailing padding in row 0; the output and lse cotangents."""
  q, k, v = qkv(seed, B, L, N, K, H)
  seg = packed_segments(B, L, seed=seed, pad_rows=(1,)).at[0, -3:].set(0)
  rng = np.random.default_rng(seed)
  do = jnp.asarray(rng.normal(size=(B, L, N, H)), jnp.float32)
  dlse = jnp.asarray(rng.normal(size=(B, L, N)), jnp.float32)
  return q, k, v, seg, do, dlse


def float64_oracle(q, k, v, seg, do, dlse, *, is_causal, cap):
  """The kit's float64 oracle (numpy, hand-written backward): out, lse and the gradients of
  ``<out, do> + <lse, dlse>`` w.r.t. q, k, v and the sinks."""
  pos = np.arange(L)
  vis = oracle.visibility(pos, pos, is_causal, None, seg, seg)
  return oracle.attention(q, k, v, vis, H ** -0.5, do, dlse, sinks=SINKS, soft_cap=cap)


def reference64(q, k, v, seg, *, is_causal, cap):
  """ring_jax.reference_attention in float64 with the sinks (the dense oracle's forward)."""
  with jax.enable_x64(True):
    q64, k64, v64 = (jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v))
    return np.asarray(ring_jax.reference_attention(
        q64, k64, v64, is_causal=is_causal, segment_ids=seg, logits_soft_cap=cap,
        sinks=jnp.asarray(SINKS, jnp.float64)))


def check_against_oracles(fn, seed, *, is_causal, cap, what):
  """``fn(q, k, v, seg, sinks) -> (out, lse)`` vs both oracles, forward and gradients."""
  q, k, v, seg, do, dlse = inputs(seed)
  sinks = jnp.asarray(SINKS)
  want = float64_oracle(q, k, v, seg, do, dlse, is_causal=is_causal, cap=cap)

  def loss(q, k, v, sinks):  # the output comes with the gradients: one program
    out, lse = fn(q, k, v, seg, sinks)
    return jnp.sum(out * do) + jnp.sum(lse * dlse), (out, lse)

  got, (out, lse) = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(q, k, v, sinks)
  assert_close(out, reference64(q, k, v, seg, is_causal=is_causal, cap=cap),
               what=f"{what} out vs reference_attention")
  assert_close(out, want["out"], what=f"{what} out")
  assert_close(lse, want["lse"], what=f"{what} lse")
  pad = np.asarray(seg) == 0  # sink-only rows: output 0, lse = the head's sink
  assert pad[1].all() and pad[0].any()
  np.testing.assert_array_equal(np.asarray(out)[pad], 0.0)
  np.testing.assert_array_equal(np.asarray(lse)[pad], np.broadcast_to(SINKS, (pad.sum(), N)))
  for name, g in zip(("dq", "dk", "dv", "dsinks"), got):
    assert_close(g, want[name], rtol=1e-4, atol=1e-5, what=f"{what} {name}")


# strategy, mesh shape, mesh axes, seq_axis, layout, logits_soft_cap
CASES = [
    ("all_gather", (8,), ("sequence",), "sequence", "zigzag", CAP),
    # heads over tensor=2, Ulysses over 4: 4 query heads per device, its 1 K/V head repeated
    # to 4; each device applies the sinks of the one head it attends after the all_to_all
    ("ulysses", (2, 4), ("tensor", "sequence"), "sequence", "contiguous", CAP),
    ("hybrid", (2, 4), ("ring", "ulysses"), ("ring", "ulysses"), "zigzag", CAP),
    ("ring", (2, 4), ("outer", "inner"), ("outer", "inner"), "zigzag", CAP),  # two-level
    ("all_gather", (2, 4), ("data", "sequence"), "sequence", "striped", None),
]


@pytest.mark.parametrize("strategy,shape,names,seq_axis,layout,cap", CASES,
                         ids=["all_gather", "ulysses-tensor", "hybrid", "two_level_ring",
                              "all_gather-data-no_cap"])
def test_sinks_and_soft_cap_match_float64_oracle(strategy, shape, names, seq_axis, layout,
                                                  cap):
  """Causal; sinks from -10 to 10, a soft-cap of 2 (the cap-less case: sinks alone)."""
  mesh = make_mesh(shape, names)

  def fn(q, k, v, seg, sinks):
    return ring_jax.attention_sharded(q, k, v, mesh=mesh, strategy=strategy,
                                      seq_axis=seq_axis, is_causal=True, segment_ids=seg,
                                      layout=layout, block_q=2, block_kv=2, sinks=sinks,
                                      logits_soft_cap=cap, return_lse=True)

  check_against_oracles(fn, seed=len(names) + len(strategy), is_causal=True, cap=cap,
                        what=strategy)


def test_auto_with_sinks_picks_among_every_strategy():
  """"auto" with sinks runs plan()'s pick over every strategy (sinks no longer restrict it),
  equal to that strategy with sinks and to the oracle."""
  mesh = make_mesh((8,), ("sequence",))
  q, k, v, seg, _, _ = inputs(11)
  sinks = jnp.asarray(SINKS)
  chosen = ring_jax.plan(batch=B, seq_len=L, heads=N, kv_heads=K, head_dim=H, dtype=q.dtype,
                         is_causal=True, layout="zigzag", sequence=8,
                         device=jax.devices()[0].device_kind,
                         strategies=("ring", "all_gather", "ulysses")).strategy
  run = lambda strategy: jax.jit(functools.partial(  # noqa: E731
      ring_jax.attention_sharded, mesh=mesh, strategy=strategy, is_causal=True,
      layout="zigzag", segment_ids=seg, sinks=sinks))(q, k, v)
  auto = run("auto")
  np.testing.assert_array_equal(np.asarray(auto), np.asarray(run(chosen)))
  assert_close(auto, reference64(q, k, v, seg, is_causal=True, cap=None), what="auto")


@pytest.mark.parametrize("fn", [ring_jax.all_gather_attention, ring_jax.ulysses_attention,
                                ring_jax.hybrid_attention], ids=lambda f: f.__name__)
def test_in_shard_map_with_sinks_and_lse(fn):
  """The in-shard_map strategy functions take ``sinks`` (this device's query heads: all
  ``N`` here, replicated) and ``return_lse``; forward vs the float64 oracle."""
  mesh = make_mesh((2, 4), ("ring", "ulysses"))
  axes = ("ring", "ulysses")
  q, k, v, seg, do, dlse = inputs(12)
  want = float64_oracle(q, k, v, seg, do, dlse, is_causal=False, cap=CAP)
  spec = P(None, axes)
  local = functools.partial(fn, axis_name=axes, return_lse=True, logits_soft_cap=CAP)
  mapped = jax.shard_map(lambda q, k, v, s, z: local(q, k, v, segment_ids=s, sinks=z),
                         mesh=mesh, in_specs=(spec,) * 4 + (P(),),
                         out_specs=(spec, P(None, axes, None)))
  out, lse = jax.jit(mapped)(q, k, v, seg, jnp.asarray(SINKS))
  assert_close(out, want["out"], what=f"{fn.__name__} out")
  assert_close(lse, want["lse"], what=f"{fn.__name__} lse")


@pytest.mark.parametrize("strategy,seq_axis", [
    ("all_gather", "sequence"), ("ulysses", "sequence"), ("hybrid", ("ring", "sequence")),
    ("ring", ("ring", "sequence")), ("auto", "sequence")])
@pytest.mark.parametrize("sinks,match", [
    (np.zeros((3,), np.float32), r"sinks must be one float logit per query head, shape \(8,\)"),
    (np.zeros((8,), np.int32), "sinks must be floating point")])
def test_bad_sinks_are_one_clear_error_in_every_strategy(strategy, seq_axis, sinks, match):
  mesh = make_mesh((2, 4), ("ring", "sequence"))
  q, k, v = qkv(13, 1, 32, N, K, H)
  with pytest.raises(ValueError, match=match):
    ring_jax.attention_sharded(q, k, v, mesh=mesh, strategy=strategy, seq_axis=seq_axis,
                               sinks=sinks)
