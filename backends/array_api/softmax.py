"""Softmax over the last axis on the Array API: row blocks within the block budget."""

from __future__ import annotations

import array_api_compat

from ._blocks import acc_dtype, for_each_block, ones, path_arrays, to, workers

__all__ = ["backward", "forward"]


def forward(y, x) -> None:
    """``y = exp(x - max(x)) / sum(exp(x - max(x)))`` per row, in row blocks, PyTorch CPU tensors
    through zero-copy NumPy views (:func:`._blocks.numpy_views`). Parameters: the ``softmax``
    Signature's (:func:`xpkernels.backends.protocol.module_functions`)."""
    y, x = path_arrays(y, x)
    xp = array_api_compat.array_namespace(y, x)
    acc = acc_dtype(xp, x.dtype)
    rows, m = x.shape
    if m == 0:
        return  # nothing to write; a max over an empty row is undefined
    ones_m = ones(xp, m, acc, x)

    def block(worker, r0, r1):
        xb = to(xp, x[r0:r1, :], acc)
        e = xp.exp(xb - xp.max(xb, axis=1)[:, None])
        e *= (1.0 / (e @ ones_m))[:, None]
        y[r0:r1, :] = to(xp, e, y.dtype)

    for_each_block(xp, block, rows, m, workers(xp, rows, m))


def backward(y, dy, dx) -> None:
    """``dx = y * (dy - sum(y * dy))`` per row, in row blocks. Parameters: the ``softmax``
    Signature's (:func:`xpkernels.backends.protocol.module_functions`)."""
    y, dy, dx = path_arrays(y, dy, dx)
    xp = array_api_compat.array_namespace(y, dy, dx)
    acc = acc_dtype(xp, y.dtype)
    rows, m = y.shape

    def block(worker, r0, r1):
        yb = to(xp, y[r0:r1, :], acc)
        dy_b = to(xp, dy[r0:r1, :], acc)
        g = dy_b - xp.vecdot(yb, dy_b)[:, None]
        g *= yb
        dx[r0:r1, :] = to(xp, g, dx.dtype)

    for_each_block(xp, block, rows, m, workers(xp, rows, m))
