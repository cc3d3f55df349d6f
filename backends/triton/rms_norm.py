r"""RMSNorm in Triton: fused one-read kernels for rows held in registers, streaming ones beyond.

Per row, with :math:`w' = w + \mathrm{offset}`:

.. math::

    \mathrm{rstd} = \big(\tfrac{1}{M}\textstyle\sum_j x_j^2 + \varepsilon\big)^{-1/2},\quad
    y = x\,\mathrm{rstd}\,w',\quad
    dx = \mathrm{rstd}\,\big(g - \hat x\,\tfrac{1}{M}\textstyle\sum_j g_j\hat x_j\big),\quad
    dw = \textstyle\sum_{\text{rows}} dy\,\hat x

where :math:`\hat x = x\,\mathrm{rstd}` and :math:`g = dy\,w'`. ``dw`` is summed
per program into row ``program_id`` of ``dw_partial`` and reduced by
:func:`reduce_partials`. Accumulation is float32; outputs are written in
their buffer's dtype.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import (
    fill_empty_row_checkpoints,
    launch_rows,
    load_chunk,
    load_row_vector,
    load_tile,
    partial_programs,
    reduce_partials,
    row_chunk,
    row_config,
    row_strides,
    store_tile,
)

__all__ = ["backward", "forward", "partials", "reduce_partials"]

#: Registers per thread of the backward kernels' sm_90 builds at the benchmark shapes in
#: bfloat16, by whether the kernel streams (False: fused, True: streaming); they size the
#: persistent grid to one wave (``_common.partial_programs``).
BACKWARD_REGISTERS = {False: 64, True: 64}


@triton.jit
def _weight(w_ptr, cols, col_ok, offset):
    """``w + offset`` at ``cols`` in float32, 0 past M; 1 on every column when ``w_ptr`` is None."""
    if w_ptr is None:
        w = tl.where(col_ok, 1.0, 0.0)
    else:
        w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32) + offset
    return w


@triton.jit
def _weight_rows(w_ptr, cols, col_ok, offset, ROWS: tl.constexpr):
    """:func:`_weight` repeated down ``ROWS`` rows, loaded 16 bytes a thread (``load_row_vector``)."""
    if w_ptr is None:
        w = tl.broadcast_to(tl.where(col_ok, 1.0, 0.0)[None, :], (ROWS, cols.shape[0]))
    else:
        w = load_row_vector(w_ptr, cols, col_ok, ROWS) + offset
    return w


@triton.jit
def _forward_fused(
    y_ptr, x_ptr,  # (rows, M) output and input
    w_ptr,  # (M,) weight, or None (no weight)
    rstd_ptr,  # (rows,) float32 checkpoint, or None (inference)
    rows, m,  # number of rows, row length M
    stride_y, stride_x, stride_rstd,  # elements between rows of y and of x, entries of rstd
    eps, offset,  # added to the mean square, added to w
    ROWS: tl.constexpr,  # rows per tile
    BLOCK_M: tl.constexpr,  # padded row length (>= M)
):  # fmt: skip
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_M)
    row_ok = r < rows
    col_ok = cols < m
    mask = row_ok[:, None] & col_ok[None, :]
    r64 = r.to(tl.int64)
    x = load_tile(x_ptr, r64[:, None], cols[None, :], stride_x, mask)
    w = _weight(w_ptr, cols, col_ok, offset)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / m + eps)
    store_tile(y_ptr, r64[:, None], cols[None, :], stride_y, mask, x * rstd[:, None] * w[None, :])
    if rstd_ptr is not None:
        tl.store(rstd_ptr + r64 * stride_rstd, rstd, mask=row_ok)


@triton.jit
def _forward_streaming(
    y_ptr, x_ptr,  # (rows, M) output and input
    w_ptr,  # (M,) weight, or None (no weight)
    rstd_ptr,  # (rows,) float32 checkpoint, or None (inference)
    rows, m,  # number of rows, row length M
    stride_y, stride_x, stride_rstd,  # elements between rows of y and of x, entries of rstd
    eps, offset,  # added to the mean square, added to w
    ROWS: tl.constexpr,  # rows per tile
    BLOCK_M: tl.constexpr,  # chunk length
    N_CHUNKS: tl.constexpr,  # chunks per row, cdiv(M, BLOCK_M)
):  # fmt: skip
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = r < rows
    r64 = r.to(tl.int64)
    x_rows = x_ptr + r64[:, None] * stride_x
    y_rows = y_ptr + r64[:, None] * stride_y
    sum_sq = tl.zeros([ROWS, BLOCK_M], dtype=tl.float32)
    for k in range(N_CHUNKS):
        cols, col_ok, mask = row_chunk(k, m, row_ok, BLOCK_M)
        x = load_chunk(x_rows, cols, mask, "evict_last")
        sum_sq += x * x
    rstd = tl.rsqrt(tl.sum(sum_sq, axis=1) / m + eps)
    for k in range(N_CHUNKS):
        cols, col_ok, mask = row_chunk(k, m, row_ok, BLOCK_M)
        x = load_chunk(x_rows, cols, mask, "evict_first")
        w = _weight(w_ptr, cols, col_ok, offset)
        y = x * rstd[:, None] * w[None, :]
        tl.store(y_rows + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    if rstd_ptr is not None:
        tl.store(rstd_ptr + r64 * stride_rstd, rstd, mask=row_ok)


def forward(y, x, w, rstd, *, eps, offset) -> None:
    """``y = x * rstd * (w + offset)``; writes ``rstd`` unless None. Parameters: the
    ``rms_norm`` Signature's (:func:`xpkernels.backends.protocol.module_functions`)."""
    rows, m = x.shape
    if rows == 0:
        return
    if m == 0:
        fill_empty_row_checkpoints(eps, rstd)
        return
    config = row_config(m, x.element_size(), "forward")
    args = (y, x, w, rstd, rows, m, *row_strides(y, x, rstd), eps, offset)
    launch_rows(_forward_fused, _forward_streaming, config, x, *args)


@triton.jit
def _backward_fused(
    dy_ptr, x_ptr,  # (rows, M) output gradient, forward input
    w_ptr,  # (M,) weight, or None (no weight)
    rstd_ptr,  # (rows,) float32 checkpoint
    dx_ptr,  # (rows, M) input gradient, overwritten (may alias dy)
    dw_partial_ptr,  # (P, M) float32 partial sums of dy * x_hat, one row per program, or None
    rows, m,  # number of rows, row length M
    stride_dy, stride_x, stride_dx, stride_rstd,  # elements between rows of dy, x, dx; of rstd
    stride_partial_p, stride_partial_m,  # elements between rows, columns of dw_partial
    offset,  # added to w
    ACCUMULATE: tl.constexpr,  # add to dw_partial instead of overwriting it
    ROWS: tl.constexpr,  # rows per tile
    BLOCK_M: tl.constexpr,  # padded row length (>= M)
):  # fmt: skip
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_M)
    col_ok = cols < m
    w = _weight(w_ptr, cols, col_ok, offset)
    dw_sum = tl.zeros([ROWS, BLOCK_M], dtype=tl.float32)
    n_tiles = tl.cdiv(rows, ROWS)
    tile = pid
    while tile < n_tiles:
        r = tile * ROWS + tl.arange(0, ROWS)
        row_ok = r < rows
        mask = row_ok[:, None] & col_ok[None, :]
        r64 = r.to(tl.int64)
        x = load_tile(x_ptr, r64[:, None], cols[None, :], stride_x, mask)
        dy = load_tile(dy_ptr, r64[:, None], cols[None, :], stride_dy, mask)
        rstd = tl.load(rstd_ptr + r64 * stride_rstd, mask=row_ok, other=0.0)
        x_hat = x * rstd[:, None]
        g = dy * w[None, :]
        proj = tl.sum(g * x_hat, axis=1) / m
        dx = (g - x_hat * proj[:, None]) * rstd[:, None]
        store_tile(dx_ptr, r64[:, None], cols[None, :], stride_dx, mask, dx)
        if dw_partial_ptr is not None:
            dw_sum += dy * x_hat
        tile += tl.num_programs(0)
    if dw_partial_ptr is not None:
        dw = tl.sum(dw_sum, axis=0)
        ptrs = dw_partial_ptr + pid.to(tl.int64) * stride_partial_p + cols * stride_partial_m
        if ACCUMULATE:
            dw += tl.load(ptrs, mask=col_ok, other=0.0)
        tl.store(ptrs, dw, mask=col_ok)


@triton.jit
def _backward_streaming(
    dy_ptr, x_ptr,  # (rows, M) output gradient, forward input
    w_ptr,  # (M,) weight, or None (no weight)
    rstd_ptr,  # (rows,) float32 checkpoint
    dx_ptr,  # (rows, M) input gradient, overwritten (may alias dy)
    dw_partial_ptr,  # (P, M) float32 partial sums of dy * x_hat, one row per program, or None
    rows, m,  # number of rows, row length M
    stride_dy, stride_x, stride_dx, stride_rstd,  # elements between rows of dy, x, dx; of rstd
    stride_partial_p, stride_partial_m,  # elements between rows, columns of dw_partial
    offset,  # added to w
    ACCUMULATE: tl.constexpr,  # add to dw_partial instead of overwriting it
    ROWS: tl.constexpr,  # rows per tile
    BLOCK_M: tl.constexpr,  # chunk length
    N_CHUNKS: tl.constexpr,  # chunks per row, cdiv(M, BLOCK_M)
):  # fmt: skip
    pid = tl.program_id(0)
    partial_row = pid.to(tl.int64) * stride_partial_p
    n_tiles = tl.cdiv(rows, ROWS)
    tile = pid
    while tile < n_tiles:
        r = tile * ROWS + tl.arange(0, ROWS)
        row_ok = r < rows
        r64 = r.to(tl.int64)
        x_rows = x_ptr + r64[:, None] * stride_x
        dy_rows = dy_ptr + r64[:, None] * stride_dy
        dx_rows = dx_ptr + r64[:, None] * stride_dx
        rstd = tl.load(rstd_ptr + r64 * stride_rstd, mask=row_ok, other=0.0)
        gx = tl.zeros([ROWS, BLOCK_M], dtype=tl.float32)
        for k in range(N_CHUNKS):
            cols, col_ok, mask = row_chunk(k, m, row_ok, BLOCK_M)
            x = load_chunk(x_rows, cols, mask, "evict_last")
            dy = load_chunk(dy_rows, cols, mask, "evict_last")
            w = _weight_rows(w_ptr, cols, col_ok, offset, ROWS)
            gx += dy * w * x
        proj = tl.sum(gx, axis=1) * rstd / m
        for k in range(N_CHUNKS):
            cols, col_ok, mask = row_chunk(k, m, row_ok, BLOCK_M)
            x_hat = load_chunk(x_rows, cols, mask, "evict_first") * rstd[:, None]
            dy = load_chunk(dy_rows, cols, mask, "evict_first")
            w = _weight_rows(w_ptr, cols, col_ok, offset, ROWS)
            dx = (dy * w - x_hat * proj[:, None]) * rstd[:, None]
            tl.store(dx_rows + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
            if dw_partial_ptr is not None:
                ptrs = dw_partial_ptr + partial_row + cols * stride_partial_m
                if ACCUMULATE:
                    earlier = col_ok
                else:
                    # Columns the partial row already holds: all of them after this program's
                    # first tile. Written as one comparison because the Triton interpreter
                    # splats a scalar comparison as int32, which ``mask`` refuses from Triton 3.9.
                    earlier = cols < tl.where(tile > pid, m, 0)
                dw = tl.sum(dy * x_hat, axis=0) + tl.load(ptrs, mask=earlier, other=0.0)
                tl.store(ptrs, dw, mask=col_ok)
        tile += tl.num_programs(0)
    if dw_partial_ptr is not None and not ACCUMULATE and pid >= n_tiles:
        for k in range(N_CHUNKS):
            cols = k * BLOCK_M + tl.arange(0, BLOCK_M)
            zeros = tl.zeros([BLOCK_M], dtype=tl.float32)
            tl.store(dw_partial_ptr + partial_row + cols * stride_partial_m, zeros, mask=cols < m)


def backward(dy, x, w, rstd, dx, dw_partial, *, offset, accumulate) -> None:
    """``dx`` and, unless ``dw_partial`` is None, per-program ``dw`` partial sums.

    One program per row of the float32 ``dw_partial``; ``accumulate=False``
    overwrites all P rows (programs without rows write zeros). Parameters: the
    ``rms_norm`` Signature's (:func:`xpkernels.backends.protocol.module_functions`).
    """
    rows, m = x.shape
    if m == 0:
        return  # no element of dx and no column of dw_partial to write
    config = row_config(m, x.element_size(), "backward")
    if dw_partial is None:
        if rows == 0:
            return
        programs, partial_strides = config.tiles(rows), (0, 0)
    else:
        programs, partial_strides = dw_partial.shape[0], dw_partial.stride()
    tensors = (dy, x, w, rstd, dx, dw_partial)
    args = (*tensors, rows, m, *row_strides(dy, x, dx, rstd), *partial_strides, offset)
    kernels = (_backward_fused, _backward_streaming)
    launch_rows(*kernels, config, x, *args, programs=programs, ACCUMULATE=accumulate)


def partials(rows: int, m: int, like) -> int:
    """Rows ``P`` of ``dw_partial`` (:func:`xpkernels.backends.protocol.partials`).

    One per program: one wave of the SM count times the programs an SM holds
    on CUDA (capped by the row tiles), a few on CPU.
    """
    return partial_programs(rows, m, like, BACKWARD_REGISTERS)
