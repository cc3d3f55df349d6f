r"""LayerNorm in Triton: fused one-read kernels for rows held in registers, streaming ones beyond.

Per row, with :math:`\hat x = (x - \mathrm{mean})\,\mathrm{rstd}` and
:math:`g = dy\,w` (:math:`g = dy` without a weight):

.. math::

    \mathrm{rstd} = \big(\tfrac{1}{M}\textstyle\sum_j (x_j - \mathrm{mean})^2
        + \varepsilon\big)^{-1/2},\quad
    y = \hat x\,w + b,\quad
    dx = \mathrm{rstd}\,\big(g - \overline{g} - \hat x\,\overline{g\hat x}\big),\quad
    dw = \textstyle\sum_{\text{rows}} dy\,\hat x,\quad
    db = \textstyle\sum_{\text{rows}} dy

(overlines are row means). The variance is computed from centred values:
the fused kernels hold the row, the streaming ones merge per-chunk means and
sums of squares (Chan et al.), so large row means do not cancel. ``dw`` and
``db`` are summed per program into row ``program_id`` of their partial
buffers and reduced by :func:`reduce_partials`.
"""

from __future__ import annotations

import dataclasses

import triton
import triton.language as tl

from ._common import (
    RowConfig,
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
BACKWARD_REGISTERS = {False: 64, True: 126}

#: Warps of the streaming backward on 16-bit rows. At the 16 its chunk would get, it compiled
#: (sm_90, 4096 x 65536 bfloat16) to 100 registers a thread, one program per SM; at 8, to 126
#: registers with no spills, two programs per SM (1344 SASS instructions a program against
#: 1056 for twice the threads), so the persistent grid is one wave of two programs per SM.
#: Float32 rows keep 16 warps: at 8 they compiled to 162 registers, still one program per SM.
STREAMING_BACKWARD_WARPS = 8


def _backward_config(m: int, itemsize: int) -> RowConfig:
    """The backward's launch configuration: ``row_config``'s, the streaming kernel's warps
    on 16-bit rows capped at :data:`STREAMING_BACKWARD_WARPS`."""
    config = row_config(m, itemsize, "backward")
    if config.streaming and itemsize == 2:
        return dataclasses.replace(
            config, num_warps=min(config.num_warps, STREAMING_BACKWARD_WARPS)
        )
    return config


@triton.jit
def _forward_fused(
    y_ptr, x_ptr,  # (rows, M) output and input
    w_ptr, b_ptr,  # (M,) weight and bias, or None (no scale, no shift)
    mean_ptr, rstd_ptr,  # (rows,) float32 checkpoints, or None
    rows, m,  # number of rows, row length M
    stride_y, stride_x, stride_mean, stride_rstd,  # elements between rows of y, x; mean, rstd
    eps,  # added to the variance
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
    mean = tl.sum(x, axis=1) / m
    centred = tl.where(mask, x - mean[:, None], 0.0)
    rstd = tl.rsqrt(tl.sum(centred * centred, axis=1) / m + eps)
    y = centred * rstd[:, None]
    if w_ptr is not None:
        y *= tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if b_ptr is not None:
        y += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    store_tile(y_ptr, r64[:, None], cols[None, :], stride_y, mask, y)
    if mean_ptr is not None:
        tl.store(mean_ptr + r64 * stride_mean, mean, mask=row_ok)
    if rstd_ptr is not None:
        tl.store(rstd_ptr + r64 * stride_rstd, rstd, mask=row_ok)


@triton.jit
def _forward_streaming(
    y_ptr, x_ptr,  # (rows, M) output and input
    w_ptr, b_ptr,  # (M,) weight and bias, or None (no scale, no shift)
    mean_ptr, rstd_ptr,  # (rows,) float32 checkpoints, or None
    rows, m,  # number of rows, row length M
    stride_y, stride_x, stride_mean, stride_rstd,  # elements between rows of y, x; mean, rstd
    eps,  # added to the variance
    ROWS: tl.constexpr,  # rows per tile
    BLOCK_M: tl.constexpr,  # chunk length
    N_CHUNKS: tl.constexpr,  # chunks per row, cdiv(M, BLOCK_M)
):  # fmt: skip
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = r < rows
    r64 = r.to(tl.int64)
    x_rows = x_ptr + r64[:, None] * stride_x
    y_rows = y_ptr + r64[:, None] * stride_y
    mean = tl.zeros([ROWS], dtype=tl.float32)
    sum_sq = tl.zeros([ROWS], dtype=tl.float32)
    for k in range(N_CHUNKS):
        start = k * BLOCK_M
        cols, _, mask = row_chunk(k, m, row_ok, BLOCK_M)
        x = load_chunk(x_rows, cols, mask, "evict_last")
        count = tl.minimum(m - start, BLOCK_M)
        chunk_mean = tl.sum(x, axis=1) / count
        centred = tl.where(mask, x - chunk_mean[:, None], 0.0)
        delta = chunk_mean - mean
        share = count / (start + count)
        mean += delta * share
        sum_sq += tl.sum(centred * centred, axis=1) + delta * delta * (start * share)
    rstd = tl.rsqrt(sum_sq / m + eps)
    for k in range(N_CHUNKS):
        cols, col_ok, mask = row_chunk(k, m, row_ok, BLOCK_M)
        y = (load_chunk(x_rows, cols, mask, "evict_first") - mean[:, None]) * rstd[:, None]
        if w_ptr is not None:
            y *= tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if b_ptr is not None:
            y += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(y_rows + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    if mean_ptr is not None:
        tl.store(mean_ptr + r64 * stride_mean, mean, mask=row_ok)
    if rstd_ptr is not None:
        tl.store(rstd_ptr + r64 * stride_rstd, rstd, mask=row_ok)


def forward(y, x, w, b, mean, rstd, *, eps) -> None:
    """``y = (x - mean) * rstd * w + b``; writes ``mean``/``rstd`` unless None. Parameters:
    the ``layer_norm`` Signature's (:func:`xpkernels.backends.protocol.module_functions`)."""
    rows, m = x.shape
    if rows == 0:
        return
    if m == 0:
        fill_empty_row_checkpoints(eps, rstd, mean)
        return
    config = row_config(m, x.element_size(), "forward")
    args = (y, x, w, b, mean, rstd, rows, m, *row_strides(y, x, mean, rstd), eps)
    launch_rows(_forward_fused, _forward_streaming, config, x, *args)


@triton.jit
def _backward_fused(
    dy_ptr, x_ptr,  # (rows, M) output gradient, forward input
    w_ptr,  # (M,) weight, or None (no scale)
    mean_ptr, rstd_ptr,  # (rows,) float32 checkpoints
    dx_ptr,  # (rows, M) input gradient, overwritten (may alias dy)
    dw_partial_ptr,  # (P, M) float32 partial sums of dy * x_hat, one row per program, or None
    db_partial_ptr,  # (P, M) float32 partial sums of dy, one row per program, or None
    rows, m,  # number of rows, row length M
    stride_dy, stride_x, stride_dx,  # elements between rows of dy, x, dx
    stride_mean, stride_rstd,  # elements between entries of mean, rstd
    stride_dw_p, stride_dw_m,  # elements between rows, columns of dw_partial
    stride_db_p, stride_db_m,  # elements between rows, columns of db_partial
    ACCUMULATE: tl.constexpr,  # add to the partial sums instead of overwriting them
    ROWS: tl.constexpr,  # rows per tile
    BLOCK_M: tl.constexpr,  # padded row length (>= M)
):  # fmt: skip
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_M)
    col_ok = cols < m
    if w_ptr is not None:
        w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    dw_sum = tl.zeros([ROWS, BLOCK_M], dtype=tl.float32)
    db_sum = tl.zeros([ROWS, BLOCK_M], dtype=tl.float32)
    n_tiles = tl.cdiv(rows, ROWS)
    tile = pid
    while tile < n_tiles:
        r = tile * ROWS + tl.arange(0, ROWS)
        row_ok = r < rows
        mask = row_ok[:, None] & col_ok[None, :]
        r64 = r.to(tl.int64)
        x = load_tile(x_ptr, r64[:, None], cols[None, :], stride_x, mask)
        dy = load_tile(dy_ptr, r64[:, None], cols[None, :], stride_dy, mask)
        mean = tl.load(mean_ptr + r64 * stride_mean, mask=row_ok, other=0.0)
        rstd = tl.load(rstd_ptr + r64 * stride_rstd, mask=row_ok, other=0.0)
        x_hat = (x - mean[:, None]) * rstd[:, None]
        if w_ptr is not None:
            g = dy * w[None, :]
        else:
            g = dy
        g_mean = tl.sum(g, axis=1) / m
        proj = tl.sum(g * x_hat, axis=1) / m
        dx = (g - g_mean[:, None] - x_hat * proj[:, None]) * rstd[:, None]
        store_tile(dx_ptr, r64[:, None], cols[None, :], stride_dx, mask, dx)
        if dw_partial_ptr is not None:
            dw_sum += dy * x_hat
        if db_partial_ptr is not None:
            db_sum += dy
        tile += tl.num_programs(0)
    pid64 = pid.to(tl.int64)
    if dw_partial_ptr is not None:
        dw = tl.sum(dw_sum, axis=0)
        dw_ptrs = dw_partial_ptr + pid64 * stride_dw_p + cols * stride_dw_m
        if ACCUMULATE:
            dw += tl.load(dw_ptrs, mask=col_ok, other=0.0)
        tl.store(dw_ptrs, dw, mask=col_ok)
    if db_partial_ptr is not None:
        db = tl.sum(db_sum, axis=0)
        db_ptrs = db_partial_ptr + pid64 * stride_db_p + cols * stride_db_m
        if ACCUMULATE:
            db += tl.load(db_ptrs, mask=col_ok, other=0.0)
        tl.store(db_ptrs, db, mask=col_ok)


@triton.jit
def _backward_streaming(
    dy_ptr, x_ptr,  # (rows, M) output gradient, forward input
    w_ptr,  # (M,) weight, or None (no scale)
    mean_ptr, rstd_ptr,  # (rows,) float32 checkpoints
    dx_ptr,  # (rows, M) input gradient, overwritten (may alias dy)
    dw_partial_ptr,  # (P, M) float32 partial sums of dy * x_hat, one row per program, or None
    db_partial_ptr,  # (P, M) float32 partial sums of dy, one row per program, or None
    rows, m,  # number of rows, row length M
    stride_dy, stride_x, stride_dx,  # elements between rows of dy, x, dx
    stride_mean, stride_rstd,  # elements between entries of mean, rstd
    stride_dw_p, stride_dw_m,  # elements between rows, columns of dw_partial
    stride_db_p, stride_db_m,  # elements between rows, columns of db_partial
    ACCUMULATE: tl.constexpr,  # add to the partial sums instead of overwriting them
    ROWS: tl.constexpr,  # rows per tile
    BLOCK_M: tl.constexpr,  # chunk length
    N_CHUNKS: tl.constexpr,  # chunks per row, cdiv(M, BLOCK_M)
):  # fmt: skip
    pid = tl.program_id(0)
    pid64 = pid.to(tl.int64)
    n_tiles = tl.cdiv(rows, ROWS)
    tile = pid
    while tile < n_tiles:
        r = tile * ROWS + tl.arange(0, ROWS)
        row_ok = r < rows
        r64 = r.to(tl.int64)
        x_rows = x_ptr + r64[:, None] * stride_x
        dy_rows = dy_ptr + r64[:, None] * stride_dy
        dx_rows = dx_ptr + r64[:, None] * stride_dx
        mean = tl.load(mean_ptr + r64 * stride_mean, mask=row_ok, other=0.0)
        rstd = tl.load(rstd_ptr + r64 * stride_rstd, mask=row_ok, other=0.0)
        g_sum = tl.zeros([ROWS, BLOCK_M], dtype=tl.float32)
        gx_sum = tl.zeros([ROWS, BLOCK_M], dtype=tl.float32)
        for k in range(N_CHUNKS):
            cols, col_ok, mask = row_chunk(k, m, row_ok, BLOCK_M)
            # Not load_chunk: converting x at its load compiled to 127 registers (> BACKWARD_REGISTERS).
            x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0, eviction_policy="evict_last")
            g = tl.load(dy_rows + cols[None, :], mask=mask, other=0.0, eviction_policy="evict_last")
            g = g.to(tl.float32)
            if w_ptr is not None:
                g *= load_row_vector(w_ptr, cols, col_ok, ROWS)
            g_sum += g
            gx_sum += g * tl.where(mask, x.to(tl.float32) - mean[:, None], 0.0)
        g_mean = tl.sum(g_sum, axis=1) / m
        proj = tl.sum(gx_sum, axis=1) * rstd / m
        for k in range(N_CHUNKS):
            cols, col_ok, mask = row_chunk(k, m, row_ok, BLOCK_M)
            x = load_chunk(x_rows, cols, mask, "evict_first")
            dy = load_chunk(dy_rows, cols, mask, "evict_first")
            x_hat = (x - mean[:, None]) * rstd[:, None]
            if w_ptr is not None:
                g = dy * load_row_vector(w_ptr, cols, col_ok, ROWS)
            else:
                g = dy
            dx = (g - g_mean[:, None] - x_hat * proj[:, None]) * rstd[:, None]
            tl.store(dx_rows + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
            if ACCUMULATE:
                earlier = col_ok
            else:
                # Columns the partial row already holds: all of them after this program's
                # first tile. Written as one comparison because the Triton interpreter
                # splats a scalar comparison as int32, which ``mask`` refuses from Triton 3.9.
                earlier = cols < tl.where(tile > pid, m, 0)
            if dw_partial_ptr is not None:
                dw_ptrs = dw_partial_ptr + pid64 * stride_dw_p + cols * stride_dw_m
                dw = tl.sum(dy * x_hat, axis=0) + tl.load(dw_ptrs, mask=earlier, other=0.0)
                tl.store(dw_ptrs, dw, mask=col_ok)
            if db_partial_ptr is not None:
                db_ptrs = db_partial_ptr + pid64 * stride_db_p + cols * stride_db_m
                db = tl.sum(dy, axis=0) + tl.load(db_ptrs, mask=earlier, other=0.0)
                tl.store(db_ptrs, db, mask=col_ok)
        tile += tl.num_programs(0)
    if not ACCUMULATE and pid >= n_tiles:
        for k in range(N_CHUNKS):
            cols = k * BLOCK_M + tl.arange(0, BLOCK_M)
            col_ok = cols < m
            zeros = tl.zeros([BLOCK_M], dtype=tl.float32)
            if dw_partial_ptr is not None:
                dw_ptrs = dw_partial_ptr + pid64 * stride_dw_p + cols * stride_dw_m
                tl.store(dw_ptrs, zeros, mask=col_ok)
            if db_partial_ptr is not None:
                db_ptrs = db_partial_ptr + pid64 * stride_db_p + cols * stride_db_m
                tl.store(db_ptrs, zeros, mask=col_ok)


def backward(dy, x, w, mean, rstd, dx, dw_partial, db_partial, *, accumulate) -> None:
    """``dx`` and per-program partial sums of ``dw`` and ``db`` (each unless None).

    One program per row of the float32 partial sums; ``accumulate=False``
    overwrites all P rows (programs without rows write zeros). Parameters: the
    ``layer_norm`` Signature's (:func:`xpkernels.backends.protocol.module_functions`).
    """
    rows, m = x.shape
    if m == 0:
        return  # no element of dx and no column of dw_partial or db_partial to write
    config = _backward_config(m, x.element_size())
    partial = dw_partial if dw_partial is not None else db_partial
    if partial is None:
        if rows == 0:
            return
        programs = config.tiles(rows)
    else:
        programs = partial.shape[0]
    dw_strides = (0, 0) if dw_partial is None else dw_partial.stride()
    db_strides = (0, 0) if db_partial is None else db_partial.stride()
    tensors = (dy, x, w, mean, rstd, dx, dw_partial, db_partial)
    strides = (*row_strides(dy, x, dx, mean, rstd), *dw_strides, *db_strides)
    args = (*tensors, rows, m, *strides)
    kernels = (_backward_fused, _backward_streaming)
    launch_rows(*kernels, config, x, *args, programs=programs, ACCUMULATE=accumulate)


def partials(rows: int, m: int, like) -> int:
    """Rows ``P`` of ``dw_partial``/``db_partial`` (:func:`xpkernels.backends.protocol.partials`).

    One per program: one wave of the SM count times the programs an SM holds
    on CUDA (capped by the row tiles), a few on CPU.
    """
    config = _backward_config(m, like.element_size())
    return partial_programs(rows, m, like, BACKWARD_REGISTERS, config)
