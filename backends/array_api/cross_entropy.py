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
before it writes its gradient, so ``dlogits`` may be ``logits``. PyTorch CPU
tensors run the NumPy path through zero-copy views.
"""

from __future__ import annotations

import math

import array_api_compat

from ._blocks import acc_dtype, block_rows, numpy_views, to

__all__ = ["backward", "forward"]


def _capped(xp, x, softcap):
    """``(z, dz/dx)`` of a block; ``dz/dx`` is None without a softcap."""
    if softcap is None:
        return x, None
    t = xp.tanh(x / softcap)
    return softcap * t, 1 - t * t


def _targets(xp, targets, r0: int, r1: int, vocab: int):
    """``(kept, valid, safe)`` of a block: rows not ignored, kept rows whose target lies in
    ``[0, V)``, and the targets with every other row's set to 0 (int64)."""
    t = xp.astype(targets[r0:r1], xp.int64)
    valid = xp.logical_and(t >= 0, t < vocab)
    return t, valid, xp.where(valid, t, xp.zeros_like(t))


def _blocks(rows: int, vocab: int):
    step = block_rows(rows, vocab)
    return ((r0, min(rows, r0 + step)) for r0 in range(0, rows, step))


def forward(loss, lse, logits, targets, *, ignore_index, label_smoothing, softcap, z_loss) -> None:
    """Each row's loss and logsumexp (see the module docstring) into ``loss``, ``lse``."""
    views = numpy_views(loss, lse, logits, targets)
    if views is not None:
        loss, lse, logits, targets = views
    xp = array_api_compat.array_namespace(loss, lse, logits, targets)
    acc = acc_dtype(xp, logits.dtype)
    rows, vocab = logits.shape
    eps = label_smoothing
    for r0, r1 in _blocks(rows, vocab):
        z, _ = _capped(xp, to(xp, logits[r0:r1, :], acc), softcap)
        top = xp.max(z, axis=1, keepdims=True)
        top = xp.where(xp.isfinite(top), top, xp.zeros_like(top))
        total = xp.sum(xp.exp(z - top), axis=1)
        row_lse = xp.log(total) + top[:, 0]
        t, valid, safe = _targets(xp, targets, r0, r1, vocab)
        picked = xp.take_along_axis(z, safe[:, None], axis=1)[:, 0]
        row = (1 - eps) * (row_lse - picked)
        if eps > 0:
            row = row + eps * (row_lse - xp.mean(z, axis=1))
        if z_loss > 0:
            row = row + z_loss * row_lse * row_lse
        kept = t != ignore_index
        row = xp.where(kept, xp.where(valid, row, xp.full_like(row, math.nan)), 0)
        loss[r0:r1] = to(xp, row, loss.dtype)
        lse[r0:r1] = to(xp, row_lse, lse.dtype)


def backward(
    dlogits, logits, targets, lse, grad, *, ignore_index, label_smoothing, softcap, z_loss
) -> None:
    """``dlogits`` = ``grad[r]`` times each row's loss gradient, from the forward's ``lse``;
    ``dlogits`` may be ``logits``."""
    views = numpy_views(dlogits, logits, targets, lse, grad)
    if views is not None:
        dlogits, logits, targets, lse, grad = views
    xp = array_api_compat.array_namespace(dlogits, logits, targets, lse, grad)
    acc = acc_dtype(xp, logits.dtype)
    rows, vocab = logits.shape
    eps = label_smoothing
    columns = xp.arange(vocab, dtype=xp.int64, device=array_api_compat.device(logits))
    for r0, r1 in _blocks(rows, vocab):
        z, slope = _capped(xp, to(xp, logits[r0:r1, :], acc), softcap)
        row_lse = to(xp, lse[r0:r1], acc)[:, None]
        g = xp.exp(z - row_lse)
        if z_loss > 0:
            g = g * (1 + 2 * z_loss * row_lse)
        if eps > 0:
            g = g - eps / vocab
        t, valid, safe = _targets(xp, targets, r0, r1, vocab)
        g = xp.where(columns[None, :] == safe[:, None], g - (1 - eps), g)
        if slope is not None:
            g = g * slope
        weight = to(xp, grad[r0:r1], acc)
        weight = xp.where(valid, weight, xp.full_like(weight, math.nan))
        weight = xp.where(t != ignore_index, weight, xp.zeros_like(weight))[:, None]
        g = xp.where(weight != 0, g * weight, xp.zeros_like(g))
        dlogits[r0:r1, :] = to(xp, g, dlogits.dtype)
