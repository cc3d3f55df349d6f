r"""SwiGLU on the Array API, elementwise over row blocks within the block budget.

.. math::

    y = \mathrm{silu}(a)\,b,\qquad
    da = dy\,b\,s\,\big(1 + a\,(1 - s)\big),\qquad db = dy\,\mathrm{silu}(a),

with :math:`s = \sigma(a)` and :math:`\mathrm{silu}(a) = a\,s`. The sigmoid is
computed from :math:`e = \exp(-|a|)`, which never overflows:
:math:`s = 1/(1 + e)` for :math:`a \ge 0`, :math:`e/(1 + e)` below. So
:math:`|a|` of any size warns nothing, ``NaN`` propagates, and
:math:`a = \pm\infty` give what ``torch.nn.functional.silu`` gives
(:math:`\mathrm{silu}(+\infty) = +\infty`, :math:`\mathrm{silu}(-\infty)` and
both derivatives at :math:`\pm\infty` NaN: :math:`\infty \cdot 0`).
"""

from __future__ import annotations

import array_api_compat

from ._blocks import acc_dtype, for_each_block, numpy_views, to, workers

__all__ = ["backward", "forward"]


def _sigmoid(xp, a):
    """``sigmoid(a)`` of a block in its own dtype, without overflow for any ``|a|``."""
    e = xp.exp(-xp.abs(a))
    r = 1.0 / (1.0 + e)
    return xp.where(a >= 0, r, e * r)


def forward(y, a, b) -> None:
    """``y = silu(a) * b`` over 2-D ``(rows, M)`` views.

    ``y`` may be the very same array as ``a`` or ``b``. Computed in float32
    (float64 for float64 ``a``), written in ``y``'s dtype. PyTorch CPU tensors
    run the NumPy path through zero-copy views (:func:`._blocks.numpy_views`).
    """
    views = numpy_views(y, a, b)
    if views is not None:
        y, a, b = views
    xp = array_api_compat.array_namespace(y, a, b)
    acc = acc_dtype(xp, a.dtype)
    rows, m = a.shape
    if rows == 0 or m == 0:
        return

    def block(worker, r0, r1):
        a_b = to(xp, a[r0:r1, :], acc)
        b_b = to(xp, b[r0:r1, :], acc)
        out = a_b * _sigmoid(xp, a_b)
        out *= b_b
        y[r0:r1, :] = to(xp, out, y.dtype)

    for_each_block(xp, block, rows, m, workers(xp, rows, m))


def backward(dy, a, b, da, db) -> None:
    """``da = dy * b * s * (1 + a * (1 - s))``, ``db = dy * silu(a)`` over ``(rows, M)`` views.

    ``s = sigmoid(a)`` is recomputed. ``da`` (overwritten) may be the very
    same array as ``dy``, or ``db`` may be: each block computes both
    gradients before storing either.
    """
    views = numpy_views(dy, a, b, da, db)
    if views is not None:
        dy, a, b, da, db = views
    xp = array_api_compat.array_namespace(dy, a, b, da, db)
    acc = acc_dtype(xp, a.dtype)
    rows, m = a.shape
    if rows == 0 or m == 0:
        return

    def block(worker, r0, r1):
        a_b = to(xp, a[r0:r1, :], acc)
        b_b = to(xp, b[r0:r1, :], acc)
        dy_b = to(xp, dy[r0:r1, :], acc)
        s = _sigmoid(xp, a_b)
        silu = a_b * s
        grad_b = dy_b * silu
        # s * (1 + a * (1 - s)) = s + silu * (1 - s)
        grad_a = dy_b * b_b
        grad_a *= s + silu * (1.0 - s)
        da[r0:r1, :] = to(xp, grad_a, da.dtype)
        db[r0:r1, :] = to(xp, grad_b, db.dtype)

    for_each_block(xp, block, rows, m, workers(xp, rows, m))
