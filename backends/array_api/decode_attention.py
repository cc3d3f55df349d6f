"""Split-KV decode attention on the Array API (flash-decoding), float32/float64 accumulation.

For batch ``b`` the keys the query sees, ``[lo, lengths[b])`` with ``lo = 0``
or ``lengths[b] - window`` under a sliding window, are cut into ``n_splits``
contiguous slices of ``ceil((lengths[b] - lo) / n_splits)`` keys. Each slice yields,
for every query head, an unnormalised partial output, its running max and its
exponent sum (an empty slice yields 0, -inf, 0); a log-sum-exp combine then
merges the slices (the trailing empty slices of a short length are written in
one step). ``lengths[b]`` is read as a Python int and clamped to
``[0, Smax]``. Within a slice, keys are read in tiles within
``TILE_ELEMENTS`` with an online softmax (scores capped by ``softcap * tanh(s /
softcap)`` when asked). A paged cache is read page-slice by page-slice, or a
tile's worth of small pages gathered at once. The query heads of one kv group are
stacked as rows, so the cache is read once per group.
"""

from __future__ import annotations

import math

import array_api_compat

from ._blocks import acc_dtype, to

__all__ = ["forward", "default_splits"]

#: Keys per split chosen by :func:`default_splits`.
SPLIT_KEYS = 2048

#: Elements of one key tile's temporaries (scores ``(group, keys)`` and a
#: converted ``(keys, D)`` cache tile); float32: 1 MiB.
TILE_ELEMENTS = 1 << 18


def default_splits(batch: int, kv_heads: int, max_len: int, like) -> int:
    """Splits for a cache of ``max_len`` keys: one per ``SPLIT_KEYS`` keys (at least 1).

    NumPy gains no parallelism from more splits, so only the length matters.
    """
    return max(1, math.ceil(max_len / SPLIT_KEYS))


def forward(
    o,
    q,
    k,
    v,
    lengths,
    o_partial,
    m_partial,
    l_partial,
    *,
    scale,
    softcap=None,
    window=None,
    block_table=None,
) -> None:
    """Write ``o`` for validated inputs.

    ``o``: (B, H, Dv); ``q``: (B, H, D); ``k``: (B, Hkv, Smax, D); ``v``:
    (B, Hkv, Smax, Dv) -- or, with ``block_table`` (B, max_pages), the pages
    ``k`` (num_pages, Hkv, page_size, D) and ``v`` (num_pages, Hkv,
    page_size, Dv), ``Smax = max_pages * page_size``; ``lengths``: (B,)
    integers (clamped to ``[0, Smax]``); ``o_partial`` (B, H, n_splits, Dv),
    ``m_partial`` and ``l_partial`` (B, H, n_splits): scratch in the
    accumulation dtype, overwritten for every batch with ``lengths[b] > 0``.
    ``scale`` is a float, ``softcap`` a float or None, ``window`` an int or
    None. ``lengths[b] == 0`` gives ``o[b] = 0``. Block-table entries are
    clamped to ``[0, num_pages)``.
    """
    xp = array_api_compat.array_namespace(o, q, k, v)
    batch, heads, d = q.shape
    kv_heads, dv = k.shape[1], v.shape[3]
    group = heads // kv_heads
    smax = k.shape[2] if block_table is None else block_table.shape[1] * k.shape[2]
    n_splits = o_partial.shape[2]
    key_tile = max(1, TILE_ELEMENTS // max(group, d, dv))
    for b in range(batch):
        n = min(smax, max(0, int(lengths[b])))
        if n == 0:
            o[b, ...] = 0.0
            continue
        lo = 0 if window is None else max(0, n - window)  # the first key the query sees
        chunk = math.ceil((n - lo) / n_splits)
        used = math.ceil((n - lo) / chunk)  # splits holding a key; the rest are empty
        o_partial[b, :, used:, :] = 0.0
        m_partial[b, :, used:] = -math.inf
        l_partial[b, :, used:] = 0.0
        cache = _Cache(xp, k, v, b, block_table, key_tile)
        for g in range(kv_heads):
            heads_g = slice(g * group, (g + 1) * group)
            for split in range(used):
                _split(
                    xp,
                    q,
                    cache,
                    o_partial,
                    m_partial,
                    l_partial,
                    b,
                    g,
                    heads_g,
                    split,
                    start=lo + split * chunk,
                    stop=min(n, lo + (split + 1) * chunk),
                    scale=scale,
                    softcap=softcap,
                )
        _combine(xp, o, o_partial, m_partial, l_partial, b)


class _Cache:
    """The key/value tiles of batch ``b``, from a contiguous cache or from pages.

    Tiles hold at most ``key_tile`` keys. A paged cache whose pages hold at
    least ``key_tile`` keys is read in slices of one page (no copy); smaller
    pages are gathered a tile's worth of whole pages at a time (one
    ``take`` per tile, never per key).
    """

    def __init__(self, xp, k, v, b, block_table, key_tile):
        self.xp, self.k, self.v, self.b, self.key_tile = xp, k, v, b, key_tile
        self.pages = None
        if block_table is not None:
            self.page_size = k.shape[2]
            self.pages = xp.clip(block_table[b, :], 0, k.shape[0] - 1)

    def tiles(self, g, start, stop):
        """``(k_tile, v_tile)`` of kv head ``g`` covering keys ``[start, stop)`` in order."""
        xp, k, v, b = self.xp, self.k, self.v, self.b
        if self.pages is None:
            for j0 in range(start, stop, self.key_tile):
                j1 = min(stop, j0 + self.key_tile)
                yield k[b, g, j0:j1, :], v[b, g, j0:j1, :]
            return
        size = self.page_size
        if size >= self.key_tile:
            j0 = start
            while j0 < stop:
                page, slot = divmod(j0, size)
                count = min(stop, j0 + self.key_tile, (page + 1) * size) - j0
                index = int(self.pages[page])
                yield k[index, g, slot : slot + count, :], v[index, g, slot : slot + count, :]
                j0 += count
            return
        per_tile = self.key_tile // size
        last_page = math.ceil(stop / size)
        for p0 in range(start // size, last_page, per_tile):
            p1 = min(last_page, p0 + per_tile)
            index = self.pages[p0:p1]
            lo, hi = max(start, p0 * size) - p0 * size, min(stop, p1 * size) - p0 * size
            k_tile = xp.reshape(_gather(xp, k, index, g), (-1, k.shape[3]))
            v_tile = xp.reshape(_gather(xp, v, index, g), (-1, v.shape[3]))
            yield k_tile[lo:hi, :], v_tile[lo:hi, :]


def _gather(xp, pages, index, g):
    """``pages[index, g]``: the pages ``index`` of kv head ``g``, ``(len(index), page_size, D)``.

    NumPy and torch index the strided head view directly; ``take`` of that
    view would first copy all of it (every page) in NumPy, so it serves only
    the other namespaces, where integer-array indexing may be missing.
    """
    if array_api_compat.is_numpy_array(pages) or array_api_compat.is_torch_array(pages):
        return pages[xp.astype(index, xp.int64), g, ...]
    return xp.take(pages[:, g, ...], index, axis=0)


def _split(
    xp,
    q,
    cache,
    o_partial,
    m_partial,
    l_partial,
    b,
    g,
    heads_g,
    split,
    *,
    start,
    stop,
    scale,
    softcap,
):
    """Partial result of keys ``[start, stop)`` (not empty) for the query heads ``heads_g`` of kv head ``g``."""
    acc = acc_dtype(xp, q.dtype)
    q_scaled = to(xp, q[b, heads_g, :], acc) * scale
    m_run = l_run = o_acc = None
    for k_tile, v_tile in cache.tiles(g, start, stop):
        s = q_scaled @ to(xp, k_tile, acc).mT
        if softcap is not None:
            s = xp.tanh(s / softcap) * softcap
        row_max = xp.max(s, axis=1)
        m_new = row_max if m_run is None else xp.maximum(m_run, row_max)
        s -= m_new[:, None]
        p = xp.exp(s)
        pv = p @ to(xp, v_tile, acc)
        if m_run is None:
            l_run, o_acc = xp.sum(p, axis=1), pv
        else:
            alpha = xp.exp(m_run - m_new)
            l_run = l_run * alpha + xp.sum(p, axis=1)
            o_acc *= alpha[:, None]
            o_acc += pv
        m_run = m_new
    o_partial[b, heads_g, split, :] = to(xp, o_acc, o_partial.dtype)
    m_partial[b, heads_g, split] = to(xp, m_run, m_partial.dtype)
    l_partial[b, heads_g, split] = to(xp, l_run, l_partial.dtype)


def _combine(xp, o, o_partial, m_partial, l_partial, b) -> None:
    """``o[b]`` from the splits' partials by log-sum-exp; split 0 is never empty, so the max is finite."""
    m_all = m_partial[b, ...]
    m_max = xp.max(m_all, axis=1)
    weight = xp.exp(m_all - m_max[:, None])
    total = xp.sum(weight * l_partial[b, ...], axis=1)
    merged = xp.sum(weight[:, :, None] * o_partial[b, ...], axis=1)
    o[b, ...] = to(xp, merged / total[:, None], o.dtype)
