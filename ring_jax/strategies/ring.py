"""The ring (:func:`ring_jax.ring_attention`) as a strategy on global arrays.

K/V shards travel around the sequence axis with ``ppermute``, overlapped with
each hop's compute; memory linear in the *local* length. The ring itself
lives in :mod:`ring_jax.ring`; this module only tells the global-array
wrapper how to run it (:func:`ring_jax.ring_attention_sharded`). With
``seq_axis=(outer, inner)`` it runs the two-level ring
(:mod:`ring_jax.two_level`): an inner ring over ``inner``, the outer
transfers over ``outer`` issued a whole inner ring ahead.
"""

from __future__ import annotations

import math

from ring_jax import validation
from ring_jax.ring import ring_attention
from ring_jax.strategies import global_arrays
from ring_jax.strategies.options import AttentionOptions
from ring_jax.two_level import two_level_ring_attention


def _local(query, key, value, segment_ids, *, axis_name, options: AttentionOptions,
           sinks=None):
  attend = two_level_ring_attention if isinstance(axis_name, tuple) else ring_attention
  return attend(query, key, value, axis_name=axis_name, segment_ids=segment_ids, sinks=sinks,
                **options.ring_kwargs())


def _check(where: global_arrays.Placement, length, kv_len, heads, kv_heads, options):
  del heads, kv_heads  # any head count
  ring = math.prod(where.seq_sizes)  # a pair (outer, inner): one ring over both
  validation.check_split(options.layout, ring, length, what="query length")
  validation.check_split(options.layout, ring, kv_len, what="key/value length")


STRATEGY = global_arrays.Strategy(name="ring", local=_local, check=_check,
                                  cross_attention=True, one_ring_over_pair=True)
