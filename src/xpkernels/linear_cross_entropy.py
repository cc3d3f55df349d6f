r"""Cross-entropy of a linear layer's logits, chunk by chunk: the ``N x V`` logits never exist.

The loss of :mod:`xpkernels.cross_entropy` over the logits :math:`x W^T + b`
of hidden states ``x`` ``(N, H)``, a weight ``(V, H)`` (the LM head) and an
optional bias ``(V,)``. The forward forms ``C`` rows of logits at a time in
a scratch chunk ``(C, V)`` (the product in ``x``'s dtype), runs the
cross-entropy rows over it, and keeps each row's ``lse``. The backward forms
each chunk again, turns it into its gradient in place (one elementwise pass
from ``lse``), then

.. math::

    dx_{\text{chunk}} = dZ\,W, \qquad dW \mathrel{+}= dZ^T x_{\text{chunk}},
    \qquad db \mathrel{+}= \textstyle\sum_{\text{rows}} dZ.

Given Duplicated inputs, the forward does the same in the same loop for a
unit cotangent of a reduced loss (three products in all instead of four, as
Liger-Kernel's fused linear cross-entropy; autograd takes this path,
:mod:`xpkernels.torch._linear_ce`). Either way the extra memory is one
chunk, plus on NumPy and CuPy (whose ``matmul`` cannot add into its output)
a product block of a quarter of a chunk's size;
:func:`xpkernels.allocate_scratchspace` sizes the chunk from a byte budget.
``dW`` is accumulated in the weight's dtype, one rounding per chunk (a
16-bit weight's gradient carries about ``chunks`` roundings); ``db`` in
float32. The products run on the arrays' own library (BLAS on the CPU,
cuBLAS through PyTorch or CuPy); the cross-entropy rows on the routed backend.
"""

from __future__ import annotations

import importlib
import math
from collections import namedtuple
from typing import Any

import array_api_compat

from . import _autograd
from . import _checks as check
from .buffers import (
    Checkpoints,
    Duplicated,
    check_forward,
    checkpoints_for,
    empty,
    empty_accumulator,
    forget_forward,
    primal,
    record_forward,
    scratchspace_for,
    with_new_shadows,
)
from .cross_entropy import (
    check_loss,
    check_lse,
    check_targets,
    given_options,
    kernel_options,
    loss_shape,
    namespace,
    options,
    reduce_rows,
    row_weights,
    run_rows,
)
from .registry import resolve

__all__ = [
    "LinearCrossEntropyCheckpoints",
    "LinearCrossEntropyScratch",
    "linear_cross_entropy",
    "linear_cross_entropy_",
    "linear_cross_entropy_backward",
    "linear_cross_entropy_backward_",
]


#: Fewest rows of the default chunk. Each chunk reads and rewrites all of ``dW`` (``V x H``),
#: so the chunk count sets that traffic: ``s / (3 C)`` bytes per FLOP of the three products
#: for ``C`` rows of ``s``-byte elements, about 60% of the products' time at 256 bf16 rows on
#: an H100 (3.35 TB/s, ~990 dense bf16 TFLOP/s at best), 15% at 1024; and BLAS runs products
#: of few rows below its rate (NumPy, N=2048, H=512, V=16000: the backward took 867 ms at 66
#: rows, 540 ms at 262).
MIN_CHUNK_ROWS = 1024

#: The product block of ``dW`` (NumPy, CuPy) holds at most ``1 / PRODUCT_SHARE`` of a chunk's
#: elements: the scratch is 1.25 chunks.
PRODUCT_SHARE = 4


class LinearCrossEntropyCheckpoints(
    namedtuple("_LinearCrossEntropyCheckpointsArrays", ("lse",)), Checkpoints
):
    """What :func:`linear_cross_entropy_` saves: ``lse`` ``(N,)``, each row's logsumexp,
    float32 (float64 for float64 inputs)."""


class LinearCrossEntropyScratch(
    namedtuple("_LinearCrossEntropyScratchArrays", ("logits", "loss_rows", "product", "bias_sum"))
):
    """The workspace of either pass: ``logits`` ``(C, V)`` in ``x``'s dtype (one chunk of
    rows, C-contiguous), ``loss_rows`` ``(N,)`` (the forward's per-row losses), ``product``
    ``(Vb, H)`` in ``x``'s dtype or None (NumPy and CuPy: a block of ``dW``'s chunk product)
    and ``bias_sum`` ``(V,)`` (the backward's sum of ``db``), the last two float32 (float64
    for float64 inputs)."""

    __slots__ = ()


def _inputs(fn: str, arrays: dict, names: dict, bias):
    """Check ``x`` ``(N, H)``, ``weight`` ``(V, H)``, ``bias`` ``(V,)`` (labelled by
    ``names``); return ``(xp, N, V, H)``."""
    x, weight = arrays[names["x"]], arrays[names["weight"]]
    optional = {names["bias"], "Bias.shadow"}
    given = {k: v for k, v in arrays.items() if v is not None or k not in optional}
    xp = namespace(fn, given, names["x"])
    check.rank(fn, names["x"], x, 2, "(N, H)")
    check.rank(fn, names["weight"], weight, 2, "(V, H)")
    dtype = check.floating(fn, names["x"], xp, x)
    for name in (names["weight"], names["bias"]):
        a = arrays.get(name)
        got = None if a is None else check.floating(fn, name, xp, a)
        if got is not None and got != dtype:
            raise TypeError(f"{fn}: {name} must have {names['x']}'s dtype {dtype}, got {got}")
    rows, hidden = (int(n) for n in x.shape)
    vocab = int(weight.shape[0])
    if int(weight.shape[1]) != hidden:
        raise ValueError(
            f"{fn}: {names['weight']} must have H = {hidden} as {names['x']} has, got shape "
            f"{tuple(weight.shape)} (V, H)"
        )
    if vocab < 1:
        raise ValueError(
            f"{fn}: {names['weight']} must have V >= 1 rows, got {tuple(weight.shape)}"
        )
    if bias is not None:
        check.shape(fn, names["bias"], bias, (vocab,))
    return xp, rows, vocab, hidden


def _chunk_rows(rows: int, vocab: int, hidden: int, itemsize: int, memory) -> int:
    """Rows per chunk: ``memory`` bytes of logits, or by default as many elements as ``x`` and
    at least :data:`MIN_CHUNK_ROWS` (all ``N`` when fewer)."""
    if memory is None:
        return max(1, min(rows, max(MIN_CHUNK_ROWS, math.ceil(rows * hidden / vocab))))
    memory = check.index_int(
        "allocate_scratchspace(linear_cross_entropy_)", "memory", memory, low=1
    )
    return max(1, min(rows, memory // (vocab * itemsize)))


def _scratch(x, weight, memory, bias_sum: bool) -> LinearCrossEntropyScratch:
    rows, hidden = (int(n) for n in x.shape)
    vocab = int(weight.shape[0])
    itemsize = array_api_compat.array_namespace(x).finfo(x.dtype).bits // 8
    chunk = _chunk_rows(rows, vocab, hidden, itemsize, memory)
    product = None
    if not array_api_compat.is_torch_array(x):
        block = max(1, min(vocab, chunk * vocab // (PRODUCT_SHARE * max(hidden, 1))))
        product = empty(x, (block, hidden), x.dtype)
    return LinearCrossEntropyScratch(
        empty(x, (chunk, vocab), x.dtype),
        empty_accumulator(x, (rows,)),
        product,
        empty_accumulator(x, (vocab,)) if bias_sum else None,
    )


def _check_scratch(fn: str, xp, scratch, x, rows: int, vocab: int, hidden: int) -> None:
    if not isinstance(scratch, LinearCrossEntropyScratch):
        raise TypeError(
            f"{fn}: scratch must be a LinearCrossEntropyScratch (allocate_scratchspace(...)), "
            f"got {type(scratch).__name__}"
        )
    logits = scratch.logits
    check.array(fn, "scratch.logits", logits)
    fields = {"scratch.logits": logits, "scratch.loss_rows": scratch.loss_rows}
    fields.update({"scratch.product": scratch.product, "scratch.bias_sum": scratch.bias_sum})
    check.same_namespace(fn, xp, fields, "x")
    if logits.dtype != x.dtype or logits.ndim != 2 or int(logits.shape[1]) != vocab:
        raise ValueError(
            f"{fn}: scratch.logits must be (C, V = {vocab}) of dtype {x.dtype}, got "
            f"{tuple(logits.shape)} {logits.dtype}"
        )
    if int(logits.shape[0]) < 1 or check.strides(logits) not in (None, (vocab, 1), (1, 1)):
        raise ValueError(f"{fn}: scratch.logits must be C-contiguous with C >= 1 rows")
    check.accumulator(fn, "scratch.loss_rows", xp, scratch.loss_rows, x.dtype)
    check.shape(fn, "scratch.loss_rows", scratch.loss_rows, (rows,))
    if scratch.product is not None and (
        scratch.product.ndim != 2 or int(scratch.product.shape[1]) != hidden
    ):
        raise ValueError(f"{fn}: scratch.product must be (Vb, H = {hidden})")
    if scratch.bias_sum is not None:
        check.accumulator(fn, "scratch.bias_sum", xp, scratch.bias_sum, x.dtype)
        check.shape(fn, "scratch.bias_sum", scratch.bias_sum, (vocab,))


def _shadows(fn: str, arrays: dict) -> dict:
    """``{"X": dx, "Weight": dweight, "Bias": dbias}`` (None where not asked): each shadow of
    its primal's dtype and shape."""
    grads = {n: arrays.get(f"{n}.shadow") for n in ("X", "Weight", "Bias")}
    for name, g in grads.items():
        p = arrays[f"{name}.primal"]
        if g is not None and (g.dtype != p.dtype or tuple(g.shape) != tuple(p.shape)):
            raise TypeError(
                f"{fn}: {name}.shadow must have {name}.primal's dtype {p.dtype} and shape "
                f"{tuple(p.shape)}, got {g.dtype} {tuple(g.shape)}"
            )
    return grads


def _fields(scratch) -> dict:
    return {f"scratch.{k}": v for k, v in scratch._asdict().items() if v is not None}


def _matmul(xp, a, b, out, accumulate: bool = False, block=None) -> None:
    """``out = a @ b`` (``accumulate``: ``out += a @ b``) with no ``out``-sized temporary
    where the library allows: PyTorch's ``addmm_``/``matmul(out=)``, NumPy's and CuPy's
    ``matmul(out=)`` (adding through ``block``, rows of ``b``'s columns at a time)."""
    if array_api_compat.is_torch_array(out):
        import torch

        if accumulate:
            out.addmm_(a, b)
        elif out.is_contiguous():
            torch.matmul(a, b, out=out)
        else:
            out.copy_(a @ b)
        return
    native: Any = None
    if array_api_compat.is_numpy_array(out):
        native = importlib.import_module("numpy")
    elif array_api_compat.is_cupy_array(out):
        native = importlib.import_module("cupy")
    if native is None:
        out[...] = out + a @ b if accumulate else a @ b
        return
    if not accumulate:
        native.matmul(a, b, out=out)
        return
    step = out.shape[0] if block is None else int(block.shape[0])
    for r0 in range(0, out.shape[0], step):
        r1 = min(out.shape[0], r0 + step)
        if block is None:
            out[r0:r1, ...] += a[r0:r1, ...] @ b
        else:
            native.matmul(a[r0:r1, ...], b, out=block[: r1 - r0, ...])
            out[r0:r1, ...] += block[: r1 - r0, ...]


def _logits(xp, z, x_chunk, weight, bias) -> None:
    """``z = x_chunk @ weight.T (+ bias)`` in place."""
    _matmul(xp, x_chunk, xp.matrix_transpose(weight), z)
    if bias is not None:
        if array_api_compat.is_array_api_strict_namespace(xp):
            z[...] = z + bias
        else:
            z += bias


def linear_cross_entropy_(
    loss,
    x,
    weight,
    targets,
    bias=None,
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
    """Linear cross-entropy forward, in place: ``loss`` = the cross-entropy of ``x @ weight.T
    + bias`` against ``targets``, reduced.

    Parameters
    ----------
    loss : array
        Output, overwritten: a scalar (``reduction`` ``"mean"``/``"sum"``) or
        ``(N,)`` (``"none"``), of any float dtype.
    x : array or Duplicated
        Hidden states ``(N, H)``. A Duplicated's shadow receives the loss's
        gradient for a unit cotangent, formed in this pass (``reduction``
        ``"mean"`` or ``"sum"`` only): the backward's work without forming
        the logits again (three products in all instead of four); scale it
        by the cotangent afterwards.
    weight : array or Duplicated
        ``(V, H)``, ``x``'s dtype; a Duplicated's shadow as ``x``'s.
    targets : array
        ``(N,)`` int32 or int64, in ``[0, V)`` or ``ignore_index``.
    bias : array or Duplicated, optional
        ``(V,)``, ``x``'s dtype; a Duplicated's shadow as ``x``'s.
    ignore_index, label_smoothing, softcap, reduction, z_loss
        As :func:`xpkernels.cross_entropy_`.
    checkpoints : LinearCrossEntropyCheckpoints, optional
        From ``allocate_checkpoints(linear_cross_entropy_, x, weight,
        targets)``: each row's ``lse``, for the backward.
    scratch : LinearCrossEntropyScratch, optional
        From ``allocate_scratchspace(linear_cross_entropy_, x, weight,
        targets, memory=...)``; None allocates it with the default chunk.
    backend : str, optional
        Explicit backend of the cross-entropy rows.

    Raises
    ------
    TypeError, ValueError
        As :func:`xpkernels.cross_entropy_`; ``weight`` or ``bias`` of another
        dtype than ``x``, an ``H`` or ``V`` that disagrees, a scratch of other
        extents (or without ``bias_sum`` for a bias's gradient), shadows of
        another dtype or shape than their primals, Duplicated inputs with
        ``reduction="none"``. Nothing is written when a check fails.

    Shapes
    ------
    x ``(N, H)``; weight ``(V, H)``; bias ``(V,)``; targets ``(N,)``; loss
    ``()`` or ``(N,)``.
    """
    fn = "linear_cross_entropy_"
    opts = options(fn, locals())
    given = {"loss": loss, "x": x, "weight": weight, "targets": targets, "bias": bias}
    _autograd.check_inplace(fn, given)
    duplicated = {n: d for n, d in (("X", x), ("Weight", weight), ("Bias", bias))}
    duplicated = {n: d for n, d in duplicated.items() if isinstance(d, Duplicated)}
    x, weight, bias = primal(x), primal(weight), primal(bias)
    shadows = {f"{n}.shadow": d.shadow for n, d in duplicated.items()}
    arrays = {"x": x, "weight": weight, "bias": bias, "targets": targets, "loss": loss, **shadows}
    names = {"x": "x", "weight": "weight", "bias": "bias"}
    xp, rows, vocab, hidden = _inputs(fn, arrays, names, bias)
    primals = {"X.primal": x, "Weight.primal": weight, "Bias.primal": bias}
    grads = _shadows(fn, {**primals, **shadows}) if duplicated else None
    check_loss(fn, "loss", xp, loss, opts["reduction"], rows)
    if grads is not None and opts["reduction"] == "none":
        raise ValueError(
            f"{fn}: gradients in the forward (Duplicated {', '.join(duplicated)}) need a reduced "
            "loss: with reduction='none' the rows' cotangents are not known yet"
        )
    check_targets(fn, xp, targets, rows, vocab, opts["ignore_index"])
    if checkpoints is not None:
        check_lse(fn, xp, checkpoints, rows, x.dtype, LinearCrossEntropyCheckpoints)
    with_bias_sum = grads is not None and grads["Bias"] is not None
    scratch = _given_scratch(fn, xp, scratch, x, weight, with_bias_sum)
    written = {"loss": loss, **_fields(scratch)}
    written.update({f"{n}.shadow": g for n, g in (grads or {}).items() if g is not None})
    if checkpoints is not None:
        written["checkpoints.lse"] = checkpoints.lse
    check.writable(fn, written)
    reads = {"x": x, "weight": weight, "bias": bias, "targets": targets}
    check.no_overlap(fn, written, reads)
    route = resolve("linear_cross_entropy", {"x": x, "targets": targets}, backend=backend)
    if checkpoints is not None:
        forget_forward(checkpoints)
    lse = empty_accumulator(x, (rows,)) if checkpoints is None else checkpoints.lse
    weights = None
    if grads is not None:
        one = xp.ones((), dtype=lse.dtype, device=array_api_compat.device(lse))
        weights = row_weights(xp, one, targets, opts["reduction"], opts["ignore_index"], lse)
    _chunks(route, xp, (x, weight, bias, targets), scratch, opts, lse, True, grads, weights)
    reduce_rows(xp, loss, scratch.loss_rows, targets, opts["reduction"], opts["ignore_index"])
    if checkpoints is not None:
        record = {**opts, "bias": "none" if bias is None else "given"}
        record_forward(checkpoints, fn, record, _shapes(x, weight))


def _shapes(x, weight) -> dict:
    """What checkpoints record of the inputs' shapes."""
    return {"x": tuple(x.shape), "weight": tuple(weight.shape)}


def _given_scratch(fn: str, xp, scratch, x, weight, bias_sum: bool):
    """The caller's scratch, checked, or a new one with the default chunk."""
    if scratch is None:
        return _scratch(x, weight, None, bias_sum=bias_sum)
    rows, hidden = (int(n) for n in x.shape)
    _check_scratch(fn, xp, scratch, x, rows, int(weight.shape[0]), hidden)
    if bias_sum and scratch.bias_sum is None:
        raise ValueError(f"{fn}: scratch.bias_sum is None but the bias gets a gradient")
    return scratch


def _chunks(route, xp, inputs, scratch, opts, lse, forward: bool, grads=None, weights=None):
    """The loop over chunks of rows both passes run (see the module docstring).

    Each chunk's logits are formed in ``scratch.logits``; ``forward`` runs the
    rows' forward (``scratch.loss_rows``, ``lse``); with ``grads`` (``{"X": dx,
    "Weight": dweight, "Bias": dbias}``, None where not wanted) the chunk then
    becomes its gradient (row weights ``weights``, from ``lse``) and the products
    are accumulated: ``dweight`` overwritten by the first chunk's, ``dbias``
    summed in ``scratch.bias_sum`` then written.
    """
    x, weight, bias, targets = inputs
    rows, step = x.shape[0], int(scratch.logits.shape[0])
    dx, dweight, dbias = (None, None, None) if grads is None else grads.values()
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        z = scratch.logits[: r1 - r0, ...]
        _logits(xp, z, x[r0:r1, ...], weight, bias)
        if forward:
            run_rows(route, scratch.loss_rows[r0:r1], lse[r0:r1], z, targets[r0:r1], opts)
        if grads is None:
            continue
        kernel = kernel_options(opts)
        route.impl.backward(z, z, targets[r0:r1], lse[r0:r1], weights[r0:r1], **kernel)
        if dx is not None:
            _matmul(xp, z, weight, dx[r0:r1, ...])
        if dweight is not None:
            zt = xp.matrix_transpose(z)
            _matmul(xp, zt, x[r0:r1, ...], dweight, r0 > 0, scratch.product)
        if dbias is not None:
            part = xp.sum(z, axis=0, dtype=scratch.bias_sum.dtype)
            scratch.bias_sum[...] = part if r0 == 0 else scratch.bias_sum + part
    if rows == 0 and dweight is not None:
        dweight[...] = xp.zeros_like(dweight)
    if dbias is not None:
        if rows == 0:
            scratch.bias_sum[...] = xp.zeros_like(scratch.bias_sum)
        dbias[...] = xp.astype(scratch.bias_sum, dbias.dtype)


@checkpoints_for(linear_cross_entropy_)
def _allocate_checkpoints(x, *args, **kwargs) -> LinearCrossEntropyCheckpoints:
    """``allocate_checkpoints(linear_cross_entropy_, x, weight, targets)``."""
    x = primal(x)
    check.rank("allocate_checkpoints(linear_cross_entropy_)", "x", x, 2, "(N, H)")
    return LinearCrossEntropyCheckpoints(empty_accumulator(x, (x.shape[0],)))


def _allocate_scratch(x, weight, targets=None, bias=None, *, memory=None, **options):
    """``allocate_scratchspace(linear_cross_entropy_ or linear_cross_entropy_backward_, x,
    weight, targets, bias, memory=None)``: ``memory`` is the chunk's budget in bytes (at
    least one row of ``V`` logits); None gives chunks of as many elements as ``x``, and at
    least :data:`MIN_CHUNK_ROWS` rows."""
    x, weight = primal(x), primal(weight)
    fn = "allocate_scratchspace(linear_cross_entropy_)"
    check.rank(fn, "x", x, 2, "(N, H)")
    check.rank(fn, "weight", weight, 2, "(V, H)")
    return _scratch(x, weight, memory, bias_sum=bias is not None)


def linear_cross_entropy(
    x,
    weight,
    targets,
    bias=None,
    *,
    ignore_index=-100,
    label_smoothing=0.0,
    softcap=None,
    reduction="mean",
    z_loss=0.0,
    checkpoints=None,
    backend=None,
):
    """Linear cross-entropy forward into a new array; see :func:`linear_cross_entropy_`.

    Returns
    -------
    loss : float32 array (float64 for float64 inputs), a scalar or ``(N,)``. On torch
    tensors that require grad (grad mode on), autograd records xpkernels' backward: for a
    reduced loss the forward forms the gradients too and the backward scales them
    (:mod:`xpkernels.torch._linear_ce`); for ``reduction="none"`` the backward forms the
    logits again, chunk by chunk. No ``N x V`` array in either pass.
    """
    opts = given_options(locals())
    check.no_gradient("linear_cross_entropy", "targets", targets, "the targets")
    arrays = {"x": x, "weight": weight, "targets": targets, "bias": bias}
    given = {**opts, "checkpoints": checkpoints, "backend": backend}
    recorded = _autograd.record("linear_cross_entropy", arrays, given)
    if recorded is not _autograd.NOT_RECORDED:
        return recorded
    fn = "linear_cross_entropy"
    x = primal(x)
    check.namespace(fn, "x", x)
    check.rank(fn, "x", x, 2, "(N, H)")
    opts = options(fn, opts)
    loss = empty_accumulator(x, loss_shape(opts["reduction"], x.shape[0]))
    linear_cross_entropy_(
        loss, x, weight, targets, bias, **opts, checkpoints=checkpoints, backend=backend
    )
    return loss


def linear_cross_entropy_backward_(
    Loss,
    X,
    Weight,
    targets,
    Bias=None,
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
    """Linear cross-entropy backward, in place: the shadows of ``X``, ``Weight`` (and
    ``Bias``) get the gradients of ``Loss``.

    Parameters
    ----------
    Loss : Duplicated
        The forward's output; its shadow holds ``dloss`` (its primal is not read).
    X, Weight : Duplicated
        ``x`` and ``weight``; their shadows (of their primals' dtypes) are overwritten.
    targets : array
        As the forward's.
    Bias : Duplicated, optional
        The bias and its gradient, when the forward had one.
    ignore_index, label_smoothing, softcap, reduction, z_loss
        As the forward's.
    checkpoints : LinearCrossEntropyCheckpoints, optional
        Written by :func:`linear_cross_entropy_` with these options; None
        recomputes each row's ``lse`` (one more pass of products).
    scratch : LinearCrossEntropyScratch, optional
        From ``allocate_scratchspace(linear_cross_entropy_backward_, X, Weight,
        targets, Bias, memory=...)``; None allocates it.
    backend : str, optional
        Explicit backend of the cross-entropy rows.

    Raises
    ------
    TypeError, ValueError
        As :func:`linear_cross_entropy_`; a Loss, X, Weight or a given Bias
        that is not a Duplicated; shadows of another dtype than their primals,
        overlapping anything; checkpoints of another forward or options.
        Nothing is written when a check fails.
    """
    fn = "linear_cross_entropy_backward_"
    opts = options(fn, locals())
    duplicated = {"Loss": Loss, "X": X, "Weight": Weight}
    if Bias is not None:
        duplicated["Bias"] = Bias
    _autograd.check_inplace(fn, {**duplicated, "targets": targets})
    for name, d in duplicated.items():
        check.duplicated(fn, name, d)
    x, weight = X.primal, Weight.primal
    bias = None if Bias is None else Bias.primal
    arrays = {
        "X.primal": x,
        "Weight.primal": weight,
        "Bias.primal": bias,
        "targets": targets,
        "Loss.shadow": Loss.shadow,
        "Loss.primal": Loss.primal,
        "X.shadow": X.shadow,
        "Weight.shadow": Weight.shadow,
        "Bias.shadow": None if Bias is None else Bias.shadow,
    }
    names = {"x": "X.primal", "weight": "Weight.primal", "bias": "Bias.primal"}
    xp, rows, vocab, hidden = _inputs(fn, arrays, names, bias)
    grads = _shadows(fn, arrays)
    check_loss(fn, "Loss.shadow", xp, Loss.shadow, opts["reduction"], rows)
    if checkpoints is not None:  # first: another ignore_index is named as such
        check_lse(fn, xp, checkpoints, rows, x.dtype, LinearCrossEntropyCheckpoints)
        record = {**opts, "bias": "none" if bias is None else "given"}
        check_forward(fn, checkpoints, "linear_cross_entropy_", record, _shapes(x, weight))
    check_targets(fn, xp, targets, rows, vocab, opts["ignore_index"])
    scratch = _given_scratch(fn, xp, scratch, x, weight, bias is not None)
    written = {f"{n}.shadow": g for n, g in grads.items() if g is not None}
    written.update(_fields(scratch))
    check.writable(fn, written)
    reads = {k: arrays[k] for k in ("X.primal", "Weight.primal", "Bias.primal", "targets")}
    reads["Loss.shadow"] = Loss.shadow
    if checkpoints is not None:
        reads["checkpoints.lse"] = checkpoints.lse
    check.no_overlap(fn, written, reads)
    route = resolve("linear_cross_entropy", {"x": x, "targets": targets}, backend=backend)
    inputs = (x, weight, bias, targets)
    if checkpoints is None:
        lse = empty_accumulator(x, (rows,))
        _chunks(route, xp, inputs, scratch, opts, lse, True)
    else:
        lse = checkpoints.lse
    weights = row_weights(xp, Loss.shadow, targets, opts["reduction"], opts["ignore_index"], lse)
    _chunks(route, xp, inputs, scratch, opts, lse, False, grads, weights)


def linear_cross_entropy_backward(
    dloss,
    x,
    weight,
    targets,
    bias=None,
    *,
    ignore_index=-100,
    label_smoothing=0.0,
    softcap=None,
    reduction="mean",
    z_loss=0.0,
    checkpoints=None,
    backend=None,
):
    """Linear cross-entropy backward into new arrays; see :func:`linear_cross_entropy_backward_`.

    Returns
    -------
    dx, dweight, dbias : arrays of ``x``'s, ``weight``'s and ``bias``' shapes and dtypes
    (``dbias`` None without a bias).
    """
    fn = "linear_cross_entropy_backward"
    check.namespace(fn, "dloss", dloss)
    arrays = {"x": x, "weight": weight}
    if primal(bias) is not None:
        arrays["bias"] = bias
    new = with_new_shadows(fn, arrays)
    linear_cross_entropy_backward_(
        Duplicated(dloss, dloss),
        new["x"],
        new["weight"],
        targets,
        new.get("bias"),
        **given_options(locals()),
        checkpoints=checkpoints,
        backend=backend,
    )
    return new["x"].shadow, new["weight"].shadow, new["bias"].shadow if "bias" in new else None


scratchspace_for(linear_cross_entropy_)(_allocate_scratch)
scratchspace_for(linear_cross_entropy_backward_)(_allocate_scratch)
