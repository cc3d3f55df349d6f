r"""SwiGLU, the gated activation of Llama-style MLPs.

Forward, elementwise over ``(..., M)`` arrays (``a`` the gate, ``b`` the up projection):

.. math::

    y = \mathrm{silu}(a)\, b, \qquad \mathrm{silu}(a) = a\,\sigma(a) = \frac{a}{1 + e^{-a}}

Backward, with :math:`s = \sigma(a)`:

.. math::

    da = dy\, b\, s\,\big(1 + a\,(1 - s)\big), \qquad db = dy\,\mathrm{silu}(a)

Nothing is checkpointed: the backward recomputes :math:`s` from ``a``.
Computation is in float32 (float64 for float64 inputs).
"""

from __future__ import annotations

from ._declared import RowPrimitive

__all__ = ["swiglu", "swiglu_", "swiglu_backward", "swiglu_backward_"]

_PRIMITIVE = RowPrimitive("swiglu", __name__)


def swiglu_(y, a, b, *, backend=None) -> None:
    """SwiGLU forward, in place: ``y = silu(a) * b``.

    Parameters
    ----------
    y : array
        Output, written in full. May be the very same array as ``a`` or ``b``.
    a : array or Duplicated
        The gate.
    b : array or Duplicated
        The gated values.
    backend : str, optional
        Explicit backend; see :mod:`xpkernels.registry`.

    Raises
    ------
    TypeError, ValueError
        Non-arrays, non-float dtypes, mixed namespaces, shapes that differ, a
        last axis that is not contiguous, a read-only ``y``, ``y`` overlapping
        an input other than being it. Nothing is written when a check fails.

    Shapes
    ------
    a, b, y : ``(..., M)``, one shape. Any float dtypes; the last axis must be
    contiguous, other axes may have any stride.
    """
    _PRIMITIVE.forward_({"y": y}, {"a": a, "b": b}, {}, None, backend)


def swiglu(a, b, *, backend=None):
    """SwiGLU forward into a new array of ``a``'s dtype; see :func:`swiglu_`.

    Returns
    -------
    y : array, shape and dtype of ``a``. On torch tensors that require grad (grad mode on),
    autograd records xpkernels' backward (:mod:`xpkernels.torch`).
    """
    return _PRIMITIVE.forward({"a": a, "b": b}, {}, None, backend)


def swiglu_backward_(Y, A, B, *, backend=None) -> None:
    """SwiGLU backward, in place: overwrites ``shadow(A)`` and ``shadow(B)``.

    Parameters
    ----------
    Y : Duplicated
        The forward's output; its shadow holds ``dy`` (its primal is not read).
    A : Duplicated
        The gate: its primal is read, its shadow receives ``da`` and may be
        the very same array as ``shadow(Y)``.
    B : Duplicated
        The gated values: its primal is read, its shadow receives ``db`` and
        may be the very same array as ``shadow(Y)`` when ``shadow(A)`` is not.
    backend : str, optional
        Explicit backend.

    Raises
    ------
    TypeError, ValueError
        As :func:`swiglu_`, and when Y, A or B is not a Duplicated. Nothing is
        written when a check fails.

    Shapes
    ------
    every primal and shadow : ``(..., M)``, one shape.
    """
    _PRIMITIVE.backward_({"Y": Y, "A": A, "B": B}, {}, None, None, backend)


def swiglu_backward(dy, a, b, *, backend=None):
    """SwiGLU backward into new arrays; see :func:`swiglu_backward_`.

    Returns
    -------
    da, db : arrays of ``a``'s and ``b``'s shapes and dtypes.
    """
    return _PRIMITIVE.backward({"dy": dy, "a": a, "b": b}, {}, None, backend)
