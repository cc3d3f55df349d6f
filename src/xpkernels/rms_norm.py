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

from typing import NamedTuple

from . import _autograd
from . import _checks as check
from ._rows import n_rows, row_groups
from .buffers import (
    Checkpoints,
    Duplicated,
    check_forward,
    checkpoints_for,
    empty,
    empty_accumulator,
    empty_float32,
    forget_forward,
    primal,
    record_forward,
    scratchspace_for,
)
from .registry import resolve

__all__ = [
    "rms_norm_",
    "rms_norm",
    "rms_norm_backward_",
    "rms_norm_backward",
    "RMSNormCheckpoints",
    "RMSNormBackwardScratch",
]


class _RMSNormCheckpointArrays(NamedTuple):
    rstd: object  #: ``(rows,)`` float32, the reciprocal RMS of each row


class RMSNormCheckpoints(_RMSNormCheckpointArrays, Checkpoints):
    """What ``rms_norm_`` saves for its backward: ``rstd``; it records ``offset`` and whether
    the forward had a weight."""


class RMSNormBackwardScratch(NamedTuple):
    """Transient workspace of ``rms_norm_backward_``."""

    dw_partial: (
        object  #: ``(P, M)`` float32 (float64 for float64 x), partial sums of ``dy * x_hat``
    )


def _weight(fn, name, xp, w, m, offset):
    """Check the weight ``(M,)`` (None: no weight, which takes no ``offset``); ``offset`` as a float."""
    offset = check.finite(fn, "offset", offset)
    if w is None:
        if offset != 0.0:
            raise ValueError(f"{fn}: offset={offset!r} applies to the weight, but {name} is None")
        return offset
    check.floating(fn, name, xp, w)
    check.shape(fn, name, w, (m,))
    check.last_axis_contiguous(fn, name, w)
    return offset


def _validate_forward(fn, y, x, w, eps, offset, checkpoints):
    xp = check.namespace(fn, "x", x)
    check.same_namespace(fn, xp, {"x": x, "w": w, "y": y})
    check.min_rank(fn, "x", x, 1, "(..., M)")
    check.floating(fn, "x", xp, x)
    m = x.shape[-1]
    offset = _weight(fn, "w", xp, w, m, offset)
    check.floating(fn, "y", xp, y)
    check.shape(fn, "y", y, tuple(x.shape))
    check.last_axis_contiguous(fn, "y", y)
    check.last_axis_contiguous(fn, "x", x)
    eps = check.positive_finite(fn, "eps", eps)
    rstd = None
    if checkpoints is not None:
        rstd = _checkpoint_rstd(fn, xp, checkpoints, x)
    check.writable(fn, {"y": y, "checkpoints.rstd": rstd})
    check.no_overlap(
        fn, {"y": y, "checkpoints.rstd": rstd}, {"x": x, "w": w}, may_alias=[("y", "x")]
    )
    return xp, eps, offset, rstd


def _checkpoint_rstd(fn, xp, checkpoints, x):
    if not isinstance(checkpoints, RMSNormCheckpoints):
        raise TypeError(
            f"{fn}: checkpoints must be the RMSNormCheckpoints from "
            f"allocate_checkpoints(rms_norm_, x, w), got {type(checkpoints).__name__}"
        )
    rstd = checkpoints.rstd
    check.float32(fn, "checkpoints.rstd", xp, rstd)
    check.shape(fn, "checkpoints.rstd", rstd, (n_rows(x.shape),))
    return rstd


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
    fn = "rms_norm_"
    _autograd.check_inplace(fn, {"x": x, "w": w, "y": y})
    x, w = primal(x), primal(w)
    _, eps, offset, rstd = _validate_forward(fn, y, x, w, eps, offset, checkpoints)
    route = resolve("rms_norm", {"y": y, "x": x, "w": w, "checkpoints.rstd": rstd}, backend=backend)
    if checkpoints is not None:
        forget_forward(checkpoints)
    m = x.shape[-1]
    for first, (yv, xv) in row_groups([y, x], m):
        rv = None if rstd is None else rstd[first : first + xv.shape[0]]
        route.impl.forward(yv, xv, w, rv, eps=eps, offset=offset)
    if checkpoints is not None:
        record_forward(checkpoints, fn, _recorded(w, offset))


def _recorded(w, offset) -> dict:
    """The options of the forward that its backward must repeat."""
    return {"offset": offset, "weight": "none" if w is None else "given"}


@checkpoints_for(rms_norm_)
def allocate_rms_norm_checkpoints(x, w=None, **options) -> RMSNormCheckpoints:
    """Allocate ``rms_norm_``'s checkpoints for input ``x`` (``(..., M)``): ``rstd (rows,)`` float32."""
    x = primal(x)
    check.namespace("allocate_checkpoints(rms_norm_)", "x", x)
    check.min_rank("allocate_checkpoints(rms_norm_)", "x", x, 1, "(..., M)")
    return RMSNormCheckpoints(rstd=empty_float32(x, (n_rows(x.shape),)))


def rms_norm(x, w=None, *, eps=1e-6, offset=0.0, checkpoints=None, backend=None):
    """RMSNorm forward into a new array of ``x``'s dtype; see :func:`rms_norm_`.

    Returns
    -------
    y : array, shape and dtype of ``x``. On torch tensors that require grad (grad mode on),
    autograd records xpkernels' backward (:mod:`xpkernels.torch`).
    """
    options = {"eps": eps, "offset": offset, "checkpoints": checkpoints, "backend": backend}
    if (y := _autograd.record("rms_norm", {"x": x, "w": w}, options)) is not _autograd.NOT_RECORDED:
        return y
    x = primal(x)
    check.namespace("rms_norm", "x", x)
    y = empty(x, x.shape, x.dtype)
    rms_norm_(y, x, w, eps=eps, offset=offset, checkpoints=checkpoints, backend=backend)
    return y


def _validate_backward(fn, Y, X, W, checkpoints, scratch, offset):
    Y = check.duplicated(fn, "Y", Y)
    X = check.duplicated(fn, "X", X)
    x, w, dy, dx = X.primal, primal(W), Y.shadow, X.shadow
    xp = check.namespace(fn, "X.primal", x)
    dw = W.shadow if isinstance(W, Duplicated) else None
    check.same_namespace(
        fn, xp, {"X.primal": x, "W": w, "Y.shadow": dy, "X.shadow": dx, "W.shadow": dw}
    )
    check.min_rank(fn, "X.primal", x, 1, "(..., M)")
    check.floating(fn, "X.primal", xp, x)
    m = x.shape[-1]
    for name, a in (("Y.shadow", dy), ("X.shadow", dx)):
        check.floating(fn, name, xp, a)
        check.shape(fn, name, a, tuple(x.shape))
        check.last_axis_contiguous(fn, name, a)
    check.last_axis_contiguous(fn, "X.primal", x)
    offset = _weight(fn, "W.primal" if dw is not None else "W", xp, w, m, offset)
    if dw is not None:
        check.floating(fn, "W.shadow", xp, dw)
        check.shape(fn, "W.shadow", dw, (m,))
    if checkpoints is None:
        raise ValueError(
            f"{fn}: checkpoints are required: pass the RMSNormCheckpoints that rms_norm_ "
            "filled in the forward (allocate_checkpoints(rms_norm_, x, w))"
        )
    rstd = _checkpoint_rstd(fn, xp, checkpoints, x)
    dw_partial = None
    if dw is not None and scratch is not None:
        if not isinstance(scratch, RMSNormBackwardScratch):
            raise TypeError(
                f"{fn}: scratch must be the RMSNormBackwardScratch from "
                f"allocate_scratchspace(rms_norm_backward_, Y, X, W), got {type(scratch).__name__}"
            )
        dw_partial = scratch.dw_partial
        check.namespace(fn, "scratch.dw_partial", dw_partial)
        check.accumulator(fn, "scratch.dw_partial", xp, dw_partial, x.dtype)
        if dw_partial.ndim != 2 or dw_partial.shape[1] != m or dw_partial.shape[0] < 1:
            raise ValueError(
                f"{fn}: scratch.dw_partial must have shape (P, {m}) with P >= 1, "
                f"got {tuple(dw_partial.shape)}"
            )
    outputs = {"X.shadow": dx, "W.shadow": dw, "scratch.dw_partial": dw_partial}
    check.writable(fn, outputs)
    check.no_overlap(
        fn,
        outputs,
        {"X.primal": x, "W": w, "Y.shadow": dy, "checkpoints.rstd": rstd},
        may_alias=[("X.shadow", "Y.shadow")],
    )
    check_forward(fn, checkpoints, "rms_norm_", _recorded(w, offset))
    return x, w, dy, dx, dw, rstd, dw_partial, offset


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
    fn = "rms_norm_backward_"
    _autograd.check_inplace(fn, {"Y": Y, "X": X, "W": W})
    x, w, dy, dx, dw, rstd, dw_partial, offset = _validate_backward(
        fn, Y, X, W, checkpoints, scratch, offset
    )
    arrays = {"X.primal": x, "W": w, "Y.shadow": dy, "X.shadow": dx, "W.shadow": dw, "rstd": rstd}
    route = resolve("rms_norm", arrays, backend=backend)
    if dw is not None and dw_partial is None:
        dw_partial = _alloc_dw_partial(route, x)
    m = x.shape[-1]
    groups = row_groups([dy, x, dx], m)
    for k, (first, (dyv, xv, dxv)) in enumerate(groups):
        rv = rstd[first : first + xv.shape[0]]
        route.impl.backward(dyv, xv, w, rv, dxv, dw_partial, offset=offset, accumulate=k > 0)
    if dw is not None:
        route.hook("reduce_partials")(dw_partial, dw)


def _alloc_dw_partial(route, x):
    m = x.shape[-1]
    return empty_accumulator(x, (route.hook("partials")(n_rows(x.shape), m, x), m))


@scratchspace_for(rms_norm_backward_)
def allocate_rms_norm_backward_scratch(
    Y, X, W=None, *, backend=None, **options
) -> RMSNormBackwardScratch:
    """Allocate ``rms_norm_backward_``'s scratch: ``dw_partial (P, M)``, P chosen by the backend."""
    x, w = primal(X), primal(W)
    fn = "allocate_scratchspace(rms_norm_backward_)"
    check.namespace(fn, "X", x)
    check.min_rank(fn, "X", x, 1, "(..., M)")
    route = resolve("rms_norm", {"X": x, "W": w}, backend=backend)
    return RMSNormBackwardScratch(dw_partial=_alloc_dw_partial(route, x))


def rms_norm_backward(dy, x, w=None, *, checkpoints, offset=0.0, backend=None):
    """RMSNorm backward into new arrays; see :func:`rms_norm_backward_`.

    Returns
    -------
    dx : array, shape and dtype of ``x``.
    dw : array of ``w``'s shape and dtype, or None when ``w`` is None.
    """
    fn = "rms_norm_backward"
    x, w = primal(x), primal(w)
    check.namespace(fn, "x", x)
    check.namespace(fn, "dy", dy)
    X = Duplicated(x, empty(x, x.shape, x.dtype))
    W = None
    if w is not None:
        check.namespace(fn, "w", w)
        W = Duplicated(w, empty(w, w.shape, w.dtype))
    Y = Duplicated(dy, dy)  # the backward reads only Y's shadow
    rms_norm_backward_(Y, X, W, checkpoints=checkpoints, offset=offset, backend=backend)
    return X.shadow, None if W is None else W.shadow
