"""The dense oracle agrees with jax.nn.dot_product_attention and with its own definition."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ring_jax
from attn_utils import assert_close, packed_segments, qkv


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
    assert ring_jax.reference_attention(q, k, v).dtype == jnp.float64
