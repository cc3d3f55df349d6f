r"""Merging two attention states in Triton: one program per tile of rows, whole head dim per row.

.. math::

    m = \max(m_a, m_b),\quad l = l_a e^{m_a - m} + l_b e^{m_b - m},\quad
    o = w_a o_a + w_b o_b,\quad w_a = l_a e^{m_a - m} / l

Backward: ``do_a = w_a do``, ``dlse_a = w_a (rowsum(do * (o_a - o)) +
dlse)``, the same for ``b``. A row is one ``(b, h, s)`` of the ``(B, H, S)``
states, found from its flat index; every stride is passed to the kernel and
offsets are computed in int64. A program loads everything it reads before it
stores, and each stored element depends only on its own row, so an output
may be the very same tensor as an input (``o is o_a``, ``do_a is do``).
Empty rows (``m = -inf``) are shifted by 0 before ``exp``, and ``1 / l`` is
taken only where ``l != 0``: no ``-inf - -inf`` and no ``0 / 0``. A side of
weight exactly 0 contributes exactly 0 (selected, never multiplied). NaN in
a row's statistics reaches that row's results, as on the other backends: a
NaN weight is not 0, so it is multiplied in; the row max propagates NaN
(``tl.maximum`` would drop it, as the GPU's ``max.f32`` does); an ``l`` that
is negative or ``+inf`` counts as NaN (no attention state has one), and
``m = +inf`` gives NaN through ``exp(inf - inf)``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import launch

__all__ = ["backward", "forward"]

#: Elements of one ``(ROWS, BLOCK_D)`` tile of ``o``.
_TILE_ELEMENTS = 4096


@triton.jit
def _row_offsets(r, rows, heads, seq, stride_b, stride_h, stride_s):
    """Offsets (int64) of flat rows ``r`` (clamped to the last row) in a ``(B, H, S, ...)`` layout."""
    r64 = tl.minimum(r, rows - 1).to(tl.int64)
    s = r64 % seq
    h = (r64 // seq) % heads
    b = r64 // (seq * heads)
    return b * stride_b + h * stride_h + s * stride_s


@triton.jit
def _valid_sum(l):
    """A row sum as read: NaN where it is negative or ``+inf``."""
    return tl.where((l >= 0) & (l < float("inf")), l, float("nan"))


@triton.jit
def _row_max(m_a, m_b):
    """``max(m_a, m_b)``, NaN where either is NaN."""
    return tl.maximum(m_a, m_b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _weight(m_side, l_side, m, inv_l):
    """``l_side exp(m_side - m) / l`` with empty merged rows (``m = -inf``) shifted by 0."""
    shift = tl.where(m == float("-inf"), 0.0, m)
    return _valid_sum(l_side) * tl.exp(m_side - shift) * inv_l


@triton.jit
def _inverse(l):
    """``1 / l``, and 0 where ``l == 0`` (NaN stays NaN)."""
    return tl.where(l == 0, 0.0, 1.0 / tl.where(l == 0, 1.0, l))


@triton.jit
def _forward_kernel(
    o_ptr,  # (B, H, S, Dv) merged output
    m_ptr,  # (B, H, S) merged row max
    l_ptr,  # (B, H, S) merged row sum
    oa_ptr,  # (B, H, S, Dv) side a's output
    ma_ptr,  # (B, H, S) side a's row max
    la_ptr,  # (B, H, S) side a's row sum
    ob_ptr,  # (B, H, S, Dv) side b's output
    mb_ptr,  # (B, H, S) side b's row max
    lb_ptr,  # (B, H, S) side b's row sum
    o_sb, o_sh, o_ss,  # element strides (b, h, s) of o
    m_sb, m_sh, m_ss,  # of m
    l_sb, l_sh, l_ss,  # of l
    oa_sb, oa_sh, oa_ss,  # of o_a
    ma_sb, ma_sh, ma_ss,  # of m_a
    la_sb, la_sh, la_ss,  # of l_a
    ob_sb, ob_sh, ob_ss,  # of o_b
    mb_sb, mb_sh, mb_ss,  # of m_b
    lb_sb, lb_sh, lb_ss,  # of l_b
    rows,  # B * H * S
    heads,  # H
    seq,  # S
    dv,  # head dim Dv
    ROWS: tl.constexpr,  # rows per program
    BLOCK_D: tl.constexpr,  # padded head dim (>= Dv)
):  # fmt: skip
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = r < rows
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < dv
    m_a = tl.load(ma_ptr + _row_offsets(r, rows, heads, seq, ma_sb, ma_sh, ma_ss)).to(tl.float32)
    l_a = tl.load(la_ptr + _row_offsets(r, rows, heads, seq, la_sb, la_sh, la_ss)).to(tl.float32)
    m_b = tl.load(mb_ptr + _row_offsets(r, rows, heads, seq, mb_sb, mb_sh, mb_ss)).to(tl.float32)
    l_b = tl.load(lb_ptr + _row_offsets(r, rows, heads, seq, lb_sb, lb_sh, lb_ss)).to(tl.float32)
    oa_rows = _row_offsets(r, rows, heads, seq, oa_sb, oa_sh, oa_ss)
    ob_rows = _row_offsets(r, rows, heads, seq, ob_sb, ob_sh, ob_ss)
    o_a = tl.load(oa_ptr + oa_rows[:, None] + cols[None, :], mask=col_ok[None, :], other=0.0)
    o_b = tl.load(ob_ptr + ob_rows[:, None] + cols[None, :], mask=col_ok[None, :], other=0.0)
    m = _row_max(m_a, m_b)
    shift = tl.where(m == float("-inf"), 0.0, m)
    scaled_a = _valid_sum(l_a) * tl.exp(m_a - shift)
    scaled_b = _valid_sum(l_b) * tl.exp(m_b - shift)
    l = scaled_a + scaled_b
    inv_l = _inverse(l)
    w_a = scaled_a * inv_l
    w_b = scaled_b * inv_l
    # An empty side contributes exactly 0, whatever its o holds.
    o = tl.where(w_a[:, None] != 0, w_a[:, None] * o_a.to(tl.float32), 0.0)
    o += tl.where(w_b[:, None] != 0, w_b[:, None] * o_b.to(tl.float32), 0.0)
    o_rows = _row_offsets(r, rows, heads, seq, o_sb, o_sh, o_ss)
    tile_ok = row_ok[:, None] & col_ok[None, :]
    tl.store(o_ptr + o_rows[:, None] + cols[None, :], o.to(o_ptr.dtype.element_ty), mask=tile_ok)
    m_rows = _row_offsets(r, rows, heads, seq, m_sb, m_sh, m_ss)
    tl.store(m_ptr + m_rows, m.to(m_ptr.dtype.element_ty), mask=row_ok)
    l_rows = _row_offsets(r, rows, heads, seq, l_sb, l_sh, l_ss)
    tl.store(l_ptr + l_rows, l.to(l_ptr.dtype.element_ty), mask=row_ok)


@triton.jit
def _side_backward(
    do,  # (ROWS, BLOCK_D) float32 output gradient
    o,  # (ROWS, BLOCK_D) float32 merged output
    d_lse,  # (ROWS,) float32 merged lse gradient
    m,  # (ROWS,) merged row max
    inv_l,  # (ROWS,) 1 / merged row sum (0 on empty rows)
    o_side,  # (ROWS, BLOCK_D) float32 the side's output
    m_side,  # (ROWS,) the side's row max
    l_side,  # (ROWS,) the side's row sum
):
    """``(w do, w (rowsum(do * (o_side - o)) + d_lse))``, 0 on an empty side."""
    w = _weight(m_side, l_side, m, inv_l)
    dot = tl.sum(tl.where(w[:, None] != 0, do * (o_side - o), 0.0), axis=1)
    return w[:, None] * do, tl.where(w != 0, w * (dot + d_lse), 0.0)


@triton.jit
def _backward_kernel(
    do_ptr,  # (B, H, S, Dv) merged output gradient
    dlse_ptr,  # (B, H, S) merged lse gradient (not read unless HAS_DLSE)
    o_ptr,  # (B, H, S, Dv) merged output
    m_ptr,  # (B, H, S) merged row max
    l_ptr,  # (B, H, S) merged row sum
    oa_ptr,  # (B, H, S, Dv) side a's output
    ma_ptr,  # (B, H, S) side a's row max
    la_ptr,  # (B, H, S) side a's row sum
    ob_ptr,  # (B, H, S, Dv) side b's output
    mb_ptr,  # (B, H, S) side b's row max
    lb_ptr,  # (B, H, S) side b's row sum
    doa_ptr,  # (B, H, S, Dv) side a's output gradient, overwritten
    dlsea_ptr,  # (B, H, S) side a's lse gradient, overwritten
    dob_ptr,  # (B, H, S, Dv) side b's output gradient, overwritten
    dlseb_ptr,  # (B, H, S) side b's lse gradient, overwritten
    do_sb, do_sh, do_ss,  # element strides (b, h, s) of do
    dlse_sb, dlse_sh, dlse_ss,  # of dlse
    o_sb, o_sh, o_ss,  # of o
    m_sb, m_sh, m_ss,  # of m
    l_sb, l_sh, l_ss,  # of l
    oa_sb, oa_sh, oa_ss,  # of o_a
    ma_sb, ma_sh, ma_ss,  # of m_a
    la_sb, la_sh, la_ss,  # of l_a
    ob_sb, ob_sh, ob_ss,  # of o_b
    mb_sb, mb_sh, mb_ss,  # of m_b
    lb_sb, lb_sh, lb_ss,  # of l_b
    doa_sb, doa_sh, doa_ss,  # of do_a
    dlsea_sb, dlsea_sh, dlsea_ss,  # of dlse_a
    dob_sb, dob_sh, dob_ss,  # of do_b
    dlseb_sb, dlseb_sh, dlseb_ss,  # of dlse_b
    rows,  # B * H * S
    heads,  # H
    seq,  # S
    dv,  # head dim Dv
    HAS_DLSE: tl.constexpr,  # whether dlse is given (else zero)
    ROWS: tl.constexpr,  # rows per program
    BLOCK_D: tl.constexpr,  # padded head dim (>= Dv)
):  # fmt: skip
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = r < rows
    cols = tl.arange(0, BLOCK_D)[None, :]
    col_ok = cols < dv
    tile_ok = row_ok[:, None] & col_ok
    do_rows = _row_offsets(r, rows, heads, seq, do_sb, do_sh, do_ss)
    do = tl.load(do_ptr + do_rows[:, None] + cols, mask=col_ok, other=0.0).to(tl.float32)
    if HAS_DLSE:
        dlse_rows = _row_offsets(r, rows, heads, seq, dlse_sb, dlse_sh, dlse_ss)
        d_lse = tl.load(dlse_ptr + dlse_rows).to(tl.float32)
    else:
        d_lse = tl.zeros([ROWS], dtype=tl.float32)
    o_rows = _row_offsets(r, rows, heads, seq, o_sb, o_sh, o_ss)
    o = tl.load(o_ptr + o_rows[:, None] + cols, mask=col_ok, other=0.0).to(tl.float32)
    m = tl.load(m_ptr + _row_offsets(r, rows, heads, seq, m_sb, m_sh, m_ss)).to(tl.float32)
    l = tl.load(l_ptr + _row_offsets(r, rows, heads, seq, l_sb, l_sh, l_ss)).to(tl.float32)
    inv_l = _inverse(_valid_sum(l))
    oa_rows = _row_offsets(r, rows, heads, seq, oa_sb, oa_sh, oa_ss)
    o_a = tl.load(oa_ptr + oa_rows[:, None] + cols, mask=col_ok, other=0.0).to(tl.float32)
    m_a = tl.load(ma_ptr + _row_offsets(r, rows, heads, seq, ma_sb, ma_sh, ma_ss)).to(tl.float32)
    l_a = tl.load(la_ptr + _row_offsets(r, rows, heads, seq, la_sb, la_sh, la_ss)).to(tl.float32)
    ob_rows = _row_offsets(r, rows, heads, seq, ob_sb, ob_sh, ob_ss)
    o_b = tl.load(ob_ptr + ob_rows[:, None] + cols, mask=col_ok, other=0.0).to(tl.float32)
    m_b = tl.load(mb_ptr + _row_offsets(r, rows, heads, seq, mb_sb, mb_sh, mb_ss)).to(tl.float32)
    l_b = tl.load(lb_ptr + _row_offsets(r, rows, heads, seq, lb_sb, lb_sh, lb_ss)).to(tl.float32)
    do_a, dlse_a = _side_backward(do, o, d_lse, m, inv_l, o_a, m_a, l_a)
    do_b, dlse_b = _side_backward(do, o, d_lse, m, inv_l, o_b, m_b, l_b)
    doa_rows = _row_offsets(r, rows, heads, seq, doa_sb, doa_sh, doa_ss)
    tl.store(doa_ptr + doa_rows[:, None] + cols, do_a.to(doa_ptr.dtype.element_ty), mask=tile_ok)
    dob_rows = _row_offsets(r, rows, heads, seq, dob_sb, dob_sh, dob_ss)
    tl.store(dob_ptr + dob_rows[:, None] + cols, do_b.to(dob_ptr.dtype.element_ty), mask=tile_ok)
    dlsea_rows = _row_offsets(r, rows, heads, seq, dlsea_sb, dlsea_sh, dlsea_ss)
    tl.store(dlsea_ptr + dlsea_rows, dlse_a.to(dlsea_ptr.dtype.element_ty), mask=row_ok)
    dlseb_rows = _row_offsets(r, rows, heads, seq, dlseb_sb, dlseb_sh, dlseb_ss)
    tl.store(dlseb_ptr + dlseb_rows, dlse_b.to(dlseb_ptr.dtype.element_ty), mask=row_ok)


def _strides(*tensors) -> list[int]:
    """The ``(b, h, s)`` element strides of each tensor, flattened in order."""
    return [st for t in tensors for st in t.stride()[:3]]


def _launch(o_a):
    """``(rows, grid, ROWS, BLOCK_D)`` for states shaped like ``o_a`` ``(B, H, S, Dv)``."""
    batch, heads, seq, dv = o_a.shape
    rows = batch * heads * seq
    block_d = triton.next_power_of_2(max(dv, 1))
    rows_per = max(1, min(triton.next_power_of_2(rows), _TILE_ELEMENTS // block_d))
    return rows, (triton.cdiv(rows, rows_per),), rows_per, block_d


def forward(o, m, l, o_a, m_a, l_a, o_b, m_b, l_b) -> None:
    """``(o, m, l)`` of attention over both key sets; see the module docstring.

    The ``(B, H, S)`` states are float32, any strides. The contract of
    :class:`xpkernels.backends.protocol.MergeAttentionStatesModule`.
    """
    rows, grid, rows_per, block_d = _launch(o_a)
    if rows == 0:
        return
    states = (o, m, l, o_a, m_a, l_a, o_b, m_b, l_b)
    args = (*states, *_strides(*states), rows, *o_a.shape[1:])
    launch(_forward_kernel, o_a, grid, *args, ROWS=rows_per, BLOCK_D=block_d)


def backward(do, dlse, o, m, l, o_a, m_a, l_a, o_b, m_b, l_b, do_a, dlse_a, do_b, dlse_b) -> None:
    """``do_a``, ``dlse_a``, ``do_b``, ``dlse_b``; see the module docstring.

    The ``(B, H, S)`` arrays are float32. The contract of
    :class:`xpkernels.backends.protocol.MergeAttentionStatesModule`.
    """
    rows, grid, rows_per, block_d = _launch(o_a)
    if rows == 0:
        return
    has_dlse = dlse is not None
    dlse_arg = dlse if has_dlse else m  # never read when HAS_DLSE is False
    states = (do, dlse_arg, o, m, l, o_a, m_a, l_a, o_b, m_b, l_b, do_a, dlse_a, do_b, dlse_b)
    args = (*states, *_strides(*states), rows, *o_a.shape[1:])
    meta = {"HAS_DLSE": has_dlse, "ROWS": rows_per, "BLOCK_D": block_d}
    launch(_backward_kernel, o_a, grid, *args, **meta)
