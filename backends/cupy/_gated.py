r"""Launch code of the gated activations in CUDA C (``gated.cuh``, included by ``swiglu.cu`` and
``geglu.cu``), through the module-loader interface.

Elementwise over ``(rows, M)`` views, with an activation :math:`f(a) = a\,g(a)`
(a template parameter of the kernels, defined by each ``.cu``):

.. math::

    y = f(a)\,b,\qquad da = dy\,b\,f'(a),\qquad db = dy\,f(a),

:math:`f` and :math:`f'` recomputed by the backward. Computation in float32.

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

__all__ = ["launch", "name_expressions"]

_KERNELS = ("forward", "backward")
THREADS = 256  #: threads per block (the kernels' __launch_bounds__)
MAX_COLUMN_BLOCKS = 65535  #: most blocks along a row (CUDA's grid y limit); they stride beyond


def _expressions(t: str, activations) -> list[str]:
    """The instantiations ``gated_<kernel><t, Act, V, U>`` of every activation for dtype ``t``."""
    return [e for act in activations for e in _rows.expressions("gated", _KERNELS, t, act)]


def name_expressions(activations) -> list[str]:
    """Every instantiation a ``.cu`` defining ``activations`` may compile (offline reports)."""
    return [e for t in _rows.CTYPES.values() for e in _expressions(t, activations)]


def _geometry(rows: int, m: int, v: int, u: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """``(grid, block)`` of a launch over ``rows`` rows of ``m`` elements, ``u`` vectors of
    ``v`` per thread and step."""
    steps = -(-m // (v * u))  # thread steps that cover a row
    x = min(THREADS, 1 << max(steps - 1, 0).bit_length())
    y = THREADS // x
    column_blocks = min(MAX_COLUMN_BLOCKS, -(-steps // x))
    return (-(-rows // y), column_blocks), (x, y)


def launch(op: str, source: Path, activations, activation: str, kind: str, arrays) -> None:
    """Run ``gated_<kind>`` with ``activation`` over the ``(rows, M)`` ``arrays`` (the kernel's
    order; the gate ``a`` is the second).

    Parameters
    ----------
    op : str
        The primitive, for error messages.
    source : Path
        The ``.cu`` defining ``activations`` (compiled once per dtype with all of them).
    activations : tuple of str
        Every activation type ``source`` defines.
    activation : str
        The one to run.
    kind : {"forward", "backward"}
        Which kernel.
    arrays : tuple
        ``(y, a, b)`` or ``(dy, a, b, da, db)``.
    """
    if _rows.mixed(*arrays):  # one dtype per kernel: the call in float32
        written = (0,) if kind == "forward" else (3, 4)
        staged, finish = _rows.in_float32(arrays, outputs=written)
        launch(op, source, activations, activation, kind, staged)
        return finish()
    lead = arrays[1]
    t = _rows.same_type(op, "a", lead, *arrays)
    rows, m = lead.shape
    if rows == 0 or m == 0:
        return
    loader = loader_for(lead)
    v = _rows.vector(arrays)
    u = _rows.cache(v)
    module = loader.module(source, _expressions(t, activations), OPTIONS)
    kernel = module.get_function(f"gated_{kind}<{t},{activation},{v},{u}>")
    grid, block = _geometry(rows, m, v, u)
    kernel(grid, block, _rows.row_args(arrays, rows, m))
