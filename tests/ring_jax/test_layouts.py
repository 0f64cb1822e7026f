"""Layouts: reorder/restore, global positions, the one length check."""

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
  np.testing.assert_array_equal(ring_jax.layout_positions("zigzag", 2, 8),
                                [0, 1, 6, 7, 2, 3, 4, 5])
  np.testing.assert_array_equal(ring_jax.layout_positions("striped", 2, 8),
                                [0, 2, 4, 6, 1, 3, 5, 7])
  np.testing.assert_array_equal(ring_jax.layout_positions("contiguous", 2, 8), np.arange(8))


def test_layout_errors():
  with pytest.raises(ValueError, match="layout must be one of"):
    ring_jax.layout_positions("ring", 2, 8)
  with pytest.raises(ValueError, match="not divisible by the ring size"):
    ring_jax.to_layout(jnp.zeros((1, 10)), "striped", 4)
  with pytest.raises(ValueError, match="must be even"):
    ring_jax.to_layout(jnp.zeros((1, 12)), "zigzag", 4)


@pytest.mark.parametrize("layout,ring_size,multiple", [
    ("contiguous", 4, 4), ("striped", 3, 3), ("zigzag", 4, 8), ("zigzag", 1, 2)])
def test_length_multiple_and_check_length(layout, ring_size, multiple):
  """The one rule: lengths that are multiples of length_multiple split; others name the fix."""
  assert layouts.length_multiple(layout, ring_size) == multiple
  for length in (multiple, 3 * multiple):
    assert layouts.check_length(layout, ring_size, length) == length // ring_size
  for length in range(1, 3 * multiple):
    if length % multiple:
      with pytest.raises(ValueError, match=f"pad .*to a multiple of {multiple}"):
        layouts.check_length(layout, ring_size, length, "query length")


def test_check_length_errors():
  with pytest.raises(ValueError, match="query length 10 is not divisible by the ring size 4"):
    layouts.check_length("striped", 4, 10, "query length")
  with pytest.raises(ValueError, match="must be positive"):
    layouts.check_length("contiguous", 2, 0)
  with pytest.raises(ValueError, match="ring_size must be >= 1"):
    layouts.length_multiple("contiguous", 0)
  with pytest.raises(ValueError, match="layout must be one of"):
    layouts.check_length("spiral", 2, 8)


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


@pytest.mark.parametrize("layout", ["zigzag", "striped"])
def test_shard_reorder_of_a_pytree_groups_arrays(layout):
  """A pytree reorders as its arrays one by one (None stays None); arrays of one dtype and
  leading shape share one set of collectives (zigzag: two ppermutes for q, k, v together)."""
  import jax
  from jax.sharding import PartitionSpec as P
  from attn_utils import make_mesh

  n = 4
  mesh = make_mesh((n,), ("sequence",))
  length = 2 * n * n
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.standard_normal((2, length, 4, 3)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((2, length, 2, 3)), jnp.float32)
  seg = jnp.arange(2 * length, dtype=jnp.int32).reshape(2, length)
  spec, spec2 = P(None, "sequence"), P(None, "sequence")
  tree = {"q": q, "k": k, "seg": seg, "none": None}
  specs = {"q": spec, "k": spec, "seg": spec2, "none": None}
  to = jax.shard_map(lambda t: ring_jax.shard_to_layout(t, layout, "sequence"), mesh=mesh,
                     in_specs=(specs,), out_specs=specs)
  back = jax.shard_map(lambda t: ring_jax.shard_from_layout(t, layout, "sequence"),
                       mesh=mesh, in_specs=(specs,), out_specs=specs)
  y = jax.jit(to)(tree)
  assert y["none"] is None
  for name in ("q", "k", "seg"):
    np.testing.assert_array_equal(y[name], ring_jax.to_layout(tree[name], layout, n))
  round_trip = jax.jit(back)(y)
  for name in ("q", "k", "seg"):
    np.testing.assert_array_equal(round_trip[name], tree[name])
  if layout == "zigzag":
    hlo = jax.jit(to).lower(tree).as_text()
    assert hlo.count("collective_permute") + hlo.count("collective-permute") == 4  # f32, int32
