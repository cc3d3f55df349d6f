r"""Cross-entropy of logit rows against integer targets, forward and backward in place.

Row :math:`r` of the ``(N, V)`` logits, with target :math:`t`, sees the
logits :math:`z = c \tanh(x / c)` with a ``softcap`` :math:`c` (Gemma 2),
else :math:`z = x`, and loses

.. math::

    \ell_r = (1 - \varepsilon)(\mathrm{lse} - z_t)
             + \varepsilon\,(\mathrm{lse} - \bar z) + \lambda\,\mathrm{lse}^2,
    \qquad \mathrm{lse} = \log \sum_j e^{z_j},

with :math:`\varepsilon` the ``label_smoothing`` (PyTorch's: the target
distribution mixes in :math:`\varepsilon / V` of every class), :math:`\bar z`
the row's mean and :math:`\lambda` the ``z_loss`` weight (PaLM's, keeping
the normaliser near 1). A row whose target is ``ignore_index`` loses 0 and
gets no gradient. ``reduction`` gives the rows' losses (``"none"``), their
sum, or their mean over the rows not ignored (``"mean"``; 0, not NaN, when
every row is ignored). The gradient of row :math:`r` is

.. math::

    \frac{\partial \ell_r}{\partial x_j} =
    \bigl(p_j (1 + 2\lambda\,\mathrm{lse}) - (1 - \varepsilon)[j = t]
    - \varepsilon / V\bigr)\,\bigl(1 - (z_j / c)^2\bigr),
    \qquad p_j = e^{z_j - \mathrm{lse}},

the last factor with a softcap only. The forward checkpoints each row's
:math:`\mathrm{lse}`; the backward is then one elementwise pass over the
logits, and may write the gradient over the logits themselves
(``Duplicated(logits, logits)``, as Liger-Kernel does: no second ``N x V``
buffer). Computation is in float32 (float64 for float64 logits).

:func:`xpkernels.linear_cross_entropy_` fuses the product that makes the
logits, chunk by chunk, so that ``N x V`` logits never exist.
"""

from __future__ import annotations

from collections import namedtuple
from typing import Any

import array_api_compat

from xpkernels.backends.protocol import REDUCTIONS

from . import _autograd
from . import _checks as check
from ._debug import debug_enabled
from .buffers import (
    Checkpoints,
    Duplicated,
    check_forward,
    checkpoints_for,
    empty_accumulator,
    forget_forward,
    primal,
    record_forward,
    scratchspace_for,
    with_new_shadows,
)
from .registry import resolve

__all__ = [
    "CrossEntropyCheckpoints",
    "CrossEntropyScratch",
    "cross_entropy",
    "cross_entropy_",
    "cross_entropy_backward",
    "cross_entropy_backward_",
]

#: The options and their defaults, in their keyword order.
DEFAULTS = {
    "ignore_index": -100,
    "label_smoothing": 0.0,
    "softcap": None,
    "reduction": "mean",
    "z_loss": 0.0,
}


class CrossEntropyCheckpoints(namedtuple("_CrossEntropyCheckpointsArrays", ("lse",)), Checkpoints):
    """What :func:`cross_entropy_` saves for its backward: ``lse`` ``(N,)``, each row's
    logsumexp of its (soft-capped) logits, float32 (float64 for float64 logits)."""


class CrossEntropyScratch(namedtuple("_CrossEntropyScratchArrays", ("loss_rows",))):
    """The forward's workspace: ``loss_rows`` ``(N,)``, each row's loss before the reduction,
    float32 (float64 for float64 logits)."""

    __slots__ = ()


def options(fn: str, values: dict) -> dict:
    """The options checked: ``ignore_index`` an int, ``label_smoothing`` in [0, 1],
    ``softcap`` None or finite > 0, ``reduction`` one of :data:`REDUCTIONS`, ``z_loss`` >= 0."""
    softcap = values["softcap"]
    return {
        "ignore_index": check.index_int(fn, "ignore_index", values["ignore_index"]),
        "label_smoothing": check.unit_interval(fn, "label_smoothing", values["label_smoothing"]),
        "softcap": None if softcap is None else check.positive_finite(fn, "softcap", softcap),
        "reduction": check.one_of(fn, "reduction", values["reduction"], REDUCTIONS),
        "z_loss": check.non_negative(fn, "z_loss", values["z_loss"]),
    }


def given_options(values: dict) -> dict:
    """The options among a call's ``values`` (its ``locals()``), as given (unchecked)."""
    return {name: values[name] for name in DEFAULTS}


def loss_shape(reduction: str, rows: int) -> tuple:
    """The loss's shape: ``(N,)`` for ``reduction="none"``, else ``()``."""
    return (rows,) if reduction == "none" else ()


def check_targets(fn: str, xp, targets, rows: int, vocab: int, ignore_index: int) -> None:
    """``targets``: ``(N,)`` int32 or int64, each in ``[0, V)`` or ``ignore_index``; the values
    are checked on host arrays or in debug mode only (reading device values would sync)."""
    check.rank(fn, "targets", targets, 1, "(N,)")
    if targets.dtype not in (xp.int32, xp.int64):
        raise TypeError(f"{fn}: targets must have dtype int32 or int64, got {targets.dtype}")
    if targets.shape[0] != rows:
        raise ValueError(
            f"{fn}: targets must have N = {rows} entries (one per logit row), got shape "
            f"{tuple(targets.shape)}"
        )
    if rows == 0 or not (check.is_host_array(targets) or debug_enabled()):
        return
    kept = targets != ignore_index
    bad = xp.logical_and(kept, xp.logical_or(targets < 0, targets >= vocab))
    if bool(xp.any(bad)):
        low = int(xp.min(xp.where(kept, targets, xp.zeros_like(targets))))
        high = int(xp.max(xp.where(kept, targets, xp.zeros_like(targets))))
        raise ValueError(
            f"{fn}: targets must lie in [0, {vocab - 1}] (the logits' V columns) or be "
            f"ignore_index = {ignore_index}, got values in [{low}, {high}]"
        )


def check_loss(fn: str, name: str, xp, loss, reduction: str, rows: int) -> None:
    """``loss`` a float array of :func:`loss_shape`."""
    check.floating(fn, name, xp, loss)
    expected = loss_shape(reduction, rows)
    if tuple(loss.shape) != expected:
        what = "(N,) with reduction='none'" if reduction == "none" else "() (a scalar)"
        raise ValueError(
            f"{fn}: {name} must have shape {expected}, {what}, got {tuple(loss.shape)}"
        )


def check_lse(fn: str, xp, checkpoints, rows: int, dtype, kind=None) -> None:
    """``checkpoints`` a ``kind`` (default :class:`CrossEntropyCheckpoints`) whose ``lse`` is
    ``(N,)`` of the accumulation dtype for inputs of ``dtype``."""
    kind = kind or CrossEntropyCheckpoints
    if not isinstance(checkpoints, kind):
        raise TypeError(
            f"{fn}: checkpoints must be a {kind.__name__} "
            f"(allocate_checkpoints(...)), got {type(checkpoints).__name__}"
        )
    lse = checkpoints.lse
    check.array(fn, "checkpoints.lse", lse)
    check.accumulator(fn, "checkpoints.lse", xp, lse, dtype)
    check.shape(fn, "checkpoints.lse", lse, (rows,))


def _logits(fn: str, name: str, xp, a) -> tuple[int, int]:
    check.rank(fn, name, a, 2, "(N, V)")
    check.floating(fn, name, xp, a)
    check.last_axis_contiguous(fn, name, a)
    rows, vocab = (int(n) for n in a.shape)
    if vocab < 1:
        raise ValueError(f"{fn}: {name} must have V >= 1 columns, got shape {tuple(a.shape)}")
    return rows, vocab


def namespace(fn: str, arrays: dict, lead: str):
    """The namespace of ``arrays`` (name -> array), which must share it and ``lead``'s device."""
    xp = check.namespaces(fn, arrays, lead)
    device = array_api_compat.device(arrays[lead])
    for name, a in arrays.items():
        if array_api_compat.device(a) != device:
            raise TypeError(
                f"{fn}: {name} is on device {array_api_compat.device(a)} but {lead} is on "
                f"{device}; all arrays of a call must be on one device"
            )
    return xp


def row_weights(xp, dloss, targets, reduction: str, ignore_index: int, like):
    """The backward's per-row weights ``(N,)`` of ``like``'s dtype: ``dloss`` itself
    (``"none"``), or ``dloss`` broadcast (stride 0) and, for ``"mean"``, divided by the
    rows not ignored (at least 1). Device arrays stay on the device (no sync)."""
    rows = targets.shape[0]
    d = xp.astype(dloss, like.dtype)
    if reduction == "none":
        return d
    d = xp.reshape(d, (1,))
    if reduction == "mean":
        d = d / xp.maximum(kept_rows(xp, targets, ignore_index, like.dtype), 1)
    return xp.broadcast_to(d, (rows,))


def kept_rows(xp, targets, ignore_index: int, dtype):
    """The number of rows not ignored, as a 0-d array of ``dtype``."""
    return xp.sum(xp.astype(targets != ignore_index, dtype))


def reduce_rows(xp, loss, rows, targets, reduction: str, ignore_index: int) -> None:
    """``loss[...]`` = the rows' losses ``rows`` reduced (the mean over kept rows, 0 if none)."""
    if reduction == "none":
        if rows is not loss:
            loss[...] = xp.astype(rows, loss.dtype)
        return
    total = xp.sum(rows)
    if reduction == "mean":
        total = total / xp.maximum(kept_rows(xp, targets, ignore_index, rows.dtype), 1)
    loss[...] = xp.astype(total, loss.dtype)


def _row_buffer(loss, like, rows: int, reduction: str, scratch, fn: str, xp):
    """Where the kernels write the rows' losses: the scratch's (checked), else ``loss`` itself
    when it can take them (``"none"``, the accumulation dtype, contiguous), else new."""
    if scratch is not None:
        if not isinstance(scratch, CrossEntropyScratch):
            raise TypeError(
                f"{fn}: scratch must be a CrossEntropyScratch (allocate_scratchspace(...)), got "
                f"{type(scratch).__name__}"
            )
        check.array(fn, "scratch.loss_rows", scratch.loss_rows)
        check.accumulator(fn, "scratch.loss_rows", xp, scratch.loss_rows, like.dtype)
        check.shape(fn, "scratch.loss_rows", scratch.loss_rows, (rows,))
        return scratch.loss_rows
    accumulator = xp.float64 if like.dtype == xp.float64 else xp.float32
    contiguous = check.strides(loss) in ((1,), None) or rows <= 1
    if reduction == "none" and loss.dtype == accumulator and contiguous:
        return loss
    return empty_accumulator(like, (rows,))


def cross_entropy_(
    loss,
    logits,
    targets,
    *,
    ignore_index=-100,
    label_smoothing=0.0,
    softcap=None,
    reduction="mean",
    z_loss=0.0,
    checkpoints=None,
    scratch=None,
    backend=None,
) -> None:
    """Cross-entropy forward, in place: ``loss`` = the rows' losses, reduced.

    Parameters
    ----------
    loss : array
        Output, overwritten: a scalar (``reduction`` ``"mean"`` or ``"sum"``)
        or ``(N,)`` (``"none"``), of any float dtype.
    logits : array or Duplicated
        The ``(N, V)`` logits (the primal of a Duplicated).
    targets : array
        ``(N,)`` int32 or int64 classes in ``[0, V)``, or ``ignore_index``.
    ignore_index : int
        The target of rows that count for nothing (loss 0, no gradient).
    label_smoothing : float
        In ``[0, 1]``; see the module docstring.
    softcap : float, optional
        Logits become ``softcap * tanh(logits / softcap)`` first.
    reduction : {"mean", "sum", "none"}
        The mean over rows not ignored, the sum, or every row's loss.
    z_loss : float
        Weight (>= 0) of each row's ``lse**2`` added to its loss.
    checkpoints : CrossEntropyCheckpoints, optional
        From ``allocate_checkpoints(cross_entropy_, logits, targets)``; the
        forward writes each row's ``lse`` there for the backward.
    scratch : CrossEntropyScratch, optional
        From ``allocate_scratchspace(cross_entropy_, logits, targets)``;
        None allocates what the call needs.
    backend : str, optional
        Explicit backend; see :mod:`xpkernels.registry`.

    Raises
    ------
    TypeError, ValueError
        Non-arrays, mixed namespaces, dtypes (float logits and loss, int32 or
        int64 targets), shapes (``loss`` of the reduction's shape), targets
        outside ``[0, V)`` that are not ``ignore_index`` (checked on host
        arrays, or in debug mode; a device kernel gives such a row a NaN
        loss), logits whose last axis is not contiguous, option values,
        read-only or overlapping outputs. Nothing is written when a check fails.

    Shapes
    ------
    logits ``(N, V)``, any row stride; targets ``(N,)``, any stride; loss
    ``()`` or ``(N,)``.
    """
    fn = "cross_entropy_"
    opts = options(fn, locals())
    _autograd.check_inplace(fn, {"loss": loss, "logits": logits, "targets": targets})
    logits = primal(logits)
    arrays = {"loss": loss, "logits": logits, "targets": targets}
    xp = namespace(fn, arrays, "logits")
    rows, vocab = _logits(fn, "logits", xp, logits)
    check_loss(fn, "loss", xp, loss, opts["reduction"], rows)
    check_targets(fn, xp, targets, rows, vocab, opts["ignore_index"])
    if checkpoints is not None:
        check_lse(fn, xp, checkpoints, rows, logits.dtype)
    loss_rows = _row_buffer(loss, logits, rows, opts["reduction"], scratch, fn, xp)
    written = {"loss": loss}
    if checkpoints is not None:
        written["checkpoints.lse"] = checkpoints.lse
    if loss_rows is not loss:
        written["loss_rows"] = loss_rows
    check.writable(fn, written)
    check.no_overlap(fn, written, {"logits": logits, "targets": targets})
    route = resolve("cross_entropy", {"logits": logits, "targets": targets}, backend=backend)
    if checkpoints is not None:
        forget_forward(checkpoints)
    lse = empty_accumulator(logits, (rows,)) if checkpoints is None else checkpoints.lse
    run_rows(route, loss_rows, lse, logits, targets, opts)
    reduce_rows(xp, loss, loss_rows, targets, opts["reduction"], opts["ignore_index"])
    if checkpoints is not None:
        record_forward(checkpoints, fn, opts, {"logits": tuple(logits.shape)})


def run_rows(route, loss_rows, lse, logits, targets, opts: dict) -> None:
    """The backend's row forward (nothing for ``N = 0``)."""
    if logits.shape[0]:
        route.impl.forward(loss_rows, lse, logits, targets, **kernel_options(opts))


def kernel_options(opts: dict) -> dict:
    """The options the backend modules take (all but ``reduction``)."""
    return {k: v for k, v in opts.items() if k != "reduction"}


def _row_allocator(fn: str, kind):
    """``fn(cross_entropy_, logits, targets)``: a ``kind`` of one ``(N,)`` accumulator."""

    def allocate(logits, targets=None, *args, **kwargs):
        logits = primal(logits)
        check.rank(fn, "logits", logits, 2, "(N, V)")
        return kind(empty_accumulator(logits, (logits.shape[0],)))

    return allocate


checkpoints_for(cross_entropy_)(
    _row_allocator("allocate_checkpoints(cross_entropy_)", CrossEntropyCheckpoints)
)
scratchspace_for(cross_entropy_)(
    _row_allocator("allocate_scratchspace(cross_entropy_)", CrossEntropyScratch)
)


def cross_entropy(
    logits,
    targets,
    *,
    ignore_index=-100,
    label_smoothing=0.0,
    softcap=None,
    reduction="mean",
    z_loss=0.0,
    checkpoints=None,
    backend=None,
):
    """Cross-entropy forward into a new array; see :func:`cross_entropy_`.

    Returns
    -------
    loss : float32 array (float64 for float64 logits), a scalar or ``(N,)``
    (``reduction="none"``): a sum of many rows kept in 16 bits would lose its
    digits (``torch.nn.functional.cross_entropy`` returns the logits' dtype).
    On torch tensors that require grad (grad mode on), autograd records
    xpkernels' backward (:mod:`xpkernels.torch`).
    """
    opts = given_options(locals())
    check.no_gradient("cross_entropy", "targets", targets, "the targets")
    arrays = {"logits": logits, "targets": targets}
    given = {**opts, "checkpoints": checkpoints, "backend": backend}
    recorded = _autograd.record("cross_entropy", arrays, given)
    if recorded is not _autograd.NOT_RECORDED:
        return recorded
    fn = "cross_entropy"
    logits = primal(logits)
    check.namespace(fn, "logits", logits)
    check.rank(fn, "logits", logits, 2, "(N, V)")
    opts = options(fn, opts)
    loss = empty_accumulator(logits, loss_shape(opts["reduction"], logits.shape[0]))
    cross_entropy_(loss, logits, targets, **opts, checkpoints=checkpoints, backend=backend)
    return loss


def cross_entropy_backward_(
    Loss,
    Logits,
    targets,
    *,
    ignore_index=-100,
    label_smoothing=0.0,
    softcap=None,
    reduction="mean",
    z_loss=0.0,
    checkpoints=None,
    backend=None,
) -> None:
    """Cross-entropy backward, in place: ``Logits.shadow`` = the gradient of ``Loss``.

    Parameters
    ----------
    Loss : Duplicated
        The forward's output; its shadow holds the cotangent ``dloss`` (a
        scalar, or ``(N,)`` with ``reduction="none"``; its primal is not read).
    Logits : Duplicated
        The logits and the gradient's buffer, overwritten; the shadow may be
        the very same array as the primal (the gradient replaces the logits).
    targets, ignore_index, label_smoothing, softcap, reduction, z_loss
        As the forward's.
    checkpoints : CrossEntropyCheckpoints, optional
        Written by :func:`cross_entropy_` with these options; None recomputes
        each row's ``lse`` (one more pass over the logits).
    backend : str, optional
        Explicit backend.

    Raises
    ------
    TypeError, ValueError
        As :func:`cross_entropy_`; Loss or Logits not a Duplicated; the
        shadow overlapping the logits other than being them; checkpoints
        written by another forward or with other options. Nothing is
        written when a check fails.

    Shapes
    ------
    Logits ``(N, V)`` (the shadow any float dtype, last axis contiguous);
    targets ``(N,)``; Loss ``()`` or ``(N,)``.
    """
    fn = "cross_entropy_backward_"
    opts = options(fn, locals())
    duplicated = {"Loss": Loss, "Logits": Logits}
    _autograd.check_inplace(fn, {**duplicated, "targets": targets})
    for name, d in duplicated.items():
        check.duplicated(fn, name, d)
    logits, dlogits, dloss = Logits.primal, Logits.shadow, Loss.shadow
    arrays = {
        "Logits.primal": logits,
        "Logits.shadow": dlogits,
        "Loss.shadow": dloss,
        "Loss.primal": Loss.primal,
        "targets": targets,
    }
    xp = namespace(fn, arrays, "Logits.primal")
    rows, vocab = _logits(fn, "Logits.primal", xp, logits)
    _logits(fn, "Logits.shadow", xp, dlogits)
    check_loss(fn, "Loss.shadow", xp, dloss, opts["reduction"], rows)
    if checkpoints is not None:  # first: another ignore_index is named as such
        check_lse(fn, xp, checkpoints, rows, logits.dtype)
        check_forward(fn, checkpoints, "cross_entropy_", opts, {"logits": tuple(logits.shape)})
    check_targets(fn, xp, targets, rows, vocab, opts["ignore_index"])
    check.writable(fn, {"Logits.shadow": dlogits})
    reads: dict[str, Any] = {"Logits.primal": logits, "targets": targets, "Loss.shadow": dloss}
    if checkpoints is not None:
        reads["checkpoints.lse"] = checkpoints.lse
    check.no_overlap(
        fn, {"Logits.shadow": dlogits}, reads, may_alias=[("Logits.shadow", "Logits.primal")]
    )
    route = resolve("cross_entropy", {"logits": logits, "targets": targets}, backend=backend)
    if rows == 0:
        return
    if checkpoints is None:
        lse = empty_accumulator(logits, (rows,))
        run_rows(route, empty_accumulator(logits, (rows,)), lse, logits, targets, opts)
    else:
        lse = checkpoints.lse
    weights = row_weights(xp, dloss, targets, opts["reduction"], opts["ignore_index"], lse)
    route.impl.backward(dlogits, logits, targets, lse, weights, **kernel_options(opts))


def cross_entropy_backward(
    dloss,
    logits,
    targets,
    *,
    ignore_index=-100,
    label_smoothing=0.0,
    softcap=None,
    reduction="mean",
    z_loss=0.0,
    checkpoints=None,
    backend=None,
):
    """Cross-entropy backward into a new array; see :func:`cross_entropy_backward_`.

    Returns
    -------
    dlogits : array of ``logits``' shape and dtype.
    """
    fn = "cross_entropy_backward"
    Logits = with_new_shadows(fn, {"logits": logits})["logits"]
    check.namespace(fn, "dloss", dloss)
    cross_entropy_backward_(
        Duplicated(dloss, dloss),
        Logits,
        targets,
        **given_options(locals()),
        checkpoints=checkpoints,
        backend=backend,
    )
    return Logits.shadow
