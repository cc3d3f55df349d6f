r"""LayerNorm.

Forward, per row ``x`` of length ``M``:

.. math::

    \mu = \tfrac{1}{M}\textstyle\sum_j x_j, \qquad
    \mathrm{rstd} = \Big(\tfrac{1}{M}\textstyle\sum_j (x_j - \mu)^2 + \varepsilon\Big)^{-1/2},
    \qquad y_j = (x_j - \mu)\,\mathrm{rstd}\,w_j + b_j

Backward, with :math:`\hat x = (x - \mu)\,\mathrm{rstd}` and :math:`g = dy\,w`:

.. math::

    dx = \mathrm{rstd}\,\big(g - \tfrac{1}{M}\textstyle\sum_j g_j
         - \hat x\,\tfrac{1}{M}\textstyle\sum_j g_j \hat x_j\big),
    \qquad dw = \textstyle\sum_{\text{rows}} dy\,\hat x,
    \qquad db = \textstyle\sum_{\text{rows}} dy

``w=None`` means no scale (``w = 1``), ``b=None`` no shift (``b = 0``).
Accumulation is in float32 (float64 for float64 inputs); ``mean`` and
``rstd`` are checkpointed in float32.
"""

from __future__ import annotations

from ._declared import RowPrimitive

__all__ = [
    "layer_norm_",
    "layer_norm",
    "layer_norm_backward_",
    "layer_norm_backward",
    "LayerNormCheckpoints",
    "LayerNormBackwardScratch",
]

_PRIMITIVE = RowPrimitive("layer_norm", __name__)
#: What ``layer_norm_`` saves for its backward: ``mean`` and ``rstd`` ``(rows,)`` float32; it
#: records whether the forward had a scale ``w``.
LayerNormCheckpoints = _PRIMITIVE.Checkpoints
#: Transient workspace of ``layer_norm_backward_``: ``dw_partial``, ``db_partial`` ``(P, M)``.
LayerNormBackwardScratch = _PRIMITIVE.Scratch


def layer_norm_(y, x, w=None, b=None, *, eps=1e-5, checkpoints=None, backend=None) -> None:
    """LayerNorm forward, in place: ``y = (x - mean) * rstd * w + b``.

    Parameters
    ----------
    y : array
        Output, written in full. May alias ``x`` (in-place normalisation).
    x : array or Duplicated
        Input rows.
    w : array or Duplicated, optional
        Scale; None for none.
    b : array or Duplicated, optional
        Shift; None for none.
    eps : float
        Added to the variance; finite and > 0.
    checkpoints : LayerNormCheckpoints, optional
        From ``allocate_checkpoints(layer_norm_, x, w, b)``; receives
        ``mean`` and ``rstd``. None saves nothing (inference).
    backend : str, optional
        Explicit backend; see :mod:`xpkernels.registry`.

    Raises
    ------
    TypeError
        Non-arrays, non-float dtypes, arrays from different namespaces or
        devices, checkpoints of the wrong type or dtype.
    ValueError
        Wrong ranks or shapes, a last axis that is not contiguous, eps not
        finite and > 0, a read-only output, an output sharing memory with an
        input (other than ``y is x``). Nothing is written when validation fails.

    Shapes
    ------
    x, y : ``(..., M)``; w, b : ``(M,)``. Any float dtypes; the last axis
    must be contiguous, other axes may have any stride.

    Checkpoints
    -----------
    mean, rstd : ``(rows,)`` float32 each, ``rows = prod(x.shape[:-1])``.
    """
    arrays = {"x": x, "w": w, "b": b}
    _PRIMITIVE.forward_({"y": y}, arrays, {"eps": eps}, checkpoints, backend)


def layer_norm(x, w=None, b=None, *, eps=1e-5, checkpoints=None, backend=None):
    """LayerNorm forward into a new array of ``x``'s dtype; see :func:`layer_norm_`.

    Returns
    -------
    y : array, shape and dtype of ``x``. On torch tensors that require grad (grad mode on),
    autograd records xpkernels' backward (:mod:`xpkernels.torch`).
    """
    return _PRIMITIVE.forward({"x": x, "w": w, "b": b}, {"eps": eps}, checkpoints, backend)


def layer_norm_backward_(Y, X, W=None, B=None, *, checkpoints, scratch=None, backend=None) -> None:
    """LayerNorm backward, in place: overwrites ``shadow(X)`` and the shadows of a Duplicated W / B.

    Parameters
    ----------
    Y : Duplicated
        The forward's output; its shadow holds ``dy`` (read only; its primal
        is not read).
    X : Duplicated
        The forward's input; its primal is read, its shadow receives ``dx``.
        ``shadow(X)`` may alias ``shadow(Y)``.
    W : Duplicated or array, optional
        The scale; a Duplicated's shadow receives ``dw``, a bare array gets
        no gradient, None means the forward had no scale.
    B : Duplicated or array, optional
        The shift; a Duplicated's shadow receives ``db``. Only its shadow is
        used: the shift does not enter ``dx`` or ``dw``.
    checkpoints : LayerNormCheckpoints
        Filled by the forward ``layer_norm_``.
    scratch : LayerNormBackwardScratch, optional
        From ``allocate_scratchspace(layer_norm_backward_, Y, X, W, B)``;
        None allocates what this call needs.
    backend : str, optional
        Explicit backend.

    Raises
    ------
    TypeError, ValueError
        As :func:`layer_norm_`, and when checkpoints are missing, Y or X is
        not a Duplicated, or scratch has the wrong type, shape or dtype.
        Nothing is written when validation fails.

    Shapes
    ------
    shadows of Y and X : ``(..., M)``; W, B and their shadows : ``(M,)``.

    Scratch
    -------
    dw_partial, db_partial : ``(P, M)`` each, ``P >= 1`` partial sums reduced
    into dw and db; float32 (float64 for float64 inputs).
    """
    arrays = {"Y": Y, "X": X, "W": W, "B": B}
    _PRIMITIVE.backward_(arrays, {}, checkpoints, scratch, backend)


def layer_norm_backward(dy, x, w=None, b=None, *, checkpoints, backend=None):
    """LayerNorm backward into new arrays; see :func:`layer_norm_backward_`.

    Returns
    -------
    dx : array, shape and dtype of ``x``.
    dw : array of ``w``'s shape and dtype, or None when ``w`` is None.
    db : array of ``b``'s shape and dtype, or None when ``b`` is None.
    """
    arrays = {"dy": dy, "x": x, "w": w, "b": b}
    return _PRIMITIVE.backward(arrays, {}, checkpoints, backend)


_PRIMITIVE.register(layer_norm_, layer_norm_backward_)
