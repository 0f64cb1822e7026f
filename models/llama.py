"""LLaMA in Flax NNX with ring attention (sequence parallelism) and blockwise FFN.

Architecture (Touvron et al. 2023; Dubey et al. 2024 for LLaMA-3 RoPE scaling):
token embedding -> ``num_layers`` x [RMSNorm -> GQA self-attention with RoPE ->
residual -> RMSNorm -> SwiGLU MLP -> residual] -> RMSNorm -> vocabulary head
(untied, or tied to the embedding).

Conventions the rest of the project relies on:

* **Layouts.** The caller reorders tokens, positions, segment ids and labels
  once with :func:`ring_jax.to_layout` and passes ``positions`` explicitly.
  The model never reorders: RoPE uses the given positions, ring attention gets
  ``inputs_in_layout=True``, and the dense backend masks with
  ``q_positions=kv_positions=positions``. Logits come back in the same order.
* **Attention backends.** ``cfg.attention`` names an entry of
  :data:`models.attention.ATTENTION_BACKENDS` (``"ring"``, ``"all_gather"``,
  ``"ulysses"``, ``"hybrid"``, ``"auto"``, ``"dense"``, or one registered with
  :func:`models.attention.register_attention`).
* **Profiles.** Embedding, each layer and its attention and MLP blocks, the
  output head and the loss run under ``jax.named_scope`` (``embed``,
  ``layer/attention/ring``, ``layer/mlp``, ``head``, ``loss``).
* **Sharding.** Parameters carry logical axis names (Variable metadata
  ``logical_axes``); :mod:`models.sharding` maps them to mesh axes. The mesh is
  the one set with ``jax.set_mesh`` (none: everything runs unsharded). The
  residual stream's tokens are named ``residual_length``, those the projections
  and attention see ``length``: the rules table (``cfg.logical_rules``, under
  which the entry points trace) decides whether tensor peers split the former
  (``tensor_sequence_parallel``).
* **Tree mode.** The model holds only ``nnx.Param`` arrays (RoPE tables are
  computed from positions, nothing is cached), no Variable is shared, and
  ``__call__`` is pure, so ``nnx.split`` / ``nnx.merge`` around a ``jax.jit``
  is all a trainer needs.
* **Stacked layers.** The per-layer parameters are stacked along a leading
  ``layers`` axis in one :class:`Block`, and the forward pass runs
  ``jax.lax.scan`` over them (``scan_layers=True``, one compiled layer for any
  depth) or a Python loop over the same arrays (``scan_layers=False``); the
  parameter tree is identical either way.
* **RoPE convention.** ``rotate_half`` (first half / second half of each head),
  as Hugging Face ``LlamaAttention`` (:mod:`models.rope`): HF q/k weights load without
  permutation.

The model is split by concern: :mod:`models.config` (:class:`LlamaConfig`, its validation
and registries), :mod:`models.rope` (the RoPE variants), :mod:`models.layers` (norms,
attention, MLP, the decoder layer), this module (embedding, layer stack, head, loss,
initialisation) and :mod:`models.pipeline` (the layers as pipeline stages). The names
other code imports from ``models.llama`` stay importable here.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from einops import rearrange
from flax import nnx

from models import pipeline as pipeline_lib
from models import sharding as shd
from models.config import REMAT_POLICIES, LlamaConfig
from models.layers import Block, RMSNorm, _embed_name, _param, _weight, backend_attend
from models.rope import _base_inv_freq, rope_attention_factor, rope_inv_freq, rope_tables

# The names other modules import from here, defined in the modules by concern.
from models.config import DTYPES, FAMILIES, LAYER_TYPES, MLP_ACTIVATIONS  # noqa: F401
from models.layers import MLP, Attention  # noqa: F401
from models.rope import ROPE_TYPES, apply_rope  # noqa: F401


def _under_rules(method):
  """Traces ``method`` under the model's rules table (``cfg.logical_rules``): the layers only
  name their activations, the table (e.g. ``tensor_sequence_parallel``) decides the split."""

  @functools.wraps(method)
  def wrapped(self, *args, **kwargs):
    with shd.use_rules(self.cfg.logical_rules):
      return method(self, *args, **kwargs)

  return wrapped


class Llama(nnx.Module):
  """The LLaMA decoder. ``__call__(tokens, positions, segment_ids) -> float32 logits``."""

  def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    e = _embed_name(cfg)
    self.embed = _param(rngs, (cfg.vocab_size, cfg.dim), ("vocab", e), cfg, None)
    self.layers = Block(cfg, rngs=rngs, stack=cfg.num_layers)
    self.final_norm = RMSNorm(cfg)
    if not cfg.tie_embeddings:
      self.lm_head = _param(rngs, (cfg.dim, cfg.vocab_size), (e, "vocab"), cfg, None)

  @_under_rules
  def __call__(self, tokens_BL, positions_BL, segment_ids_BL=None):
    """Logits ``[B, L, vocab]`` (float32) in the order of the inputs.

    Same arguments as :meth:`hidden`; ``head(hidden(...))``.
    """
    return self.head(self.hidden(tokens_BL, positions_BL, segment_ids_BL),
                     ("batch", "length"))

  @_under_rules
  def hidden(self, tokens_BL, positions_BL, segment_ids_BL=None):
    """Final-normed hidden states ``[B, L, dim]`` (compute dtype), before the output head.

    Args:
      tokens_BL: int token ids, in ``cfg.layout`` order when the ring backend
        shards the sequence (the caller applies :func:`ring_jax.to_layout`).
      positions_BL: int positions of those tokens (RoPE angles; the dense
        backend's causal mask), ``[B, L]`` or ``[L]`` (shared by all rows).
        Per-document positions (restarting at 0) work with segment ids.
      segment_ids_BL: optional int ``[B, L]``: tokens attend within equal ids;
        0 is padding (its attention output is 0; its logits are meaningless).
    """
    if segment_ids_BL is not None:
      segment_ids_BL = shd.with_logical_constraint(jnp.asarray(segment_ids_BL, jnp.int32),
                                                   ("batch", "length"))
    make_attend = lambda positions_BL, segment_ids_BL, _, window: backend_attend(
        self.cfg, positions_BL, segment_ids_BL, window=window)
    return self.forward_layers(tokens_BL, positions_BL, make_attend,
                               segment_ids_BL=segment_ids_BL)[0]

  @_under_rules
  def forward_layers(self, tokens_BL, positions_BL, make_attend, layer_xs=None,
                     segment_ids_BL=None, rope_length: int | None = None):
    """``(final-normed hidden [B, L, D], aux stacked over layers)`` with a custom attention.

    The forward pass of :meth:`hidden`, but each layer's attention is
    ``make_attend(positions_BL, segment_ids_BL, x, window)`` (see
    :meth:`Attention.forward`) for the rows the layer runs on, where ``x`` is
    that layer's slice of ``layer_xs`` (a pytree with a leading ``num_layers``
    axis, e.g. a KV cache; None gives None) and ``window`` the layer's sliding
    window (:attr:`LlamaConfig.layer_windows`, a static int or None); the
    attends' ``aux`` come back stacked along a leading layers axis. Inference
    (:mod:`models.inference`) uses it to collect and update the KV cache.

    The layers run as :attr:`LlamaConfig.layer_segments`: one scan (or loop) per
    run of layers sharing a window, or per repeating pattern of windows (Gemma's
    interleaved local and global layers: the scan body is one pattern), so a
    window is static where the ring prunes hops by it; a uniform stack is one scan.

    ``rope_length``: the sequence length dynamic-NTK RoPE is computed at
    (:func:`rope_inv_freq`); None: ``L``, the length of the rows given (training).
    Decoding passes the KV cache's length, the same at prefill and every step.

    On a mesh with a ``pipeline`` axis of ``S > 1`` devices the layers run as
    ``S`` pipeline stages over ``cfg.pipeline_microbatches`` microbatches
    (:mod:`models.pipeline`, GPipe); ``layer_xs`` must then be None and the
    ``aux`` is None. Every stage runs the same program, so a stack mixing
    windowed and full layers is refused there (ValueError).
    """
    cfg = self.cfg
    tokens_BL = shd.with_logical_constraint(jnp.asarray(tokens_BL), ("batch", "length"))
    positions_BL = jnp.asarray(positions_BL, jnp.int32)
    if positions_BL.ndim == 1:
      positions_BL = jnp.broadcast_to(positions_BL, tokens_BL.shape)
    positions_BL = shd.with_logical_constraint(positions_BL, ("batch", "length"))
    with jax.named_scope("embed"):
      # Vocabulary-parallel lookup (partial sums over the tensor peers), reduce-scattered into
      # the residual stream's split (looked up straight into it, GSPMD gathered the table).
      x_BLD = shd.logical_take(_weight(self.embed, cfg), tokens_BL, ("batch", "length", "embed"))
      if cfg.scale_embeddings:  # Gemma: sqrt(dim), rounded to the compute dtype
        x_BLD = x_BLD * jnp.asarray(math.sqrt(cfg.dim), cfg.compute_dtype)
      x_BLD = shd.with_logical_constraint(x_BLD, ("batch", "residual_length", "embed"))
    inv_freq_K = rope_inv_freq(cfg, tokens_BL.shape[1] if rope_length is None else rope_length)
    attention_factor = rope_attention_factor(cfg)
    local_freq_K = (None if cfg.rope_local_theta is None
                    else _base_inv_freq(cfg.rope_local_theta, cfg.resolved_head_dim))

    graphdef, stacked = nnx.split(self.layers)
    segments = cfg.layer_segments

    def make_layer(window):
      def layer(x_BLD, layer_state, layer_x, rows):
        cos_BL1H, sin_BL1H, positions_BL, segment_ids_BL = rows
        block = nnx.merge(graphdef, layer_state)
        return block.forward(x_BLD, cos_BL1H, sin_BL1H,
                             make_attend(positions_BL, segment_ids_BL, layer_x, window))

      if cfg.remat_policy != "none":
        # prevent_cse matters only outside scan (scan already stops CSE across iterations).
        layer = jax.checkpoint(layer, policy=REMAT_POLICIES[cfg.remat_policy],
                               prevent_cse=not cfg.scan_layers)
      return layer

    def run_group(layer, x_BLD, stacked, layer_xs, rows):
      if cfg.scan_layers:
        return jax.lax.scan(lambda x, s: layer(x, *s, rows), x_BLD, (stacked, layer_xs))
      auxes = []
      for i in range(jax.tree.leaves(stacked)[0].shape[0]):
        x_BLD, aux = layer(x_BLD, *jax.tree.map(lambda a, i=i: a[i], (stacked, layer_xs)), rows)
        auxes.append(aux)
      return x_BLD, jax.tree.map(lambda *a: jnp.stack(a), *auxes)

    def pattern_layer(pattern, rows_of):
      """One repetition of ``pattern`` as one layer over weights ``[len(pattern), ...]``."""
      layers = [make_layer(window) for window in pattern]

      def layer(x_BLD, layer_state, layer_x, _):
        auxes = []
        for j, (one, window) in enumerate(zip(layers, pattern)):
          x_BLD, aux = one(x_BLD, *jax.tree.map(lambda a, j=j: a[j], (layer_state, layer_x)),
                           rows_of(window))
          auxes.append(aux)
        return x_BLD, jax.tree.map(lambda *a: jnp.stack(a), *auxes)

      return layer

    def run_segment(pattern, x_BLD, stacked, layer_xs, rows_of):
      if len(pattern) == 1:
        return run_group(make_layer(pattern[0]), x_BLD, stacked, layer_xs, rows_of(pattern[0]))
      # [reps * p, ...] -> [reps, p, ...]: the scan walks repetitions of the pattern.
      p = len(pattern)
      fold = lambda tree: jax.tree.map(lambda t: t.reshape(t.shape[0] // p, p, *t.shape[1:]),
                                       tree)
      x_BLD, aux = run_group(pattern_layer(pattern, rows_of), x_BLD, fold(stacked),
                             fold(layer_xs), None)
      return x_BLD, jax.tree.map(lambda t: t.reshape(-1, *t.shape[2:]), aux)

    def layer_stack(x_BLD, stacked, layer_xs, positions_BL, segment_ids_BL):
      rows = (*rope_tables(positions_BL, inv_freq_K, attention_factor), positions_BL,
              segment_ids_BL)
      # Gemma 3: the sliding-window layers rotate by their own base (default RoPE).
      local_rows = rows if local_freq_K is None else (
          *rope_tables(positions_BL, local_freq_K), positions_BL, segment_ids_BL)
      rows_of = lambda window: rows if window is None else local_rows
      if len(segments) == 1:
        return run_segment(segments[0][2], x_BLD, stacked, layer_xs, rows_of)
      # A mixed stack (Qwen2 with max_window_layers < num_layers, Gemma's interleaved local
      # and global layers): one scan per segment over its slice of the stacked weights (and
      # cache); the auxes are joined back.
      auxes = []
      for start, stop, pattern in segments:
        part = lambda tree, a=start, b=stop: jax.tree.map(lambda t: t[a:b], tree)
        x_BLD, aux = run_segment(pattern, x_BLD, part(stacked), part(layer_xs), rows_of)
        auxes.append(aux)
      return x_BLD, jax.tree.map(lambda *a: jnp.concatenate(a), *auxes)

    x_BLD, aux = pipeline_lib.run_layers(cfg, layer_stack, stacked, x_BLD, positions_BL,
                                         segment_ids_BL, layer_xs)

    with jax.named_scope("final_norm"):
      return self.final_norm(x_BLD), aux

  @_under_rules
  @jax.named_scope("head")
  def head(self, x_XD, lead_names):
    """Float32 logits ``[..., vocab]`` of hidden states ``[..., dim]`` named ``lead_names``."""
    cfg = self.cfg
    # Column-parallel over the vocabulary: the tokens are gathered over tensor first.
    x_XD = shd.with_logical_constraint(x_XD, (*lead_names, "embed"))
    if cfg.tie_embeddings:
      w, eq = _weight(self.embed, cfg), "...D,VD->...V"
    else:
      w, eq = _weight(self.lm_head, cfg), "...D,DV->...V"
    logits_XV = shd.logical_einsum(eq, x_XD, w, (*lead_names, "vocab"),
                                   preferred_element_type=jnp.float32)
    if cfg.final_logits_soft_cap is not None:  # Gemma 2: c * tanh(logits / c)
      cap = float(cfg.final_logits_soft_cap)
      logits_XV = cap * jnp.tanh(logits_XV / cap)
    return logits_XV

  @_under_rules
  def nll_sums(self, tokens_BL, positions_BL, segment_ids_BL, labels_BL, mask_BL):
    """``(sum of masked next-token NLL, count of masked argmax hits)``, both float32 scalars.

    With ``cfg.loss_chunk_size`` the head and log-softmax run over chunks of
    each device's local sequence under a rematerialised scan (as the
    blockwise FFN does), so the ``[B, L, vocab]`` float32 logits, and their
    gradient, exist for one chunk at a time instead of the whole sequence.
    """
    x_BLD = self.hidden(tokens_BL, positions_BL, segment_ids_BL)
    with jax.named_scope("loss"):
      return self._nll_sums(x_BLD, labels_BL, mask_BL)

  def _nll_sums(self, x_BLD, labels_BL, mask_BL):
    chunk = self.cfg.loss_chunk_size
    # The head is column-parallel over the vocabulary: gather the tokens over tensor once.
    x_BLD = shd.with_logical_constraint(x_BLD, ("batch", "length", "embed"))

    def sums(x_XD, labels_X, mask_X, lead_names):
      logits_XV = self.head(x_XD, lead_names)
      logp_XV = jax.nn.log_softmax(logits_XV, axis=-1)
      # The label's log-probability as a masked sum over the vocabulary, not a gather: the
      # vocabulary is sharded over tensor, and a sum reduces over shards (Megatron's
      # vocab-parallel cross entropy) where a gather would need every logit on one device
      # (on an Explicit mesh take_along_axis refuses such a gather outright).
      vocab_XV = jax.lax.broadcasted_iota(labels_X.dtype, logp_XV.shape, logp_XV.ndim - 1)
      nll_X = -jnp.sum(jnp.where(vocab_XV == labels_X[..., None], logp_XV, 0.0), axis=-1)
      correct_X = (jnp.argmax(logits_XV, axis=-1) == labels_X).astype(jnp.float32)
      mask_X = mask_X.astype(jnp.float32)
      return jnp.sum(nll_X * mask_X), jnp.sum(correct_X * mask_X)

    if chunk is None:
      return sums(x_BLD, labels_BL, mask_BL, ("batch", "length"))
    length = x_BLD.shape[1]
    r = shd.rule_shards("length")
    if length % r or (length // r) % chunk:
      raise ValueError(
          f"loss_chunk_size={chunk} must divide the local sequence length {length}/{r}.")
    c = length // r // chunk

    def chunks(x):
      # [B, L, ...] -> [C, B, R, chunk, ...]: R stays sharded, the scan walks local chunks.
      return rearrange(x, "b (r c k) ... -> c b r k ...", r=r, c=c)

    names = ("batch", "length", None)

    def body(acc, xs):
      x_CD, labels_C, mask_C = xs
      nll, correct = sums(x_CD, labels_C, mask_C, names)
      return (acc[0] + nll, acc[1] + correct), None

    zero = jnp.zeros((), jnp.float32)
    (nll, correct), _ = jax.lax.scan(
        jax.checkpoint(body), (zero, zero),
        (chunks(x_BLD), chunks(labels_BL), chunks(mask_BL)))
    return nll, correct


# ----------------------------------------------------------------------------------------------
# Construction helpers
# ----------------------------------------------------------------------------------------------


def weight_decay_mask(params):
  """``True`` for weight matrices and embeddings, ``False`` for RMSNorm scales and attention
  sinks (optax ``mask=``).

  Decided by the ``logical_axes`` metadata, not by ``ndim``: the stacked norm
  scales are ``[layers, dim]``, 2-D like a matrix; a parameter whose last axis is
  ``heads`` is a sink logit per head (every weight's last axis is ``head_dim`` or ``embed``).
  Takes a Module, a State or any pytree of Variables and returns the same structure holding
  bools.
  """
  if isinstance(params, nnx.Module):
    params = nnx.state(params)

  def one(var):
    return var.replace(var.get_metadata()[shd.LOGICAL_AXES_KEY][-1] not in ("norm", "heads"))

  return jax.tree.map(one, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


@functools.lru_cache(maxsize=8)
def _sharded_init(cfg: LlamaConfig, mesh, seed: int):
  """``(graphdef, init)``: ``init()`` is a jitted function returning the sharded param State.

  Cached per (config, mesh, seed): compiling the initialisers costs seconds on CPU, and a
  caller that first inspects ``init.lower().compile()`` then reuses the executable.
  """
  abstract = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(seed)))
  graphdef, abstract_state = nnx.split(abstract)

  def init():
    return nnx.split(Llama(cfg, rngs=nnx.Rngs(seed)))[1]

  return graphdef, jax.jit(init, out_shardings=shd.param_shardings(abstract_state, mesh))


def create_sharded_model(cfg: LlamaConfig, mesh, seed: int = 0) -> Llama:
  """A freshly initialised :class:`Llama` whose parameters are created already sharded.

  The initialiser runs under ``jax.jit`` with ``out_shardings`` from the
  rules table, and each weight is drawn with its sharding (see ``_param``), so
  every device computes and stores only its shards: no full host or device
  copy. Values depend on ``seed`` only, not on the mesh.
  """
  graphdef, init = _sharded_init(cfg, mesh, seed)
  with jax.set_mesh(mesh):
    state = init()
  return nnx.merge(graphdef, state)
