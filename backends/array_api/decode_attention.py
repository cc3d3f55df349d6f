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
tile's worth of small pages gathered at once (on NumPy and torch into buffers
made once per call). The query heads of one kv group are stacked as rows, so
the cache is read once per group.
"""

from __future__ import annotations

import math

import array_api_compat

from ._blocks import acc_dtype, path_arrays, to

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
    """Write ``o``: the splits of each batch (see the module docstring), then their combine.

    ``scale`` is a float. PyTorch CPU tensors run the NumPy path through zero-copy views
    (:func:`._blocks.numpy_views`). The contract of
    :class:`xpkernels.backends.protocol.DecodeAttentionModule`.
    """
    o, q, k, v, lengths, o_partial, m_partial, l_partial, block_table = path_arrays(
        o, q, k, v, lengths, o_partial, m_partial, l_partial, block_table
    )
    xp = array_api_compat.array_namespace(o, q, k, v)
    batch, heads, d = q.shape
    kv_heads, dv = k.shape[1], v.shape[3]
    group = heads // kv_heads
    smax = k.shape[2] if block_table is None else block_table.shape[1] * k.shape[2]
    n_splits = o_partial.shape[2]
    key_tile = max(1, TILE_ELEMENTS // max(group, d, dv))
    gather = None
    if block_table is not None and k.shape[2] < key_tile:
        # Pages per gathered tile: a tile's worth, but no more than the pages that a
        # split of at most ceil(smax / n_splits) keys can meet.
        size = k.shape[2]
        spanned = -(-smax // (n_splits * size)) + 1
        count = min(key_tile // size, block_table.shape[1], spanned)
        gather = _Gather(xp, k, count), _Gather(xp, v, count)
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
        cache = _Cache(xp, k, v, b, block_table, key_tile, gather)
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
    pages are gathered a tile's worth of whole pages at a time by ``gather``
    (one gather per tile and cache, never per key).
    """

    def __init__(self, xp, k, v, b, block_table, key_tile, gather):
        self.xp, self.k, self.v, self.b, self.key_tile = xp, k, v, b, key_tile
        self.gather = gather
        self.pages = None
        if block_table is not None:
            self.page_size = k.shape[2]
            self.pages = xp.clip(block_table[b, :], 0, k.shape[0] - 1)
            if gather is not None:
                self.pages = xp.astype(self.pages, xp.int64)
                self.rows = self.pages * k.shape[1]  # page p of kv head g is row p * Hkv + g

    def tiles(self, g, start, stop):
        """``(k_tile, v_tile)`` of kv head ``g`` covering keys ``[start, stop)`` in order.

        Gathered tiles are views of buffers that the next tile overwrites:
        each is used up before the next is asked for.
        """
        k, v, b = self.k, self.v, self.b
        if self.pages is None:
            for j0 in range(start, stop, self.key_tile):
                j1 = min(stop, j0 + self.key_tile)
                yield k[b, g, j0:j1, :], v[b, g, j0:j1, :]
            return
        size = self.page_size
        if self.gather is None:
            j0 = start
            while j0 < stop:
                page, slot = divmod(j0, size)
                count = min(stop, j0 + self.key_tile, (page + 1) * size) - j0
                index = int(self.pages[page])
                yield k[index, g, slot : slot + count, :], v[index, g, slot : slot + count, :]
                j0 += count
            return
        gather_k, gather_v = self.gather
        per_tile = gather_k.count
        last_page = math.ceil(stop / size)
        for p0 in range(start // size, last_page, per_tile):
            p1 = min(last_page, p0 + per_tile)
            index = self.pages[p0:p1]
            rows = self.rows[p0:p1] + g if gather_k.by_rows or gather_v.by_rows else None
            lo, hi = max(start, p0 * size) - p0 * size, min(stop, p1 * size) - p0 * size
            yield gather_k(index, rows, g)[lo:hi, :], gather_v(index, rows, g)[lo:hi, :]


class _Gather:
    """Up to ``count`` whole pages of one kv head of ``pages``, as ``(keys, D)`` rows in order.

    On NumPy and torch the pages are copied into one buffer of ``count``
    pages, made once per call and reused by every tile: a fresh tile-sized
    array per tile costs page faults whenever the allocator maps it afresh
    (measured at the bench shape, 16-key pages, NumPy float32, one BLAS
    thread: 1.5x to 5x the contiguous decode's time with fresh arrays,
    depending on the heap's state, against about 1.4x with the buffers). NumPy ``take(..., out=)`` copies from
    C-contiguous pages viewed as ``(num_pages * Hkv, page_size * D)`` rows
    (row ``p * Hkv + g`` is page ``p`` of kv head ``g``); torch
    ``index_select(..., out=)`` reads the strided head view. Otherwise each
    tile is a fresh gather: NumPy indexes the strided head view (NumPy's
    ``take`` first copies a non-contiguous array whole: every page), other
    namespaces ``take`` it.

    The gather is not overlapped with the products. Gathering the next tile on
    a worker thread of :mod:`._blocks`'s pool into a second buffer, with
    1024-key tiles (so that OpenBLAS does not thread the products), was measured
    on 2 cores shared with other work at the bench shape, interleaved in one
    process, before :func:`_scores` turned the score product: median 2.21x
    the contiguous decode against 1.58x for this serial gather (11 repeats, default
    BLAS threads), 2.65x against 1.41x with one BLAS thread. Only under heavy
    load did it win, by its small tiles: the contiguous decode's 2048-key
    products, threaded by OpenBLAS, took a 270 ms median instead of 20 ms, the
    prefetching call 55 ms.
    """

    def __init__(self, xp, pages, count):
        self.xp, self.pages, self.count = xp, pages, count
        num_pages, kv_heads, size, d = pages.shape
        self.d = d
        self.by_rows = False
        self.buffer = None
        if array_api_compat.is_torch_array(pages):
            self.buffer = xp.empty((count, size, d), dtype=pages.dtype, device=pages.device)
        elif array_api_compat.is_numpy_array(pages) and pages.flags.c_contiguous:
            self.by_rows = True
            self.table = xp.reshape(pages, (num_pages * kv_heads, size * d), copy=False)
            self.buffer = xp.empty((count, size * d), dtype=pages.dtype)

    def __call__(self, index, rows, g):
        """Pages ``index`` (int64) of kv head ``g``, whose rows in the row view are ``rows``."""
        xp, pages, n = self.xp, self.pages, index.shape[0]
        if self.by_rows:
            out = xp.take(self.table, rows, axis=0, out=self.buffer[:n, :], mode="clip")
        elif self.buffer is not None:
            import torch

            out = torch.index_select(pages[:, g, ...], 0, index, out=self.buffer[:n, ...])
        elif array_api_compat.is_numpy_array(pages):
            out = pages[index, g, ...]
        else:
            out = xp.take(pages[:, g, ...], index, axis=0)
        return xp.reshape(out, (-1, self.d))


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
        s = _scores(xp, q_scaled, to(xp, k_tile, acc))
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


def _scores(xp, q_scaled, k_tile):
    """``q_scaled @ k_tile.mT``: ``(group, keys)``, C-contiguous.

    On NumPy computed as ``k_tile @ q_scaled.mT`` and copied to rows: OpenBLAS
    runs the product with ``group`` columns faster than the one with
    ``group`` rows (measured, one thread, group 4, D 64, a 1024-key tile in
    cache: 16 against 27 us; with the copy and the softmax 30 against 45 us).
    """
    if not array_api_compat.is_numpy_namespace(xp):
        return q_scaled @ k_tile.mT
    s_t = k_tile @ q_scaled.mT
    return xp.reshape(s_t.mT, s_t.mT.shape, copy=True)


def _combine(xp, o, o_partial, m_partial, l_partial, b) -> None:
    """``o[b]`` from the splits' partials by log-sum-exp; split 0 is never empty, so the max is finite."""
    m_all = m_partial[b, ...]
    m_max = xp.max(m_all, axis=1)
    weight = xp.exp(m_all - m_max[:, None])
    total = xp.sum(weight * l_partial[b, ...], axis=1)
    merged = xp.sum(weight[:, :, None] * o_partial[b, ...], axis=1)
    o[b, ...] = to(xp, merged / total[:, None], o.dtype)
