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

from ._loader import OPTIONS, loader_for
from ._rows import (
    BACKWARD_MAX_THREADS,
    CTYPES,
    MAX_THREADS,
    REDUCE_THREADS,
    WARP_MAX_M,
    WARP_ROWS,
    block_threads,
    cache,
    ptr,
    raise_shared_limit,
    stride,
    vector,
    vectors,
    warp_max,
)

__all__ = ["backward", "forward", "name_expressions", "partials", "reduce_partials", "supports"]

SOURCE = Path(__file__).with_name("rms_norm.cu")
SMEM_ACC_MAX_BYTES = (
    160 * 1024
)  #: wide-row backward: dw sums in shared memory up to this, else in dw_partial
PARTIALS_PER_SM = 2  #: dw_partial rows (backward blocks) per multiprocessor
BLOCKS_PER_SM = 32  #: cap of a backward grid without dw_partial


def supports(x, w=None, out=None) -> str | None:
    """Why this backend cannot serve arrays of these dtypes, or None when it can.

    ``x`` (and ``y``/``dy``/``dx``, passed as ``out``) must share one of
    float32/float16/bfloat16; ``w`` is None, of ``x``'s dtype or float32.
    """
    if str(x.dtype) not in CTYPES:
        return f"cupy rms_norm: x has dtype {x.dtype}; supported: float32, float16, bfloat16"
    if out is not None and out.dtype != x.dtype:
        return f"cupy rms_norm: the outputs must have x's dtype {x.dtype}, got {out.dtype}"
    if w is not None and str(w.dtype) not in (str(x.dtype), "float32"):
        return f"cupy rms_norm: w must have x's dtype {x.dtype} or float32, got {w.dtype}"
    return None


def _check(x, w, *outs) -> None:
    for out in outs:
        reason = supports(x, w, out)
        if reason is not None:
            raise TypeError(reason)


def _expressions(t: str, tw: str) -> list[str]:
    out = []
    for v in vectors(t):
        c = cache(v)
        for kernel in ("forward_warp", "forward_block", "backward_warp", "backward_block"):
            out.append(f"rms_norm_{kernel}<{t},{tw},{v},{c}>")
    return out


def name_expressions() -> list[str]:
    """Every template instantiation the launchers may compile (for offline compile reports)."""
    pairs = [(t, t) for t in CTYPES.values()] + [(t, "float") for t in ("__half", "__nv_bfloat16")]
    out = [e for t, tw in pairs for e in _expressions(t, tw)]
    return out + [f"rms_norm_reduce_partials<{c}>" for c in CTYPES.values()]


def _kernel(loader, x, w, kernel: str, v: int):
    t = CTYPES[str(x.dtype)]
    tw = t if w is None else CTYPES[str(w.dtype)]
    module = loader.module(SOURCE, _expressions(t, tw), OPTIONS)
    return module.get_function(f"rms_norm_{kernel}<{t},{tw},{v},{cache(v)}>")


def forward(y, x, w, rstd, *, eps, offset) -> None:
    """``y = x * rstd * (w + offset)`` over 2-D ``(rows, M)`` views; writes ``rstd`` unless None.

    Parameters
    ----------
    y, x : array
        ``(rows, M)``, last axis contiguous, any row stride; ``y`` may alias ``x``.
    w : array or None
        ``(M,)`` contiguous; None means no weight (``w = 1``).
    rstd : array or None
        ``(rows,)`` float32, receives ``rstd``.
    eps, offset : float
    """
    _check(x, w, y)
    rows, m = x.shape
    if rows == 0:
        return
    loader = loader_for(x)
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
    if m <= warp_max(v):
        kernel = _kernel(loader, x, w, "forward_warp", v)
        kernel((-(-rows // WARP_ROWS),), (32, WARP_ROWS), args)
    else:
        kernel = _kernel(loader, x, w, "forward_block", v)
        kernel((rows,), (block_threads(m, v, MAX_THREADS),), args)


def backward(dy, x, w, rstd, dx, dw_partial, *, offset, accumulate) -> None:
    """``dx`` (overwritten) and, unless ``dw_partial`` is None, per-block ``dw`` partial sums.

    Parameters
    ----------
    dy, x, dx : array
        ``(rows, M)``, last axis contiguous, any row stride; ``dx`` may alias ``dy``.
    w : array or None
        ``(M,)`` contiguous; None means no weight (``w = 1``).
    rstd : array
        ``(rows,)`` float32 checkpoint of the forward.
    dw_partial : array or None
        ``(P, M)`` float32, one row per block. ``accumulate=False``
        overwrites all P rows (blocks without rows write zeros), True adds.
    offset : float
    accumulate : bool
    """
    _check(x, w, dy, dx)
    rows, m = x.shape
    if m == 0 or (dw_partial is None and rows == 0):
        return
    if dw_partial is not None and str(dw_partial.dtype) != "float32":
        raise TypeError(f"cupy rms_norm: dw_partial must be float32, got {dw_partial.dtype}")
    loader = loader_for(x)
    v = vector((dy, x, dx), (w,))
    if dw_partial is None:
        tiles = -(-rows // WARP_ROWS) if m <= warp_max(v) else rows
        grid, partial_strides = min(tiles, BLOCKS_PER_SM * loader.sm_count(x)), (0, 0)
    else:
        grid, partial_strides = (
            dw_partial.shape[0],
            (stride(dw_partial, 0), stride(dw_partial, 1)),
        )
    args = [
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
        np.int64(partial_strides[0]),
        np.int64(partial_strides[1]),
        np.float32(offset),
        np.int32(1 if accumulate else 0),
    ]
    if m <= warp_max(v):
        kernel = _kernel(loader, x, w, "backward_warp", v)
        shared = 0 if dw_partial is None else WARP_ROWS * m * 4
        kernel((grid,), (32, WARP_ROWS), tuple(args), shared_mem=shared)
        return
    smem_acc = dw_partial is not None and m * 4 <= SMEM_ACC_MAX_BYTES
    shared = m * 4 if smem_acc else 0
    kernel = _kernel(loader, x, w, "backward_block", v)
    raise_shared_limit(kernel, shared)
    args.append(np.int32(1 if smem_acc else 0))
    kernel(
        (grid,),
        (block_threads(m, v, min(MAX_THREADS, BACKWARD_MAX_THREADS)),),
        tuple(args),
        shared_mem=shared,
    )


def partials(rows: int, m: int, like) -> int:
    """Rows ``P`` of ``dw_partial``: ``PARTIALS_PER_SM`` per multiprocessor, at most one per row tile."""
    tiles = -(-rows // WARP_ROWS) if m <= WARP_MAX_M else rows
    return max(1, min(PARTIALS_PER_SM * loader_for(like).sm_count(like), tiles))


def reduce_partials(partial, out) -> None:
    """``out[:] = partial.sum(0)``: float32 sums in a fixed order, written in ``out``'s dtype.

    Parameters
    ----------
    partial : array
        ``(P, M)`` float32 partial sums, any strides.
    out : array
        ``(M,)`` float32, float16 or bfloat16, any stride.
    """
    p, m = partial.shape
    if str(out.dtype) not in CTYPES:
        raise TypeError(
            f"cupy rms_norm: dw has dtype {out.dtype}; supported: float32, float16, bfloat16"
        )
    if m == 0:
        return
    loader = loader_for(partial)
    module = loader.module(
        SOURCE, [f"rms_norm_reduce_partials<{c}>" for c in CTYPES.values()], OPTIONS
    )
    kernel = module.get_function(f"rms_norm_reduce_partials<{CTYPES[str(out.dtype)]}>")
    kernel(
        (-(-m // REDUCE_THREADS),),
        (REDUCE_THREADS,),
        (
            partial,
            out,
            np.int32(p),
            np.int32(m),
            np.int64(stride(partial, 0)),
            np.int64(stride(partial, 1)),
            np.int64(stride(out)),
        ),
    )
