"""Sequence-parallel inference: ring prefill, a sequence-sharded KV cache, decoding, sampling.

The mesh is the training mesh (``data``, ``sequence``, ``tensor``) and the
sharding rules are :mod:`models.sharding`'s: the cache's batch rows are split
over ``data``, its key/value heads over ``tensor``, and its positions
(``length``) over ``sequence``, so each device holds ``cache_len / n`` of the
positions (``n`` the ``sequence`` size): memory per device linear in
``cache_len / n``.

**Prefill.** The prompts (a batch of rows padded to ``P`` tokens, natural
order, pads with segment id 0) are reordered once into the model's layout
(``LlamaConfig.layout``: contiguous, zigzag or striped; "document", a training layout,
prefills as zigzag, whose mask positions it shares) and run through the model
with its configured attention backend (the ring over ``sequence``, or dense);
every layer's keys and values are kept.

**Cache layout (ownership rule).** The cache has ``S = n * C`` slots per row
(``C`` per device), sharded contiguously over ``sequence``: global slot
``g`` lives on device ``g // C``. Device ``d``'s first ``P / n`` slots hold
exactly the prompt tokens prefill gave it (its shard in the model's layout),
so no key or value moves after prefill, whatever the layout. The ``t``-th
token fed to the decoder (``t = 0, 1, ...``) is written on device ``t mod n``
at local slot ``P / n + t // n``: new tokens go round the ring, so every
device's share grows by one slot every ``n`` steps. Each slot also stores its
token's position and segment id (0: empty or padding), and the attention masks
come from those (same nonzero segment, key position <= query position), so
the order of slots never matters. The cache holds the prompt and every
generated token when ``P + max_new_tokens <= S``.

**Decode.** One token per row and step: its query attends every device's
cache shard locally, the partial results merge exactly by log-sum-exp over
``sequence`` (:mod:`ring_jax.decode`; only ``[B, 1, N, H]`` crosses devices),
plus the token's own key, then its key and value are written to the owner's
slot. Greedy decoding gives the tokens of recomputing the whole sequence with
dense attention at every step (``tests/models/test_inference.py``).

**Padding.** Rows may be padded on the left or the right
(:func:`prepare_prompts`); pads are segment 0 and invisible. A row may pack
several documents (segment ids 1, 2, ...); generation continues the row's
last document: new tokens take its segment id and the positions after its
last token.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from typing import Iterator, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from models import attention as attn_lib
from models import lengths
from models import sharding as shd
from models.llama import Llama, LlamaConfig, backend_attend
import ring_jax
from ring_jax import decode as decode_lib
from ring_jax import layouts

PADDING_SIDES = ("left", "right")


class KVCache(NamedTuple):
  """The decoding state; a pytree (jit argument and result).

  ``k, v``: ``[layers, B, S, K, H]`` keys (RoPE applied) and values;
  ``positions, segment_ids``: ``[B, S]`` int32 per slot (segment 0: empty or
  padding); ``next_position, segment``: ``[B]`` position and segment id of the
  next token fed; ``prompt_slots``: int32 scalar ``P / n`` (slots per device
  the prompt fills); ``steps``: int32 scalar, tokens fed after the prompt.
  """
  k: jax.Array
  v: jax.Array
  positions: jax.Array
  segment_ids: jax.Array
  next_position: jax.Array
  segment: jax.Array
  prompt_slots: jax.Array
  steps: jax.Array


#: Logical axis names of each KVCache field (models.sharding rules map them to the mesh).
CACHE_AXES = KVCache(
    k=("layers", "batch", "length", "kv_heads", "head_dim"),
    v=("layers", "batch", "length", "kv_heads", "head_dim"),
    positions=("batch", "length"), segment_ids=("batch", "length"),
    next_position=("batch",), segment=("batch",), prompt_slots=(), steps=())


# ----------------------------------------------------------------------------------------------
# Prompts and lengths (host side, static numbers: checked before anything compiles)
# ----------------------------------------------------------------------------------------------


def ring_size(mesh) -> int:
  """Devices the cache's positions are split over (1 without a mesh or ``sequence`` axis;
  ``sequence_outer x sequence`` on a two-level mesh, outer-major)."""
  return 1 if mesh is None else shd.ring_size(mesh.shape)


def prompt_length_multiple(cfg: LlamaConfig, mesh) -> int:
  """Padded prompt lengths are multiples of this: the length rule (:mod:`models.lengths`)
  of the prefill's config, which drops the FFN and loss chunks where they do not divide
  (:func:`config_for_length`), so only the layout and the ring's blocks constrain it."""
  forward = dataclasses.replace(cfg, ffn_chunk_size=None, loss_chunk_size=None)
  return lengths.length_multiple(forward, ring_size(mesh))


def config_for_length(cfg: LlamaConfig, local_len: int) -> LlamaConfig:
  """``cfg`` for a forward pass of ``local_len`` tokens per device without gradients.

  No remat (nothing is differentiated); the blockwise FFN only when its chunk
  divides ``local_len`` (a decode step has 1 token); no loss chunking. The
  parameters are the same, so one checkpoint serves every variant.
  """
  chunk = cfg.ffn_chunk_size
  return dataclasses.replace(
      cfg, remat_policy="none", loss_chunk_size=None,
      ffn_chunk_size=chunk if chunk is not None and local_len % chunk == 0 else None)


def cache_slots(cfg: LlamaConfig, mesh, cache_len: int) -> int:
  """Slots per row of a cache of at least ``cache_len`` tokens: a multiple of the ring size."""
  n = ring_size(mesh)
  return -(-cache_len // n) * n


def _documents(prompt) -> list[list[int]]:
  """A prompt is a sequence of token ids, or a sequence of such (packed documents)."""
  if len(prompt) and isinstance(prompt[0], (list, tuple, np.ndarray)):
    return [list(map(int, d)) for d in prompt]
  return [list(map(int, prompt))]


def check_request(cfg: LlamaConfig, mesh, prompts: Sequence, max_new_tokens: int,
                  cache_len: int, padding: str = "right") -> int:
  """Checks a generation request; returns the padded prompt length ``P``.

  Raises ValueError naming the fix: an empty prompt, a token id outside
  ``[0, vocab_size)``, a batch of several prompts not divisible by the mesh's
  ``data`` axis (a single prompt runs replicated over it),
  a prompt longer than the cache, or ``max_new_tokens`` past it.
  """
  if padding not in PADDING_SIDES:
    raise ValueError(f"padding must be one of {PADDING_SIDES}, got {padding!r}.")
  if not len(prompts):
    raise ValueError("no prompts given; pass at least one.")
  if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}.")
  lengths = []
  for i, prompt in enumerate(prompts):
    docs = _documents(prompt)
    if not docs or any(not d for d in docs):
      raise ValueError(f"prompt {i} is empty (or holds an empty document); give every row "
                       "at least one token.")
    ids = np.concatenate([np.asarray(d, np.int64) for d in docs])
    bad = ids[(ids < 0) | (ids >= cfg.vocab_size)]
    if bad.size:
      raise ValueError(f"prompt {i} holds token id {int(bad[0])}, outside the model's "
                       f"vocabulary [0, {cfg.vocab_size}); use the tokenizer the model was "
                       "trained with (or a config whose model.vocab_size covers it).")
    lengths.append(len(ids))
  batch_axis = attn_lib.rule_axis("batch", mesh) if mesh is not None else None
  # One prompt runs replicated over the batch axis; a batch must split over it.
  if batch_axis is not None and len(prompts) > 1 and len(prompts) % int(mesh.shape[batch_axis]):
    raise ValueError(
        f"{len(prompts)} prompts do not split over the mesh '{batch_axis}' axis "
        f"({mesh.shape[batch_axis]}); give a multiple of {mesh.shape[batch_axis]} prompts "
        "(e.g. repeat one) or a config with a smaller 'data' mesh axis.")
  multiple = prompt_length_multiple(cfg, mesh)
  padded = -(-max(lengths) // multiple) * multiple
  slots = cache_slots(cfg, mesh, cache_len)
  if padded > slots:
    raise ValueError(
        f"the longest prompt has {max(lengths)} tokens (padded to {padded}, a multiple of "
        f"{multiple} for layout={cfg.layout!r} on a ring of {ring_size(mesh)}), longer than the "
        f"cache of {slots} tokens; raise the cache length (--cache_len) to at least "
        f"{padded + max_new_tokens} or shorten the prompt.")
  if padded + max_new_tokens > slots:
    raise ValueError(
        f"max_new_tokens={max_new_tokens} after the prompt (padded to {padded} tokens) runs "
        f"past the cache of {slots} tokens; raise the cache length (--cache_len) to at least "
        f"{padded + max_new_tokens} or lower max_new_tokens to {slots - padded}.")
  return padded


def prepare_prompts(prompts: Sequence, length: int, padding: str = "right"
                    ) -> dict[str, np.ndarray]:
  """``tokens, positions, segment_ids [B, length]`` (int32, natural order) and ``last [B]``.

  Row ``b`` holds prompt ``b``'s documents end to end (segment ids 1, 2, ...;
  positions restart at 0 per document), padded with segment 0 on the
  ``padding`` side; ``last`` is the index of its last token.
  """
  if padding not in PADDING_SIDES:
    raise ValueError(f"padding must be one of {PADDING_SIDES}, got {padding!r}.")
  rows = len(prompts)
  tokens = np.zeros((rows, length), np.int32)
  positions = np.zeros((rows, length), np.int32)
  segments = np.zeros((rows, length), np.int32)
  last = np.zeros((rows,), np.int32)
  for b, prompt in enumerate(prompts):
    docs = _documents(prompt)
    ids = np.concatenate([np.asarray(d, np.int32) for d in docs])
    if len(ids) > length:
      raise ValueError(f"prompt {b} has {len(ids)} tokens, more than the length {length}.")
    seg = np.concatenate([np.full(len(d), i + 1, np.int32) for i, d in enumerate(docs)])
    pos = np.concatenate([np.arange(len(d), dtype=np.int32) for d in docs])
    start = 0 if padding == "right" else length - len(ids)
    tokens[b, start:start + len(ids)] = ids
    segments[b, start:start + len(ids)] = seg
    positions[b, start:start + len(ids)] = pos
    last[b] = start + len(ids) - 1
  return dict(tokens=tokens, positions=positions, segment_ids=segments, last=last)


# ----------------------------------------------------------------------------------------------
# Sampling
# ----------------------------------------------------------------------------------------------


def sample(logits_BV, key, temperature: float = 0.0, top_p: float = 1.0,
           vocab_limit: int | None = None):
  """Next token ids ``[B]`` (int32) from float logits.

  ``temperature == 0``: argmax (greedy; ``key`` unused). Otherwise softmax of
  ``logits / temperature`` restricted to the smallest set of most likely
  tokens whose probability reaches ``top_p`` (nucleus sampling, Holtzman et
  al. 2020; ``top_p=1`` keeps all). ``vocab_limit``: ids at or above it are
  never produced (e.g. the padding of the vocabulary past a tokenizer's ids).
  """
  if not temperature >= 0:
    raise ValueError(f"temperature must be >= 0, got {temperature}.")
  if not 0 < top_p <= 1:
    raise ValueError(f"top_p must be in (0, 1], got {top_p}.")
  logits_BV = logits_BV.astype(jnp.float32)
  if vocab_limit is not None:
    ids = jnp.arange(logits_BV.shape[-1])
    logits_BV = jnp.where(ids < vocab_limit, logits_BV, -jnp.inf)
  if temperature == 0:
    return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
  logits_BV = logits_BV / temperature
  if top_p < 1:
    sorted_BV = jnp.sort(logits_BV, axis=-1)[:, ::-1]
    probs = jax.nn.softmax(sorted_BV, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass of the strictly more likely tokens
    keep = before < top_p  # the most likely token is always kept
    threshold = jnp.min(jnp.where(keep, sorted_BV, jnp.inf), axis=-1, keepdims=True)
    logits_BV = jnp.where(logits_BV >= threshold, logits_BV, -jnp.inf)
  return jax.random.categorical(key, logits_BV, axis=-1).astype(jnp.int32)


# ----------------------------------------------------------------------------------------------
# Prefill and decode step (traced under jit, on the context mesh)
# ----------------------------------------------------------------------------------------------


def _axes(mesh, batch_size: int, num_heads: int, num_kv_heads: int):
  """``(seq_axis, batch_axis, head_axis, kv_head_axis)`` mesh axes (None: not sharded).

  As the rules table says, except that an axis not dividing its dimension is
  dropped (a single prompt runs replicated over ``data``; MQA's one key/value
  head is replicated over ``tensor``): :func:`ring_jax.attention_axes`.
  """
  if mesh is None:
    return None, None, None, None
  axes = ring_jax.attention_axes(
      mesh.shape, batch=batch_size, heads=num_heads, kv_heads=num_kv_heads,
      batch_axis=attn_lib.rule_axis("batch", mesh), head_axis=attn_lib.rule_axis("heads", mesh),
      drop=True)
  return attn_lib.sequence_axis(mesh), axes.batch, axes.heads, axes.kv_heads


def _map(fn, mesh, in_specs, out_specs):
  """``fn`` under ``jax.shard_map`` on ``mesh`` (called directly without a mesh)."""
  if mesh is None:
    return fn
  return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)


def _constrain(x, spec):
  """``x`` constrained to ``spec`` on the context mesh (reshard on Explicit axes)."""
  mesh = shd.current_mesh()
  if mesh is None:
    return x
  if shd.is_explicit_mesh(mesh):
    return jax.sharding.reshard(x, spec)
  return jax.lax.with_sharding_constraint(x, spec)


def prefill(model: Llama, tokens_BP, positions_BP, segment_ids_BP, last_BP, cache_len: int):
  """``(logits [B, vocab] float32 of each row's last prompt token, KVCache)``.

  Inputs are in the model's layout order over ``P`` tokens (sharded
  ``(batch, length)``); ``last_BP`` is 1.0 at each row's last prompt token.
  ``cache_len`` (a multiple of the ring size) is the cache's slots per row.
  """
  cfg = model.cfg
  mesh = shd.current_mesh()
  n = ring_size(mesh)
  b, p = tokens_BP.shape
  if cache_len % n or p > cache_len:
    raise ValueError(f"cache_len={cache_len} must be a multiple of {n} and >= {p}.")
  segment_ids_BP = shd.with_logical_constraint(jnp.asarray(segment_ids_BP, jnp.int32),
                                               ("batch", "length"))
  make_attend = lambda pos, _seg, _, window: backend_attend(cfg, pos, segment_ids_BP,
                                                            keep_kv=True, window=window)
  # Dynamic-NTK RoPE at the cache's length: prefill and every decode step share one table.
  h_BPD, (k_LBPKH, v_LBPKH) = model.forward_layers(tokens_BP, positions_BP, make_attend,
                                                   rope_length=cache_len)
  h_BD = shd.logical_einsum("BPD,BP->BD", h_BPD, last_BP.astype(h_BPD.dtype),
                            ("batch", "embed"))
  logits_BV = model.head(h_BD, ("batch",))

  seq, batch, _, kv_head = _axes(mesh, b, cfg.num_heads, cfg.num_kv_heads)
  local_pad = cache_len // n - p // n

  def pad(kv, pos, seg):  # this device's P/n prompt slots, then empty ones
    widths = [(0, 0)] * kv[0].ndim
    widths[2] = (0, local_pad)
    return (jnp.pad(kv[0], widths), jnp.pad(kv[1], widths),
            jnp.pad(pos, ((0, 0), (0, local_pad))), jnp.pad(seg, ((0, 0), (0, local_pad))))

  kv_spec, row_spec = P(None, batch, seq, kv_head, None), P(batch, seq)
  k, v, pos, seg = _map(pad, mesh, ((kv_spec, kv_spec), row_spec, row_spec),
                        (kv_spec, kv_spec, row_spec, row_spec))(
      (_constrain(k_LBPKH, kv_spec), _constrain(v_LBPKH, kv_spec)),
      _constrain(jnp.asarray(positions_BP, jnp.int32), row_spec),
      _constrain(segment_ids_BP, row_spec))
  last_mask = last_BP > 0
  cache = KVCache(
      k=k, v=v, positions=pos, segment_ids=seg,
      next_position=jnp.sum(jnp.where(last_mask, positions_BP, 0), axis=1).astype(jnp.int32) + 1,
      segment=jnp.sum(jnp.where(last_mask, segment_ids_BP, 0), axis=1).astype(jnp.int32),
      prompt_slots=jnp.int32(p // n), steps=jnp.int32(0))
  return logits_BV, cache


def decode_step(model: Llama, cache: KVCache, tokens_B):
  """Feeds one token per row: ``(logits [B, vocab] float32 of the next token, new cache)``.

  The token gets position ``cache.next_position`` and segment
  ``cache.segment``; its key and value go to slot
  ``(t mod n) * C + prompt_slots + t // n`` (``t = cache.steps``), see the
  module docstring.
  """
  cfg = model.cfg
  mesh = shd.current_mesh()
  n = ring_size(mesh)
  seq, batch, head, kv_head = _axes(mesh, tokens_B.shape[0], cfg.num_heads,
                                     cfg.num_kv_heads)
  slots = cache.positions.shape[1]
  t = cache.steps
  slot = (t % n) * (slots // n) + cache.prompt_slots + t // n
  q_pos_B1 = cache.next_position[:, None]
  q_seg_B1 = cache.segment[:, None]

  q_spec, new_spec = P(batch, None, head, None), P(batch, None, kv_head, None)
  kv_spec, row_spec, one_spec = P(batch, seq, kv_head, None), P(batch, seq), P(batch, None)

  # The model's score scale and soft-cap (Gemma), as its training backend gets them.
  options = attn_lib.score_options(cfg)

  def kernel(q, k_new, v_new, k_cache, v_cache, kv_pos, kv_seg, q_pos, q_seg, *sinks):
    return decode_lib.cache_attention(q, k_cache, v_cache, q_pos, q_seg, kv_pos, kv_seg,
                                      new_kv=(k_new, v_new), axis_name=seq,
                                      sinks=sinks[0] if sinks else None, **options)

  in_specs = (q_spec, new_spec, new_spec, kv_spec, kv_spec, row_spec, row_spec, one_spec,
              one_spec)
  attend_cache = _map(kernel, mesh, in_specs, q_spec)
  # With sinks: one more operand, the layer's [N] sink logits split with the query heads.
  attend_cache_sinks = _map(kernel, mesh, in_specs + (P(head),), q_spec)

  def make_attend(_, _seg, layer_cache, window):
    k_cache, v_cache = layer_cache
    kv_seg_BS = cache.segment_ids
    if window is not None:
      # A sliding-window layer sees the cache slots within window - 1 positions of the
      # query (transformers' sliding_window_overlay); the others read as empty (segment 0).
      kv_seg_BS = jnp.where(q_pos_B1 - cache.positions < window, kv_seg_BS, 0)

    def attend(q, k_new, v_new, sinks=None):
      c = _constrain
      args = (c(q, q_spec), c(k_new, new_spec), c(v_new, new_spec), c(k_cache, kv_spec),
              c(v_cache, kv_spec), c(cache.positions, row_spec), c(kv_seg_BS, row_spec),
              c(q_pos_B1, one_spec), c(q_seg_B1, one_spec))
      if sinks is None:
        o = attend_cache(*args)
      else:
        o = attend_cache_sinks(*args, c(sinks, P(head)))
      return o, (k_new, v_new)

    return attend

  h_B1D, (k_new, v_new) = model.forward_layers(tokens_B[:, None], q_pos_B1, make_attend,
                                               layer_xs=(cache.k, cache.v),
                                               rope_length=slots)
  logits_BV = model.head(h_B1D[:, 0], ("batch",))

  # Write the token's keys/values (all layers), position and segment on the owner of `slot`.
  stack_spec, stack_new = P(None, *kv_spec), P(None, *new_spec)

  def write(k, v, pos, seg, k_new, v_new, q_pos, q_seg, slot):
    w = functools.partial(decode_lib.write_slot, slot=slot, axis_name=seq)
    return (w(k, k_new, axis=2), w(v, v_new, axis=2), w(pos, q_pos, axis=1),
            w(seg, q_seg, axis=1))

  c = _constrain
  k, v, pos, seg = _map(write, mesh, (stack_spec, stack_spec, row_spec, row_spec, stack_new,
                                      stack_new, one_spec, one_spec, P()),
                        (stack_spec, stack_spec, row_spec, row_spec))(
      c(cache.k, stack_spec), c(cache.v, stack_spec), c(cache.positions, row_spec),
      c(cache.segment_ids, row_spec), c(k_new, stack_new), c(v_new, stack_new),
      c(q_pos_B1, one_spec), c(q_seg_B1, one_spec), slot)
  return logits_BV, cache._replace(k=k, v=v, positions=pos, segment_ids=seg,
                                   next_position=cache.next_position + 1, steps=t + 1)


# ----------------------------------------------------------------------------------------------
# The generation driver
# ----------------------------------------------------------------------------------------------


def cache_shardings(cfg: LlamaConfig, mesh, batch: int, cache_len: int) -> KVCache:
  """``NamedSharding`` per :class:`KVCache` field, from the rules table."""
  h = cfg.resolved_head_dim
  shapes = KVCache(
      k=(cfg.num_layers, batch, cache_len, cfg.num_kv_heads, h),
      v=(cfg.num_layers, batch, cache_len, cfg.num_kv_heads, h),
      positions=(batch, cache_len), segment_ids=(batch, cache_len), next_position=(batch,),
      segment=(batch,), prompt_slots=(), steps=())
  return KVCache(*[NamedSharding(mesh, shd.logical_to_spec(names, mesh=mesh, shape=shape))
                   for names, shape in zip(CACHE_AXES, shapes)])


def abstract_cache(cfg: LlamaConfig, mesh, batch: int, cache_len: int) -> KVCache:
  """``ShapeDtypeStruct`` leaves of a :class:`KVCache` (for ``lower``/memory analysis)."""
  shardings = cache_shardings(cfg, mesh, batch, cache_len)
  kv = (cfg.num_layers, batch, cache_len, cfg.num_kv_heads, cfg.resolved_head_dim)
  row, i32 = (batch, cache_len), jnp.int32
  shapes = KVCache(k=(kv, cfg.compute_dtype), v=(kv, cfg.compute_dtype), positions=(row, i32),
                   segment_ids=(row, i32), next_position=((batch,), i32),
                   segment=((batch,), i32), prompt_slots=((), i32), steps=((), i32))
  return KVCache(*[jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
                   for (shape, dtype), sharding in zip(shapes, shardings)])


def cache_bytes_per_device(cfg: LlamaConfig, mesh, batch: int, cache_len: int) -> int:
  """Bytes of keys and values one device holds for a cache of ``cache_len`` slots per row."""
  shard = cache_shardings(cfg, mesh, batch, cache_len).k.shard_shape(
      (cfg.num_layers, batch, cache_len, cfg.num_kv_heads, cfg.resolved_head_dim))
  return 2 * math.prod(shard) * jnp.dtype(cfg.compute_dtype).itemsize


class Generator:
  """Compiled prefill / decode step / sampler for one model, mesh and cache length.

  ``Generator(cfg, params, mesh, cache_len)`` then :meth:`generate` (a
  token stream) or :meth:`prefill` and :meth:`step`. ``params`` is the
  ``nnx.State`` of the model's Params (``nnx.split(model, nnx.Param, ...)[1]``),
  sharded on ``mesh`` (or None: one device); ``cache_len`` is rounded up to a
  multiple of the ring size. The decode step donates the cache (updated in place).
  """

  def __init__(self, cfg: LlamaConfig, params, mesh, cache_len: int):
    self.cfg, self.params, self.mesh = cfg, params, mesh
    self.cache_len = cache_slots(self.cfg, mesh, cache_len)
    # Module-level jitted functions with the config static: Generators of the same model
    # and mesh share compiled executables.
    self._prefill = functools.partial(_prefill_jit, cfg=cfg)
    self._step = functools.partial(_step_jit, cfg=cfg)
    self._sample = _sample_jit

  def _context(self):
    return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

  def check(self, prompts, max_new_tokens: int, padding: str = "right") -> int:
    """:func:`check_request` for this generator (returns the padded prompt length)."""
    return check_request(self.cfg, self.mesh, prompts, max_new_tokens, self.cache_len, padding)

  def prefill(self, prompts, max_new_tokens: int, padding: str = "right"):
    """Checks the request, runs prefill; ``(logits [B, vocab], cache)``."""
    length = self.check(prompts, max_new_tokens, padding)
    natural = prepare_prompts(prompts, length, padding)
    n = ring_size(self.mesh)
    # One prompt per row: "document" deals it as zigzag (its mask positions) does.
    perm = layouts.layout_positions(layouts.mask_layout(self.cfg.layout), n, length)
    last = np.zeros(natural["tokens"].shape, np.float32)
    last[np.arange(len(prompts)), natural["last"]] = 1.0
    host = dict(tokens=natural["tokens"], positions=natural["positions"],
                segment_ids=natural["segment_ids"], last=last)
    host = {k: np.ascontiguousarray(v[:, perm]) for k, v in host.items()}
    with self._context():
      if self.mesh is not None:
        sharding = NamedSharding(self.mesh, shd.logical_to_spec(
            ("batch", "length"), mesh=self.mesh, shape=host["tokens"].shape))
        host = jax.device_put(host, sharding)
      return self._prefill(self.params, host, ring=ring_size(self.mesh),
                           cache_len=self.cache_len)

  def step(self, cache: KVCache, tokens_B):
    """Feeds ``tokens_B``; ``(logits [B, vocab], cache)`` (the old cache is donated)."""
    with self._context():
      return self._step(self.params, cache, jnp.asarray(tokens_B, jnp.int32))

  def generate(self, prompts, max_new_tokens: int, *, temperature: float = 0.0,
               top_p: float = 1.0, seed: int = 0, padding: str = "right",
               vocab_limit: int | None = None) -> Iterator[np.ndarray]:
    """Yields ``max_new_tokens`` arrays of token ids ``[B]``, one per step, as produced."""
    logits, cache = self.prefill(prompts, max_new_tokens, padding)
    key = jax.random.key(seed)
    for i in range(max_new_tokens):
      with self._context():
        tokens = self._sample(logits, jax.random.fold_in(key, i), temperature=temperature,
                              top_p=top_p, vocab_limit=vocab_limit)
      yield np.asarray(jax.device_get(tokens))
      if i + 1 < max_new_tokens:
        logits, cache = self.step(cache, tokens)


@functools.lru_cache(maxsize=16)
def _graphdef(cfg: LlamaConfig):
  """The static structure of ``Llama(cfg)`` (no arrays allocated)."""
  return nnx.graphdef(nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0))))


def _model(cfg: LlamaConfig, params, local_len: int) -> Llama:
  return nnx.merge(_graphdef(config_for_length(cfg, local_len)), params)


@functools.partial(jax.jit, static_argnames=("cfg", "ring", "cache_len"))
def _prefill_jit(params, batch, *, cfg, ring, cache_len):
  model = _model(cfg, params, batch["tokens"].shape[1] // ring)
  return prefill(model, batch["tokens"], batch["positions"], batch["segment_ids"],
                 batch["last"], cache_len)


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache",))
def _step_jit(params, cache, tokens_B, *, cfg):
  return decode_step(_model(cfg, params, 1), cache, tokens_B)


_sample_jit = jax.jit(sample, static_argnames=("temperature", "top_p", "vocab_limit"))
