r"""GeGLU, the gated activation of Gemma- and T5-style MLPs.

Forward, elementwise over ``(..., M)`` arrays (``a`` the gate, ``b`` the up projection):

.. math::

    y = \mathrm{gelu}(a)\, b

with, for ``approximate="none"`` (exactly, through the error function),

.. math::

    \mathrm{gelu}(a) = a\,\Phi(a) = \tfrac{a}{2}\big(1 + \mathrm{erf}(a / \sqrt 2)\big),
    \qquad \mathrm{gelu}'(a) = \Phi(a) + a\,\varphi(a),\quad
    \varphi(a) = e^{-a^2/2} / \sqrt{2\pi},

and for ``approximate="tanh"`` (``gelu_pytorch_tanh`` of Gemma's configs),
with :math:`u = \sqrt{2/\pi}\,(a + 0.044715\,a^3)` and :math:`t = \tanh u`,

.. math::

    \mathrm{gelu}(a) = \tfrac{a}{2}(1 + t),
    \qquad \mathrm{gelu}'(a) = \tfrac12(1 + t)
        + \tfrac{a}{2}(1 - t^2)\sqrt{2/\pi}\,(1 + 3 \cdot 0.044715\,a^2),

the two forms of ``torch.nn.functional.gelu``. Backward:

.. math::

    da = dy\, b\, \mathrm{gelu}'(a), \qquad db = dy\,\mathrm{gelu}(a)

Nothing is checkpointed: the backward recomputes :math:`\mathrm{gelu}` from
``a``. Computation is in float32 (float64 for float64 inputs).
"""

from __future__ import annotations

from ._declared import RowPrimitive

__all__ = ["geglu", "geglu_", "geglu_backward", "geglu_backward_"]

_PRIMITIVE = RowPrimitive("geglu", __name__)


def geglu_(y, a, b, *, approximate="tanh", backend=None) -> None:
    """GeGLU forward, in place: ``y = gelu(a) * b``.

    Parameters
    ----------
    y : array
        Output, written in full. May be the very same array as ``a`` or ``b``.
    a : array or Duplicated
        The gate.
    b : array or Duplicated
        The gated values.
    approximate : {"tanh", "none"}
        The GELU form: its tanh approximation (the default, as Gemma's
        ``gelu_pytorch_tanh``) or the exact one through ``erf``
        (``torch.nn.functional.gelu``'s default).
    backend : str, optional
        Explicit backend; see :mod:`xpkernels.registry`.

    Raises
    ------
    TypeError, ValueError
        Non-arrays, non-float dtypes, mixed namespaces, shapes that differ, a
        last axis that is not contiguous, a read-only ``y``, ``y`` overlapping
        an input other than being it, an unknown ``approximate``. Nothing is
        written when a check fails.

    Shapes
    ------
    a, b, y : ``(..., M)``, one shape. Any float dtypes; the last axis must be
    contiguous, other axes may have any stride.
    """
    _PRIMITIVE.forward_({"y": y}, {"a": a, "b": b}, {"approximate": approximate}, None, backend)


def geglu(a, b, *, approximate="tanh", backend=None):
    """GeGLU forward into a new array of ``a``'s dtype; see :func:`geglu_`.

    Returns
    -------
    y : array, shape and dtype of ``a``. On torch tensors that require grad (grad mode on),
    autograd records xpkernels' backward (:mod:`xpkernels.torch`).
    """
    return _PRIMITIVE.forward({"a": a, "b": b}, {"approximate": approximate}, None, backend)


def geglu_backward_(Y, A, B, *, approximate="tanh", backend=None) -> None:
    """GeGLU backward, in place: overwrites ``shadow(A)`` and ``shadow(B)``.

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
    approximate : {"tanh", "none"}
        The forward's GELU form (nothing records it: pass the same).
    backend : str, optional
        Explicit backend.

    Raises
    ------
    TypeError, ValueError
        As :func:`geglu_`, and when Y, A or B is not a Duplicated. Nothing is
        written when a check fails.

    Shapes
    ------
    every primal and shadow : ``(..., M)``, one shape.
    """
    options = {"approximate": approximate}
    _PRIMITIVE.backward_({"Y": Y, "A": A, "B": B}, options, None, None, backend)


def geglu_backward(dy, a, b, *, approximate="tanh", backend=None):
    """GeGLU backward into new arrays; see :func:`geglu_backward_`.

    Returns
    -------
    da, db : arrays of ``a``'s and ``b``'s shapes and dtypes.
    """
    options = {"approximate": approximate}
    return _PRIMITIVE.backward({"dy": dy, "a": a, "b": b}, options, None, backend)
