"""``flax_attention_fn``: ring attention as the ``attention_fn=`` of Flax attention modules.

``flax.nnx.MultiHeadAttention`` and ``flax.linen.MultiHeadDotProductAttention``
take an ``attention_fn`` with the signature of Flax's ``dot_product_attention``.
:func:`flax_attention_fn` returns such a function that runs
:func:`ring_jax.ring_attention_sharded`, so an existing Flax model gets ring
attention by passing one argument.

The adapter only mirrors the call signature: this module does not import Flax,
and ``ring_jax`` stays importable without it.

What a dense mask would express goes to the adapter instead (ring attention
never builds the ``[q_length, kv_length]`` matrix a mask or bias lives on):
``is_causal=True``, ``segment_ids=`` (packed documents and padding) and
``local_window_size=``; so do attention sinks (``sinks=``, GPT-OSS) and a logit soft-cap
(``logits_soft_cap=``, Gemma 2), which Flax's signature has no place for.
V's head size may differ from Q/K's (MLA) where a module passes such values. A module that
passes a ``mask``, a ``bias``, active dropout or ``sow_weights=True`` is refused with a
``ValueError`` naming that fix.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ring_jax import layouts
from ring_jax import sharded
from ring_jax.strategies import global_arrays

_MASK_FIX = (
    "ring attention never builds the [q_length, kv_length] matrix a dense {what} lives on. "
    "Call the module with {what}=None and give the adapter what the {what} meant: "
    "flax_attention_fn(..., is_causal=True) for a causal mask (nnx: or module(x, "
    "is_causal=True)), segment_ids= (int [batch, length], 0 = padding) for padding and packed "
    "documents, local_window_size= for a sliding window. A {what} of any other shape (ALiBi, "
    "relative-position biases, decode-time cache masks) is not supported by ring attention; "
    "keep the module's default attention_fn for it.")


def _as_static_bool(value, name: str) -> bool:
  try:
    return bool(value)
  except Exception as e:  # a traced flag: jax.errors.ConcretizationTypeError and kin
    raise ValueError(
        f"{name} must be a Python bool for ring attention, got a traced value; pass a "
        "Python bool (e.g. deterministic=True) to the module.") from e


def _like_query_sharding(out, query, mesh):
  """On a mesh with Explicit axes, ``out`` in the sharding the query came in.

  There the ring's output carries its ``(batch, sequence, heads)`` sharding in
  its type, and the module's next layer would see a different sharding than
  with dense attention (e.g. the output projection's weight gradient would
  contract over two sharded axes and fail to trace). Dense attention keeps
  the query's sharding; so does the adapter. On Auto meshes XLA propagates
  shardings and nothing is needed.
  """
  ring_mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
  if not global_arrays.has_explicit_axes(ring_mesh):
    return out
  query_sharding = jax.typeof(query).sharding
  on_mesh = getattr(getattr(query_sharding, "mesh", None), "axis_names", ())
  spec = query_sharding.spec if on_mesh else P()
  return global_arrays.place(ring_mesh, out, spec)


def flax_attention_fn(*, mesh=None, is_causal: bool = False, layout: str = "contiguous",
                      seq_axis: str = "sequence", batch_axis: str | None = "data",
                      head_axis: str | None = "tensor", segment_ids=None,
                      scale: float | None = None, local_window_size=None,
                      inputs_in_layout: bool = False, block_q: int | None = None,
                      block_kv: int | None = None, hop_kernel="auto", sinks=None,
                      logits_soft_cap: float | None = None):
  """An ``attention_fn`` for Flax attention modules that runs ring attention.

  Usage::

    attn = nnx.MultiHeadAttention(num_heads=4, in_features=64, decode=False, rngs=rngs,
                                  attention_fn=ring_jax.flax_attention_fn(mesh=mesh,
                                                                          is_causal=True))
    # linen: nn.MultiHeadDotProductAttention(num_heads=4,
    #                                        attention_fn=ring_jax.flax_attention_fn(mesh=mesh))

  Call the module under ``jax.jit``; its activations are then sharded by the
  returned function exactly as :func:`ring_jax.ring_attention_sharded` shards
  them (sequence over ``seq_axis``, batch over ``batch_axis``, heads over
  ``head_axis``). On a mesh with Explicit axes the result comes back in the
  query's sharding, as dense attention's would.

  Args:
    mesh, seq_axis, batch_axis, head_axis, layout, inputs_in_layout, scale,
    local_window_size, block_q, block_kv, hop_kernel: as in
      :func:`ring_jax.ring_attention_sharded`. With ``inputs_in_layout=True``
      the module's inputs (and ``segment_ids``) must already be in ``layout``
      order (:func:`ring_jax.to_layout`), and its outputs stay in that order.
    is_causal: causal mask. ``nnx.MultiHeadAttention``'s own
      ``is_causal=True`` call argument also makes it causal (either one
      suffices).
    segment_ids: int ``[batch..., length]``: tokens attend only within equal
      ids; 0 is padding (a padding query's attention output is 0). Flax's
      modules cannot pass per-batch arrays to their ``attention_fn``, so the
      ids are bound here: build the ``attention_fn`` inside your jitted step
      from the batch's ids (a tracer there is fine) and set it on the module
      for that call (see ``docs/using_the_kernel.md``). Requires self-attention
      (query length == key length).
    sinks: ``[heads]`` attention sinks (one float32 logit per query head, GPT-OSS), in
      each row's softmax denominator once (:func:`ring_jax.hop.add_sinks`). Bound here
      like ``segment_ids``: a module that learns them builds the ``attention_fn`` from its
      sinks parameter in its ``__call__`` (a tracer is fine); gradients reach it.
    logits_soft_cap: ``c > 0``: scores become ``c * tanh(score / c)`` (Gemma 2).

  Returns:
    ``attention_fn(query, key, value, bias=None, mask=None,
    broadcast_dropout=True, dropout_rng=None, dropout_rate=0.0,
    deterministic=False, dtype=None, precision=None, module=None, *,
    is_causal=False, ...)`` with Flax's ``dot_product_attention`` signature
    (and the extra keywords nnx and linen modules pass). Query/key/value are
    ``[batch..., length, heads, head_dim]`` (values and the result may have a head size
    of their own); leading batch dimensions are
    flattened into one for the ring and restored; without any batch
    dimension a batch of 1 is used (pass ``batch_axis=None`` then, unless the
    batch axis has size 1). Inputs are promoted to ``dtype`` (default: their
    common dtype) and the result has that dtype, as in Flax; ``precision`` is
    passed to the kernel's matmuls.
  """
  layouts.check_layout(layout)
  adapter_causal = bool(is_causal)
  sharded_kwargs = dict(mesh=mesh, seq_axis=seq_axis, batch_axis=batch_axis,
                        head_axis=head_axis, scale=scale, local_window_size=local_window_size,
                        layout=layout, inputs_in_layout=inputs_in_layout, block_q=block_q,
                        block_kv=block_kv, hop_kernel=hop_kernel,
                        logits_soft_cap=logits_soft_cap)

  def attention_fn(query, key, value, bias=None, mask=None, broadcast_dropout=True,
                   dropout_rng=None, dropout_rate=0.0, deterministic=False, dtype=None,
                   precision=None, module=None, *, is_causal=False, promote_dtype=None,
                   force_fp32_for_softmax=False, einsum_dot_general=None,
                   qk_attn_weights_einsum=None, attn_weights_value_einsum=None):
    """Flax ``dot_product_attention`` computed by ring attention (see ``flax_attention_fn``)."""
    del broadcast_dropout, dropout_rng  # only meaningful with dropout, which is refused
    del force_fp32_for_softmax  # the ring's softmax statistics are always float32
    _refuse_what_the_ring_cannot_do(
        mask=mask, bias=bias, dropout_rate=dropout_rate, deterministic=deterministic,
        module=module, einsums=(einsum_dot_general, qk_attn_weights_einsum,
                                attn_weights_value_einsum))
    if promote_dtype is not None:  # nnx's hook: promote_dtype((q, k, v), dtype=dtype)
      query, key, value = promote_dtype((query, key, value), dtype=dtype)
    else:
      dtype = jnp.result_type(query, key, value) if dtype is None else dtype
      query, key, value = (jnp.asarray(x, dtype) for x in (query, key, value))
    batch_dims, (q, k, v, seg) = _one_batch_dim(query, key, value, segment_ids)
    out = sharded.ring_attention_sharded(q, k, v, is_causal=adapter_causal or bool(is_causal),
                                         segment_ids=seg, precision=precision, sinks=sinks,
                                         **sharded_kwargs)
    out = out.reshape(*batch_dims, *out.shape[1:]).astype(query.dtype)
    return _like_query_sharding(out, query, mesh)

  return attention_fn


def _refuse_what_the_ring_cannot_do(*, mask, bias, dropout_rate, deterministic, module,
                                    einsums) -> None:
  """ValueError naming the fix for what Flax's attention_fn may pass and the ring lacks."""
  if mask is not None:
    raise ValueError(f"flax_attention_fn got a mask: {_MASK_FIX.format(what='mask')}")
  if bias is not None:
    raise ValueError(f"flax_attention_fn got a bias: {_MASK_FIX.format(what='bias')}")
  if float(dropout_rate) > 0.0 and not _as_static_bool(deterministic, "deterministic"):
    raise ValueError(
        f"flax_attention_fn got attention dropout (dropout_rate={dropout_rate}, "
        "deterministic=False): ring attention never materialises the attention weights "
        "dropout acts on. Build the module with dropout_rate=0.0, or call it with "
        "deterministic=True (e.g. for evaluation).")
  if module is not None:
    raise ValueError(
        "flax_attention_fn got module= (the module was called with sow_weights=True): ring "
        "attention never materialises the attention weights to sow. Call the module with "
        "sow_weights=False.")
  if any(e is not None for e in einsums):
    raise ValueError(
        "flax_attention_fn got a custom einsum / dot_general (e.g. AQT quantisation of the "
        "attention matmuls); ring attention runs its own kernel (hop_kernel=). Leave "
        "einsum_dot_general, qk_attn_weights_einsum_cls and attn_weights_value_einsum_cls "
        "unset on the module.")


def _one_batch_dim(query, key, value, segment_ids):
  """``(batch_dims, (q, k, v, segment_ids))`` with the leading batch dimensions of
  ``[batch..., length, heads, head_dim]`` flattened into one (or one added): the ring's shape."""
  for name, x in (("query", query), ("key", key), ("value", value)):
    if x.ndim < 3:
      raise ValueError(
          f"{name} must be [batch..., length, heads, head_dim], got shape {x.shape}.")
  batch_dims = query.shape[:-3]
  if key.shape[:-3] != batch_dims or value.shape[:-3] != batch_dims:
    raise ValueError(
        f"query, key and value must share their batch dimensions, got {query.shape}, "
        f"{key.shape}, {value.shape}.")
  if segment_ids is not None and tuple(segment_ids.shape) != (*batch_dims, query.shape[-3]):
    raise ValueError(
        f"segment_ids must have shape [batch..., length] = {(*batch_dims, query.shape[-3])} "
        f"to match the query {query.shape}, got {tuple(segment_ids.shape)}; build the "
        "attention_fn from this batch's segment ids.")
  rows = math.prod(batch_dims)
  flat = [x.reshape(rows, *x.shape[-3:]) for x in (query, key, value)]
  seg = None if segment_ids is None else segment_ids.reshape(rows, segment_ids.shape[-1])
  return batch_dims, (*flat, seg)
