"""Split-KV decode attention on the Array API (flash-decoding), float32/float64 accumulation.

For batch ``b`` the valid cache ``[0, lengths[b])`` is cut into ``n_splits``
contiguous slices of ``ceil(lengths[b] / n_splits)`` keys. Each slice yields,
for every query head, an unnormalised partial output, its running max and its
exponent sum (an empty slice yields 0, -inf, 0); a log-sum-exp combine then
merges the slices (the trailing empty slices of a short length are written in
one step). ``lengths[b]`` is read as a Python int and clamped to
``[0, Smax]``. Within a slice, keys are read in tiles within
``TILE_ELEMENTS`` with an online softmax. The query heads of one kv group are
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


def forward(o, q, k, v, lengths, o_partial, m_partial, l_partial, *, scale) -> None:
    """Write ``o`` for validated inputs.

    ``o``: (B, H, Dv); ``q``: (B, H, D); ``k``: (B, Hkv, Smax, D); ``v``:
    (B, Hkv, Smax, Dv); ``lengths``: (B,) integers (clamped to ``[0, Smax]``);
    ``o_partial`` (B, H, n_splits, Dv), ``m_partial`` and ``l_partial``
    (B, H, n_splits): scratch in the accumulation dtype, overwritten for every
    batch with ``lengths[b] > 0``. ``scale`` is a float. ``lengths[b] == 0``
    gives ``o[b] = 0``.
    """
    xp = array_api_compat.array_namespace(o, q, k, v)
    batch, heads, d = q.shape
    kv_heads, dv = k.shape[1], v.shape[3]
    group = heads // kv_heads
    smax, n_splits = k.shape[2], o_partial.shape[2]
    key_tile = max(1, TILE_ELEMENTS // max(group, d, dv))
    for b in range(batch):
        n = min(smax, max(0, int(lengths[b])))
        if n == 0:
            o[b, ...] = 0.0
            continue
        chunk = math.ceil(n / n_splits)
        used = math.ceil(n / chunk)  # splits holding a key; the rest are empty
        o_partial[b, :, used:, :] = 0.0
        m_partial[b, :, used:] = -math.inf
        l_partial[b, :, used:] = 0.0
        for g in range(kv_heads):
            heads_g = slice(g * group, (g + 1) * group)
            for split in range(used):
                _split(
                    xp,
                    q,
                    k,
                    v,
                    o_partial,
                    m_partial,
                    l_partial,
                    b,
                    g,
                    heads_g,
                    split,
                    start=split * chunk,
                    stop=min(n, (split + 1) * chunk),
                    key_tile=key_tile,
                    scale=scale,
                )
        _combine(xp, o, o_partial, m_partial, l_partial, b)


def _split(
    xp,
    q,
    k,
    v,
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
    key_tile,
    scale,
):
    """Partial result of keys ``[start, stop)`` (not empty) for the query heads ``heads_g`` of kv head ``g``."""
    acc = acc_dtype(xp, q.dtype)
    q_scaled = to(xp, q[b, heads_g, :], acc) * scale
    m_run = l_run = o_acc = None
    for j0 in range(start, stop, key_tile):
        j1 = min(stop, j0 + key_tile)
        s = q_scaled @ to(xp, k[b, g, j0:j1, :], acc).mT
        row_max = xp.max(s, axis=1)
        m_new = row_max if m_run is None else xp.maximum(m_run, row_max)
        s -= m_new[:, None]
        p = xp.exp(s)
        pv = p @ to(xp, v[b, g, j0:j1, :], acc)
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
