r"""SwiGLU in CUDA C (``swiglu.cu``), launched through the module-loader interface.

Elementwise over ``(rows, M)`` views:

.. math::

    y = \mathrm{silu}(a)\,b,\qquad
    da = dy\,b\,s\,\big(1 + a\,(1 - s)\big),\qquad db = dy\,\mathrm{silu}(a),

with :math:`s = \sigma(a)` (from :math:`\exp(-|a|)`: no overflow for any
:math:`|a|`), recomputed by the backward. Computation in float32.

Geometry: blocks of :data:`THREADS` threads laid out ``(X, Y)``: ``Y`` rows
per block, ``X`` threads along a row, each taking ``U = _rows.cache(V)``
vectors of ``V`` elements per step (128-bit accesses where every row start
and stride allows, :func:`._rows.vector`); ``X`` is the fewest threads (a
power of two) that cover a row in one step, at most :data:`THREADS`, and the
grid's y blocks (at most :data:`MAX_COLUMN_BLOCKS`) stride over longer rows.

The same launchers run on a GPU (CuPy arrays, ``cupy.RawModule``) and on the
CPU harness (NumPy arrays inside ``xpkernels.testing.cudacpu.emulate()``).
"""

from __future__ import annotations

from pathlib import Path

from . import _rows
from ._loader import OPTIONS, loader_for

__all__ = ["backward", "forward", "name_expressions"]

SOURCE = Path(__file__).with_name("swiglu.cu")
_KERNELS = ("forward", "backward")
THREADS = 256  #: threads per block (the kernels' __launch_bounds__)
MAX_COLUMN_BLOCKS = 65535  #: most blocks along a row (CUDA's grid y limit); they stride beyond


def name_expressions() -> list[str]:
    """Every template instantiation the launchers may compile (for offline compile reports)."""
    return [e for t in _rows.CTYPES.values() for e in _rows.expressions("swiglu", _KERNELS, t)]


def _geometry(rows: int, m: int, v: int, u: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """``(grid, block)`` of a launch over ``rows`` rows of ``m`` elements, ``u`` vectors of
    ``v`` per thread and step."""
    steps = -(-m // (v * u))  # thread steps that cover a row
    x = min(THREADS, 1 << max(steps - 1, 0).bit_length())
    y = THREADS // x
    column_blocks = min(MAX_COLUMN_BLOCKS, -(-steps // x))
    return (-(-rows // y), column_blocks), (x, y)


def _launch(kind: str, lead, arrays) -> None:
    """Run ``swiglu_<kind>`` over the ``(rows, M)`` ``arrays`` (the kernel's order)."""
    t = _rows.same_type("swiglu", "a", lead, *arrays)
    rows, m = lead.shape
    if rows == 0 or m == 0:
        return
    loader = loader_for(lead)
    v = _rows.vector(arrays)
    u = _rows.cache(v)
    module = loader.module(SOURCE, _rows.expressions("swiglu", _KERNELS, t), OPTIONS)
    kernel = module.get_function(f"swiglu_{kind}<{t},{v},{u}>")
    grid, block = _geometry(rows, m, v, u)
    kernel(grid, block, _rows.row_args(arrays, rows, m))


def forward(y, a, b) -> None:
    """``y = silu(a) * b`` over 2-D ``(rows, M)`` views.

    Parameters
    ----------
    y, a, b : array
        ``(rows, M)`` of one dtype, last axis contiguous, any row stride;
        ``y`` may be the very same array as ``a`` or ``b``.
    """
    _launch("forward", a, (y, a, b))


def backward(dy, a, b, da, db) -> None:
    """``da = dy * b * s * (1 + a * (1 - s))``, ``db = dy * silu(a)`` over ``(rows, M)`` views.

    Parameters
    ----------
    dy, a, b : array
        ``(rows, M)`` inputs of one dtype, last axis contiguous, any row stride.
    da, db : array
        ``(rows, M)`` gradients, overwritten; one of them may be the very same
        array as ``dy``.
    """
    _launch("backward", a, (dy, a, b, da, db))
