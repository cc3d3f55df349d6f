r"""LayerNorm in CUDA C (``layer_norm.cu``), launched through the module-loader interface.

Per row, with :math:`w = 1` when ``w`` is None and :math:`b = 0` when ``b`` is None:

.. math::

    \mu = \tfrac{1}{M}\textstyle\sum_j x_j,\quad
    \mathrm{rstd} = \big(\tfrac{1}{M}\textstyle\sum_j (x_j - \mu)^2 + \varepsilon\big)^{-1/2},\quad
    y = \hat x\,w + b,\\
    dx = \mathrm{rstd}\,\big(g - \tfrac{1}{M}\textstyle\sum_j g_j
         - \hat x\,\tfrac{1}{M}\textstyle\sum_j g_j\hat x_j\big),\quad
    dw = \textstyle\sum_{\text{rows}} dy\,\hat x,\quad
    db = \textstyle\sum_{\text{rows}} dy

with :math:`\hat x = (x - \mu)\,\mathrm{rstd}`, :math:`g = dy\,w`. The
variance comes from values centred on a first mean, whose residual refines
the mean in the same pass. Geometry as in :mod:`._rows` (warp per row up to
``WARP_MAX_M``, else block per row; registers, then streaming; 128-bit
accesses where aligned). ``dw`` and ``db`` are summed per block into row
``blockIdx.x`` of ``dw_partial`` / ``db_partial`` and reduced, in a fixed
order, by :func:`reduce_partials`. Accumulation is float32.

The same launchers run on a GPU (CuPy arrays, ``cupy.RawModule``) and on the
CPU harness (NumPy arrays inside ``xpkernels.testing.cudacpu.emulate()``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from . import _rows
from ._loader import OPTIONS, loader_for

__all__ = ["backward", "forward", "name_expressions", "partials", "reduce_partials"]

SOURCE = Path(__file__).with_name("layer_norm.cu")
SMEM_ACC_MAX_BYTES = 160 * 1024  #: wide-row backward: dw/db sums in shared memory up to this
PARTIALS_PER_SM = 2  #: partial rows (backward blocks) per multiprocessor
BLOCKS_PER_SM = 32  #: cap of a backward grid without partials
_OP = "layer_norm"


def _types(x, w, b, *outs) -> tuple[str, str, str]:
    """``(T, TW, TB)``: the CUDA C types of x, w and b (x's type standing in for a None)."""
    t = _rows.ctype(_OP, "x", x)
    for out in outs:
        if out.dtype != x.dtype:
            raise TypeError(
                f"cupy layer_norm: the outputs must have x's dtype {x.dtype}, got {out.dtype}"
            )
    tw = t if w is None else _rows.ctype(_OP, "w", w)
    tb = t if b is None else _rows.ctype(_OP, "b", b)
    return t, tw, tb


_FORWARD = ("forward_warp", "forward_block")
_BACKWARD = ("backward_warp", "backward_block")


def _module(loader, t: str, tw: str, tb: str):
    """The compiled module of one ``(T, TW, TB)``: its forward, the backward of ``(T, TW)``, the reductions.

    The backward asks for ``(T, TW, TW)`` and the reductions for ``(TOut,
    TOut, TOut)``, ``TOut`` the gradient's type: with ``w`` and ``b`` of x's
    dtype (or None), one module serves a whole training step.
    """
    expressions = (
        _rows.expressions(_OP, _FORWARD, t, tw, tb)
        + _rows.expressions(_OP, _BACKWARD, t, tw)
        + _rows.REDUCE_EXPRESSIONS
    )
    return loader.module(SOURCE, expressions, OPTIONS)


def name_expressions() -> list[str]:
    """Every template instantiation of the default configurations (for offline compile reports).

    Weights of x's dtype or float32; the launchers compile other
    combinations the same way when a call needs them.
    """
    out = []
    for t in _rows.CTYPES.values():
        for tw in sorted({t, "float"}):
            out += _rows.expressions(_OP, _FORWARD, t, tw, tw) + _rows.expressions(
                _OP, _BACKWARD, t, tw
            )
    return out + _rows.REDUCE_EXPRESSIONS


def forward(y, x, w, b, mean, rstd, *, eps) -> None:
    """``y = (x - mean) * rstd * w + b`` per row; writes the checkpoints unless None.

    Parameters: the ``layer_norm`` Signature's
    (:func:`xpkernels.backends.protocol.module_functions`).
    """
    if _rows.mixed(x, y):  # outputs of x's dtype only: the call in float32
        (y, x), finish = _rows.in_float32((y, x), outputs=(0,))
        forward(y, x, w, b, mean, rstd, eps=eps)
        return finish()
    t, tw, tb = _types(x, w, b, y)
    rows, m = x.shape
    if rows == 0:
        return
    v = _rows.vector((x, y), (w, b))
    module = _module(loader_for(x), t, tw, tb)
    args = (
        y,
        x,
        _rows.ptr(w),
        _rows.ptr(b),
        _rows.ptr(mean),
        _rows.ptr(rstd),
        np.int64(rows),
        np.int32(m),
        np.int64(_rows.stride(y)),
        np.int64(_rows.stride(x)),
        np.int64(0 if mean is None else _rows.stride(mean)),
        np.int64(0 if rstd is None else _rows.stride(rstd)),
        np.float32(eps),
    )
    c = _rows.cache(v)
    _rows.launch(
        lambda kind: module.get_function(f"layer_norm_forward_{kind}<{t},{tw},{tb},{v},{c}>"),
        rows,
        m,
        v,
        args,
        _rows.MAX_THREADS,
    )


def backward(dy, x, w, mean, rstd, dx, dw_partial, db_partial, *, accumulate) -> None:
    """``dx`` (overwritten) and, for the partials that are not None, per-block ``dw`` / ``db`` sums.

    The partials (float32) get one row per block; ``accumulate=False``
    overwrites all P rows (blocks without rows write zeros). Parameters: the
    ``layer_norm`` Signature's (:func:`xpkernels.backends.protocol.module_functions`).
    """
    if _rows.mixed(dy, x, dx):  # x, dy, dx of one dtype only: the call in float32
        (dy, x, dx), finish = _rows.in_float32((dy, x, dx), outputs=(2,))
        backward(dy, x, w, mean, rstd, dx, dw_partial, db_partial, accumulate=accumulate)
        return finish()
    t, tw, _ = _types(x, w, None, dy, dx)
    rows, m = x.shape
    partial = dw_partial if dw_partial is not None else db_partial
    if m == 0 or (partial is None and rows == 0):
        return
    dw_strides = _rows.partial_strides(_OP, dw_partial)
    db_strides = _rows.partial_strides(_OP, db_partial)
    if dw_partial is not None and db_partial is not None and dw_partial.shape != db_partial.shape:
        raise ValueError(
            f"cupy layer_norm: dw_partial {tuple(dw_partial.shape)} and db_partial "
            f"{tuple(db_partial.shape)} must have one shape"
        )
    v = _rows.vector((dy, x, dx), (w,))
    c = _rows.cache(v)
    args = (
        dy,
        x,
        _rows.ptr(w),
        mean,
        rstd,
        dx,
        _rows.ptr(dw_partial),
        _rows.ptr(db_partial),
        np.int64(rows),
        np.int32(m),
        np.int64(_rows.stride(dy)),
        np.int64(_rows.stride(x)),
        np.int64(_rows.stride(dx)),
        np.int64(_rows.stride(mean)),
        np.int64(_rows.stride(rstd)),
        *dw_strides,
        *db_strides,
        np.int32(1 if accumulate else 0),
    )
    module = _module(loader_for(x), t, tw, tw)
    _rows.launch_backward(
        lambda kind: module.get_function(f"layer_norm_backward_{kind}<{t},{tw},{v},{c}>"),
        _rows.backward_grid(rows, m, v, partial, x, BLOCKS_PER_SM),
        m,
        v,
        args,
        (dw_partial is not None) + (db_partial is not None),
        SMEM_ACC_MAX_BYTES,
    )


def partials(rows: int, m: int, like) -> int:
    """Rows ``P`` of the partials: ``PARTIALS_PER_SM`` per multiprocessor, at most one per row tile."""
    return _rows.partial_rows(rows, m, like, PARTIALS_PER_SM)


def reduce_partials(partial, out) -> None:
    """``out[:] = partial.sum(0)``: float32 sums in a fixed order, written in ``out``'s dtype.

    ``partial`` float32, ``out`` float32, float16 or bfloat16, both of any
    strides. The contract of :func:`xpkernels.backends.protocol.reduce_partials`.
    """
    loader = loader_for(partial)
    _rows.reduce(_OP, "dw/db", lambda c: _module(loader, c, c, c), partial, out)
