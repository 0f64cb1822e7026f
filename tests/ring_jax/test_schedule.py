"""The block schedule (ring_jax.scheduling), the masks and the segment-id rule
(ring_jax.masking)."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ring_jax
from ring_jax import layouts
from ring_jax import masking, scheduling


def test_top_level_schedule_is_the_function():
  """``ring_jax.schedule`` is the function (the module is ``ring_jax.scheduling``)."""
  assert ring_jax.schedule is scheduling.schedule
  assert ring_jax.Schedule is scheduling.Schedule
  assert isinstance(ring_jax.schedule("zigzag", 2, 8, 2, 2), ring_jax.Schedule)


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
  win = masking.normalize_window(window)
  pos = [layouts.local_positions(layout, n, local, d) for d in range(n)]
  for d, h in itertools.product(range(n), range(n)):
    mask = masking.position_mask(pos[d], pos[(d - h) % n], is_causal, win)
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


def test_schedule_errors():
  with pytest.raises(ValueError, match="must divide"):
    ring_jax.schedule("zigzag", 2, 8, 3, 4, True)
  with pytest.raises(ValueError, match="must be even"):
    ring_jax.schedule("zigzag", 2, 7, 7, 7, True)


@pytest.mark.parametrize("window,want", [(None, None), (3, (3, 3)), ((2, 0), (2, 0)),
                                         (np.int64(5), (5, 5)), ((0, 2**31 - 1), (0, 2**31 - 1))])
def test_normalize_window(window, want):
  assert masking.normalize_window(window) == want


@pytest.mark.parametrize("window,match", [
    ((-1, 2), ">= 0"),
    (2**40, "<= 2\\*\\*31 - 1"),
    ((1, 2**31), "<= 2\\*\\*31 - 1"),
    ((2.5, 1), "must be integers"),
    (3.0, "must be integers"),
    ((True, 1), "must be integers"),
])
def test_bad_windows_are_value_errors(window, match):
  """Nothing is truncated or overflows inside JAX: a ValueError names the fix."""
  with pytest.raises(ValueError, match=match):
    masking.normalize_window(window)


def test_window_that_is_not_a_pair_is_a_type_error():
  with pytest.raises(TypeError, match="local_window_size"):
    masking.normalize_window("wide")


@pytest.mark.parametrize("dtype", [np.int32, np.int8, np.uint8, np.uint32])
def test_segment_rule(dtype):
  """0 is padding; every other id (negative, or >= 2**31 unsigned) is a document by equality."""
  info = np.iinfo(dtype)
  ids = np.array([0, 1, info.max, info.min if info.min < 0 else 2, 1, 0], dtype)
  mask = np.asarray(masking.segment_mask(jnp.asarray(ids), jnp.asarray(ids)))
  want = (ids[:, None] == ids[None, :]) & (ids[:, None] != 0)
  np.testing.assert_array_equal(mask, want)
  assert not mask[0].any() and not mask[:, 0].any()   # padding attends and is attended by nothing
  assert mask[2, 2] and not mask[2, 1]                 # the largest id is its own document


@pytest.mark.parametrize("dtype", [np.int32, np.uint32, np.int16])
def test_block_skip_agrees_with_segment_mask(dtype):
  """blocks_share_a_segment never skips a block pair whose segment mask has a visible pair.

  Random ids, negative and large ones included; exact (no extra pairs) when
  documents are runs of consecutive ids, as packed rows are.
  """
  rng = np.random.default_rng(0)
  info = np.iinfo(dtype)
  pool = np.array([0, 1, 2, -1, -7, info.max, info.min, info.max - 1], np.int64)
  pool = pool[(pool >= info.min) & (pool <= info.max)].astype(dtype)
  block = 4
  for trial in range(20):
    ids = rng.choice(pool, size=(2, 16))
    if trial % 2:  # runs: documents as consecutive blocks of one id
      ids = np.repeat(rng.choice(pool, size=(2, 4)), 4, axis=1)
    ids = ids.astype(dtype)
    skip_ok = np.asarray(masking.blocks_share_a_segment(jnp.asarray(ids), jnp.asarray(ids),
                                                        block, block))
    mask = np.asarray(masking.segment_mask(jnp.asarray(ids), jnp.asarray(ids)))
    visible = mask.reshape(2, 4, block, 4, block).any(axis=(0, 2, 4))
    assert (skip_ok | ~visible).all(), (ids, skip_ok, visible)
    if trial % 2:
      np.testing.assert_array_equal(skip_ok, visible)


def test_block_table_ranges():
  """Causal contiguous hop on the diagonal with packed ids: query block i meets key blocks
  [0, i + 1); pairs visible everywhere (below the diagonal, one document on both sides)
  form the unmasked run; the key-block ranges are the transpose; an all-padding block
  meets nothing, and a window far from the keys leaves every range empty."""
  seg = np.ones((1, 512), np.int32)
  seg[0, 384:] = 0    # block 3: padding
  seg[0, 200] = 2     # block 1: two documents
  table = masking.block_table(np.arange(512), np.arange(512), seg, seg, 128, 128,
                              is_causal=True, window=None)
  assert table.may_mask
  np.testing.assert_array_equal(table.q_ranges[0], [[0, 1, 1, 1], [0, 2, 2, 2],
                                                    [0, 0, 1, 3], [0, 0, 0, 0]])
  np.testing.assert_array_equal(table.kv_ranges[0], [[0, 2, 3, 3], [1, 3, 3, 3],
                                                     [2, 3, 3, 3], [0, 0, 0, 0]])
  # The same on traced arrays (the ring builds tables on device).
  traced = masking.block_table(jnp.arange(512), jnp.arange(512), jnp.asarray(seg),
                               jnp.asarray(seg), 128, 128, is_causal=True, window=None)
  np.testing.assert_array_equal(traced.q_ranges, table.q_ranges)
  np.testing.assert_array_equal(traced.kv_ranges, table.kv_ranges)
  far = masking.block_table(np.arange(256), np.arange(256) + 1000, None, None, 128, 128,
                            is_causal=False, window=(10, 10))
  assert far.q_ranges.shape == (1, 2, 4) and not far.q_ranges.any()
  assert not far.kv_ranges.any()
  dense = masking.block_table(np.arange(256), np.arange(256), None, None, 128, 128,
                              is_causal=False, window=None)
  assert not dense.may_mask
  np.testing.assert_array_equal(dense.q_ranges[0], [[0, 0, 2, 2]] * 2)


def test_merged_rows_of_a_block_table():
  """merge_rows spans every row's range and keeps unmasked only what every row sees fully;
  rows_cover says which row ranges hold a pair."""
  seg = np.array([[1] * 8 + [2] * 8, [0] * 16], np.int32)  # row 1: all padding
  table = masking.block_table(np.arange(16), np.arange(16), seg, seg, 4, 4,
                              is_causal=True, window=None)
  merged = masking.merge_rows(table.q_ranges)
  np.testing.assert_array_equal(merged, [[0, 1, 1, 1], [0, 2, 2, 2], [2, 3, 3, 3],
                                         [2, 4, 4, 4]])  # row 1 needs the mask everywhere
  assert masking.rows_cover(table.q_ranges, 3, 2)
  assert not masking.rows_cover(table.q_ranges, 3, 1)


def test_wide_segment_ids_keep_equality():
  """Segment ids outside int32 (uint32 here) are remapped, not truncated."""
  big = np.uint32(2**32 - 1)
  qs = np.array([[0, 5, big, big - 1]], np.uint32)
  ks = np.array([[big, 0, 5, big - 1, 7]], np.uint32)
  cq, ck = jax.device_get(masking.segment_ids_int32(jnp.asarray(qs), jnp.asarray(ks)))
  np.testing.assert_array_equal(cq[:, :, None] == ck[:, None, :],
                                qs[:, :, None] == ks[:, None, :])
  np.testing.assert_array_equal(cq == 0, qs == 0)
