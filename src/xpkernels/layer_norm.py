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
    "LayerNormBackwardScratch",
    "LayerNormCheckpoints",
    "layer_norm",
    "layer_norm_",
    "layer_norm_backward",
    "layer_norm_backward_",
]


class _LayerNormCheckpointArrays(NamedTuple):
    mean: object  #: ``(rows,)`` float32, the mean of each row
    rstd: object  #: ``(rows,)`` float32, the reciprocal standard deviation of each row


class LayerNormCheckpoints(_LayerNormCheckpointArrays, Checkpoints):
    """What ``layer_norm_`` saves for its backward: ``mean`` and ``rstd``; it records whether
    the forward had a scale ``w``."""


class LayerNormBackwardScratch(NamedTuple):
    """Transient workspace of ``layer_norm_backward_``."""

    dw_partial: object  #: ``(P, M)`` float32 (float64 for float64 x), partial sums of dy * x_hat
    db_partial: object  #: ``(P, M)`` float32 (float64 for float64 x), partial sums of ``dy``


def _weight(fn, name, xp, a, m):
    if a is None:
        return
    check.floating(fn, name, xp, a)
    check.shape(fn, name, a, (m,))
    check.last_axis_contiguous(fn, name, a)


def _checkpoint_arrays(fn, xp, checkpoints, x):
    if not isinstance(checkpoints, LayerNormCheckpoints):
        raise TypeError(
            f"{fn}: checkpoints must be the LayerNormCheckpoints from "
            f"allocate_checkpoints(layer_norm_, x, w, b), got {type(checkpoints).__name__}"
        )
    rows = n_rows(x.shape)
    for name in ("mean", "rstd"):
        a = getattr(checkpoints, name)
        check.float32(fn, f"checkpoints.{name}", xp, a)
        check.shape(fn, f"checkpoints.{name}", a, (rows,))
    return checkpoints.mean, checkpoints.rstd


def _recorded(w) -> dict:
    """The options of the forward that its backward must repeat."""
    return {"weight": "none" if w is None else "given"}


def _validate_forward(fn, y, x, w, b, eps, checkpoints):
    xp = check.namespace(fn, "x", x)
    check.namespace(fn, "y", y)
    ck = checkpoints if isinstance(checkpoints, LayerNormCheckpoints) else (None, None)
    arrays = {"x": x, "y": y, "w": w, "b": b, "checkpoints.mean": ck[0], "checkpoints.rstd": ck[1]}
    check.same_namespace(fn, xp, arrays)
    check.min_rank(fn, "x", x, 1, "(..., M)")
    check.floating(fn, "x", xp, x)
    m = x.shape[-1]
    _weight(fn, "w", xp, w, m)
    _weight(fn, "b", xp, b, m)
    check.floating(fn, "y", xp, y)
    check.shape(fn, "y", y, tuple(x.shape))
    check.last_axis_contiguous(fn, "y", y)
    check.last_axis_contiguous(fn, "x", x)
    eps = check.positive_finite(fn, "eps", eps)
    mean = rstd = None
    if checkpoints is not None:
        mean, rstd = _checkpoint_arrays(fn, xp, checkpoints, x)
    outputs = {"y": y, "checkpoints.mean": mean, "checkpoints.rstd": rstd}
    check.writable(fn, outputs)
    check.no_overlap(fn, outputs, {"x": x, "w": w, "b": b}, may_alias=[("y", "x")])
    return eps, mean, rstd


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
    fn = "layer_norm_"
    _autograd.check_inplace(fn, {"x": x, "w": w, "b": b, "y": y})
    x, w, b = primal(x), primal(w), primal(b)
    eps, mean, rstd = _validate_forward(fn, y, x, w, b, eps, checkpoints)
    arrays = {"x": x, "y": y, "w": w, "b": b, "checkpoints.mean": mean, "checkpoints.rstd": rstd}
    route = resolve("layer_norm", arrays, backend=backend)
    if checkpoints is not None:
        forget_forward(checkpoints)
    m = x.shape[-1]
    for first, (yv, xv) in row_groups([y, x], m):
        stop = first + xv.shape[0]
        mv = None if mean is None else mean[first:stop]
        rv = None if rstd is None else rstd[first:stop]
        route.impl.forward(yv, xv, w, b, mv, rv, eps=eps)
    if checkpoints is not None:
        record_forward(checkpoints, fn, _recorded(w))


@checkpoints_for(layer_norm_)
def allocate_layer_norm_checkpoints(x, w=None, b=None, **options) -> LayerNormCheckpoints:
    """Allocate ``layer_norm_``'s checkpoints for ``x`` ``(..., M)``: ``mean, rstd (rows,)`` float32."""
    fn = "allocate_checkpoints(layer_norm_)"
    x = primal(x)
    check.namespace(fn, "x", x)
    check.min_rank(fn, "x", x, 1, "(..., M)")
    rows = n_rows(x.shape)
    return LayerNormCheckpoints(mean=empty_float32(x, (rows,)), rstd=empty_float32(x, (rows,)))


def layer_norm(x, w=None, b=None, *, eps=1e-5, checkpoints=None, backend=None):
    """LayerNorm forward into a new array of ``x``'s dtype; see :func:`layer_norm_`.

    Returns
    -------
    y : array, shape and dtype of ``x``. On torch tensors that require grad (grad mode on),
    autograd records xpkernels' backward (:mod:`xpkernels.torch`).
    """
    options = {"eps": eps, "checkpoints": checkpoints, "backend": backend}
    arrays = {"x": x, "w": w, "b": b}
    if (y := _autograd.record("layer_norm", arrays, options)) is not _autograd.NOT_RECORDED:
        return y
    x = primal(x)
    check.namespace("layer_norm", "x", x)
    y = empty(x, x.shape, x.dtype)
    layer_norm_(y, x, w, b, eps=eps, checkpoints=checkpoints, backend=backend)
    return y


def _partial(fn, name, xp, partial, x):
    check.namespace(fn, name, partial)
    check.accumulator(fn, name, xp, partial, x.dtype)
    m = x.shape[-1]
    if partial.ndim != 2 or partial.shape[1] != m or partial.shape[0] < 1:
        raise ValueError(
            f"{fn}: {name} must have shape (P, {m}) with P >= 1, got {tuple(partial.shape)}"
        )


def _validate_backward(fn, Y, X, W, B, checkpoints, scratch):
    Y = check.duplicated(fn, "Y", Y)
    X = check.duplicated(fn, "X", X)
    x, w, b, dy, dx = X.primal, primal(W), primal(B), Y.shadow, X.shadow
    dw = W.shadow if isinstance(W, Duplicated) else None
    db = B.shadow if isinstance(B, Duplicated) else None
    xp = check.namespace(fn, "X.primal", x)
    ck = checkpoints if isinstance(checkpoints, LayerNormCheckpoints) else (None, None)
    arrays = {
        "X.primal": x,
        "Y.shadow": dy,
        "X.shadow": dx,
        "W": w,
        "W.shadow": dw,
        "B": b,
        "B.shadow": db,
        "checkpoints.mean": ck[0],
        "checkpoints.rstd": ck[1],
    }
    check.same_namespace(fn, xp, arrays)
    check.min_rank(fn, "X.primal", x, 1, "(..., M)")
    check.floating(fn, "X.primal", xp, x)
    m = x.shape[-1]
    for name, a in (("Y.shadow", dy), ("X.shadow", dx)):
        check.floating(fn, name, xp, a)
        check.shape(fn, name, a, tuple(x.shape))
        check.last_axis_contiguous(fn, name, a)
    check.last_axis_contiguous(fn, "X.primal", x)
    for name, a in (("W", w), ("W.shadow", dw), ("B", b), ("B.shadow", db)):
        _weight(fn, name, xp, a, m)
    if checkpoints is None:
        raise ValueError(
            f"{fn}: checkpoints are required: pass the LayerNormCheckpoints that layer_norm_ "
            "filled in the forward (allocate_checkpoints(layer_norm_, x, w, b))"
        )
    mean, rstd = _checkpoint_arrays(fn, xp, checkpoints, x)
    dw_partial = db_partial = None
    if scratch is not None and (dw is not None or db is not None):
        if not isinstance(scratch, LayerNormBackwardScratch):
            raise TypeError(
                f"{fn}: scratch must be the LayerNormBackwardScratch from "
                "allocate_scratchspace(layer_norm_backward_, Y, X, W, B), "
                f"got {type(scratch).__name__}"
            )
        if dw is not None:
            dw_partial = scratch.dw_partial
            _partial(fn, "scratch.dw_partial", xp, dw_partial, x)
        if db is not None:
            db_partial = scratch.db_partial
            _partial(fn, "scratch.db_partial", xp, db_partial, x)
        if (
            dw_partial is not None
            and db_partial is not None
            and dw_partial.shape != db_partial.shape
        ):
            raise ValueError(
                f"{fn}: scratch.db_partial must have the shape of scratch.dw_partial "
                f"{tuple(dw_partial.shape)}, got {tuple(db_partial.shape)}"
            )
    outputs = {
        "X.shadow": dx,
        "W.shadow": dw,
        "B.shadow": db,
        "scratch.dw_partial": dw_partial,
        "scratch.db_partial": db_partial,
    }
    check.writable(fn, outputs)
    inputs = {
        "X.primal": x,
        "W": w,
        "Y.shadow": dy,
        "checkpoints.mean": mean,
        "checkpoints.rstd": rstd,
    }
    check.no_overlap(fn, outputs, inputs, may_alias=[("X.shadow", "Y.shadow")])
    check_forward(fn, checkpoints, "layer_norm_", _recorded(w))
    return x, w, b, dy, dx, dw, db, mean, rstd, dw_partial, db_partial


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
    fn = "layer_norm_backward_"
    _autograd.check_inplace(fn, {"Y": Y, "X": X, "W": W, "B": B})
    x, w, b, dy, dx, dw, db, mean, rstd, dw_partial, db_partial = _validate_backward(
        fn, Y, X, W, B, checkpoints, scratch
    )
    arrays = {
        "X.primal": x,
        "Y.shadow": dy,
        "X.shadow": dx,
        "W": w,
        "W.shadow": dw,
        "B": b,
        "B.shadow": db,
        "checkpoints.mean": mean,
        "checkpoints.rstd": rstd,
    }
    route = resolve("layer_norm", arrays, backend=backend)
    if dw is not None and dw_partial is None:
        dw_partial = _alloc_partial(route, x)
    if db is not None and db_partial is None:
        db_partial = _alloc_partial(route, x)
    m = x.shape[-1]
    for k, (first, (dyv, xv, dxv)) in enumerate(row_groups([dy, x, dx], m)):
        stop = first + xv.shape[0]
        route.impl.backward(
            dyv,
            xv,
            w,
            mean[first:stop],
            rstd[first:stop],
            dxv,
            dw_partial,
            db_partial,
            accumulate=k > 0,
        )
    if dw is not None:
        route.hook("reduce_partials")(dw_partial, dw)
    if db is not None:
        route.hook("reduce_partials")(db_partial, db)


def _alloc_partial(route, x):
    m = x.shape[-1]
    return empty_accumulator(x, (route.hook("partials")(n_rows(x.shape), m, x), m))


@scratchspace_for(layer_norm_backward_)
def allocate_layer_norm_backward_scratch(
    Y, X, W=None, B=None, *, backend=None, **options
) -> LayerNormBackwardScratch:
    """Allocate ``layer_norm_backward_``'s scratch: ``dw_partial, db_partial (P, M)``.

    P is chosen by the backend.
    """
    fn = "allocate_scratchspace(layer_norm_backward_)"
    x = primal(X)
    check.namespace(fn, "X", x)
    check.min_rank(fn, "X", x, 1, "(..., M)")
    route = resolve("layer_norm", {"X": x, "W": primal(W), "B": primal(B)}, backend=backend)
    return LayerNormBackwardScratch(
        dw_partial=_alloc_partial(route, x), db_partial=_alloc_partial(route, x)
    )


def layer_norm_backward(dy, x, w=None, b=None, *, checkpoints, backend=None):
    """LayerNorm backward into new arrays; see :func:`layer_norm_backward_`.

    Returns
    -------
    dx : array, shape and dtype of ``x``.
    dw : array of ``w``'s shape and dtype, or None when ``w`` is None.
    db : array of ``b``'s shape and dtype, or None when ``b`` is None.
    """
    fn = "layer_norm_backward"
    x, w, b = primal(x), primal(w), primal(b)
    check.namespace(fn, "x", x)
    check.namespace(fn, "dy", dy)
    for name, a in (("w", w), ("b", b)):
        if a is not None:
            check.namespace(fn, name, a)
    X = Duplicated(x, empty(x, x.shape, x.dtype))
    W = None if w is None else Duplicated(w, empty(w, w.shape, w.dtype))
    B = None if b is None else Duplicated(b, empty(b, b.shape, b.dtype))
    Y = Duplicated(dy, dy)  # the backward reads only Y's shadow
    layer_norm_backward_(Y, X, W, B, checkpoints=checkpoints, backend=backend)
    return X.shadow, None if W is None else W.shadow, None if B is None else B.shadow
