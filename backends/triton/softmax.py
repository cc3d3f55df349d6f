r"""Softmax over the last axis in Triton: fused one-read kernels, streaming kernels for wide rows.

.. math::

    y = \frac{e^{x - \max x}}{\sum_j e^{x_j - \max x}},\qquad
    dx = y\,\big(dy - \textstyle\sum_j y_j\,dy_j\big)

The streaming forward keeps a running maximum and a running sum rescaled as
the maximum grows (online softmax), so it reads a row twice: once to reduce,
once to write. A row of ``-inf`` gives NaN, as PyTorch's softmax does.
Padding rows of a tile repeat the tile's last valid row (and are never
stored) so they compute no ``-inf - -inf``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import (
    launch_rows,
    load_chunk,
    load_tile,
    row_chunk,
    row_config,
    row_strides,
    store_tile,
)

__all__ = ["backward", "forward"]


@triton.jit
def _forward_fused(
    y_ptr, x_ptr,  # (rows, M) output and input
    rows, m,  # number of rows, row length M
    stride_y, stride_x,  # elements between rows of y and of x
    ROWS: tl.constexpr,  # rows per tile
    BLOCK_M: tl.constexpr,  # padded row length (>= M)
):  # fmt: skip
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_M)
    row_ok = r < rows
    col_ok = cols < m
    r64 = tl.minimum(r, rows - 1).to(tl.int64)
    x_ptrs = x_ptr + r64[:, None] * stride_x + cols[None, :]
    x = tl.load(x_ptrs, mask=col_ok[None, :], other=float("-inf"))
    x = x.to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=1)[:, None])
    y = e * (1.0 / tl.sum(e, axis=1))[:, None]
    store_tile(y_ptr, r64[:, None], cols[None, :], stride_y, row_ok[:, None] & col_ok[None, :], y)


@triton.jit
def _forward_streaming(
    y_ptr, x_ptr,  # (rows, M) output and input
    rows, m,  # number of rows, row length M
    stride_y, stride_x,  # elements between rows of y and of x
    ROWS: tl.constexpr,  # rows per tile
    BLOCK_M: tl.constexpr,  # chunk length
    N_CHUNKS: tl.constexpr,  # chunks per row, cdiv(M, BLOCK_M)
):  # fmt: skip
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = r < rows
    r64 = tl.minimum(r, rows - 1).to(tl.int64)
    x_rows = x_ptr + r64[:, None] * stride_x
    y_rows = y_ptr + r64[:, None] * stride_y
    row_max = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros([ROWS], dtype=tl.float32)
    for k in range(N_CHUNKS):
        cols = k * BLOCK_M + tl.arange(0, BLOCK_M)
        x = tl.load(
            x_rows + cols[None, :],
            mask=(cols < m)[None, :],
            other=float("-inf"),
            eviction_policy="evict_last",
        )
        x = x.to(tl.float32)
        new_max = tl.maximum(row_max, tl.max(x, axis=1))
        # Rows still all -inf shift by 0, so exp sees -inf - 0, never -inf - -inf.
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        row_sum = row_sum * tl.exp(row_max - shift) + tl.sum(tl.exp(x - shift[:, None]), axis=1)
        row_max = new_max
    inv_sum = 1.0 / row_sum
    for k in range(N_CHUNKS):
        cols = k * BLOCK_M + tl.arange(0, BLOCK_M)
        col_ok = cols < m
        x = tl.load(
            x_rows + cols[None, :],
            mask=col_ok[None, :],
            other=float("-inf"),
            eviction_policy="evict_first",
        )
        y = tl.exp(x.to(tl.float32) - row_max[:, None]) * inv_sum[:, None]
        mask = row_ok[:, None] & col_ok[None, :]
        tl.store(y_rows + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


def forward(y, x) -> None:
    """``y = softmax(x)`` along the last axis. Parameters: the ``softmax`` Signature's
    (:func:`xpkernels.backends.protocol.module_functions`)."""
    rows, m = x.shape
    if rows == 0 or m == 0:
        return
    config = row_config(m, x.element_size(), "forward")
    launch_rows(_forward_fused, _forward_streaming, config, x, y, x, rows, m, *row_strides(y, x))


@triton.jit
def _backward_fused(
    y_ptr, dy_ptr,  # (rows, M) forward output, output gradient
    dx_ptr,  # (rows, M) input gradient, overwritten (may alias dy)
    rows, m,  # number of rows, row length M
    stride_y, stride_dy, stride_dx,  # elements between rows of y, dy, dx
    ROWS: tl.constexpr,  # rows per tile
    BLOCK_M: tl.constexpr,  # padded row length (>= M)
):  # fmt: skip
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_M)
    mask = (r < rows)[:, None] & (cols < m)[None, :]
    r64 = r.to(tl.int64)
    y = load_tile(y_ptr, r64[:, None], cols[None, :], stride_y, mask)
    dy = load_tile(dy_ptr, r64[:, None], cols[None, :], stride_dy, mask)
    dot = tl.sum(y * dy, axis=1)
    store_tile(dx_ptr, r64[:, None], cols[None, :], stride_dx, mask, y * (dy - dot[:, None]))


@triton.jit
def _backward_streaming(
    y_ptr, dy_ptr,  # (rows, M) forward output, output gradient
    dx_ptr,  # (rows, M) input gradient, overwritten (may alias dy)
    rows, m,  # number of rows, row length M
    stride_y, stride_dy, stride_dx,  # elements between rows of y, dy, dx
    ROWS: tl.constexpr,  # rows per tile
    BLOCK_M: tl.constexpr,  # chunk length
    N_CHUNKS: tl.constexpr,  # chunks per row, cdiv(M, BLOCK_M)
):  # fmt: skip
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = r < rows
    r64 = r.to(tl.int64)
    y_rows = y_ptr + r64[:, None] * stride_y
    dy_rows = dy_ptr + r64[:, None] * stride_dy
    dx_rows = dx_ptr + r64[:, None] * stride_dx
    dot = tl.zeros([ROWS, BLOCK_M], dtype=tl.float32)
    for k in range(N_CHUNKS):
        cols, _, mask = row_chunk(k, m, row_ok, BLOCK_M)
        y = load_chunk(y_rows, cols, mask, "evict_last")
        dot += y * load_chunk(dy_rows, cols, mask, "evict_last")
    row_dot = tl.sum(dot, axis=1)
    for k in range(N_CHUNKS):
        cols, _, mask = row_chunk(k, m, row_ok, BLOCK_M)
        y = load_chunk(y_rows, cols, mask, "evict_first")
        dx = y * (load_chunk(dy_rows, cols, mask, "evict_first") - row_dot[:, None])
        tl.store(dx_rows + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)


def backward(y, dy, dx) -> None:
    """``dx = y * (dy - sum(y * dy))`` along the last axis. Parameters: the ``softmax``
    Signature's (:func:`xpkernels.backends.protocol.module_functions`)."""
    rows, m = y.shape
    if rows == 0 or m == 0:
        return
    config = row_config(m, y.element_size(), "backward")
    args = (y, dy, dx, rows, m, *row_strides(y, dy, dx))
    launch_rows(_backward_fused, _backward_streaming, config, y, *args)
