r"""SwiGLU in Triton: one elementwise kernel per pass over ``ROWS x BLOCK_M`` tiles.

.. math::

    y = \mathrm{silu}(a)\,b,\qquad
    da = dy\,b\,s\,\big(1 + a\,(1 - s)\big),\qquad db = dy\,\mathrm{silu}(a),

with :math:`s = \sigma(a)`, recomputed by the backward. The sigmoid comes
from :math:`e = \exp(-|a|)` (never an overflow, also not in the
interpreter's NumPy): :math:`s = 1/(1+e)` for :math:`a \ge 0`, else
:math:`e/(1+e)`; ``NaN`` propagates and :math:`a = \pm\infty` give what
``torch.nn.functional.silu`` gives. Computed in float32, stored in each
output's dtype.

Tiles: a program covers ``ROWS`` rows of ``BLOCK_M`` columns (a 1-D grid
over row tiles x column tiles, row offsets in int64). ``BLOCK_M`` is the
padded row up to :data:`COLUMN_BYTES` of the input, ``ROWS`` fills the tile
to :data:`TILE_BYTES` per array, and each thread holds
:data:`VECTORS_PER_THREAD` 16-byte vectors of each array: the accesses are
128-bit wherever the row length, strides and addresses are multiples of 16
(Triton's specialisation), as for the row kernels of :mod:`._common`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import VECTOR_BYTES, launch_context, row_strides, traced

__all__ = ["backward", "forward"]

#: Bytes of one array a program's tile spans along a row, at most.
COLUMN_BYTES = 4096
#: Bytes of one array a tile holds, per pass (the backward keeps three inputs live).
TILE_BYTES = {"forward": 16384, "backward": 8192}
#: 16-byte vectors of each array a thread holds, per pass: sets ``num_warps``.
VECTORS_PER_THREAD = {"forward": 4, "backward": 2}


def tile_config(m: int, itemsize: int, pass_: str) -> tuple[int, int, int]:
    """``(ROWS, BLOCK_M, num_warps)`` of a pass over rows of length ``m``.

    Parameters
    ----------
    m : int
        Row length.
    itemsize : int
        Bytes per element of the lead input (``a``).
    pass_ : {"forward", "backward"}
        Which pass.

    Returns
    -------
    tuple of int
        Powers of two; ``BLOCK_M`` spans at least one 16-byte vector.
    """
    vector = max(1, VECTOR_BYTES // itemsize)
    tile = TILE_BYTES[pass_] // itemsize
    block_m = min(max(triton.next_power_of_2(m), vector), COLUMN_BYTES // itemsize)
    rows = max(1, tile // block_m)
    warps = max(1, rows * block_m // (32 * vector * VECTORS_PER_THREAD[pass_]))
    return rows, block_m, warps


@triton.jit
def _sigmoid(a):
    """``sigmoid(a)`` of a float32 tile, from ``exp(-|a|)``: no overflow for any ``|a|``."""
    e = tl.exp(-tl.abs(a))
    r = 1.0 / (1.0 + e)
    return tl.where(a >= 0, r, e * r)


@triton.jit
def _forward_kernel(
    y_ptr,  # (rows, M) output; may be a_ptr or b_ptr
    a_ptr, b_ptr,  # (rows, M) gate, gated values
    rows, m,  # number of rows, row length M
    stride_y, stride_a, stride_b,  # elements between rows of y, a, b
    ROWS: tl.constexpr,  # rows per tile
    BLOCK_M: tl.constexpr,  # columns per tile
):  # fmt: skip
    col_tiles = tl.cdiv(m, BLOCK_M)
    pid = tl.program_id(0)
    r = (pid // col_tiles).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = (pid % col_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask = (r < rows)[:, None] & (cols < m)[None, :]
    r64 = r[:, None]
    a = tl.load(a_ptr + r64 * stride_a + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + r64 * stride_b + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    y = a * _sigmoid(a) * b
    tl.store(y_ptr + r64 * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


def forward(y, a, b) -> None:
    """``y = silu(a) * b`` over 2-D ``(rows, M)`` views.

    Parameters
    ----------
    y, a, b : torch.Tensor
        ``(rows, M)``, last axis contiguous, any row stride; ``y`` may be the
        very same tensor as ``a`` or ``b``.
    """
    rows, m = a.shape
    if rows == 0 or m == 0:
        return
    tile_rows, block_m, warps = tile_config(m, a.element_size(), "forward")
    grid = (triton.cdiv(rows, tile_rows) * triton.cdiv(m, block_m),)
    with launch_context(_forward_kernel, a):
        traced(_forward_kernel, a)[grid](
            y,
            a,
            b,
            rows,
            m,
            *row_strides(y, a, b),
            ROWS=tile_rows,
            BLOCK_M=block_m,
            num_warps=warps,
        )


@triton.jit
def _backward_kernel(
    dy_ptr,  # (rows, M) output gradient
    a_ptr, b_ptr,  # (rows, M) gate, gated values
    da_ptr, db_ptr,  # (rows, M) their gradients, overwritten; either may be dy_ptr
    rows, m,  # number of rows, row length M
    stride_dy, stride_a, stride_b, stride_da, stride_db,  # elements between rows of each
    ROWS: tl.constexpr,  # rows per tile
    BLOCK_M: tl.constexpr,  # columns per tile
):  # fmt: skip
    col_tiles = tl.cdiv(m, BLOCK_M)
    pid = tl.program_id(0)
    r = (pid // col_tiles).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = (pid % col_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask = (r < rows)[:, None] & (cols < m)[None, :]
    r64 = r[:, None]
    dy = tl.load(dy_ptr + r64 * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    a = tl.load(a_ptr + r64 * stride_a + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + r64 * stride_b + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    s = _sigmoid(a)
    silu = a * s
    # s * (1 + a * (1 - s)) = s + silu * (1 - s)
    da = dy * b * (s + silu * (1.0 - s))
    db = dy * silu
    tl.store(da_ptr + r64 * stride_da + cols[None, :], da.to(da_ptr.dtype.element_ty), mask=mask)
    tl.store(db_ptr + r64 * stride_db + cols[None, :], db.to(db_ptr.dtype.element_ty), mask=mask)


def backward(dy, a, b, da, db) -> None:
    """``da = dy * b * s * (1 + a * (1 - s))``, ``db = dy * silu(a)`` over ``(rows, M)`` views.

    Parameters
    ----------
    dy, a, b : torch.Tensor
        ``(rows, M)`` inputs, last axis contiguous, any row stride.
    da, db : torch.Tensor
        ``(rows, M)`` gradients, overwritten; one of them may be the very
        same tensor as ``dy`` (each element is loaded before either is stored).
    """
    rows, m = a.shape
    if rows == 0 or m == 0:
        return
    tile_rows, block_m, warps = tile_config(m, a.element_size(), "backward")
    grid = (triton.cdiv(rows, tile_rows) * triton.cdiv(m, block_m),)
    with launch_context(_backward_kernel, a):
        args = (dy, a, b, da, db, rows, m, *row_strides(dy, a, b, da, db))
        traced(_backward_kernel, a)[grid](*args, ROWS=tile_rows, BLOCK_M=block_m, num_warps=warps)
