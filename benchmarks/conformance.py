"""The conformance kit's full matrix (ring_jax.testing) on ring_jax and on its peers.

    python benchmarks/conformance.py              # ring_jax's ring, all-gather, Ulysses
    python benchmarks/conformance.py --peers      # + the peers' adapters, where importable
    python benchmarks/conformance.py --targets ring --cases causal,gqa

Per target, its table (each case's verdict, each quantity's error against the float64 oracle)
is printed and written with the run's provenance to
``benchmarks/results/conformance_<target>.json`` (docs/conformance.md). 8 fake CPU devices.

A peer's adapter only translates the call (global arrays -> ``jax.shard_map`` over the kit's
"sequence" axis, keyword names); no peer's code is edited. What each adapter does besides,
which decides what the kit measures, is stated in its docstring. The peers: ``pip install
ringattention==0.1.2 ejkernel==0.0.80.3``; tokamax 0.0.17: a Python >= 3.12 environment.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ring_jax  # noqa: E402
from benchmarks import common  # noqa: E402
from ring_jax import testing  # noqa: E402

SEQ = P(None, "sequence")
#: The kit's tokens per device (a peer whose kernels need more says so in :data:`PEERS`).
LOCAL_LEN = 64
#: tokamax's splash kernels take blocks of multiples of 128 (the TPU lane width).
TOKAMAX_BLOCK = 128


def _place(mesh, args, specs):
  """On a mesh with Explicit axes, ``args`` (a pytree; None stays None) resharded to their
  shard_map ``specs`` (the adapter's job: the peers take local shards)."""
  if not any(t == AxisType.Explicit for t in mesh.axis_types):
    return args
  return jax.tree.map(lambda s, x: None if x is None else jax.reshard(x, NamedSharding(mesh, s)),
                      list(specs), list(args), is_leaf=lambda x: isinstance(x, P))


def _sharded(body, mesh, args, specs):
  """``body`` on ``args`` (placed: :func:`_place`) under ``shard_map(check_vma=False)`` over
  ``mesh``, its output sharded over the sequence."""
  return jax.shard_map(body, mesh=mesh, in_specs=tuple(specs), out_specs=SEQ,
                       check_vma=False)(*_place(mesh, args, specs))


def import_ringattention():
  """``ringattention`` 0.1.2's ``ringattention_jax`` (the function), or the ImportError. Its
  ``__init__`` calls ``jax.lib.xla_bridge.get_backend()``, removed in jax >= 0.9: aliased to
  ``jax.extend.backend.get_backend`` first."""
  import jax.extend.backend  # noqa: PLC0415
  import jax.lib  # noqa: PLC0415
  if not hasattr(jax.lib, "xla_bridge"):
    import types  # noqa: PLC0415
    jax.lib.xla_bridge = types.SimpleNamespace(get_backend=jax.extend.backend.get_backend)
  from ringattention import ringattention_jax  # noqa: PLC0415 -- the function, not the module
  return ringattention_jax


def paper_local(ring_attention, *, is_causal, chunk, dtype, axis_name="sequence"):
  """The paper's ``ring_attention`` on local shards ``(q, k, v[, segment_ids])``, for a
  ``shard_map`` over ``axis_name``: query and key chunks of ``chunk``, causal =
  ``causal_block_size=1``, no dropout, nothing saved for the backward."""
  blockwise = dict(causal_block_size=1 if is_causal else None, query_chunk_size=chunk,
                   key_chunk_size=chunk, deterministic=True, dropout_rng=None, attn_pdrop=0.0,
                   dtype=dtype, policy=jax.checkpoint_policies.nothing_saveable,
                   precision=None, prevent_cse=True)

  def body(q, k, v, *seg):
    return ring_attention(q, k, v, None, seg[0] if seg else None, None, axis_name, True,
                          blockwise)
  return body


def paper_ringattention(query, key, value, *, is_causal=False, segment_ids=None, scale=None,
                        mesh=None):
  """``ringattention`` 0.1.2 (Liu et al., the paper's package), ``ringattention_jax``, over
  ``mesh``'s sequence axis, under ``shard_map(check_vma=False)``. It has no scale argument and
  scales scores by ``1/sqrt(H)``, so ``q`` is multiplied by ``scale * sqrt(H)`` first; it needs
  as many K/V heads as query heads, so K/V heads are repeated for GQA (``jnp.repeat``;
  autodiff sums their gradients). Causal = ``causal_block_size=1``; segment ids as it takes
  them."""
  h = query.shape[-1]
  scale = h ** -0.5 if scale is None else scale
  group = query.shape[2] // key.shape[2]
  body = paper_local(import_ringattention(), is_causal=is_causal, dtype=jnp.float32,
                     chunk=min(query.shape[1] // mesh.shape["sequence"], 64))
  q = query * jnp.asarray(scale * h ** 0.5, query.dtype)
  k, v = (jnp.repeat(x, group, axis=2) for x in (key, value))
  args = (q, k, v) + (() if segment_ids is None else (segment_ids,))
  return _sharded(body, mesh, args, (SEQ,) * len(args))


def ejkernel_ring(query, key, value, *, is_causal=False, segment_ids=None, scale=None,
                  mesh=None, local_window_size=None, sinks=None, logits_soft_cap=None,
                  repeat_kv=True):
  """ejkernel 0.0.80.3's XLA ring attention (``ejkernel.kernels._xla.ring_attention``, CPU)
  over ``mesh``'s sequence axis, under ``shard_map(check_vma=False)``; the kit's keywords map
  one to one (``causal``, ``q_segment_ids``/``kv_segment_ids``, ``sliding_window``,
  ``softmax_aux`` for sinks, ``logits_soft_cap``, ``softmax_scale``). Its signature takes
  fewer K/V heads than query heads, but under grad it raises a reshape ``TypeError`` whenever
  they differ, so K/V heads are repeated to the query heads unless ``repeat_kv=False``
  (``-native-gqa``: as is)."""
  from ejkernel.kernels._xla.ring_attention import _interface  # noqa: PLC0415
  if repeat_kv:
    group = query.shape[2] // key.shape[2]
    key, value = (jnp.repeat(x, group, axis=2) for x in (key, value))
  kw = dict(causal=is_causal, softmax_scale=scale, axis_name="sequence",
            sliding_window=None if local_window_size is None else tuple(local_window_size),
            logits_soft_cap=logits_soft_cap)
  extra = {name: (x, spec) for name, x, spec in (("seg", segment_ids, SEQ), ("aux", sinks, P()))
           if x is not None}  # the optional arguments, sharded as given

  def call(q, k, v, *rest):
    got = dict(zip(extra, rest))
    return _interface.ring_attention(q, k, v, q_segment_ids=got.get("seg"),
                                     kv_segment_ids=got.get("seg"), softmax_aux=got.get("aux"),
                                     **kw)

  return _sharded(call, mesh, [query, key, value, *(x for x, _ in extra.values())],
                  [SEQ] * 3 + [spec for _, spec in extra.values()])


def splash_module(module: str):
  """tokamax's ``splash_attention.<module>`` (imported on first use)."""
  return importlib.import_module(f"tokamax._src.ops.experimental.tpu.splash_attention.{module}")


def tokamax_ring_kernel(mask, n: int, *, ring_axis: str, is_mqa: bool = False,
                        block: int | None = None, **config):
  """tokamax's ring attention kernel (``ring_attention_kernel.make_ring_attention``) for the
  global ``mask`` over ``n`` shards of ``ring_axis``, configured as tokamax's own ring test
  does (``use_base2_exp=False``, ``fuse_reciprocal=True``), with every block ``block`` (None:
  tokamax's defaults) and the other ``SplashConfig`` fields of ``config``."""
  blocks = dict.fromkeys(("block_q", "block_kv", "block_kv_compute", "block_q_dkv",
                          "block_kv_dkv", "block_kv_dkv_compute"), block) if block else {}
  config = dataclasses.replace(
      splash_module("splash_attention_kernel").SplashConfig.get_default(),
      use_base2_exp=False, fuse_reciprocal=True, **blocks, **config)
  return splash_module("ring_attention_kernel").make_ring_attention(
      mask, config=config, is_mqa=is_mqa, ring_axis=ring_axis, q_seq_shards=n, kv_seq_shards=n)


def _tokamax_mask(t_len, s_len, is_causal, window):
  """The global ``[T, S]`` mask tokamax's ring takes: a ``FullMask`` or a boolean ``NumpyMask``."""
  masks = splash_module("splash_attention_mask")
  if not is_causal and window is None:
    return masks.FullMask(_shape=(t_len, s_len))
  d = np.arange(t_len)[:, None] - np.arange(s_len)[None, :]
  vis = np.ones((t_len, s_len), bool)
  if is_causal:
    vis &= d >= 0
  if window is not None:
    vis &= (d <= window[0]) & (d >= -window[1])
  return masks.NumpyMask(vis)


def tokamax_ring(query, key, value, *, is_causal=False, segment_ids=None, scale=None,
                 mesh=None, local_window_size=None, logits_soft_cap=None):
  """tokamax 0.0.17's TPU ring attention (:func:`tokamax_ring_kernel`: splash-attention
  Pallas/Mosaic kernels at every hop) in Pallas interpret mode
  (``SplashConfig(interpret=True)``) over ``mesh``'s sequence axis, blocks of ``TOKAMAX_BLOCK``
  (hence its tokens per device in :data:`PEERS`). The mask is the global ``[T, S]`` one it takes
  (:func:`_tokamax_mask`); segment ids go in as ``SegmentIds(q, kv)``. It works on ``[heads,
  length, head_dim]`` with no batch and no scale: ``q`` is multiplied by ``scale``, the batch
  ``jax.vmap``-ed, and for GQA the K/V heads too with ``is_mqa=True`` (each group's query heads
  against one K/V head). It raises ``NotImplementedError`` for sinks, so it takes no ``sinks=``;
  it takes V's own head size (declared in :data:`PEERS`)."""
  base = splash_module("base")
  ring = mesh.shape["sequence"]
  t_len, n, h = query.shape[1:]
  s_len, kh = key.shape[1:3]
  scale = h ** -0.5 if scale is None else scale
  is_mqa = kh != n
  kernel = tokamax_ring_kernel(
      _tokamax_mask(t_len, s_len, is_causal, local_window_size), ring, ring_axis="sequence",
      is_mqa=is_mqa, block=TOKAMAX_BLOCK, interpret=True, attn_logits_soft_cap=logits_soft_cap)

  def one(kern, q_NTH, k_KSH, v_KSH, seg):
    """One batch row: q ``[N, t, H]``, K/V ``[K, s, H]`` (local), segment ids ``[t]``."""
    ids = None if seg is None else base.SegmentIds(q=seg, kv=seg)
    if not is_mqa:
      return kern(q_NTH, k_KSH, v_KSH, ids)
    q_KGTH = q_NTH.reshape(kh, n // kh, *q_NTH.shape[1:])
    out = jax.vmap(lambda q, k, v: kern(q, k, v, ids))(q_KGTH, k_KSH, v_KSH)
    return out.reshape(n, *out.shape[2:])

  def call(kern, q, k, v, *seg):
    q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q * jnp.asarray(scale, q.dtype), k, v))
    out = jax.vmap(lambda *a: one(kern, *a[:3], a[3] if seg else None))(q, k, v, *seg)
    return jnp.swapaxes(out, 1, 2)

  args = [query, key, value] + ([] if segment_ids is None else [segment_ids])
  # The kernel is an argument too; its spec tree names a spec where its dK/dV mask info is None.
  return _sharded(call, mesh, [kernel, *args],
                  [kernel.manual_sharding_spec()] + [SEQ] * len(args))


#: ring_jax's own entry points in the kit's convention (blocks of 16: 4 per shard).
_BLOCKS = dict(block_q=16, block_kv=16)
OWN = {"ring": functools.partial(ring_jax.ring_attention_sharded, **_BLOCKS),
       **{name: functools.partial(ring_jax.attention_sharded, strategy=name, **_BLOCKS)
          for name in ("all_gather", "ulysses")}}
#: What ring_jax's own entry points declare beyond their keywords: V's own head size.
OWN_FEATURES = ("value_head_dim",)
_EJKERNEL = "ejkernel.kernels._xla.ring_attention"
#: The peers: name -> (adapter, tokens per device, capabilities no keyword announces
#: (``testing.run(features=)``), what must import for it to run).
PEERS = {
    "ringattention-0.1.2": (paper_ringattention, LOCAL_LEN, (), import_ringattention),
    "ejkernel-0.0.80.3-xla": (ejkernel_ring, LOCAL_LEN, (),
                              lambda: importlib.import_module(_EJKERNEL)),
    "ejkernel-0.0.80.3-xla-native-gqa": (functools.partial(ejkernel_ring, repeat_kv=False),
                                         LOCAL_LEN, (), lambda: importlib.import_module(_EJKERNEL)),
    "tokamax-0.0.17-ring-interpret": (tokamax_ring, 2 * TOKAMAX_BLOCK, ("value_head_dim",),
                                      lambda: splash_module("ring_attention_kernel")),
}


def targets(names, peers: bool) -> dict:
  """``{name: (fn, tokens per device, declared features)}`` of ``names`` (of :data:`OWN`) and,
  with ``peers``, of every peer of :data:`PEERS` importable here (the others named as not run)."""
  found, missing = {n: (OWN[n], LOCAL_LEN, OWN_FEATURES) for n in names}, []
  for name, (fn, local_len, features, probe) in (PEERS.items() if peers else ()):
    try:
      probe()
    except Exception:  # noqa: BLE001 -- not installed or not importable: not run
      missing.append(name)
      continue
    found[name] = (fn, local_len, features)
  for name in sorted(missing):
    print(f"# {name}: not importable here, not run", flush=True)
  return found


def main(argv=None):
  common.fake_cpu_devices()
  # A correctness run of ~100 small programs: compile at LLVM -O0, as tests/conftest.py does
  # (the same HLO and arithmetic, machine code that is slower to run and faster to produce).
  if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
  jax.config.update("jax_platforms", os.environ.get("JAX_PLATFORMS", "cpu"))
  ap = common.parser(__doc__)
  ap.add_argument("--targets", type=common.strs, default=list(OWN), help=f"of {list(OWN)}")
  ap.add_argument("--peers", action="store_true", help="also the peers' adapters")
  ap.add_argument("--cases", type=common.strs, help="comma-separated case names (default: all)")
  ap.add_argument("--out-dir", default=common.RESULTS, help="'' to write nothing")
  args = ap.parse_args(argv)
  failed = {}
  for name, (fn, local_len, features) in targets(args.targets, args.peers).items():
    report = testing.run(fn, args.cases or None, name=name, local_len=local_len, features=features,
                         progress=lambda r: print(f"  {r.case:24s} {r.status}", flush=True))
    print(report.table(), flush=True)
    failed[name] = [r.case for r in report.failed]
    path = os.path.join(args.out_dir, f"conformance_{name}.json") if args.out_dir else ""
    common.save(path, dict(meta=common.run_meta(argv, __file__, local_len=local_len),
                           **report.to_dict()))
  print("\nfailed cases:", failed)
  return failed


if __name__ == "__main__":
  main()
