"""Sequence layouts for ring attention: which tokens each device holds, and where they sit.

A *layout* says which global token positions each device of the ring holds.
With ``n`` devices and global length ``L`` (local length ``L/n``):

* ``"contiguous"``: device ``i`` holds positions ``[i*L/n, (i+1)*L/n)``.
  Under a causal mask device ``n-1`` does ``n`` times the work of device 0.
* ``"zigzag"``: the sequence is cut into ``2n`` chunks; device ``i`` holds
  chunks ``i`` and ``2n-1-i``. Every device then does the same causal work at
  every hop (half of a full hop after hop 0), as in Megatron/TE context
  parallelism and Brandon et al., "Striped Attention" (2023) Sec. 3.
* ``"striped"``: token ``t`` lives on device ``t mod n`` (Striped Attention).
* ``"document"``: for rows that pack many documents, a per-row permutation
  (data dependent: built on the host by :func:`ring_jax.document_layout` from
  the segment ids) that balances causal work per document; its *mask
  positions* are zigzag's (see :mod:`ring_jax.documents`). Not in
  :data:`LAYOUTS` (the static layouts): :func:`to_layout` / :func:`from_layout`
  take its ``permutation=``, attention needs segment ids and no window.

Arrays are laid out "in layout order": the global array is the concatenation
of the devices' local shards, so sharding the sequence axis evenly over the
ring gives each device exactly its tokens. :func:`to_layout` /
:func:`from_layout` convert between natural order and layout order (and
:func:`shard_to_layout` / :func:`shard_from_layout` do it shard by shard inside
``shard_map``), and :func:`layout_positions` gives each token's global position
(for RoPE and masks) in layout order. :func:`check_length` is the one check
that a length splits over a ring in a layout.

The masks these positions induce live in :mod:`ring_jax.masking`, the block schedule in
:mod:`ring_jax.scheduling`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

#: The static layouts: a fixed permutation per (ring size, length).
LAYOUTS: tuple[str, ...] = ("contiguous", "zigzag", "striped")
#: The per-row, data-dependent layout of packed documents (ring_jax.documents).
DOCUMENT = "document"
#: Every name ``layout=`` accepts.
ALL_LAYOUTS: tuple[str, ...] = LAYOUTS + (DOCUMENT,)


def check_layout(layout: str) -> None:
  if layout not in ALL_LAYOUTS:
    raise ValueError(f"layout must be one of {ALL_LAYOUTS}, got {layout!r}.")


def mask_layout(layout: str) -> str:
  """The static layout whose positions the ring masks with: ``"zigzag"`` for
  ``"document"`` (its mask positions), else ``layout`` itself."""
  check_layout(layout)
  return "zigzag" if layout == DOCUMENT else layout


def check_attention_layout(layout: str, segment_ids, local_window_size) -> str:
  """The static layout attention runs ``layout`` as (:func:`mask_layout`), after the
  document layout's conditions: segment ids given, no window (ValueError naming the fix)."""
  if layout == DOCUMENT:
    if segment_ids is None:
      raise ValueError(
          "layout='document' needs segment_ids (the renumbered ids of "
          "ring_jax.document_layout); a row without them is one document: use layout='zigzag'.")
    if local_window_size is not None:
      raise ValueError(
          "layout='document' does not keep the distances between tokens, so it cannot apply "
          "local_window_size; use layout='zigzag' or 'contiguous' for windowed attention.")
  return mask_layout(layout)


def length_multiple(layout: str, ring_size: int) -> int:
  """Sequence lengths ``layout`` can split over ``ring_size`` devices are multiples of this.

  ``ring_size`` (one shard per device), or ``2 * ring_size`` for zigzag (two
  chunks per device).
  """
  layout = mask_layout(layout)
  if ring_size < 1:
    raise ValueError(f"ring_size must be >= 1, got {ring_size}.")
  return 2 * ring_size if layout == "zigzag" else ring_size


def check_length(layout: str, ring_size: int, length: int, what: str = "sequence length") -> int:
  """Checks that ``layout`` splits ``length`` tokens over ``ring_size`` devices; returns the
  local length ``length // ring_size``.

  Raises ValueError naming the length to pad to (see :func:`length_multiple`).
  ``what`` names the length in the message (e.g. ``"query length"``).
  """
  multiple = length_multiple(layout, ring_size)
  if length < 1:
    raise ValueError(f"{what} must be positive, got {length}.")
  if length % ring_size:
    raise ValueError(
        f"{what} {length} is not divisible by the ring size {ring_size}; pad it to a multiple "
        f"of {multiple}.")
  local_len = length // ring_size
  if length % multiple:
    raise ValueError(
        f"layout={layout!r} holds two chunks per device, so the local length ({what} "
        f"{length} / ring size {ring_size} = {local_len}) must be even; pad the {what} to a "
        f"multiple of {multiple}, or use layout='striped' or 'contiguous'.")
  return local_len


def local_positions(layout: str, ring_size: int, local_len: int, device):
  """Global positions ``[local_len]`` (int32) of the tokens held by ``device``.

  ``device`` may be a Python int or a traced int32 scalar (e.g.
  ``jax.lax.axis_index``), so the same formula serves the kernel and the
  schedule. Works with numpy when ``device`` is an int. For ``"document"``:
  its mask positions (zigzag's), not the tokens' original positions.
  """
  xp = np if isinstance(device, (int, np.integer)) else jnp
  layout = mask_layout(layout) if layout == DOCUMENT else layout
  j = xp.arange(local_len, dtype=np.int32)
  if layout == "contiguous":
    return device * local_len + j
  if layout == "striped":
    return j * ring_size + device
  if layout == "zigzag":
    half = local_len // 2
    first = device * half + j
    second = (2 * ring_size - 1 - device) * half + (j - half)
    return xp.where(j < half, first, second).astype(np.int32)
  raise ValueError(f"layout must be one of {ALL_LAYOUTS}, got {layout!r}.")


@functools.lru_cache(maxsize=256)
def _permutation(layout: str, ring_size: int, length: int) -> np.ndarray:
  """perm[k] = natural position of the token at layout-order index k."""
  if layout == DOCUMENT:
    raise ValueError(
        "layout='document' is a per-row permutation of the data: build it with "
        "ring_jax.document_layout(segment_ids, ring_size) and pass its permutation= to "
        "to_layout / from_layout (its mask positions are local_positions('document', ...)).")
  local_len = check_length(layout, ring_size, length)
  perm = np.concatenate(
      [local_positions(layout, ring_size, local_len, d) for d in range(ring_size)])
  perm.setflags(write=False)
  return perm


def layout_positions(layout: str, ring_size: int, length: int) -> np.ndarray:
  """Global position ``[length]`` of each token of a layout-ordered sequence."""
  return _permutation(layout, ring_size, length).copy()


def to_layout(x, layout: str, ring_size: int, axis: int = 1, *, permutation=None):
  """Reorders a natural-order array along ``axis`` into ``layout`` order.

  ``layout="document"`` takes ``permutation`` ``[B, L]`` (from
  :func:`ring_jax.document_layout`; numpy) and reorders each row of ``x``
  ``[B, L, ...]`` (``axis`` must be 1) by its own; the static layouts take none.
  """
  if _document_permutation(layout, permutation, x, axis) is not None:
    return _gather_rows(x, np.asarray(permutation))
  perm = _permutation(layout, ring_size, x.shape[axis])
  if layout == "contiguous":
    return x
  return _gather(x, perm, axis)


def from_layout(x, layout: str, ring_size: int, axis: int = 1, *, permutation=None):
  """Inverse of :func:`to_layout`: layout order back to natural order (the same
  ``permutation`` for ``"document"``)."""
  if _document_permutation(layout, permutation, x, axis) is not None:
    return _gather_rows(x, np.argsort(np.asarray(permutation), axis=1).astype(np.int32))
  perm = _permutation(layout, ring_size, x.shape[axis])
  if layout == "contiguous":
    return x
  return _gather(x, np.argsort(perm).astype(np.int32), axis)


def _document_permutation(layout, permutation, x, axis):
  """``permutation`` checked against ``x`` for the document layout; None for static ones."""
  check_layout(layout)
  if layout != DOCUMENT:
    if permutation is not None:
      raise ValueError(f"permutation= is for layout='document' only; layout={layout!r} is "
                       "a fixed permutation.")
    return None
  if permutation is None:
    _permutation(layout, 1, 2)  # the error naming ring_jax.document_layout
  shape = np.shape(permutation)
  if axis % x.ndim != 1 or len(shape) != 2 or tuple(x.shape[:2]) != shape:
    raise ValueError(f"layout='document' reorders [batch, length, ...] arrays along axis 1 "
                     f"by a [batch, length] permutation; got x {tuple(x.shape)}, axis={axis}, "
                     f"permutation {shape}.")
  return permutation


def _gather_rows(x, index: np.ndarray):
  """``x[b, index[b]]`` for every row ``b`` (numpy stays numpy), keeping the sharding of
  ``x`` on meshes with Explicit axes (as :func:`_gather`)."""
  if isinstance(x, np.ndarray):
    return np.take_along_axis(x, index.reshape(index.shape + (1,) * (x.ndim - 2)), axis=1)
  rows = jnp.arange(index.shape[0], dtype=np.int32)[:, None]
  sharding = _explicit_sharding(x)
  if sharding is not None:
    return x.at[rows, jnp.asarray(index)].get(out_sharding=sharding)
  return x[rows, jnp.asarray(index)]


def _explicit_sharding(x):
  """The sharding of ``x`` if it lies on a mesh with Explicit axes (where a gather must be
  told its output sharding), else None."""
  sharding = getattr(jax.typeof(x), "sharding", None) if isinstance(x, jax.Array) else None
  types = getattr(getattr(sharding, "mesh", None), "axis_types", ()) or ()
  return sharding if any(t == jax.sharding.AxisType.Explicit for t in types) else None


def _gather(x, index: np.ndarray, axis: int):
  """``x`` reordered along ``axis``, keeping its sharding on meshes with Explicit axes."""
  axis = axis % x.ndim
  sharding = _explicit_sharding(x)
  if sharding is not None:
    # Sharding-in-types refuses to guess the output sharding of a gather.
    idx = (slice(None),) * axis + (jnp.asarray(index),)
    return x.at[idx].get(out_sharding=sharding)
  return jnp.take(x, jnp.asarray(index), axis=axis)


def _zigzag_home(chunk: int, ring_size: int) -> int:
  """Device that holds natural chunk ``chunk`` (of ``2n``) under the zigzag layout."""
  return chunk if chunk < ring_size else 2 * ring_size - 1 - chunk


def can_reorder_shards(layout: str, ring_size: int, local_len: int) -> bool:
  """Whether :func:`shard_to_layout` handles this case (striped needs ``n | local_len``)."""
  if layout == "striped":
    return local_len % ring_size == 0
  return layout in LAYOUTS and (layout != "zigzag" or local_len % 2 == 0)


def shard_to_layout(x, layout: str, axis_name, axis: int = 1):
  """Inside ``shard_map``: a contiguous (natural-order) shard -> this device's ``layout`` shard.

  The collective counterpart of :func:`to_layout` for a sequence already
  sharded over ``axis_name``: zigzag moves the two half-shards with two
  ``ppermute``s, striped with one ``all_to_all``; memory stays O(local
  length), whereas reordering the global array gathers it. Striped needs the
  local length divisible by the ring size (:func:`can_reorder_shards`). Profiles and
  :mod:`ring_jax.analysis` name its transfers ``to_layout``.

  ``x`` may be a pytree of arrays (None leaves stay None): the arrays of one dtype and the
  same dimensions up to ``axis`` travel together, side by side along their flattened
  trailing dimensions, so e.g. q, k and v take the collectives of one array.
  """
  with jax.named_scope("to_layout"):
    return _reorder_tree(x, layout, axis_name, axis, inverse=False)


def shard_from_layout(x, layout: str, axis_name, axis: int = 1):
  """Inverse of :func:`shard_to_layout`: this device's layout shard -> its contiguous shard
  (transfers named ``from_layout``; ``x`` an array or a pytree of arrays, grouped as
  there)."""
  with jax.named_scope("from_layout"):
    return _reorder_tree(x, layout, axis_name, axis, inverse=True)


def _reorder_tree(tree, layout, axis_name, axis, inverse):
  """:func:`_reorder_shard` of every array of ``tree``, one call per group of arrays with
  the same dtype and dimensions up to ``axis`` (joined along their flattened trailing
  dimensions, split back after)."""
  leaves, treedef = jax.tree.flatten(tree)
  groups: dict = {}
  for i, x in enumerate(leaves):
    ax = axis % x.ndim
    groups.setdefault((jnp.dtype(x.dtype), tuple(x.shape[:ax + 1])), []).append(i)
  out = list(leaves)
  for (_, lead), members in groups.items():
    ax = len(lead) - 1
    if len(members) == 1:
      out[members[0]] = _reorder_shard(leaves[members[0]], layout, axis_name, ax, inverse)
      continue
    flat = [leaves[i].reshape(lead + (-1,)) for i in members]
    joined = _reorder_shard(jnp.concatenate(flat, axis=-1), layout, axis_name, ax, inverse)
    ends = np.cumsum([f.shape[-1] for f in flat])[:-1]
    for i, part in zip(members, jnp.split(joined, ends, axis=-1)):
      out[i] = part.reshape(leaves[i].shape)
  return jax.tree.unflatten(treedef, out)


def _reorder_shard(x, layout, axis_name, axis, inverse):
  check_layout(layout)
  if layout == DOCUMENT:
    raise ValueError("layout='document' is a per-row permutation built on the host "
                     "(ring_jax.document_layout); reorder the global arrays with "
                     "to_layout(..., permutation=) before sharding them.")
  n = jax.lax.axis_size(axis_name)
  axis = axis % x.ndim
  local_len = x.shape[axis]
  if layout == "contiguous" or n == 1:
    return x
  if not can_reorder_shards(layout, n, local_len):
    need = ("striped needs a multiple of the ring size" if layout == "striped"
            else "zigzag needs an even length")
    raise ValueError(
        f"cannot reorder a local shard of {local_len} tokens into layout={layout!r} over "
        f"{n} devices: {need}.")
  if layout == "zigzag":
    half = local_len // 2
    even_device = jax.lax.axis_index(axis_name) % 2 == 0
    first, second = (jax.lax.slice_in_dim(x, 0, half, axis=axis),
                     jax.lax.slice_in_dim(x, half, local_len, axis=axis))
    # Natural chunk 2i (first half of shard i) and 2i+1 go to their zigzag homes;
    # an even device receives its first chunk from the "even" transfer.
    to_even = [(i, _zigzag_home(2 * i, n)) for i in range(n)]
    to_odd = [(i, _zigzag_home(2 * i + 1, n)) for i in range(n)]
    if not inverse:
      got_even = jax.lax.ppermute(first, axis_name, to_even)
      got_odd = jax.lax.ppermute(second, axis_name, to_odd)
      return jnp.concatenate([jnp.where(even_device, got_even, got_odd),
                              jnp.where(even_device, got_odd, got_even)], axis=axis)
    even_chunk = jnp.where(even_device, first, second)
    odd_chunk = jnp.where(even_device, second, first)
    back_even = jax.lax.ppermute(even_chunk, axis_name, [(d, s) for s, d in to_even])
    back_odd = jax.lax.ppermute(odd_chunk, axis_name, [(d, s) for s, d in to_odd])
    return jnp.concatenate([back_even, back_odd], axis=axis)
  # striped: token j of a contiguous shard goes to device j mod n (shards start at
  # multiples of n). Tiled all_to_all over a size-n axis of [.., n, L/n^.., ..] blocks.
  shape = x.shape
  lead, rest = shape[:axis], shape[axis + 1:]
  if not inverse:
    y = x.reshape(lead + (local_len // n, n) + rest)
    y = jnp.swapaxes(y, axis, axis + 1)                       # [.., residue, j, ..]
    y = jax.lax.all_to_all(y, axis_name, axis, axis, tiled=True)  # -> [.., source, j, ..]
    return y.reshape(shape)
  y = x.reshape(lead + (n, local_len // n) + rest)             # [.., source, j, ..]
  y = jax.lax.all_to_all(y, axis_name, axis, axis, tiled=True)   # -> [.., residue, j, ..]
  return jnp.swapaxes(y, axis, axis + 1).reshape(shape)

