"""RMSNorm on the Array API: row blocks within the block budget, float32/float64 accumulation."""

from __future__ import annotations

import array_api_compat

from ._blocks import acc_dtype, reduce_partials, row_blocks, to

__all__ = ["forward", "backward", "partials", "reduce_partials"]


def forward(y, x, w, rstd, *, eps, offset) -> None:
    """``y = x * rstd * (w + offset)`` over 2-D ``(rows, M)`` views; writes ``rstd`` unless None."""
    xp = array_api_compat.array_namespace(y, x, w)
    acc = acc_dtype(xp, x.dtype)
    rows, m = x.shape
    w_eff = to(xp, w, acc) + offset
    for r0, r1 in row_blocks(rows, m):
        xb = to(xp, x[r0:r1, :], acc)
        rstd_b = 1.0 / xp.sqrt(xp.vecdot(xb, xb) / m + eps)
        yb = xb * rstd_b[:, None]
        yb *= w_eff
        y[r0:r1, :] = to(xp, yb, y.dtype)
        if rstd is not None:
            rstd[r0:r1] = to(xp, rstd_b, rstd.dtype)


def backward(dy, x, w, rstd, dx, dw_partial, *, offset, accumulate) -> None:
    """``dx`` (overwritten) and, unless ``dw_partial`` is None, ``dw`` partial sums into row 0.

    ``accumulate=False`` overwrites ``dw_partial``; True adds to it (later row groups).
    """
    xp = array_api_compat.array_namespace(dy, x, w)
    acc = acc_dtype(xp, x.dtype)
    rows, m = x.shape
    w_eff = to(xp, w, acc) + offset
    if dw_partial is not None and not accumulate:
        dw_partial[...] = 0.0
    for r0, r1 in row_blocks(rows, m):
        rstd_b = to(xp, rstd[r0:r1], acc)[:, None]
        x_hat = to(xp, x[r0:r1, :], acc) * rstd_b
        dy_b = to(xp, dy[r0:r1, :], acc)
        if dw_partial is not None:
            dw_partial[0, :] += to(xp, xp.sum(dy_b * x_hat, axis=0), xp.float32)
        g = dy_b * w_eff
        c = xp.vecdot(g, x_hat) / m
        x_hat *= c[:, None]
        g -= x_hat
        g *= rstd_b
        dx[r0:r1, :] = to(xp, g, dx.dtype)


def partials(rows: int, m: int, like) -> int:
    """Rows of ``dw_partial`` this backend uses: one running sum."""
    return 1
