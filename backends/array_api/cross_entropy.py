r"""Cross-entropy rows on the Array API.

Row :math:`r` with target :math:`t`: :math:`z = c\tanh(x/c)` (softcap
:math:`c`) or :math:`z = x`, :math:`\mathrm{lse} = m + \log\sum_j e^{z_j - m}`
with :math:`m` the row's max (0 when the max is not finite, so a row of
:math:`-\infty` gives :math:`\mathrm{lse} = -\infty`, not NaN), and

.. math::

    \ell = (1 - \varepsilon)(\mathrm{lse} - z_t) + \varepsilon(\mathrm{lse} - \bar z)
           + \lambda\,\mathrm{lse}^2,
    \qquad
    \frac{\partial \ell}{\partial x_j} = \bigl(p_j(1 + 2\lambda\,\mathrm{lse})
    - (1 - \varepsilon)[j = t] - \varepsilon / V\bigr)\bigl(1 - (z_j/c)^2\bigr),

the smoothing and z-loss terms only when their weights are positive (a
:math:`-\infty` logit makes :math:`\bar z = -\infty`). Ignored rows lose 0
and get zeros; a target outside ``[0, V)`` gives its row NaN. Computed in
float32 (float64 for float64 logits) over blocks of rows of at most
:data:`._blocks.ROW_BLOCK_ELEMENTS` elements; each block reads its logits
before it writes its gradient, so ``dlogits`` may be ``logits``.

On NumPy (and PyTorch CPU tensors, through zero-copy views) the blocks are
shared among worker threads and every elementwise step writes into the
worker's reused buffers or straight into the gradient's rows (``out=``):
the forward reads a block twice (its max, then the exponentials summed by a
product with a vector of ones), the backward writes each element once and
reads it back once per step, and the target's column is corrected by index.
"""

from __future__ import annotations

import math

import array_api_compat

from ._blocks import BlockBuffers, acc_dtype, for_each_block, ones, path_arrays, to, workers

__all__ = ["backward", "forward"]


def _op(xp, name: str, *args, out=None):
    """The Array API elementwise function ``name`` of ``args``, into ``out`` when given (a
    NumPy buffer: the ufunc writes there), else into a new array."""
    if out is None:
        return getattr(xp, name)(*args)
    import numpy

    return getattr(numpy, name)(*args, out=out)


def _capped(xp, x, softcap, z_out, slope_out, slope: bool):
    """``(z, dz/dx)`` of a block (``dz/dx`` None without a softcap or ``slope``), into the
    buffers when given; ``z_out`` may be ``x``'s own memory (read first)."""
    if softcap is None:
        return x, None
    t = _op(xp, "tanh", _op(xp, "divide", x, softcap, out=slope_out), out=slope_out)
    z = _op(xp, "multiply", t, softcap, out=z_out)
    if not slope:
        return z, None
    return z, _op(xp, "subtract", 1.0, _op(xp, "multiply", t, t, out=slope_out), out=slope_out)


def _targets(xp, targets, r0: int, r1: int, vocab: int, ignore_index: int):
    """``(kept, valid, safe)`` of a block: rows not ignored, rows whose target lies in ``[0,
    V)``, and the targets with every other row's set to 0 (int64)."""
    t = xp.astype(targets[r0:r1], xp.int64)
    valid = xp.logical_and(t >= 0, t < vocab)
    return t != ignore_index, valid, xp.where(valid, t, xp.zeros_like(t))


def forward(loss, lse, logits, targets, *, ignore_index, label_smoothing, softcap, z_loss) -> None:
    """Each row's loss and logsumexp (see the module docstring).
    The contract of :class:`xpkernels.backends.protocol.CrossEntropyModule`."""
    loss, lse, logits, targets = path_arrays(loss, lse, logits, targets)
    xp = array_api_compat.array_namespace(loss, lse, logits, targets)
    acc = acc_dtype(xp, logits.dtype)
    rows, vocab = logits.shape
    eps = label_smoothing
    n_workers = workers(xp, rows, vocab)
    buffers = BlockBuffers(xp, n_workers, 2, rows, vocab, acc)
    ones_v = ones(xp, vocab, acc, logits)

    def block(worker, r0, r1):
        e_buf, z_buf = (b if b is None else b[: r1 - r0] for b in buffers.get(worker))
        z, _ = _capped(xp, to(xp, logits[r0:r1, :], acc), softcap, z_buf, e_buf, False)
        top = xp.max(z, axis=1)
        shift = xp.where(xp.isfinite(top), top, xp.zeros_like(top))
        e = _op(xp, "exp", _op(xp, "subtract", z, shift[:, None], out=e_buf), out=e_buf)
        row_lse = xp.log(e @ ones_v) + shift
        # a +inf logit makes its row NaN, as in PyTorch and the device kernels (NaN ones do)
        row_lse = xp.where(top == math.inf, xp.full_like(row_lse, math.nan), row_lse)
        kept, valid, safe = _targets(xp, targets, r0, r1, vocab, ignore_index)
        picked = xp.take_along_axis(z, safe[:, None], axis=1)[:, 0]
        row = (1 - eps) * (row_lse - picked)
        if eps > 0:
            row = row + eps * (row_lse - (z @ ones_v) / vocab)
        if z_loss > 0:
            row = row + z_loss * row_lse * row_lse
        row = xp.where(kept, xp.where(valid, row, xp.full_like(row, math.nan)), 0)
        loss[r0:r1] = to(xp, row, loss.dtype)
        lse[r0:r1] = to(xp, row_lse, lse.dtype)

    for_each_block(xp, block, rows, vocab, n_workers)


def backward(
    dlogits, logits, targets, lse, grad, *, ignore_index, label_smoothing, softcap, z_loss
) -> None:
    """``dlogits`` = ``grad[r]`` times each row's loss gradient (see the module docstring).
    The contract of :class:`xpkernels.backends.protocol.CrossEntropyModule`."""
    dlogits, logits, targets, lse, grad = path_arrays(dlogits, logits, targets, lse, grad)
    xp = array_api_compat.array_namespace(dlogits, logits, targets, lse, grad)
    numpy = array_api_compat.is_numpy_namespace(xp)
    acc = acc_dtype(xp, logits.dtype)
    rows, vocab = logits.shape
    eps = label_smoothing
    n_workers = workers(xp, rows, vocab)
    buffers = BlockBuffers(xp, n_workers, 2, rows, vocab, acc)
    columns = xp.arange(vocab, dtype=xp.int64, device=array_api_compat.device(logits))
    direct = numpy and dlogits.dtype == acc  # the gradient's rows are the block's buffer

    def block(worker, r0, r1):
        g_buf, slope_buf = (b if b is None else b[: r1 - r0] for b in buffers.get(worker))
        if direct:
            g_buf = dlogits[r0:r1, :]
        z, slope = _capped(xp, to(xp, logits[r0:r1, :], acc), softcap, g_buf, slope_buf, True)
        row_lse = to(xp, lse[r0:r1], acc)
        kept, valid, safe = _targets(xp, targets, r0, r1, vocab, ignore_index)
        weight = to(xp, grad[r0:r1], acc)
        weight = xp.where(valid, weight, xp.full_like(weight, math.nan))
        weight = xp.where(kept, weight, xp.zeros_like(weight))
        scale = weight * (1 + 2 * z_loss * row_lse) if z_loss > 0 else weight
        g = _op(xp, "exp", _op(xp, "subtract", z, row_lse[:, None], out=g_buf), out=g_buf)
        g = _op(xp, "multiply", g, scale[:, None], out=g_buf)
        if eps > 0:
            g = _op(xp, "subtract", g, (weight * (eps / vocab))[:, None], out=g_buf)
        hit = weight * (1 - eps)
        if numpy:
            at = xp.nonzero(xp.logical_and(kept, valid))[0]
            g[at, safe[at]] -= hit[at]
        else:
            g = xp.where(columns[None, :] == safe[:, None], g - hit[:, None], g)
        if slope is not None:
            g = _op(xp, "multiply", g, slope, out=g_buf)
        if numpy:
            g[~kept, :] = 0  # exact zeros, whatever the row's logits hold
        else:
            g = xp.where(kept[:, None], g, xp.zeros_like(g))
        if not direct:
            dlogits[r0:r1, :] = to(xp, g, dlogits.dtype)

    for_each_block(xp, block, rows, vocab, n_workers)
