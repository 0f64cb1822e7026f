"""benchmarks/length_buckets.py: the corpus it trains on and the ring permutes per step it reads
from a compiled program (every loop body once per iteration)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import length_buckets as lb


def test_the_corpus_is_mostly_short_documents():
  lengths = lb.document_lengths(np.random.default_rng(0), 1000, 2048, 0.8)
  assert len(lengths) == 1000 and np.mean(lengths <= 256) == 0.8
  assert lengths.min() >= 16 and lengths.max() <= 2048 and (lengths > 256).sum() == 200


def _program(outer: int, inner: int):
  """A shard_map over a ring of 4: ``outer x inner`` ring sends of f32[8] under the
  ``send_kv`` scope in two nested loops, and one other send of f32[16] outside them."""
  mesh = jax.make_mesh((4,), ("sequence",), axis_types=(jax.sharding.AxisType.Explicit,))
  pairs = [(i, (i + 1) % 4) for i in range(4)]

  def ring(x):
    def hop(_, x):
      with jax.named_scope("send_kv"):
        return jax.lax.ppermute(x, "sequence", pairs) * 1.5
    def layer(_, x):
      return jax.lax.fori_loop(0, inner, hop, x)
    x = jax.lax.fori_loop(0, outer, layer, x)
    y = jax.lax.ppermute(jnp.concatenate([x, x]), "sequence", pairs[::-1])
    return x + y[:8]

  fn = jax.jit(jax.shard_map(ring, mesh=mesh, in_specs=jax.P("sequence"),
                             out_specs=jax.P("sequence")))
  x = jax.ShapeDtypeStruct((32,), jnp.float32,
                           sharding=jax.sharding.NamedSharding(mesh, jax.P("sequence")))
  return fn.lower(x).compile().as_text()


@pytest.mark.parametrize("outer,inner", [(3, 5), (2, 7)])
def test_permutes_per_step_count_every_iteration(outer, inner):
  assert lb.permutes_per_step(_program(outer, inner), 4) == {
      "ring": {"count": outer * inner, "bytes": outer * inner * 8 * 4},
      "other": {"count": 1, "bytes": 16 * 4}}
