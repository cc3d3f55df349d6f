r"""Rotary position embeddings (RoPE) in Triton: one kernel for both passes.

Query ``s`` of batch ``b`` takes row :math:`p` of the tables (:math:`p = s`, or
``position_ids[b, s]``), and each head's rotated pair :math:`i < R_2` (rotary
dim :math:`R = 2R_2 \le D`) turns by the angle whose cosine and sine the row
holds, :math:`c = \cos_{b,p,i}`, :math:`s = \sin_{b,p,i}`:

.. math::

    \begin{pmatrix} y_1 \\ y_2 \end{pmatrix}
    = \begin{pmatrix} c & -s \\ s & c \end{pmatrix}
      \begin{pmatrix} x_1 \\ x_2 \end{pmatrix},
    \qquad
    \begin{pmatrix} dx_1 \\ dx_2 \end{pmatrix}
    = \begin{pmatrix} c & s \\ -s & c \end{pmatrix}
      \begin{pmatrix} dy_1 \\ dy_2 \end{pmatrix}.

The backward is the transposed (inverse) rotation: the same kernel with
:math:`s` negated (``INVERSE``). The pair is :math:`(x_i, x_{i+R_2})` (the
half-rotation layout of Hugging Face models) or :math:`(x_{2i}, x_{2i+1})`
(``INTERLEAVED``, GPT-J); columns :math:`j \ge R` are copied unchanged (not
even read when the output is the input). Computed in float32, stored in the
output's dtype.

Tiles: a program rotates ``BLOCK_S x BLOCK_H`` rows -- ``BLOCK_S`` queries of
one batch times ``BLOCK_H`` heads -- of the rotary columns (and the tail), so
one tile serves every head of a query when ``H`` is large and several queries
when it is small (grouped keys). Each row is ``x[b, h, s, :]``, at its own
int64 offset from the three strides, and gathers its table row the same way:
the copies of one table row across the heads of its query are L1 hits, loaded
in the layout of the row tile (as :func:`._common.load_row_vector`). Accesses
are 128-bit wherever the strides (the tables' row stride included), addresses
and ``R2`` allow it: Triton specialises on 16-divisible integers, and ``R2`` is
a ``constexpr`` (one compilation per rotary dim). An interleaved tile is
loaded whole and split into its pairs in registers; a thread then holds half
as many pairs as a 128-bit load of a 16-bit table gives it, so such table
tiles reach the pairs' layout through shared memory (4 KiB at ``R2 = 64``;
none for float32 tables). Every program loads all it reads before it stores,
and no two programs touch the same row, so ``out`` may be ``x``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import VECTOR_BYTES, launch

__all__ = ["backward", "forward", "tile_config"]

#: Bytes of ``x`` a tile holds (rotary columns and the copied tail).
TILE_BYTES = 8192
#: 16-byte vectors of ``x`` a thread holds: sets ``num_warps``.
VECTORS_PER_THREAD = 4


def tile_config(heads: int, seq: int, width: int, itemsize: int) -> tuple[int, int, int]:
    """``(BLOCK_S, BLOCK_H, num_warps)`` of a launch over rows ``width`` columns wide.

    Parameters
    ----------
    heads, seq : int
        Heads ``H`` and queries ``S`` of ``x``.
    width : int
        Padded columns a row tile spans: the rotary columns, plus the tail
        when it is copied (a sum of two powers of two).
    itemsize : int
        Bytes per element of ``x``.

    Returns
    -------
    tuple of int
        Powers of two: heads fill the tile first, then queries.
    """
    rows = _floor_power_of_2(TILE_BYTES // (width * itemsize))
    block_h = min(triton.next_power_of_2(heads), rows)
    block_s = max(1, min(triton.next_power_of_2(seq), rows // block_h))
    vectors = block_s * block_h * width * itemsize // VECTOR_BYTES
    return block_s, block_h, _floor_power_of_2(vectors // (32 * VECTORS_PER_THREAD))


def _floor_power_of_2(n: int) -> int:
    """The largest power of two not above ``n``; 1 when ``n < 1``."""
    return 1 << max(0, n.bit_length() - 1)


@triton.jit
def _rope_kernel(
    out_ptr,  # (B, H, S, D) output; may be x_ptr
    x_ptr,  # (B, H, S, D) input
    cos_ptr, sin_ptr,  # (B, P, R2) tables, any float dtype
    pos_ptr,  # (B, S) int32 or int64 table rows of the queries, or None (row s)
    heads, seq, tail,  # H, S, and the columns D - R past the rotary dim
    table_rows,  # P: position ids are clamped to [0, P - 1] (never a read outside the tables)
    stride_out_b, stride_out_h, stride_out_s,  # elements between batches, heads, queries of out
    stride_x_b, stride_x_h, stride_x_s,  # the same of x
    stride_cos_b, stride_cos_p,  # elements between batches (0: one table), rows of cos
    stride_sin_b, stride_sin_p,  # the same of sin
    stride_pos_b, stride_pos_s,  # elements between batches, queries of the positions
    R2: tl.constexpr,  # rotated pairs: the rotary dim is R = 2 R2
    BLOCK_R2: tl.constexpr,  # pairs per row tile: next_pow2(R2)
    BLOCK_T: tl.constexpr,  # tail columns per row tile; 0: the tail is not copied
    BLOCK_S: tl.constexpr,  # queries per tile
    BLOCK_H: tl.constexpr,  # heads per tile
    INTERLEAVED: tl.constexpr,  # pairs (2i, 2i + 1), else (i, i + R2)
    INVERSE: tl.constexpr,  # rotate by minus the angle (the backward)
):  # fmt: skip
    ROWS: tl.constexpr = BLOCK_S * BLOCK_H
    s_tiles = tl.cdiv(seq, BLOCK_S)
    pid = tl.program_id(0)
    b = (pid // s_tiles).to(tl.int64)
    r = tl.arange(0, ROWS)
    s = (pid % s_tiles) * BLOCK_S + r // BLOCK_H
    h = tl.program_id(1) * BLOCK_H + r % BLOCK_H
    row_ok = (s < seq) & (h < heads)
    s64, h64 = s.to(tl.int64), h.to(tl.int64)
    x_rows = (x_ptr + b * stride_x_b + h64 * stride_x_h + s64 * stride_x_s)[:, None]
    out_rows = (out_ptr + b * stride_out_b + h64 * stride_out_h + s64 * stride_out_s)[:, None]
    if pos_ptr is None:
        p = s64
    else:
        pos = pos_ptr + b * stride_pos_b + s64 * stride_pos_s
        p = tl.load(pos, mask=row_ok, other=0).to(tl.int64)
        p = tl.minimum(tl.maximum(p, 0), table_rows - 1)
    pairs = tl.arange(0, BLOCK_R2)[None, :]
    mask = row_ok[:, None] & (pairs < R2)
    cos_rows = (cos_ptr + b * stride_cos_b + p * stride_cos_p)[:, None]
    sin_rows = (sin_ptr + b * stride_sin_b + p * stride_sin_p)[:, None]
    c = tl.load(cos_rows + pairs, mask=mask, other=0.0).to(tl.float32)
    sn = tl.load(sin_rows + pairs, mask=mask, other=0.0).to(tl.float32)
    if INVERSE:
        sn = -sn
    if INTERLEAVED:
        cols = tl.arange(0, 2 * BLOCK_R2)[None, :]
        x_mask = row_ok[:, None] & (cols < 2 * R2)
        x = tl.load(x_rows + cols, mask=x_mask, other=0.0).to(tl.float32)
        x1, x2 = tl.split(tl.reshape(x, (ROWS, BLOCK_R2, 2)))
    else:
        x1 = tl.load(x_rows + pairs, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_rows + R2 + pairs, mask=mask, other=0.0).to(tl.float32)
    if BLOCK_T > 0:
        tail_cols = 2 * R2 + tl.arange(0, BLOCK_T)[None, :]
        tail_mask = row_ok[:, None] & (tail_cols < 2 * R2 + tail)
        kept = tl.load(x_rows + tail_cols, mask=tail_mask)
    y1 = x1 * c - x2 * sn
    y2 = x2 * c + x1 * sn
    dtype = out_ptr.dtype.element_ty
    if INTERLEAVED:
        y = tl.reshape(tl.join(y1, y2), (ROWS, 2 * BLOCK_R2))
        tl.store(out_rows + cols, y.to(dtype), mask=x_mask)
    else:
        tl.store(out_rows + pairs, y1.to(dtype), mask=mask)
        tl.store(out_rows + R2 + pairs, y2.to(dtype), mask=mask)
    if BLOCK_T > 0:
        tl.store(out_rows + tail_cols, kept, mask=tail_mask)


def _rotate(out, x, cos, sin, position_ids, interleaved: bool, inverse: bool) -> None:
    """Launch :func:`_rope_kernel` over ``x``; ``inverse`` rotates by minus the angle."""
    batch, heads, seq, d = x.shape
    r2 = cos.shape[-1]
    tail = d - 2 * r2
    copy_tail = tail > 0 and out is not x
    if x.numel() == 0 or (r2 == 0 and not copy_tail):
        return
    block_r2 = triton.next_power_of_2(max(r2, 1))
    block_t = triton.next_power_of_2(tail) if copy_tail else 0
    block_s, block_h, warps = tile_config(heads, seq, 2 * block_r2 + block_t, x.element_size())
    pos_strides = (0, 0) if position_ids is None else position_ids.stride()
    grid = (batch * triton.cdiv(seq, block_s), triton.cdiv(heads, block_h))
    strides = (*out.stride()[:3], *x.stride()[:3], *cos.stride()[:2], *sin.stride()[:2])
    args = (out, x, cos, sin, position_ids, heads, seq, tail, cos.shape[1], *strides, *pos_strides)
    blocks = {"BLOCK_R2": block_r2, "BLOCK_T": block_t, "BLOCK_S": block_s, "BLOCK_H": block_h}
    flags = {"R2": r2, "INTERLEAVED": interleaved, "INVERSE": inverse, "num_warps": warps}
    launch(_rope_kernel, x, grid, *args, **blocks, **flags)


def forward(out, x, cos, sin, position_ids, *, interleaved: bool) -> None:
    """``out = rope(x)``: each pair ``(x1, x2)`` becomes ``(x1 c - x2 s, x2 c + x1 s)``.

    The tables may be of any float dtype, ``2 R2 <= D``; without ``position_ids`` query ``s``
    takes row ``s`` (``P >= S``); ``interleaved`` pairs ``(x[2i], x[2i + 1])`` (GPT-J), else
    ``(x[i], x[i + R2])``. The contract of :class:`xpkernels.backends.protocol.RopeModule`.
    """
    _rotate(out, x, cos, sin, position_ids, interleaved, inverse=False)


def backward(dx, dout, cos, sin, position_ids, *, interleaved: bool) -> None:
    """``dx`` from ``dout`` by the inverse rotation: ``(d1 c + d2 s, d2 c - d1 s)`` per pair.

    The contract of :class:`xpkernels.backends.protocol.RopeModule`; the tables and pairs as
    in :func:`forward`.
    """
    _rotate(dx, dout, cos, sin, position_ids, interleaved, inverse=True)
