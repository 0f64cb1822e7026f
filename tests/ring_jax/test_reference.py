"""The dense oracle agrees with jax.nn.dot_product_attention and with its own definition."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ring_jax
from attn_utils import assert_close, packed_segments, programs_compiled, qkv


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("window", [None, 3, (2, 5)])
@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_matches_jax_nn(is_causal, window, kv_heads):
  q, k, v = qkv(0, 2, 16, 4, kv_heads, 8)
  got = ring_jax.reference_attention(q, k, v, is_causal=is_causal, local_window_size=window)
  want = jax.nn.dot_product_attention(q, k, v, is_causal=is_causal, local_window_size=window)
  assert_close(got, want, 1e-5, 1e-6)


def test_segments_match_explicit_mask():
  q, k, v = qkv(1, 2, 16, 2, 2, 8)
  seg = packed_segments(2, 16, seed=0)
  got = ring_jax.reference_attention(q, k, v, is_causal=True, segment_ids=seg)
  mask = (seg[:, None, :, None] == seg[:, None, None, :]) & jnp.tril(jnp.ones((16, 16), bool))
  want = jax.nn.dot_product_attention(q, k, v, mask=mask)
  valid = np.asarray(seg != 0)
  assert_close(np.asarray(got)[valid], np.asarray(want)[valid], 1e-5, 1e-6)
  assert np.all(np.asarray(got)[~valid] == 0)  # padding queries output 0


def test_positions_make_layout_order_equivalent():
  q, k, v = qkv(2, 1, 16, 2, 2, 8)
  pos = ring_jax.layout_positions("striped", 4, 16)
  got = ring_jax.reference_attention(q[:, pos], k[:, pos], v[:, pos], is_causal=True,
                                     q_positions=pos, kv_positions=pos)
  want = ring_jax.reference_attention(q, k, v, is_causal=True)
  assert_close(got, want[:, pos])


def test_float64_oracle():
  with jax.enable_x64(True):
    q, k, v = (x.astype(jnp.float64) for x in qkv(3, 1, 8, 2, 2, 4))
    out = ring_jax.reference_attention(q, k, v, is_causal=True)
  chex.assert_type(out, jnp.float64)
  chex.assert_shape(out, q.shape)
  # Plain numpy in float64 (MHA: query head n uses K/V head n).
  qn, kn, vn = (np.asarray(x) for x in (q, k, v))
  scores = np.einsum("btnh,bsnh->bnts", qn, kn) / 2.0  # head_dim 4: scale 1/2
  scores = np.where(np.tril(np.ones((8, 8), bool)), scores, -np.inf)
  p = np.exp(scores - scores.max(-1, keepdims=True))
  want = np.einsum("bnts,bsnh->btnh", p / p.sum(-1, keepdims=True), vn)
  np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_padding_values_are_never_read(dtype):
  """NaN/inf in padding keys and values (segment id 0) change nothing, in float32 and float64."""
  seg = np.ones((2, 16), np.int32)
  seg[0, 12:] = 0
  with jax.enable_x64(dtype == jnp.float64):
    q, k, v = (x.astype(dtype) for x in qkv(4, 2, 16, 2, 1, 8))
    clean = ring_jax.reference_attention(q, k, v, is_causal=True, segment_ids=seg)
    dirty = ring_jax.reference_attention(q, k.at[0, 12:].set(jnp.inf), v.at[0, 12:].set(jnp.nan),
                                         is_causal=True, segment_ids=seg)
  chex.assert_trees_all_equal(dirty, clean)
  assert np.isfinite(np.asarray(clean)).all()


def test_non_finite_value_reaches_only_the_outputs_that_read_it():
  """A NaN in V at position 5, head dim 1: rows >= 5 (causal) are NaN in column 1 only; the
  other entries equal attention over the same inputs with that V entry set to 0 there."""
  q, k, v = qkv(5, 1, 8, 2, 1, 4)
  out = np.asarray(ring_jax.reference_attention(q, k, v.at[0, 5, 0, 1].set(jnp.nan),
                                                is_causal=True))
  zeroed = np.asarray(ring_jax.reference_attention(q, k, v.at[0, 5, 0, 1].set(0.0),
                                                   is_causal=True))
  bad = np.zeros(out.shape, bool)
  bad[0, 5:, :, 1] = True
  np.testing.assert_array_equal(np.isnan(out), bad)
  np.testing.assert_allclose(out[~bad], zeroed[~bad], rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(out[:, :5], zeroed[:, :5])  # earlier rows never read it


def test_non_finite_scores_make_their_rows_non_finite():
  """NaN in a query gives a NaN row; a +inf score a NaN row (inf - inf), as dense math would."""
  q, k, v = qkv(6, 1, 8, 1, 1, 4)
  out = np.asarray(ring_jax.reference_attention(q.at[0, 3, 0, 0].set(jnp.nan), k, v))
  np.testing.assert_array_equal(np.isnan(out).any(axis=(2, 3))[0], np.arange(8) == 3)
  k_inf = k.at[0, 2, 0, 0].set(jnp.inf)  # score is +inf where q[..., 0] > 0, else -inf
  out = np.asarray(ring_jax.reference_attention(q, k_inf, v))
  plus = np.asarray(q)[0, :, 0, 0] > 0
  np.testing.assert_array_equal(np.isnan(out).all(axis=(2, 3))[0], plus)
  assert np.isfinite(out[0, ~plus]).all()


def test_an_eager_call_compiles_one_program_once(caplog):
  """Called outside jit (an oracle, a notebook) the reference is one compiled program, reused
  for the same shapes and options: not one program per operation."""
  q, k, v = qkv(11, 1, 24, 4, 2, 8)
  seg = packed_segments(1, 24, seed=3)
  _, first = programs_compiled(caplog, ring_jax.reference_attention, q, k, v, is_causal=True,
                               segment_ids=seg)
  out, again = programs_compiled(caplog, ring_jax.reference_attention, q, k, v, is_causal=True,
                                 segment_ids=seg)
  assert len(first) == 1 and again == [], (first, again)
  assert_close(out, jax.jit(functools.partial(ring_jax.reference_attention, is_causal=True))(
      q, k, v, segment_ids=seg), 0, 0, "eager vs jit")
