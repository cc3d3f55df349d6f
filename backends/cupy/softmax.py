r"""Softmax over the last axis in CUDA C (``softmax.cu``), launched through the module-loader interface.

Per row :math:`x` of length :math:`M`:

.. math::

    y = \frac{\exp(x - \max x)}{\sum_j \exp(x_j - \max x)},\qquad
    dx = y\,\big(dy - \textstyle\sum_j y_j\,dy_j\big)

Geometry as in :mod:`._rows`: a warp per row up to ``WARP_MAX_M``
elements, else a block per row; each thread keeps part of its row in
registers and streams the rest (the forward folds streamed elements into a
running max and rescaled sum, so they are read once for the statistics and
once for the output); 128-bit accesses where aligned. Accumulation is
float32; ``-inf`` logits give 0.

The same launchers run on a GPU (CuPy arrays, ``cupy.RawModule``) and on the
CPU harness (NumPy arrays inside ``xpkernels.testing.cudacpu.emulate()``).
"""

from __future__ import annotations

from pathlib import Path

from . import _rows
from ._loader import OPTIONS, loader_for

__all__ = ["backward", "forward", "name_expressions"]

SOURCE = Path(__file__).with_name("softmax.cu")
_KERNELS = ("forward_warp", "forward_block", "backward_warp", "backward_block")


def name_expressions() -> list[str]:
    """Every template instantiation the launchers may compile (for offline compile reports)."""
    return [e for t in _rows.CTYPES.values() for e in _rows.expressions("softmax", _KERNELS, t)]


def _launch(kind: str, arrays, output: int, threads_limit: int) -> None:
    """Run ``softmax_<kind>_{warp,block}`` over the ``(rows, M)`` ``arrays`` (the kernel's order,
    ``arrays[output]`` written), in float32 when their dtypes differ (:func:`._rows.in_float32`)."""
    if _rows.mixed(*arrays):
        staged, finish = _rows.in_float32(arrays, outputs=(output,))
        _launch(kind, staged, output, threads_limit)
        return finish()
    lead = arrays[1] if kind == "forward" else arrays[0]
    t = _rows.same_type("softmax", "x" if kind == "forward" else "y", lead, *arrays)
    rows, m = lead.shape
    if rows == 0 or m == 0:
        return
    v = _rows.vector(arrays)
    c = _rows.cache(v)
    module = loader_for(lead).module(SOURCE, _rows.expressions("softmax", _KERNELS, t), OPTIONS)
    _rows.launch(
        lambda shape: module.get_function(f"softmax_{kind}_{shape}<{t},{v},{c}>"),
        rows,
        m,
        v,
        _rows.row_args(arrays, rows, m),
        threads_limit,
    )


def forward(y, x) -> None:
    """``y = softmax(x)`` per row.

    Parameters: the ``softmax`` Signature's (:func:`xpkernels.backends.protocol.module_functions`).
    """
    _launch("forward", (y, x), 0, _rows.MAX_THREADS)


def backward(y, dy, dx) -> None:
    """``dx = y * (dy - sum(y * dy))`` per row.

    Parameters: the ``softmax`` Signature's (:func:`xpkernels.backends.protocol.module_functions`).
    """
    _launch("backward", (y, dy, dx), 2, _rows.BACKWARD_MAX_THREADS)
