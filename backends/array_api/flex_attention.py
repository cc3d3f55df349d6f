"""FlexAttention on the Array API: flash-style tiles running traced score and mask mods.

Work runs per (batch, kv head), like attention: the query heads of the kv
head's group are stacked as the rows of one matrix. The tile plan
(:class:`xpkernels.mods.TilePlan`) says, for every (query tile, key tile),
whether to skip it, to evaluate the mask there (PARTIAL) or not (FULL); the
same plan drives the forward (query tiles outer, online softmax over their
key tiles) and the backward (key tiles outer, recomputing each tile's
probabilities from the checkpoints ``m``, ``l``).

Mods arrive as traced graphs (:class:`xpkernels.mods.Graph`) and are
evaluated on each tile's ``(heads, queries, keys)`` index grid; the score
mod's reverse mode gives d(score out)/d(score in) for ``ds`` and adds the
gradients of its captured arrays into their accumulators, tile by tile.
Built-in and user mods take exactly the same path.

Element-wise passes over a score tile are what NumPy pays for, so there are
few, as in attention: the forward exponentiates unshifted scores while every
running row max lies within ``+-SAFE_EXPONENT`` and gets row sums from a
matrix-vector product; the backward folds ``-delta`` into the ``do @ v^T``
product, and (without a score mod) ``-lse`` into the score product, by
appending one column to each operand.

On NumPy arrays, as in attention: the forward's (batch, kv head, row chunk)
items are shared among the worker threads of :mod:`._blocks` while NumPy's
OpenBLAS runs one thread per product, and score products go into a
per-worker buffer (``matmul(out=)``), exponentiated in place when no score
mod holds them. Without a score mod a PARTIAL tile's mask is applied in
place too: added as a 0/``-inf`` bias when the chunk's scores are provably
finite (Cauchy-Schwarz on the query and key norms; 8 against 34 us for a
selection at 256 x 256), selected otherwise; and FULL tiles of a chunk whose
scores are bounded by ``SAFE_EXPONENT`` take base-2 scores through ``exp2``
(as attention's NumPy tiles; PARTIAL tiles keep ``exp``, which takes
``-inf`` at full speed). Measured at 1x8x2048x64 float32, 2 cores, same
process: forward 0.90-0.94x the time before these measures (window 256,
4 documents, causal). The backward shares its (batch, kv head) items the same way
without a score mod; with one it stays on the caller's thread (the score
mod's gradient accumulators are shared by every tile).

On NumPy without a score mod, a mask that keeps exactly one interval of keys
per row (the plan's ``bands``: sliding windows, prefix masks, contiguous
documents over host ids) runs the forward of :mod:`._flex_band` instead
where that computes at most 0.9 of the tiles' scores: row chunks of 32 against
their own span of keys, consecutive chunks in one batched product. At
1x8x2048x64 float32 with a 256-key window, 2 cores, interleaved (medians of
15): 17.0 against 29.9 ms with checkpoints, 16.1 against 28.1 without; at
1x8x4096x128 (medians of 9), 51.9 against 77.2 ms; 4 documents of 47-1325
rows at 1x8x2048x64, 55.6 against 73.0 ms on the BlockMask's tiles (medians
of 11).

Plain attention -- no score mod, and no mask or one whose exact band is
causal or keeps every key (:func:`_plain_attention`) -- runs the forward and
backward of :mod:`.attention` on NumPy instead: the same scores and masks,
without a mask graph, its causal diagonal in chunks. At 1x8x2048x64 float32,
2 cores, interleaved (medians of 7): causal forward 47.1 against 56.4 ms,
backward 105.9 against 151.2; no mask 71.6 against 81.3 and 173.9 against
226.7.

A query tile is split into row chunks so that one chunk's scores hold at most
``TILE_ELEMENTS``: extra memory is bounded by that budget, not by Sq or Sk.
Rows that keep no key have ``o = 0``, ``m = -inf``, ``l = 0`` and zero
gradients, with no NaN and no floating-point warning.

Non-finite inputs reach exactly the rows (and keys) whose kept pairs see
them, as in attention. A pair is hidden by selecting ``-inf`` (mask) or by a
score mod returning it; in a tile that hides pairs, an operand of a product
whose other side is zero on them (``p @ v``, ``p^T @ do``, ``ds @ k``,
``ds^T @ q``) is checked, and when it holds a non-finite value the product
takes it as 0 and the results whose kept pairs see it are set to NaN
(:func:`_seen_product`); ``p`` and ``ds`` are 0 on the hidden pairs.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import array_api_compat
import numpy as np

from xpkernels.mods import PARTIAL, SKIP, tile_grid

from . import attention as _attention
from ._blocks import (
    LOG2E,
    SAFE_EXPONENT,
    acc_dtype,
    for_each_item,
    max_row_norm,
    numpy_views,
    row_blocks,
    spans,
    tile_workers,
    to,
)
from ._flex_band import BandWorkspace, band_batches, forward_batch, tile_elements

__all__ = ["forward", "backward", "default_tiles"]

#: Score elements of one row chunk x key tile (float32: 1 MiB), as attention.
#: Each call holds a handful of temporaries this size, whatever Sq and Sk are.
TILE_ELEMENTS = 1 << 18

#: Keys per tile without a mask (as attention) and with one (finer, so more
#: tiles are skipped); queries per masked tile at most ``MASKED_QUERY_TILE``.
KEY_TILE, MASKED_KEY_TILE, MASKED_QUERY_TILE = 1024, 256, 256


def default_tiles(n_q: int, n_kv: int, group: int, masked: bool) -> tuple[int, int]:
    """``(tile_m, tile_n)``: queries and keys per tile when no BlockMask fixes them."""
    tile_n = max(1, min(MASKED_KEY_TILE if masked else KEY_TILE, n_kv))
    tile_m = max(1, TILE_ELEMENTS // (tile_n * group))
    if masked:
        tile_m = min(tile_m, MASKED_QUERY_TILE)
    return max(1, min(tile_m, n_q)), tile_n


def _matmul(a, b, out):
    """``a @ b``, written into ``out`` (a NumPy view) unless it is None."""
    return a @ b if out is None else np.matmul(a, b, out=out)


def _seen_product(xp, a, b, seen):
    """``a @ b`` where ``a`` is zero on the pairs ``seen`` (bool, ``a``'s shape) is False.

    A non-finite entry of ``b`` would reach every result through ``0 * inf`` or
    ``0 * NaN``: it enters the product as 0 instead, and each result whose row
    of ``seen`` sees it is NaN. Only called for a ``b`` holding one.
    """
    finite = xp.isfinite(b)
    product = a @ xp.where(finite, b, xp.zeros_like(b))
    hits = to(xp, seen, b.dtype) @ to(xp, ~finite, b.dtype)
    return xp.where(hits > 0, math.nan, product)


def _all_finite(xp, a) -> bool:
    """Whether every entry of ``a`` is finite (read on the host)."""
    return bool(xp.all(xp.isfinite(a)))


def _with_column(xp, a, column, acc):
    """``[a | column]`` in ``acc``: ``a`` (rows, n) and one more column ((rows,) array or float)."""
    rows, n = a.shape
    out = xp.empty((rows, n + 1), dtype=acc, device=array_api_compat.device(a))
    out[:, :n] = to(xp, a, acc)
    out[:, n] = column
    return out


def _views(arrays, input_pos, score_mod, mask_mod, grads=()):
    """A call on PyTorch CPU tensors as zero-copy NumPy views (:func:`._blocks.numpy_views`):
    ``(arrays, input_pos, (score mod arrays, mask mod arrays), grads)``, or None unless every
    one of them -- the mods' captured arrays and the score mod's gradient accumulators too --
    is a tensor NumPy holds (None entries kept)."""
    position = () if isinstance(input_pos, tuple) else (input_pos,)
    slots = [[] if g is None else [slot.array for slot in g.slots] for g in (score_mod, mask_mod)]
    views = numpy_views(*arrays, *position, *slots[0], *slots[1], *grads)
    if views is None:
        return None
    rest = iter(views)
    arrays = tuple(next(rest) for _ in arrays)
    input_pos = next(rest) if position else input_pos
    slot_views = tuple([next(rest) for _ in group] for group in slots)
    return arrays, input_pos, slot_views, [next(rest) for _ in grads]


class _Tiles:
    """What every tile of one call shares: namespace, dtypes, sizes, bound graphs."""

    def __init__(
        self, xp, q, k, v, *, scale, input_pos, score_mod, mask_mod, plan, first_batch, slots=None
    ):
        """``slots``: ``(score mod arrays, mask mod arrays)`` replacing the graphs' captured
        arrays (their NumPy views), or None."""
        self.xp = xp
        self.first_batch = first_batch
        self.acc = acc_dtype(xp, q.dtype)
        self.device = array_api_compat.device(q)
        self.batch, self.heads, self.n_q, self.d = q.shape
        self.kv_heads, self.n_kv, self.dv = k.shape[1], k.shape[2], v.shape[3]
        self.group = self.heads // self.kv_heads
        self.scale = scale
        if isinstance(input_pos, tuple):
            self.positions = input_pos if len(input_pos) > 1 else input_pos * self.batch
        else:  # a (B,) device array: never read on the host, only added to row indices
            self.positions = xp.astype(input_pos, xp.int64)
        self.plan = plan
        self.rows_per_chunk = max(1, TILE_ELEMENTS // (self.group * plan.tile_n))
        score_arrays, mask_arrays = (None, None) if slots is None else slots
        self.score = (
            None if score_mod is None else score_mod.bind(xp, self.acc, self.device, score_arrays)
        )
        self.mask = (
            None if mask_mod is None else mask_mod.bind(xp, self.acc, self.device, mask_arrays)
        )
        self.names = (score_mod.inputs if score_mod else frozenset()) | (
            mask_mod.inputs if mask_mod else frozenset()
        )
        self.ones = xp.ones((max(plan.tile_n, self.n_kv),), dtype=self.acc, device=self.device)
        self.in_place_mask = array_api_compat.is_numpy_namespace(xp)
        self._shifted = None
        self.local = threading.local()

    def shifted(self, s, lse):
        """``s - lse[:, None]`` in a buffer of this call, leaving ``s`` (the mod's values) intact.

        The score mod's reverse mode reads its node values, the modified
        scores among them, so they are not shifted in place; the buffer is
        allocated once per call at the largest chunk's size and reused.
        """
        xp = self.xp
        if self._shifted is None:
            rows = self.group * min(self.rows_per_chunk, self.plan.tile_m, self.n_q)
            self._shifted = xp.empty((rows, self.plan.tile_n), dtype=self.acc, device=self.device)
        out = self._shifted[: s.shape[0], : s.shape[1]]
        out[...] = s
        out -= lse[:, None]
        return out

    def span_keys(self, rows: int) -> int:
        """Most keys of one forward span of ``rows`` rows: FULL tiles in a row are taken together
        up to the tile budget (at least one tile)."""
        return max(self.plan.tile_n, TILE_ELEMENTS // max(rows, 1))

    def tile_buffer(self):
        """A flat buffer for one chunk's scores over a span of key tiles on NumPy (reused by
        every span a worker runs: no allocation, and no page faults, per tile); None elsewhere."""
        if not array_api_compat.is_numpy_namespace(self.xp):
            return None
        rows = self.group * min(self.rows_per_chunk, self.plan.tile_m, self.n_q)
        keys = min(self.span_keys(rows), max(self.n_kv, self.plan.tile_n))
        return self.xp.empty((rows * keys,), dtype=self.acc, device=self.device)

    def q_chunks(self, i):
        """Row chunks of query tile ``i``."""
        first = i * self.plan.tile_m
        return spans(first, min(self.n_q, first + self.plan.tile_m), self.rows_per_chunk)

    def kv_span(self, j):
        first = j * self.plan.tile_n
        return first, min(self.n_kv, first + self.plan.tile_n)

    def scores(self, s, b, g, r0, r1, j0, j1, state, finite=False):
        """Scores ``s`` (rows, keys) of a chunk after the score mod and (PARTIAL tiles) the mask.

        The forward's worker threads each set ``self.local.cache``, a
        :class:`_MaskCache` that may hold the mask; the tile's index grid is
        built only when a mod runs (not on a cache hit). Without a score mod,
        on NumPy, the mask is applied to ``s`` in place as an additive bias (0
        where kept, ``-inf`` where hidden; the cache holds the bias): added
        when the caller knows every score is ``finite`` (4x faster than
        selecting), else ``-inf`` is selected where the bias is negative (a
        NaN score must not reach a row that cannot see it). Returns
        ``(s, values, grid)``; ``values`` are the score graph's node values
        (for its reverse mode), None without a score mod.
        """
        needs_mask = self.mask is not None and state == PARTIAL
        if self.score is None and not needs_mask:
            return s, None, None
        xp = self.xp
        shape = (self.group, r1 - r0, j1 - j0)
        grids: list = []

        def grid():
            if not grids:
                grids.append(
                    tile_grid(
                        xp,
                        self.device,
                        self.names,
                        b=self.first_batch + b,
                        h0=g * self.group,
                        n_h=self.group,
                        q_pos0=self.positions[b] + r0,
                        q_row0=r0,
                        n_q=r1 - r0,
                        kv0=j0,
                        n_kv=j1 - j0,
                    )
                )
            return grids[0]

        s3 = xp.reshape(s, shape)
        values = None
        if self.score is not None:
            values = self.score.run(grid(), s3)
            s3 = values[self.score.graph.output]
        if needs_mask:
            mask, in_place = self.mask, self.score is None and self.in_place_mask

            def compute():
                keep = mask.run(grid())[mask.graph.output]
                if not in_place:
                    return keep
                return np.where(keep, np.zeros((), self.acc), np.full((), -math.inf, self.acc))

            cache = getattr(self.local, "cache", None)
            pairs = compute() if cache is None else cache.get(b, r0, r1, j0, compute)
            if in_place:
                if finite:
                    np.add(s3, pairs, out=s3)
                else:
                    np.copyto(s3, -math.inf, where=pairs < 0)
                return s, values, None
            s3 = xp.where(pairs, s3, -math.inf)
        if tuple(s3.shape) != shape:
            # a result that does not span the tile (it ignores the score): written into the raw
            # scores, which it no longer reads, so that callers may shift it in place
            s[...] = xp.reshape(xp.broadcast_to(s3, shape), tuple(s.shape))
            return s, values, grids[0] if grids else None
        return xp.reshape(s3, tuple(s.shape)), values, grids[0] if grids else None


def forward(
    o, q, k, v, m, l, *, scale, input_pos, score_mod, mask_mod, plan, first_batch=0
) -> None:
    """Write ``o`` and the checkpoints, tile by tile of ``plan`` (:class:`xpkernels.mods.TilePlan`).

    ``scale`` is a float; ``input_pos`` the position of query row 0 as a tuple of ints (one per
    batch, or one shared) or the caller's ``(B,)`` device array (values never read on the host);
    the mods are traced graphs (:class:`xpkernels.mods.Graph`) or None. ``first_batch``, beyond
    the contract: the index the mods see as ``b`` for batch 0 (packed calls run one sequence at
    a time, each at its own index). Parameters: the ``flex_attention`` Signature's
    (:func:`xpkernels.backends.protocol.module_functions`).
    """
    slots = None
    views = _views((o, q, k, v, m, l), input_pos, score_mod, mask_mod)
    if views is not None:  # PyTorch CPU tensors: the NumPy path
        (o, q, k, v, m, l), input_pos, slots, _ = views
    xp = array_api_compat.array_namespace(o, q, k, v)
    plain = _plain_attention(xp, q, k, input_pos, score_mod, mask_mod, plan)
    if plain is not None:
        _attention.forward(o, q, k, v, m, l, scale=scale, **plain)
        return
    t = _Tiles(
        xp,
        q,
        k,
        v,
        scale=scale,
        input_pos=input_pos,
        score_mod=score_mod,
        mask_mod=mask_mod,
        plan=plan,
        first_batch=first_batch,
        slots=slots,
    )
    items: list[tuple] = []
    for b in range(t.batch):
        kv_groups = []
        batches = _band_batches(t, plan, b)
        for g in range(t.kv_heads):
            heads = slice(g * t.group, (g + 1) * t.group)
            k_norm = None
            if (m is None and t.score is None) or t.in_place_mask:
                k_norm = max_row_norm(xp, k[b, g, :, :])
            v_finite = _all_finite(xp, v[b, g, :, :])
            if batches is not None and v_finite and _bounded(t, q, b, heads, k_norm):
                band = plan.bands[b if len(plan.bands) > 1 else 0]
                items.extend((_BAND, b, g, heads, batch, band) for batch in batches)
                continue
            kv_groups.append((g, heads, plan.group(b, heads.start, heads.stop), k_norm, v_finite))
        for i in range(plan.states.shape[2]):
            for r0, r1 in t.q_chunks(i):
                for g, heads, states, k_norm, v_finite in kv_groups:  # kv heads inner: _MaskCache
                    row = states[i]
                    visits = [(int(j), int(row[j])) for j in np.nonzero(row != SKIP)[0]]
                    if visits:
                        items.append((_TILES, b, g, heads, r0, r1, visits, k_norm, v_finite))
                    else:
                        _empty_rows(o, m, l, b, heads, r0, r1)
    n_workers = tile_workers(xp, len(items))
    kinds = {item[0] for item in items}
    buffers = [t.tile_buffer() if _TILES in kinds else None for _ in range(n_workers)]
    workspaces = [BandWorkspace(t.acc) if _BAND in kinds else None for _ in range(n_workers)]
    caches = [_MaskCache(t) for _ in range(n_workers)]

    def work(worker, item):
        if item[0] == _BAND:
            forward_batch(t, o, q, k, v, m, l, *item[1:], workspaces[worker])
            return
        t.local.cache = caches[worker]
        try:
            _forward_rows(t, o, q, k, v, m, l, *item[1:], buffers[worker])
        finally:
            t.local.cache = None

    # band batches differ in size (a sequence's first rows often form a short batch): dealt by
    # their scores; tile items keep their order, in which workers share masks (_MaskCache)
    costs = None if _TILES in kinds else [i[4].count * i[4].rows * i[4].keys for i in items]
    for_each_item(xp, work, items, n_workers, costs)


_BAND, _TILES = "band", "tiles"


def _plain_attention(xp, q, k, input_pos, score_mod, mask_mod, plan):
    """The options of :mod:`.attention` (``causal``, ``input_pos``, no lengths) when the call
    is plain attention on NumPy arrays, else None.

    Plain: no score mod, and either no mask or one whose exact band (the
    plan's, from host positions) keeps every key of every row, or keys
    ``0 .. position + r`` of row ``r`` (causal: the last key clipped to
    ``Sk - 1``). The attention tiles then compute the same scores, masks and
    checkpoints with fewer passes (no mask graph, the diagonal in chunks).
    """
    if score_mod is not None or not array_api_compat.is_numpy_namespace(xp):
        return None
    if mask_mod is None:
        return {"causal": False, "input_pos": 0, "q_lengths": None, "k_lengths": None}
    if plan.bands is None or not isinstance(input_pos, tuple) or len(plan.bands) != len(input_pos):
        return None
    n_q, n_kv = q.shape[2], k.shape[2]
    rows = np.arange(n_q, dtype=np.int64)
    causal = full = True
    for position, (lo, hi) in zip(input_pos, plan.bands, strict=True):
        if np.any(lo != 0):
            return None
        causal = causal and np.array_equal(hi, np.minimum(position + rows, n_kv - 1))
        full = full and bool(np.all(hi == n_kv - 1))
    if not (causal or full):
        return None
    positions = input_pos[0] if len(input_pos) == 1 else np.asarray(input_pos, dtype=np.int64)
    return {"causal": causal, "input_pos": positions, "q_lengths": None, "k_lengths": None}


def _band_batches(t, plan, b):
    """The band's batches (:mod:`._flex_band`) for batch ``b``, or None: tiles run instead
    (another namespace, a score mod, a mask that is no exact band, or one the tiles serve
    with fewer scores)."""
    if plan.bands is None or t.score is not None or not t.in_place_mask:
        return None
    lo, hi = plan.bands[b if len(plan.bands) > 1 else 0]
    states = plan.group(b, 0, t.heads)
    tiles = tile_elements(states, plan.tile_m, plan.tile_n, t.n_q, t.n_kv, t.group)
    return band_batches(lo, hi, t.n_kv, t.group, tiles)


def _bounded(t, q, b, heads, k_norm) -> bool:
    """Whether every score of the query heads ``heads`` of batch ``b`` lies within
    ``SAFE_EXPONENT`` (Cauchy-Schwarz; False when any query or key is not finite)."""
    bound = k_norm * abs(t.scale)  # head by head: each q[b, h] is a view, read in row blocks
    return all(
        bound * max_row_norm(t.xp, q[b, h, :, :]) <= SAFE_EXPONENT
        for h in range(heads.start, heads.stop)
    )


class _MaskCache:
    """One worker's masks of the PARTIAL tiles of its current row chunk, shared by kv heads.

    A mask that reads no head index keeps the same pairs for every kv head of
    a batch, and the forward's items run the kv heads of a row chunk one
    after another (each worker taking every ``n_workers``-th), so each worker
    evaluates the mask graph once per (row chunk, key tile) instead of once
    per kv head it runs: ``Hkv / n_workers`` times fewer (1x8x2048x64,
    256-key sliding window, 2 workers: forward ratio to compiled FlexAttention
    1.53 -> 1.06, medians under load). At most ``TILE_ELEMENTS`` mask
    elements (bool, or the accumulation dtype for a bias) are held per worker.
    """

    def __init__(self, t):
        self.usable = t.mask is not None and "h" not in t.mask.graph.inputs
        self.chunk: tuple = ()
        self.masks: dict = {}
        self.elements = 0

    def get(self, b, r0, r1, j0, compute):
        """The mask of key tile ``j0`` of rows ``[r0, r1)`` of batch ``b``; ``compute()`` makes it."""
        if not self.usable:
            return compute()
        if self.chunk != (b, r0, r1):
            self.chunk, self.masks, self.elements = (b, r0, r1), {}, 0
        keep = self.masks.get(j0)
        if keep is None:
            keep = compute()
            size = math.prod(keep.shape)
            if self.elements + size <= TILE_ELEMENTS:
                self.masks[j0] = keep
                self.elements += size
        return keep


def _empty_rows(o, m, l, b, heads, r0, r1) -> None:
    o[b, heads, r0:r1, :] = 0.0
    if m is not None:
        m[b, heads, r0:r1] = -math.inf
        l[b, heads, r0:r1] = 0.0


def _spans_of(t, visits, most: int) -> list[tuple[int, int, int]]:
    """``(first key, end key, state)`` of the forward's spans over ``visits``: consecutive tiles
    of the same state merged, up to ``most`` keys (a PARTIAL span's mask is evaluated over the
    whole span). One product and one pass of each kind per span: at 256-key tiles NumPy's
    per-call overhead was a third of a tile's time (a sliding window's chunk, two PARTIAL
    tiles: 32.5 against 38.8 ms at 1x8x2048x64; 4 documents 76 against 84 ms)."""
    merged: list[tuple[int, int, int]] = []
    for j, state in visits:
        j0, j1 = t.kv_span(j)
        if merged and merged[-1][2] == state and merged[-1][1] == j0:
            if j1 - merged[-1][0] <= most:
                merged[-1] = (merged[-1][0], j1, state)
                continue
        merged.append((j0, j1, state))
    return merged


def _forward_rows(
    t, o, q, k, v, m, l, b, g, heads, r0, r1, visits, k_norm, v_finite, buffer
) -> None:
    """Rows ``[r0, r1)`` of the heads of kv group ``g`` against their visited key tiles.

    ``o_acc`` and ``l_run`` hold sums of ``exp(s - shift)``, where ``shift``
    is 0 (None) or the running max (0 for rows that kept nothing so far: rows
    can be all -inf under a PARTIAL mask or a score mod returning -inf). A
    row holding sums had its max within ``SAFE_EXPONENT`` or was shifted, so
    its rescale exponent never exceeds ``SAFE_EXPONENT``; the clamp only
    touches rows whose sums are still 0 (no overflow, no 0 * inf).
    ``k_norm`` (the largest key norm of the kv head, or None) lets
    Cauchy-Schwarz bound every score of the chunk: a finite bound lets the
    mask be added (:meth:`_Tiles.scores`), and without checkpoints or a score
    mod a bound within ``SAFE_EXPONENT`` skips the row max altogether.
    ``v_finite``: every value of the kv head is finite (read once per head,
    not per tile). ``buffer`` (NumPy, else None) receives the score products;
    without a score mod (whose values may be views of its captured arrays)
    the scores are then shifted and exponentiated in place.
    """
    xp, acc = t.xp, t.acc
    rows = t.group * (r1 - r0)
    masked = t.score is not None or (
        t.mask is not None and any(state == PARTIAL for _, state in visits)
    )
    q_scaled = xp.reshape(to(xp, q[b, heads, r0:r1, :], acc) * t.scale, (rows, t.d))
    bound = math.nan if k_norm is None else k_norm * max_row_norm(xp, q_scaled)
    scores_finite = math.isfinite(bound)  # every score of the chunk is finite
    bounded = m is None and t.score is None and bound <= SAFE_EXPONENT
    # NumPy without a score mod, every score within SAFE_EXPONENT: FULL tiles in base-2 units
    base2 = buffer is not None and t.score is None and bound <= SAFE_EXPONENT
    q_two = q_scaled * LOG2E if base2 else None
    m_run: Any = None
    l_run: Any = None
    o_acc: Any = None
    shift: Any = None
    new_shift: Any = None
    for j0, j1, state in _spans_of(t, visits, t.span_keys(rows)):
        out = None if buffer is None else xp.reshape(buffer[: rows * (j1 - j0)], (rows, j1 - j0))
        two = base2 and state != PARTIAL
        s = _matmul(q_two if two else q_scaled, to(xp, k[b, g, j0:j1, :], acc).mT, out)
        s, _, _ = t.scores(s, b, g, r0, r1, j0, j1, state, finite=scores_finite)
        v_tile = to(xp, v[b, g, j0:j1, :], acc)
        # pairs the row keeps, where a tile hides some and V holds a non-finite value
        kept = None
        hides = t.score is not None or state == PARTIAL
        if hides and not v_finite and not _all_finite(xp, v_tile):
            kept = s != -math.inf
        if not bounded:
            row_max = xp.max(s, axis=1)
            if two:
                row_max *= 1.0 / LOG2E
            m_run = row_max if m_run is None else xp.maximum(m_run, row_max)
            if not base2:  # (under base2's bound no kept score leaves SAFE_EXPONENT)
                finite = xp.where(m_run == -math.inf, 0.0, m_run) if masked else m_run
                new_shift = None if float(xp.max(xp.abs(finite))) <= SAFE_EXPONENT else finite
        if new_shift is not None:
            s -= new_shift[:, None]
        if two:
            p = np.exp2(s, out=s)
        else:
            p = xp.exp(s) if buffer is None or t.score is not None else np.exp(s, out=s)
        pv = p @ v_tile if kept is None else _seen_product(xp, p, v_tile, kept)
        row_sum = p @ t.ones[: j1 - j0]
        if o_acc is None:
            l_run, o_acc = row_sum, pv
        else:
            if shift is not None or new_shift is not None:
                step = (0.0 if shift is None else shift) - (0.0 if new_shift is None else new_shift)
                alpha = xp.exp(xp.clip(step, max=SAFE_EXPONENT))
                l_run = l_run * alpha
                o_acc *= alpha[:, None]
            l_run = l_run + row_sum
            o_acc += pv
        shift = new_shift
    seen = l_run > 0
    o_acc /= (xp.where(seen, l_run, 1.0) if masked else l_run)[:, None]
    n = r1 - r0
    o[b, heads, r0:r1, :] = to(xp, xp.reshape(o_acc, (t.group, n, t.dv)), o.dtype)
    if m is not None:
        finite = xp.where(seen, m_run, 0.0) if masked else m_run
        l_run = l_run * xp.exp((0.0 if shift is None else shift) - finite)
        m[b, heads, r0:r1] = to(xp, xp.reshape(m_run, (t.group, n)), m.dtype)
        l[b, heads, r0:r1] = to(xp, xp.reshape(l_run, (t.group, n)), l.dtype)


def backward(
    do,
    q,
    k,
    v,
    o,
    m,
    l,
    dq,
    dk,
    dv,
    delta,
    dq_accum,
    *,
    scale,
    input_pos,
    score_mod,
    mask_mod,
    plan,
    score_mod_grads,
    deterministic=True,
    score_mod_workspace=None,
    first_batch=0,
) -> None:
    """Overwrite ``dq``, ``dk``, ``dv`` and ADD the score mod's array gradients.

    ``delta`` receives ``rowsum(do * o)`` and ``dq_accum`` the sums ``dq / scale`` over key
    tiles. ``deterministic`` is ignored: these sums always run in a fixed order.
    ``score_mod_workspace`` is always None (the protocol's default hook sizes it 0).
    Parameters: the ``flex_attention`` Signature's
    (:func:`xpkernels.backends.protocol.module_functions`), and :func:`forward`'s ``first_batch``.
    """
    slots = None
    arrays = (do, q, k, v, o, m, l, dq, dk, dv, delta, dq_accum)
    views = _views(arrays, input_pos, score_mod, mask_mod, score_mod_grads)
    if views is not None:  # PyTorch CPU tensors: the NumPy path
        arrays, input_pos, slots, score_mod_grads = views
        do, q, k, v, o, m, l, dq, dk, dv, delta, dq_accum = arrays
    xp = array_api_compat.array_namespace(do, q, k, v, o)
    plain = _plain_attention(xp, q, k, input_pos, score_mod, mask_mod, plan)
    if plain is not None:
        _attention.backward(*arrays, scale=scale, **plain)
        return
    t = _Tiles(
        xp,
        q,
        k,
        v,
        scale=scale,
        input_pos=input_pos,
        score_mod=score_mod,
        mask_mod=mask_mod,
        plan=plan,
        first_batch=first_batch,
        slots=slots,
    )
    items = []
    for b in range(t.batch):
        _row_dots(t, do, o, delta, b)
        dq_accum[b, ...] = 0.0
        for g in range(t.kv_heads):
            heads = slice(g * t.group, (g + 1) * t.group)
            items.append((b, g, heads, plan.group(b, heads.start, heads.stop)))
    # A kv head's key tiles add into the dq_accum rows of its own query heads only; the
    # score mod's gradient accumulators and shifted-score buffer are shared by every tile.
    n_workers = tile_workers(xp, len(items)) if t.score is None else 1

    def work(worker, item):
        b, g, heads, states = item
        for j in range(states.shape[1]):
            visits = [(int(i), int(states[i, j])) for i in np.nonzero(states[:, j] != SKIP)[0]]
            _backward_key_tile(
                t,
                do,
                q,
                k,
                v,
                m,
                l,
                dk,
                dv,
                delta,
                dq_accum,
                b,
                g,
                heads,
                j,
                visits,
                score_mod_grads,
            )

    for_each_item(xp, work, items, n_workers)
    for b in range(t.batch):
        for h in range(t.heads):
            for r0, r1 in row_blocks(t.n_q, t.d):
                dq[b, h, r0:r1, :] = to(xp, dq_accum[b, h, r0:r1, :] * scale, dq.dtype)


def _row_dots(t, do, o, delta, b) -> None:
    """``delta[b] = rowsum(do * o)`` in row blocks."""
    xp = t.xp
    for h in range(t.heads):
        for r0, r1 in row_blocks(t.n_q, t.dv):
            dots = xp.vecdot(to(xp, do[b, h, r0:r1, :], t.acc), to(xp, o[b, h, r0:r1, :], t.acc))
            delta[b, h, r0:r1] = to(xp, dots, delta.dtype)


def _backward_key_tile(
    t, do, q, k, v, m, l, dk, dv, delta, dq_accum, b, g, heads, j, visits, grads
) -> None:
    """dk, dv of key tile ``j`` of kv head ``g``; its share of dq and of the mod's gradients.

    With ``do_aug = [do | -delta]`` and ``v_aug = [v | 1]``, ``do_aug @
    v_aug^T = do v^T - delta``; without a score mod, ``q_aug = [q * scale |
    -lse]`` and ``k_aug = [k | 1]`` give ``q_aug @ k_aug^T = s - lse``. Rows
    that kept nothing (``l = 0``) have ``lse = +inf``: their probabilities are 0; rows whose
    checkpoints are NaN (they saw NaN) stay NaN. In tiles
    that hide pairs (PARTIAL, or under a score mod, which may return ``-inf``),
    non-finite entries of q, k, v, do or delta reach only the pairs that see
    them (:func:`_seen_product`).
    """
    xp, acc, d = t.xp, t.acc, t.d
    j0, j1 = t.kv_span(j)
    k_aug = _with_column(xp, k[b, g, j0:j1, :], 1.0, acc)
    v_aug = _with_column(xp, v[b, g, j0:j1, :], 1.0, acc)
    dk_tile = xp.zeros((j1 - j0, d), dtype=acc, device=t.device)
    dv_tile = xp.zeros((j1 - j0, t.dv), dtype=acc, device=t.device)
    k_finite, v_finite = _all_finite(xp, k_aug), _all_finite(xp, v_aug)
    for i, state in visits:
        hides = t.score is not None or state == PARTIAL
        for r0, r1 in t.q_chunks(i):
            n = r1 - r0
            rows = t.group * n
            l_rows = to(xp, xp.reshape(l[b, heads, r0:r1], (rows,)), acc)
            empty = l_rows == 0  # kept nothing; a NaN row (it saw NaN) stays NaN
            m_rows = to(xp, xp.reshape(m[b, heads, r0:r1], (rows,)), acc)
            lse = xp.where(empty, math.inf, m_rows + xp.log(xp.where(empty, 1.0, l_rows)))
            q_rows = xp.reshape(q[b, heads, r0:r1, :], (rows, d))
            do_aug = _with_column(
                xp,
                xp.reshape(do[b, heads, r0:r1, :], (rows, t.dv)),
                -xp.reshape(to(xp, delta[b, heads, r0:r1], acc), (rows,)),
                acc,
            )
            # Where the tile hides pairs and an operand holds a non-finite value, the
            # pairs each row keeps (read before the score mod's scores are shifted):
            # ds is 0 elsewhere and the products keep the value to the rows that see it.
            q_finite = do_finite = True
            if hides:
                q_finite, do_finite = _all_finite(xp, q_rows), _all_finite(xp, do_aug)
            finite = not hides or (k_finite and v_finite and q_finite and do_finite)
            if t.score is None:
                q_op = _with_column(xp, q_rows, -lse, acc)
                q_op[:, :d] *= t.scale
                s, values, grid = t.scores(q_op @ k_aug.mT, b, g, r0, r1, j0, j1, state)
            else:
                q_op = to(xp, q_rows, acc) * t.scale
                s, values, grid = t.scores(q_op @ k_aug[:, :d].mT, b, g, r0, r1, j0, j1, state)
            kept = None if finite else s != -math.inf
            if t.score is not None:
                s = t.shifted(s, lse)
            p = xp.exp(s)
            if kept is not None:  # a NaN lse (the row saw NaN) shifts hidden pairs to NaN too
                p = xp.where(kept, p, 0.0)
            dv_tile += (
                p.mT @ do_aug[:, : t.dv]
                if kept is None or do_finite
                else _seen_product(xp, p.mT, do_aug[:, : t.dv], kept.mT)
            )
            ds = do_aug @ v_aug.mT
            ds *= p
            if kept is not None:
                ds = xp.where(kept, ds, 0.0)
            if values is not None:
                d_in = t.score.backprop(values, grid, xp.reshape(ds, (t.group, n, j1 - j0)), grads)
                ds = xp.zeros_like(ds) if d_in is None else xp.reshape(d_in, (rows, j1 - j0))
            dq_step = (
                ds @ k_aug[:, :d]
                if kept is None or k_finite
                else _seen_product(xp, ds, k_aug[:, :d], kept)
            )
            dq_accum[b, heads, r0:r1, :] += to(
                xp, xp.reshape(dq_step, (t.group, n, d)), dq_accum.dtype
            )
            dk_tile += (
                ds.mT @ q_op[:, :d]
                if kept is None or q_finite
                else _seen_product(xp, ds.mT, q_op[:, :d], kept.mT)
            )
    dk[b, g, j0:j1, :] = to(xp, dk_tile, dk.dtype)
    dv[b, g, j0:j1, :] = to(xp, dv_tile, dv.dtype)
