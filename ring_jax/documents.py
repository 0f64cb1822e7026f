"""The ``"document"`` layout: causal work balanced per packed document, row by row.

Zigzag balances one causal sequence per row. A row that packs many documents
is not balanced by it: a device's causal work is the sum, over its tokens, of
the number of earlier tokens *of the same document*, so it depends on where
the long documents fall (docs/benchmarks.md, "Packed documents"). The ``"document"``
layout balances every row on its own, from its segment ids, on the host (numpy), in the
data pipeline.

**Construction.** Every device's shard has two halves, as in zigzag: its first
half holds *mask positions* (:func:`ring_jax.local_positions`) of zigzag chunk
``d``, its second half those of chunk ``2n-1-d``. Each document is dealt over
the ring in at most two passes: a *forward* part cut into ``n`` consecutive
pieces, piece ``j`` into the first half of device ``j``; a *backward* part cut
into ``n`` pieces, the first into the second half of device ``n-1``, the last
into that of device 0. A document is forward, backward, or *split* (head
forward, tail backward: one long document is exactly zigzag; halving every
document, as PyTorch's per-document head-tail load balancer in
``torch.distributed.tensor.experimental._attention`` does, is one balanced
choice, and the one here cuts at most two documents in two). A forward
document's piece on device ``j`` costs ``~ m^2 (j + 1/2)`` (``m = len / n``), a
backward one ``~ m^2 (n - j - 1/2)``, so every device's work is affine in
``j`` and balanced when the forward and backward documents' ``sum(len^2)``
agree. With each side holding ``L/2`` tokens that is two linear conditions on
the documents' head lengths, met with at most two documents split
(:func:`_heads`); the split is then moved so the work's slope also cancels the
masked pairs the kernel computes around the split documents (see
:func:`_row`). Pieces take ``len // n`` tokens and the
remainders are dealt round-robin over the devices (so short documents, shorter
than the ring, land one token per device), padding fills what is left. In
every half the documents come in the same order with pieces of equal size
(+-1 token), so a document's pieces sit at the same offsets on every device,
and renumbered segment ids (forward documents first, then split, then
backward) keep the block table's document ranges tight.

**Why it is exact.** The ring masks with the layout's static mask positions
(zigzag's) and the segment ids. Within each document the pieces' mask
positions increase with the tokens' original positions (forward pieces sit in
chunks ``0..n-1`` in order, backward pieces in chunks ``n..2n-1`` in order,
a token keeps its order inside a piece), and tokens of different documents
never see each other, so "same id and mask position of the key <= that of
the query" is "same document and causal in the original order". Windows
measure distances in positions, which the layout does not keep: they are
refused. Segment ids are required (without them a row is one document: use
``"zigzag"``).

**Use.** ``doc = document_layout(segment_ids_BL, ring_size)`` on the host;
reorder every ``[B, L]`` field with ``to_layout(x, "document", ring_size,
permutation=doc.permutation)`` (``from_layout`` inverts it); pass
``doc.segment_ids`` (renumbered, layout order) to attention with
``layout="document"`` and the tokens' RoPE positions as data
(``doc.permutation`` is each token's original index in the row).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ring_jax import layouts
from ring_jax import masking


class DocumentLayout(NamedTuple):
  """What :func:`document_layout` returns: each row's permutation into the ``"document"``
  layout and its segment ids in that order (numpy int32 ``[B, L]`` each).

  permutation: int32: ``permutation[b, k]`` is the original (natural-order) index of the
    token at layout slot ``k`` of row ``b`` (also its position in the row).
  segment_ids: int32: the tokens' documents renumbered ``1, 2, ...`` per row in the
    order the layout places them (0 stays padding): pass these to attention.
  """
  permutation: np.ndarray
  segment_ids: np.ndarray


def document_layout(segment_ids, ring_size: int) -> DocumentLayout:
  """Builds the ``"document"`` layout of rows packed with documents: a per-row permutation
  that balances every document's causal work over a ring of ``ring_size`` devices, and the
  segment ids in that order (host-side numpy; see :mod:`ring_jax.documents`).

  Args:
    segment_ids: integer ``[B, L]`` ids in natural order (numpy or a concrete jax
      array): 0 is padding, every other value a document (all tokens with one id are
      one document, in their order, even if not adjacent).
    ring_size: the ring's size ``n``; ``L`` must be a multiple of ``2n``.

  Returns:
    :class:`DocumentLayout` (numpy int32 ``[B, L]`` permutation and renumbered ids).
  """
  seg = np.asarray(segment_ids)
  if seg.ndim != 2 or not np.issubdtype(seg.dtype, np.integer):
    raise ValueError(f"segment_ids must be an integer [batch, length] array, got "
                     f"{seg.dtype} {seg.shape}.")
  layouts.check_length(layouts.DOCUMENT, ring_size, seg.shape[1])
  rows = [_row(r, ring_size) for r in seg]
  return DocumentLayout(permutation=np.stack([p for p, _ in rows]).astype(np.int32),
                        segment_ids=np.stack([s for _, s in rows]).astype(np.int32))


def _row(seg: np.ndarray, n: int):
  """``(permutation [L], renumbered ids [L])`` of one row."""
  length = seg.shape[0]
  order = np.argsort(seg, kind="stable")  # tokens grouped by id, natural order inside
  ids, starts, counts = np.unique(seg[order], return_index=True, return_counts=True)
  groups = {i: order[s:s + c] for i, s, c in zip(ids.tolist(), starts, counts)}
  pads = groups.pop(0, np.zeros(0, np.int64))
  docs = sorted(groups, key=lambda i: groups[i][0])  # by first appearance
  sizes = np.array([len(groups[d]) for d in docs], np.int64)
  # Two split documents sit [S1 head, S2 head | S1 tail, S2 tail] around the middle of each
  # shard: at the hops where a device holds a shard from a later device (``n - 1 - d`` of
  # them), a query block of S1's tail spans S2's head pieces too, and S2's tail S1's tail:
  # masked pairs the kernel computes, about ``(t1 h2 + t2 t1) / n^2`` per such hop. That
  # waste falls linearly over the devices, so a forward-heavy slope of the same size evens
  # it out; the slope moves the split, so a few candidates are tried and the one whose slope
  # best matches its own waste is kept.
  best, slope = None, 0
  for _ in range(4):
    cand = dict(zip(docs, _heads(sizes, len(pads), length // 2, slope).tolist()))
    spl = [d for d in docs if 0 < cand[d] < len(groups[d])]  # at most two
    waste = 0
    if len(spl) == 2:
      (_, t1), (h2, t2) = ((cand[d], len(groups[d]) - cand[d]) for d in spl)
      waste = t1 * h2 + t2 * t1
    got = sum(len(groups[d]) * (2 * cand[d] - len(groups[d])) for d in docs)
    if best is None or abs(got - waste) < best[0]:
      best = (abs(got - waste), cand)
    if waste == slope:
      break
    slope = waste
  heads = best[1]
  spl = [d for d in docs if 0 < heads[d] < len(groups[d])]
  fwd = [d for d in docs if heads[d] == len(groups[d])]
  bwd = [d for d in docs if heads[d] == 0]
  n_pad_f = length // 2 - sum(heads.values())
  first = [pads[:n_pad_f]] + [groups[d] for d in fwd] + [groups[d][:heads[d]] for d in spl]
  second = ([groups[d][heads[d]:] for d in spl] + [groups[d] for d in bwd]
            + [pads[n_pad_f:]])
  new_id = {d: i + 1 for i, d in enumerate(fwd + spl + bwd)}
  relabel = np.zeros(length, np.int64)
  for d, i in new_id.items():
    relabel[groups[d]] = i
  firsts, seconds = _deal(first, n, reverse=False), _deal(second, n, reverse=True)
  perm = np.concatenate([np.concatenate([f, b]) for f, b in zip(firsts, seconds)])
  return perm, relabel[perm]


def _heads(sizes: np.ndarray, pad: int, half: int, slope: int = 0) -> np.ndarray:
  """int64 head length ``a_D`` (tokens dealt forward) of each document of ``sizes``.

  Conditions: ``sum(a) + pad_f = half`` with ``0 <= pad_f <= pad`` (each side holds half
  the row), and ``sum(len_D * (2 a_D - len_D)) = slope`` (0: forward and backward balance,
  no slope in the devices' work). Halving every document meets both for ``slope = 0``
  (PyTorch's per-document head-tail split); this is the solution with at most two
  documents split: with the row's tokens ordered by the length of their document
  (padding first, length 0), the heads are the window of ``half`` consecutive tokens
  whose summed document length is ``(sum(len^2) + slope) / 2`` (the window's sum grows
  with its start, from the shortest documents' half to the longest's, so a search over
  the start finds it).
  """
  order = np.argsort(sizes, kind="stable")
  ends = pad + np.cumsum(sizes[order])          # token stream: padding, then by length
  starts = ends - sizes[order]
  weight_end = np.cumsum(sizes[order] ** 2)     # summed document length up to each end

  def weight(x):  # summed document length of the first x tokens of the stream
    k = np.searchsorted(ends, x, side="left")
    if k >= len(order):
      return int(weight_end[-1]) if len(order) else 0
    before = int(weight_end[k - 1]) if k else 0
    return before + max(0, int(x - starts[k])) * int(sizes[order][k])

  target = int((sizes ** 2).sum()) + slope  # 2 x the wanted window sum (kept integer)
  lo, hi = 0, pad + int(sizes.sum()) - half
  while lo < hi:  # smallest start whose window reaches half the total
    mid = (lo + hi) // 2
    if 2 * (weight(mid + half) - weight(mid)) < target:
      lo = mid + 1
    else:
      hi = mid
  start = lo
  if start > 0 and (abs(2 * (weight(start - 1 + half) - weight(start - 1)) - target)
                    < abs(2 * (weight(start + half) - weight(start)) - target)):
    start -= 1
  heads = np.zeros(len(sizes), np.int64)
  heads[order] = np.clip(np.minimum(ends, start + half) - np.maximum(starts, start), 0, None)
  return heads


def _deal(items, n: int, reverse: bool):
  """Each item (token indices in order) cut into ``n`` consecutive pieces of ``len // n``
  tokens plus remainders dealt round-robin across items; piece ``k`` to device ``k``
  (``reverse``: device ``n-1-k``). Returns each device's indices, items in order."""
  per_device = [[] for _ in range(n)]
  offset = 0
  k = np.arange(n)
  for idx in items:
    base, rem = divmod(len(idx), n)
    sizes = base + (((k - offset) % n) < rem)
    offset = (offset + rem) % n
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    for piece in range(n):
      per_device[n - 1 - piece if reverse else piece].append(idx[bounds[piece]:bounds[piece + 1]])
  return [np.concatenate(p) if p else np.zeros(0, np.int64) for p in per_device]


def token_work(segment_ids, permutation, ring_size: int) -> np.ndarray:
  """int64 ``[B, n]``: the (query, key) pairs each device scores under a causal mask within
  documents (a token sees itself and the earlier tokens of its document).

  ``segment_ids`` ``[B, L]`` natural order; ``permutation`` ``[B, L]`` or ``[L]``: the
  natural index of each layout slot (:func:`ring_jax.layout_positions` for the static
  layouts, :attr:`DocumentLayout.permutation`); device ``d`` holds slots
  ``[d L/n, (d+1) L/n)``. The token-level model, independent of block sizes.
  """
  seg = np.asarray(segment_ids)
  b, length = seg.shape
  perm = np.broadcast_to(np.asarray(permutation), (b, length))
  order = np.argsort(seg, axis=1, kind="stable")
  sorted_seg = np.take_along_axis(seg, order, axis=1)
  idx = np.arange(length)
  start = np.ones((b, length), bool)
  start[:, 1:] = sorted_seg[:, 1:] != sorted_seg[:, :-1]
  rank = idx - np.maximum.accumulate(np.where(start, idx, 0), axis=1)
  work = np.zeros((b, length), np.int64)
  np.put_along_axis(work, order, np.where(sorted_seg != 0, rank + 1, 0), axis=1)
  return np.take_along_axis(work, perm, axis=1).reshape(b, ring_size, -1).sum(-1)


def block_work(segment_ids, layout: str, ring_size: int, block_q: int, block_kv: int,
               is_causal: bool = True) -> np.ndarray:
  """int64 ``[B, n, n]``: block pairs device ``d`` computes at hop ``h`` (``[b, d, h]``),
  from the same :func:`ring_jax.masking.block_table` the ring builds at every hop.

  ``segment_ids`` ``[B, L]`` in ``layout`` order (for ``"document"``,
  :attr:`DocumentLayout.segment_ids`). Each row is counted on its own (as with batch 1).
  A query block computes every key block of its table range ``[lo, hi)``. Sum over
  hops for each device's work; hops are synchronous, so a pass costs
  ``max(axis=1).sum(-1)`` (the critical path).
  """
  seg = np.asarray(segment_ids)
  b, length = seg.shape
  local = layouts.check_length(layout, ring_size, length)
  pos = [layouts.local_positions(layout, ring_size, local, d) for d in range(ring_size)]
  shards = seg.reshape(b, ring_size, local)
  work = np.zeros((b, ring_size, ring_size), np.int64)
  for r in range(b):
    for d in range(ring_size):
      for h in range(ring_size):
        src = (d - h) % ring_size
        table = masking.block_table(pos[d], pos[src], shards[r, d][None], shards[r, src][None],
                                    block_q, block_kv, is_causal, None)
        lo, hi = table.q_ranges[0, :, 0], table.q_ranges[0, :, 3]
        work[r, d, h] = int((hi - lo).sum())
  return work
