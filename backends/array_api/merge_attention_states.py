"""Merging two attention states on the Array API: blocks of rows within the block budget.

Each block reads every input it needs into temporaries before it writes, so
an output may be the very same array as an input (``o is o_a``, ``do_a is
do``): element ``i`` of an output depends only on row ``i`` of the inputs.

Empty rows merge without NaN (no ``-inf - -inf``, no ``0 / 0``), and a side
of weight 0 contributes exactly 0 (selected, never multiplied). NaN in a
row's statistics reaches that row's results: a weight that is NaN is not 0,
so it is multiplied in; an ``l`` that is negative or ``+inf`` counts as NaN
(no attention state has one), and ``m = +inf`` gives NaN through ``exp(inf - inf)``.
"""

from __future__ import annotations

import math

import array_api_compat

from ._blocks import BLOCK_ELEMENTS, acc_dtype, path_arrays, to

__all__ = ["backward", "forward"]


def _blocks(o):
    """``(b, s0, s1)`` per block of ``(H, s1 - s0, Dv)`` elements of a ``(B, H, S, Dv)`` array."""
    batch, heads, seq, dv = o.shape
    step = max(1, BLOCK_ELEMENTS // max(heads * dv, 1))
    return [(b, s0, min(seq, s0 + step)) for b in range(batch) for s0 in range(0, seq, step)]


def _shifted_exp(xp, m_side, m):
    """``exp(m_side - m)``, with an empty merged row (``m = -inf``) shifted by 0: never ``-inf - -inf``."""
    return xp.exp(m_side - xp.where(m == -math.inf, xp.zeros_like(m), m))


def _inverse(xp, l):
    """``1 / l``, and 0 where ``l == 0`` (an empty merged row), without dividing by 0."""
    empty = l == 0
    return xp.where(empty, xp.zeros_like(l), 1.0 / xp.where(empty, xp.ones_like(l), l))


def _valid_sum(xp, l):
    """A row sum ``l`` as read: NaN where it is negative or ``+inf`` (no attention state has
    such an ``l``; its ``lse = m + log l`` is not a finite number or ``-inf``)."""
    return xp.where((l >= 0) & (l < math.inf), l, xp.full_like(l, math.nan))


def _weighted(xp, w, o):
    """``w[..., None] * o``, exactly 0 where ``w == 0`` (an empty side's ``o`` is not read)."""
    return xp.where(w[..., None] != 0, w[..., None] * o, xp.zeros_like(o))


def forward(o, m, l, o_a, m_a, l_a, o_b, m_b, l_b) -> None:
    """``(o, m, l)`` of attention over both key sets, in blocks of rows; PyTorch CPU tensors run
    on NumPy through zero-copy views (:func:`._blocks.numpy_views`). The contract of
    :class:`xpkernels.backends.protocol.MergeAttentionStatesModule`."""
    o, m, l, o_a, m_a, l_a, o_b, m_b, l_b = path_arrays(o, m, l, o_a, m_a, l_a, o_b, m_b, l_b)
    xp = array_api_compat.array_namespace(o, o_a, m_a)
    acc = acc_dtype(xp, o_a.dtype)
    for b, s0, s1 in _blocks(o_a):
        rows = (b, slice(None), slice(s0, s1))
        tile = (*rows, slice(None))
        ma, la = to(xp, m_a[rows], acc), _valid_sum(xp, to(xp, l_a[rows], acc))
        mb, lb = to(xp, m_b[rows], acc), _valid_sum(xp, to(xp, l_b[rows], acc))
        m_new = xp.maximum(ma, mb)
        scaled_a, scaled_b = la * _shifted_exp(xp, ma, m_new), lb * _shifted_exp(xp, mb, m_new)
        l_new = scaled_a + scaled_b
        inv = _inverse(xp, l_new)
        w_a, w_b = scaled_a * inv, scaled_b * inv
        o_new = _weighted(xp, w_a, to(xp, o_a[tile], acc)) + _weighted(
            xp, w_b, to(xp, o_b[tile], acc)
        )
        o[tile] = to(xp, o_new, o.dtype)
        m[rows] = to(xp, m_new, m.dtype)
        l[rows] = to(xp, l_new, l.dtype)


def backward(do, dlse, o, m, l, o_a, m_a, l_a, o_b, m_b, l_b, do_a, dlse_a, do_b, dlse_b) -> None:
    """``do_a = w_a do``, ``dlse_a = w_a (rowsum(do * (o_a - o)) + dlse)`` and the same for ``b``
    (PyTorch CPU tensors through zero-copy NumPy views, as :func:`forward`). The contract of
    :class:`xpkernels.backends.protocol.MergeAttentionStatesModule`."""
    do, dlse, o, m, l, o_a, m_a, l_a, o_b, m_b, l_b, do_a, dlse_a, do_b, dlse_b = path_arrays(
        do, dlse, o, m, l, o_a, m_a, l_a, o_b, m_b, l_b, do_a, dlse_a, do_b, dlse_b
    )
    xp = array_api_compat.array_namespace(do, o_a, m_a)
    acc = acc_dtype(xp, o_a.dtype)
    for b, s0, s1 in _blocks(o_a):
        rows = (b, slice(None), slice(s0, s1))
        tile = (*rows, slice(None))
        m_new, l_new = to(xp, m[rows], acc), to(xp, l[rows], acc)
        dov = to(xp, do[tile], acc)
        ov = to(xp, o[tile], acc)
        d_new = xp.zeros_like(m_new) if dlse is None else to(xp, dlse[rows], acc)
        inv = _inverse(xp, _valid_sum(xp, l_new))
        results = []
        for m_s, l_s, o_s in ((m_a, l_a, o_a), (m_b, l_b, o_b)):
            scaled = _valid_sum(xp, to(xp, l_s[rows], acc)) * _shifted_exp(
                xp, to(xp, m_s[rows], acc), m_new
            )
            w = scaled * inv
            diff = to(xp, o_s[tile], acc) - ov
            dot = xp.sum(xp.where(w[..., None] != 0, dov * diff, xp.zeros_like(diff)), axis=-1)
            results.append(
                (w[..., None] * dov, xp.where(w != 0, w * (dot + d_new), xp.zeros_like(w)))
            )
        (do_a_new, dlse_a_new), (do_b_new, dlse_b_new) = results
        do_a[tile] = to(xp, do_a_new, do_a.dtype)
        do_b[tile] = to(xp, do_b_new, do_b.dtype)
        dlse_a[rows] = to(xp, dlse_a_new, dlse_a.dtype)
        dlse_b[rows] = to(xp, dlse_b_new, dlse_b.dtype)
