r"""Softmax over the last axis.

Forward, per row ``x`` of length ``M``:

.. math::

    y_j = \frac{\exp(x_j - \max_k x_k)}{\sum_i \exp(x_i - \max_k x_k)}

Backward, which reads only ``y`` and ``dy``:

.. math::

    dx = y\,\big(dy - \textstyle\sum_j y_j\,dy_j\big)

Nothing is checkpointed: the backward's only saved state is the output
``y`` itself, which the caller already owns. Accumulation is in float32
(float64 for float64 inputs).
"""

from __future__ import annotations

from . import _autograd
from . import _checks as check
from ._rows import row_groups
from .buffers import Duplicated, empty, primal
from .registry import resolve

__all__ = ["softmax", "softmax_", "softmax_backward", "softmax_backward_"]


def _rows_like(fn, xp, lead_name, lead, others):
    """Check ``lead`` is a float ``(..., M)`` array and each of ``others`` matches its shape."""
    check.min_rank(fn, lead_name, lead, 1, "(..., M)")
    check.floating(fn, lead_name, xp, lead)
    check.last_axis_contiguous(fn, lead_name, lead)
    for name, a in others:
        check.floating(fn, name, xp, a)
        check.shape(fn, name, a, tuple(lead.shape))
        check.last_axis_contiguous(fn, name, a)


def softmax_(y, x, *, backend=None) -> None:
    """Softmax forward over the last axis, in place: ``y = exp(x - max x) / sum exp(x - max x)``.

    Parameters
    ----------
    y : array
        Output, written in full. May alias ``x``.
    x : array or Duplicated
        Input rows.
    backend : str, optional
        Explicit backend; see :mod:`xpkernels.registry`.

    Raises
    ------
    TypeError
        Non-arrays, non-float dtypes, arrays from different namespaces or
        devices.
    ValueError
        Wrong rank or shape, a last axis that is not contiguous, a read-only
        ``y``, ``y`` overlapping ``x`` other than being ``x`` itself. Nothing
        is written when validation fails.

    Shapes
    ------
    x, y : ``(..., M)``. Any float dtypes; the last axis must be contiguous,
    other axes may have any stride.
    """
    fn = "softmax_"
    _autograd.check_inplace(fn, {"x": x, "y": y})
    x = primal(x)
    xp = check.namespace(fn, "x", x)
    check.namespace(fn, "y", y)
    check.same_namespace(fn, xp, {"x": x, "y": y})
    _rows_like(fn, xp, "x", x, [("y", y)])
    check.writable(fn, {"y": y})
    check.no_overlap(fn, {"y": y}, {"x": x}, may_alias=[("y", "x")])
    route = resolve("softmax", {"x": x, "y": y}, backend=backend)
    for _, (yv, xv) in row_groups([y, x], x.shape[-1]):
        route.impl.forward(yv, xv)


def softmax(x, *, backend=None):
    """Softmax forward into a new array of ``x``'s dtype; see :func:`softmax_`.

    Returns
    -------
    y : array, shape and dtype of ``x``. On torch tensors that require grad (grad mode on),
    autograd records xpkernels' backward (:mod:`xpkernels.torch`).
    """
    options = {"backend": backend}
    if (y := _autograd.record("softmax", {"x": x}, options)) is not _autograd.NOT_RECORDED:
        return y
    x = primal(x)
    check.namespace("softmax", "x", x)
    y = empty(x, x.shape, x.dtype)
    softmax_(y, x, backend=backend)
    return y


def softmax_backward_(Y, X, *, backend=None) -> None:
    """Softmax backward, in place: overwrites ``shadow(X)`` with ``y * (dy - sum(y * dy))``.

    Parameters
    ----------
    Y : Duplicated
        The forward's output: its primal ``y`` and its shadow ``dy`` are read.
    X : Duplicated
        The forward's input; its shadow receives ``dx`` and may alias
        ``shadow(Y)``. Its primal is not read.
    backend : str, optional
        Explicit backend.

    Raises
    ------
    TypeError, ValueError
        As :func:`softmax_`, and when Y or X is not a Duplicated. Nothing is
        written when validation fails.

    Shapes
    ------
    primal and shadow of Y, shadow of X : ``(..., M)``.
    """
    fn = "softmax_backward_"
    _autograd.check_inplace(fn, {"Y": Y, "X": X})
    Y = check.duplicated(fn, "Y", Y)
    X = check.duplicated(fn, "X", X)
    y, dy, dx = Y.primal, Y.shadow, X.shadow
    arrays = {"Y.primal": y, "Y.shadow": dy, "X.shadow": dx}
    xp = check.namespace(fn, "Y.primal", y)
    check.same_namespace(fn, xp, arrays)
    _rows_like(fn, xp, "Y.primal", y, [("Y.shadow", dy), ("X.shadow", dx)])
    check.writable(fn, {"X.shadow": dx})
    check.no_overlap(
        fn, {"X.shadow": dx}, {"Y.primal": y, "Y.shadow": dy}, may_alias=[("X.shadow", "Y.shadow")]
    )
    route = resolve("softmax", arrays, backend=backend)
    for _, (yv, dyv, dxv) in row_groups([y, dy, dx], y.shape[-1]):
        route.impl.backward(yv, dyv, dxv)


def softmax_backward(dy, y, *, backend=None):
    """Softmax backward into a new array; see :func:`softmax_backward_`.

    Parameters
    ----------
    dy : array
        Gradient of the output.
    y : array or Duplicated
        The forward's output.
    backend : str, optional
        Explicit backend.

    Returns
    -------
    dx : array, shape and dtype of ``y``.
    """
    fn = "softmax_backward"
    y = primal(y)
    check.namespace(fn, "y", y)
    check.namespace(fn, "dy", dy)
    check.shape(fn, "dy", dy, tuple(y.shape))
    dx = empty(y, y.shape, y.dtype)
    # X's primal is never read by the backward; y stands in for it.
    softmax_backward_(Duplicated(y, dy), Duplicated(y, dx), backend=backend)
    return dx
