"""RMSNorm on the Array API: row blocks within the block budget, float32/float64 accumulation."""

from __future__ import annotations

import array_api_compat

from ._blocks import (
    ColumnSums,
    acc_dtype,
    block_rows,
    for_each_block,
    path_arrays,
    path_namespace,
    reduce_partials,
    tiled,
    to,
    workers,
)

__all__ = ["backward", "forward", "partials", "reduce_partials"]


def forward(y, x, w, rstd, *, eps, offset) -> None:
    """``y = x * rstd * (w + offset)`` in row blocks, PyTorch CPU tensors through zero-copy NumPy
    views (:func:`._blocks.numpy_views`) as every row kernel here. Parameters: the ``rms_norm``
    Signature's (:func:`xpkernels.backends.protocol.module_functions`)."""
    y, x, w, rstd = path_arrays(y, x, w, rstd)
    xp = array_api_compat.array_namespace(y, x)
    acc = acc_dtype(xp, x.dtype)
    rows, m = x.shape
    m_div = max(m, 1)  # rows of length 0: every sum is 0
    w_rows = None if w is None else tiled(xp, to(xp, w, acc) + offset, rows, m)

    def block(worker, r0, r1):
        xb = to(xp, x[r0:r1, :], acc)
        rstd_b = 1.0 / xp.sqrt(xp.vecdot(xb, xb) / m_div + eps)
        yb = xb * rstd_b[:, None]
        if w_rows is not None:
            yb *= w_rows[: r1 - r0, :]
        y[r0:r1, :] = to(xp, yb, y.dtype)
        if rstd is not None:
            rstd[r0:r1] = to(xp, rstd_b, rstd.dtype)

    for_each_block(xp, block, rows, m, workers(xp, rows, m))


def backward(dy, x, w, rstd, dx, dw_partial, *, offset, accumulate) -> None:
    """``dx`` and, unless ``dw_partial`` is None, ``dw`` partial sums.

    With ``g = dy * rstd * (w + offset)`` (``rstd`` folded in once, so one
    row-broadcast product serves both ``dx`` and ``dw``), per row:
    ``dx = g - x * rstd**2 * sum(g * x) / M``. Worker ``k`` sums its blocks'
    ``sum(dy * rstd * x, axis=0)`` into ``dw_partial[k]``, in chunks and
    pairwise (:class:`._blocks.ColumnSums`); ``accumulate=False`` zeroes every
    row first (``accumulate=True``: later row groups). Parameters: the
    ``rms_norm`` Signature's (:func:`xpkernels.backends.protocol.module_functions`).
    """
    dy, x, w, rstd, dx, dw_partial = path_arrays(dy, x, w, rstd, dx, dw_partial)
    xp = array_api_compat.array_namespace(dy, x)
    acc = acc_dtype(xp, x.dtype)
    rows, m = x.shape
    m_div = max(m, 1)  # rows of length 0: every sum is 0
    w_rows = None if w is None else tiled(xp, to(xp, w, acc) + offset, rows, m)
    n_workers = workers(xp, rows, m)
    if dw_partial is not None:
        n_workers = min(n_workers, dw_partial.shape[0])
    dw_sums = ColumnSums(xp, n_workers, acc, x, block_rows(rows, m))

    def block(worker, r0, r1):
        rstd_b = to(xp, rstd[r0:r1], acc)[:, None]
        xb = to(xp, x[r0:r1, :], acc)
        g = to(xp, dy[r0:r1, :], acc) * rstd_b
        if dw_partial is not None:
            dw_sums.add_dot(worker, g, xb)
        if w_rows is not None:
            g *= w_rows[: r1 - r0, :]
        coef = (rstd_b * rstd_b) * (xp.vecdot(g, xb) / m_div)[:, None]
        g -= xb * coef
        dx[r0:r1, :] = to(xp, g, dx.dtype)

    for_each_block(xp, block, rows, m, n_workers)
    if dw_partial is not None:
        dw_sums.write(dw_partial, accumulate)


def partials(rows: int, m: int, like) -> int:
    """Rows of ``dw_partial`` this backend uses: one running sum per worker thread."""
    return workers(path_namespace(like), rows, m)
