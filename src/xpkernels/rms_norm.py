r"""RMSNorm.

Forward, per row ``x`` of length ``M``:

.. math::

    \mathrm{rstd} = \Big(\tfrac{1}{M}\textstyle\sum_j x_j^2 + \varepsilon\Big)^{-1/2},
    \qquad y_j = x_j \,\mathrm{rstd}\,(w_j + \mathrm{offset})

Backward, with :math:`\hat x = x\,\mathrm{rstd}` and :math:`g = dy\,(w + \mathrm{offset})`:

.. math::

    dx = \mathrm{rstd}\,\big(g - \hat x\,\tfrac{1}{M}\textstyle\sum_j g_j \hat x_j\big),
    \qquad dw = \textstyle\sum_{\text{rows}} dy\,\hat x

``offset=1`` gives Gemma's ``w + 1`` parametrisation; ``w=None`` means no
weight (``y = x * rstd``, as ``torch.nn.RMSNorm(elementwise_affine=False)``).
Accumulation is in float32 (float64 for float64 inputs); ``rstd`` is
checkpointed in float32.
"""

from __future__ import annotations

from ._declared import RowPrimitive

__all__ = [
    "rms_norm_",
    "rms_norm",
    "rms_norm_backward_",
    "rms_norm_backward",
    "RMSNormCheckpoints",
    "RMSNormBackwardScratch",
]

_PRIMITIVE = RowPrimitive("rms_norm", __name__)
#: What ``rms_norm_`` saves for its backward: ``rstd (rows,)`` float32; it records ``offset``
#: and whether the forward had a weight.
RMSNormCheckpoints = _PRIMITIVE.Checkpoints
#: Transient workspace of ``rms_norm_backward_``: ``dw_partial (P, M)``.
RMSNormBackwardScratch = _PRIMITIVE.Scratch


def rms_norm_(y, x, w=None, *, eps=1e-6, offset=0.0, checkpoints=None, backend=None) -> None:
    """RMSNorm forward, in place: ``y = x * rstd * (w + offset)``.

    Parameters
    ----------
    y : array
        Output, written in full. May alias ``x`` (in-place normalisation).
    x : array or Duplicated
        Input rows.
    w : array or Duplicated, optional
        Weight; None for none (``y = x * rstd``).
    eps : float
        Added to the mean square; finite and > 0.
    offset : float
        Added to ``w`` (``1.0`` for Gemma-style weights); 0 when ``w`` is None.
    checkpoints : RMSNormCheckpoints, optional
        From ``allocate_checkpoints(rms_norm_, x, w)``; receives ``rstd`` and
        records ``offset`` and whether there is a weight, which the backward
        must match. None saves nothing (inference).
    backend : str, optional
        Explicit backend; see :mod:`xpkernels.registry`.

    Raises
    ------
    TypeError, ValueError
        Bad arrays or options (named in the message), a read-only ``y``, an
        output sharing memory with an input (other than ``y is x``). Nothing
        is written when a check fails.

    Shapes
    ------
    x, y : ``(..., M)``; w : ``(M,)``. Any float dtypes; the last axis must
    be contiguous, other axes may have any stride.

    Checkpoints
    -----------
    rstd : ``(rows,)`` float32, ``rows = prod(x.shape[:-1])``.
    """
    _PRIMITIVE.forward_(
        {"y": y}, {"x": x, "w": w}, {"eps": eps, "offset": offset}, checkpoints, backend
    )


def rms_norm(x, w=None, *, eps=1e-6, offset=0.0, checkpoints=None, backend=None):
    """RMSNorm forward into a new array of ``x``'s dtype; see :func:`rms_norm_`.

    Returns
    -------
    y : array, shape and dtype of ``x``. On torch tensors that require grad (grad mode on),
    autograd records xpkernels' backward (:mod:`xpkernels.torch`).
    """
    options = {"eps": eps, "offset": offset}
    return _PRIMITIVE.forward({"x": x, "w": w}, options, checkpoints, backend)


def rms_norm_backward_(
    Y, X, W=None, *, checkpoints, scratch=None, offset=0.0, backend=None
) -> None:
    """RMSNorm backward, in place: overwrites ``shadow(X)`` and, if W is Duplicated, ``shadow(W)``.

    Parameters
    ----------
    Y : Duplicated
        The forward's output; its shadow holds ``dy`` (read only).
    X : Duplicated
        The forward's input; its primal is read, its shadow receives ``dx``.
        ``shadow(X)`` may alias ``shadow(Y)``.
    W : Duplicated or array, optional
        The weight; a Duplicated's shadow receives ``dw``, a bare array gets
        no gradient (and needs no scratch); None when the forward had none.
    checkpoints : RMSNormCheckpoints
        Filled by the forward ``rms_norm_``, whose ``offset`` and weight (or
        none) this call must repeat: a mismatch is a ValueError.
    scratch : RMSNormBackwardScratch, optional
        From ``allocate_scratchspace(rms_norm_backward_, Y, X, W)``; None
        allocates it for this call.
    offset : float
        The forward's ``offset``.
    backend : str, optional
        Explicit backend.

    Shapes
    ------
    shadows of Y and X : ``(..., M)``; W and its shadow : ``(M,)``.

    Scratch
    -------
    dw_partial : ``(P, M)``, ``P >= 1`` partial sums reduced into dw; float32
    (float64 for float64 inputs).
    """
    arrays = {"Y": Y, "X": X, "W": W}
    _PRIMITIVE.backward_(arrays, {"offset": offset}, checkpoints, scratch, backend)


def rms_norm_backward(dy, x, w=None, *, checkpoints, offset=0.0, backend=None):
    """RMSNorm backward into new arrays; see :func:`rms_norm_backward_`.

    Returns
    -------
    dx : array, shape and dtype of ``x``.
    dw : array of ``w``'s shape and dtype, or None when ``w`` is None.
    """
    arrays = {"dy": dy, "x": x, "w": w}
    return _PRIMITIVE.backward(arrays, {"offset": offset}, checkpoints, backend)


_PRIMITIVE.register(rms_norm_, rms_norm_backward_)
