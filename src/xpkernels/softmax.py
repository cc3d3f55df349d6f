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

from ._declared import RowPrimitive

__all__ = ["softmax", "softmax_", "softmax_backward", "softmax_backward_"]

_PRIMITIVE = RowPrimitive("softmax", __name__)


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
    _PRIMITIVE.forward_({"y": y}, {"x": x}, {}, None, backend)


def softmax(x, *, backend=None):
    """Softmax forward into a new array of ``x``'s dtype; see :func:`softmax_`.

    Returns
    -------
    y : array, shape and dtype of ``x``. On torch tensors that require grad (grad mode on),
    autograd records xpkernels' backward (:mod:`xpkernels.torch`).
    """
    return _PRIMITIVE.forward({"x": x}, {}, None, backend)


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
    _PRIMITIVE.backward_({"Y": Y, "X": X}, {}, None, None, backend)


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
    return _PRIMITIVE.backward({"dy": dy, "y": y}, {}, None, backend)
