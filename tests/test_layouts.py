"""Layouts: reorder/restore, global positions, and the block schedule."""

import itertools

import jax.numpy as jnp
import numpy as np
import pytest

import ring_jax
from ring_jax import layouts


@pytest.mark.parametrize("layout", ring_jax.LAYOUTS)
@pytest.mark.parametrize("ring_size", [1, 2, 3, 8])
def test_round_trip_and_positions(layout, ring_size):
  length = 4 * ring_size
  x = jnp.arange(2 * length).reshape(2, length) * 10
  y = ring_jax.to_layout(x, layout, ring_size)
  np.testing.assert_array_equal(ring_jax.from_layout(y, layout, ring_size), x)
  pos = ring_jax.layout_positions(layout, ring_size, length)
  np.testing.assert_array_equal(np.asarray(y[0]), np.asarray(x[0])[pos])
  assert sorted(pos.tolist()) == list(range(length))
  local = length // ring_size
  for d in range(ring_size):  # the kernel's per-device formula agrees with the global one
    np.testing.assert_array_equal(
        layouts.local_positions(layout, ring_size, local, d), pos[d * local:(d + 1) * local])


def test_layout_definitions():
  np.testing.assert_array_equal(ring_jax.layout_positions("zigzag", 2, 8), [0, 1, 6, 7, 2, 3, 4, 5])
  np.testing.assert_array_equal(ring_jax.layout_positions("striped", 2, 8), [0, 2, 4, 6, 1, 3, 5, 7])
  np.testing.assert_array_equal(ring_jax.layout_positions("contiguous", 2, 8), np.arange(8))


def test_layout_errors():
  with pytest.raises(ValueError, match="layout must be one of"):
    ring_jax.layout_positions("ring", 2, 8)
  with pytest.raises(ValueError, match="not divisible by the ring size"):
    ring_jax.to_layout(jnp.zeros((1, 10)), "striped", 4)
  with pytest.raises(ValueError, match="must be even"):
    ring_jax.to_layout(jnp.zeros((1, 12)), "zigzag", 4)
  with pytest.raises(ValueError, match="must divide"):
    ring_jax.schedule("zigzag", 2, 8, 3, 4, True)
  with pytest.raises(ValueError, match=">= 0"):
    layouts.normalize_window((-1, 2))
  with pytest.raises(TypeError, match="local_window_size"):
    layouts.normalize_window("wide")


@pytest.mark.parametrize("layout", ring_jax.LAYOUTS)
@pytest.mark.parametrize("window", [None, 3, (6, 0), (1, 4)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_schedule_matches_brute_force(layout, window, is_causal):
  """Block pairs with a visible (query, key) pair are scheduled, and (bar one case) only those.

  The exception, documented in block_visibility: striped blocks under a local
  window may schedule a pair whose mask is empty (extra work, never a miss).
  """
  n, local, bq, bk = 4, 8, 2, 4
  sched = ring_jax.schedule(layout, n, local, bq, bk, is_causal, window)
  win = layouts.normalize_window(window)
  pos = [layouts.local_positions(layout, n, local, d) for d in range(n)]
  for d, h in itertools.product(range(n), range(n)):
    mask = layouts.position_mask(pos[d], pos[(d - h) % n], is_causal, win)
    per_block = mask.reshape(local // bq, bq, local // bk, bk).sum(axis=(1, 3))
    visible = per_block > 0
    if window is not None and layout == "striped":
      assert (sched.active[d, h] | ~visible).all()
    else:
      np.testing.assert_array_equal(sched.active[d, h], visible)
    m = sched.num_pairs[d, h]
    for (a, b), part in zip(sched.pairs[d, h, :m], sched.partial[d, h, :m]):
      assert part == (per_block[a, b] < bq * bk)


def test_causal_balance():
  """The figures the README quotes: causal block pairs per device, 8 devices, 4 blocks/chunk."""
  n, local, block = 8, 32, 4
  work = {lay: ring_jax.schedule(lay, n, local, block, block, True) for lay in ring_jax.LAYOUTS}
  contiguous = work["contiguous"].work_per_device()
  np.testing.assert_array_equal(contiguous, 36 + 64 * np.arange(n))  # c(c+1)/2 + i*c^2, c=8
  zig = work["zigzag"].work_per_device()
  assert (zig == zig[0]).all() and zig[0] == 4 * 5 // 2 * 2 + 16 + (n - 1) * 2 * 16
  assert zig.sum() == contiguous.sum()  # same total work, evenly spread
  assert work["zigzag"].critical_path() < 0.6 * work["contiguous"].critical_path()
  striped = work["striped"].work_per_device()
  assert (striped == striped[0]).all()


def test_non_causal_schedule_is_dense():
  sched = ring_jax.schedule("zigzag", 4, 16, 4, 8)
  assert (sched.num_pairs == 4 * 2).all() and not sched.partial.any()


@pytest.mark.parametrize("layout", ring_jax.LAYOUTS)
@pytest.mark.parametrize("ring_size", [2, 3, 8])
def test_shard_reorder_matches_global_reorder(layout, ring_size):
  """shard_to_layout / shard_from_layout inside shard_map == to_layout / from_layout."""
  import jax
  from jax.sharding import PartitionSpec as P
  from attn_utils import make_mesh

  mesh = make_mesh((ring_size,), ("sequence",))
  length = 2 * ring_size * ring_size
  x = jnp.arange(2 * length * 3).reshape(2, length, 3)
  spec = P(None, "sequence")
  to = jax.shard_map(lambda x: ring_jax.shard_to_layout(x, layout, "sequence"), mesh=mesh,
                     in_specs=spec, out_specs=spec)
  back = jax.shard_map(lambda x: ring_jax.shard_from_layout(x, layout, "sequence"), mesh=mesh,
                       in_specs=spec, out_specs=spec)
  y = jax.jit(to)(x)
  np.testing.assert_array_equal(y, ring_jax.to_layout(x, layout, ring_size))
  np.testing.assert_array_equal(jax.jit(back)(y), x)
