r"""RMSNorm in CUDA C (``rms_norm.cu``), launched through the module-loader interface.

Per row, with :math:`w' = w + \mathrm{offset}` (:math:`w' = 1 + \mathrm{offset}` when ``w`` is None):

.. math::

    \mathrm{rstd} = \big(\tfrac{1}{M}\textstyle\sum_j x_j^2 + \varepsilon\big)^{-1/2},\quad
    y = x\,\mathrm{rstd}\,w',\quad
    dx = \mathrm{rstd}\,\big(g - \hat x\,\tfrac{1}{M}\textstyle\sum_j g_j\hat x_j\big),\quad
    dw = \textstyle\sum_{\text{rows}} dy\,\hat x

with :math:`\hat x = x\,\mathrm{rstd}`, :math:`g = dy\,w'`. Rows of up to
``WARP_MAX_M`` elements get a warp each (``WARP_ROWS`` rows per block), wider
rows a block each; every thread keeps ``CACHE_ELEMENTS`` elements of its row
in registers between the two passes and re-reads the rest. Accesses are 128-bit
vectors whenever the row length, strides and addresses allow. ``dw`` is summed
per block into row ``blockIdx.x`` of ``dw_partial`` and reduced, in a fixed
order, by :func:`reduce_partials`. Accumulation is float32.

The same launchers run on a GPU (CuPy arrays, ``cupy.RawModule``) and on the
CPU harness (NumPy arrays inside ``xpkernels.testing.cudacpu.emulate()``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from . import _rows
from ._loader import OPTIONS, loader_for
from ._rows import CTYPES, cache, ptr, stride, vector

__all__ = ["backward", "forward", "name_expressions", "partials", "reduce_partials", "supports"]

SOURCE = Path(__file__).with_name("rms_norm.cu")
SMEM_ACC_MAX_BYTES = (
    160 * 1024
)  #: wide-row backward: dw sums in shared memory up to this, else in dw_partial
PARTIALS_PER_SM = 2  #: dw_partial rows (backward blocks) per multiprocessor
BLOCKS_PER_SM = 32  #: cap of a backward grid without dw_partial


def supports(x, w=None, out=None) -> str | None:
    """Why the kernels cannot take arrays of these dtypes as they are, or None when they can.

    They take ``x`` (and ``y``/``dy``/``dx``, passed as ``out``) of one of
    float32/float16/bfloat16 and ``w`` None, of ``x``'s dtype or float32; the
    launchers run other mixes in float32 (:func:`._rows.in_float32`).
    """
    if str(x.dtype) not in CTYPES:
        return f"cupy rms_norm: x has dtype {x.dtype}; supported: float32, float16, bfloat16"
    if out is not None and out.dtype != x.dtype:
        return f"cupy rms_norm: the outputs must have x's dtype {x.dtype}, got {out.dtype}"
    if w is not None and str(w.dtype) not in (str(x.dtype), "float32"):
        return f"cupy rms_norm: w must have x's dtype {x.dtype} or float32, got {w.dtype}"
    return None


_KERNELS = ("forward_warp", "forward_block", "backward_warp", "backward_block")


def name_expressions() -> list[str]:
    """Every template instantiation the launchers may compile (for offline compile reports)."""
    pairs = [(t, t) for t in CTYPES.values()] + [(t, "float") for t in ("__half", "__nv_bfloat16")]
    out = [e for t, tw in pairs for e in _rows.expressions("rms_norm", _KERNELS, t, tw)]
    return out + _rows.REDUCE_EXPRESSIONS


def _kernels(loader, x, w, v: int):
    """``kernel(name)``: the ``rms_norm_<name>`` kernel for x's and w's types and ``v``."""
    t = CTYPES[str(x.dtype)]
    tw = t if w is None else CTYPES[str(w.dtype)]
    module = loader.module(SOURCE, _rows.expressions("rms_norm", _KERNELS, t, tw), OPTIONS)
    return lambda name: module.get_function(f"rms_norm_{name}<{t},{tw},{v},{cache(v)}>")


def forward(y, x, w, rstd, *, eps, offset) -> None:
    """``y = x * rstd * (w + offset)`` per row; writes ``rstd`` unless None.

    Parameters: the ``rms_norm`` Signature's (:func:`xpkernels.backends.protocol.module_functions`).
    """
    if supports(x, w, y) is not None:  # dtypes the kernels do not pair: the call in float32
        (y, x, w), finish = _rows.in_float32((y, x, w), outputs=(0,))
        forward(y, x, w, rstd, eps=eps, offset=offset)
        return finish()
    rows, m = x.shape
    if rows == 0:
        return
    v = vector((x, y), (w,))
    args = (
        y,
        x,
        ptr(w),
        ptr(rstd),
        np.int64(rows),
        np.int32(m),
        np.int64(stride(y)),
        np.int64(stride(x)),
        np.int64(0 if rstd is None else stride(rstd)),
        np.float32(eps),
        np.float32(offset),
    )
    kernels = _kernels(loader_for(x), x, w, v)
    _rows.launch(lambda kind: kernels(f"forward_{kind}"), rows, m, v, args, _rows.MAX_THREADS)


def backward(dy, x, w, rstd, dx, dw_partial, *, offset, accumulate) -> None:
    """``dx`` (overwritten) and, unless ``dw_partial`` is None, per-block ``dw`` partial sums.

    ``dw_partial`` (float32) gets one row per block; ``accumulate=False``
    overwrites all P rows (blocks without rows write zeros). Parameters: the
    ``rms_norm`` Signature's (:func:`xpkernels.backends.protocol.module_functions`).
    """
    if supports(x, w, dy) is not None or supports(x, w, dx) is not None:
        (dy, x, w, dx), finish = _rows.in_float32((dy, x, w, dx), outputs=(3,))
        backward(dy, x, w, rstd, dx, dw_partial, offset=offset, accumulate=accumulate)
        return finish()
    rows, m = x.shape
    if m == 0 or (dw_partial is None and rows == 0):
        return
    partial_strides = _rows.partial_strides("rms_norm", dw_partial)
    v = vector((dy, x, dx), (w,))
    args = (
        dy,
        x,
        ptr(w),
        rstd,
        dx,
        ptr(dw_partial),
        np.int64(rows),
        np.int32(m),
        np.int64(stride(dy)),
        np.int64(stride(x)),
        np.int64(stride(dx)),
        np.int64(stride(rstd)),
        *partial_strides,
        np.float32(offset),
        np.int32(1 if accumulate else 0),
    )
    grid = _rows.backward_grid(rows, m, v, dw_partial, x, BLOCKS_PER_SM)
    kernels = _kernels(loader_for(x), x, w, v)
    sums = int(dw_partial is not None)
    _rows.launch_backward(
        lambda kind: kernels(f"backward_{kind}"), grid, m, v, args, sums, SMEM_ACC_MAX_BYTES
    )


def partials(rows: int, m: int, like) -> int:
    """Rows ``P`` of ``dw_partial``: ``PARTIALS_PER_SM`` per multiprocessor, at most one per row tile."""
    return _rows.partial_rows(rows, m, like, PARTIALS_PER_SM)


def reduce_partials(partial, out) -> None:
    """``out[:] = partial.sum(0)``: float32 sums in a fixed order, written in ``out``'s dtype.

    ``partial`` float32, ``out`` float32, float16 or bfloat16, both of any
    strides. The contract of :func:`xpkernels.backends.protocol.reduce_partials`.
    """
    loader = loader_for(partial)
    _rows.reduce(
        "rms_norm",
        "dw",
        lambda c: loader.module(SOURCE, _rows.REDUCE_EXPRESSIONS, OPTIONS),
        partial,
        out,
    )
