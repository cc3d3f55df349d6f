r"""Rotary position embeddings in CUDA C (``rope.cu``).

Query ``s`` of batch ``b`` takes row :math:`p` = ``position_ids[b, s]`` of
the ``(B, P, R2)`` tables (row ``s`` without position ids); pair ``i`` --
``(x[i], x[i + R2])`` in the half layout, ``(x[2i], x[2i + 1])``
interleaved -- is rotated by :math:`c = \cos[b, p, i]`, :math:`s = \sin[b, p, i]`:

.. math::

    \text{forward: } (x_1 c - x_2 s,\; x_2 c + x_1 s),\qquad
    \text{backward: } (d_1 c + d_2 s,\; d_2 c - d_1 s),

one kernel for both (the backward negates the sine). Elements from
``R = 2 R2`` to ``D`` are copied (skipped when the output is the input).
Computation in float32, stored in the output's dtype.

Geometry: blocks of :data:`THREADS` threads laid out ``(X, Y)``: ``Y`` rows
``(b, s)`` per block, ``X`` threads along a row's units (a rotation unit:
``V`` pairs in the half layout, ``max(V, 2)`` elements interleaved; then
the copied tail's vectors), ``X`` the fewest threads (a power of two) that
cover them, at most :data:`THREADS`. Each thread reads its unit's cosines
and sines once and rotates about :data:`HEADS` heads with them, one after
another: the grid's y blocks (``H / HEADS``, at most
:data:`MAX_HEAD_BLOCKS`) stride over the heads. Accesses of ``x`` and the
output are 128-bit vectors where the pair layout, every row and every table
row allow it (:func:`_vector`), else scalar; offsets are int64 from every
array's own strides.

The same launchers run on a GPU (CuPy arrays, ``cupy.RawModule``) and on the
CPU harness (NumPy arrays inside ``xpkernels.testing.cudacpu.emulate()``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from . import _rows
from ._loader import OPTIONS, address, loader_for

__all__ = ["backward", "forward", "name_expressions"]

SOURCE = Path(__file__).with_name("rope.cu")
THREADS = 256  #: threads per block (the kernel's __launch_bounds__)
HEADS = 4  #: heads each thread rotates (the grid's y: H / HEADS) with one load of its tables
MAX_HEAD_BLOCKS = 65535  #: most blocks along the heads (CUDA's grid y limit); they stride beyond
_GRID_MAX = 2**31 - 1
#: The table dtypes and the kernel's kinds for them.
_TABLE_KINDS = {"float32": 0, "float16": 1, "bfloat16": 2, "float64": 3}
_LAYOUTS = ("false", "true")  #: the kernel's INTERLEAVED


def _expressions(t: str) -> list[str]:
    """The instantiations ``rope<T, V, INTERLEAVED>`` for dtype ``t``."""
    return [f"rope<{t},{v},{i}>" for v in _rows.vectors(t) for i in _LAYOUTS]


def name_expressions() -> list[str]:
    """Every template instantiation the launchers may compile (for offline compile reports)."""
    return [e for t in _rows.CTYPES.values() for e in _expressions(t)]


def _vector(rows, tables, r2: int, d: int, interleaved: bool) -> int:
    """Elements per access of the ``(B, H, S, D)`` ``rows``: 16 bytes' worth when the pair layout,
    the ``d`` elements written, every row and every table row allow it, else 1.

    A unit of ``v`` elements needs ``v`` pairs (half layout) or ``v // 2``
    (interleaved) of each table, read in accesses of at most 16 bytes: the
    tables' rows must be aligned to that many elements.
    """
    v = 16 // rows[0].itemsize
    rotated = 2 * r2 if interleaved else r2
    if rotated % v or d % v:
        return 1
    if not all(address(a) % 16 == 0 and _rows.aligned(a, range(3), v) for a in rows):
        return 1
    pairs = v // 2 if interleaved else v
    for t in tables:
        n = min(pairs, 16 // t.itemsize)
        if address(t) % (n * t.itemsize) or not _rows.aligned(t, range(2), n):
            return 1
    return v


def _geometry(rows: int, units: int, heads: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """``(grid, block)`` of a launch over ``rows`` rows ``(b, s)`` of ``units`` units and
    ``heads`` heads."""
    x = min(THREADS, 1 << max(units - 1, 0).bit_length())
    y = THREADS // x
    grid = -(-rows // y)
    if grid > _GRID_MAX:
        raise ValueError(f"cupy rope: {rows} rows need {grid} blocks, more than {_GRID_MAX}")
    return (grid, min(MAX_HEAD_BLOCKS, -(-heads // HEADS))), (x, y)


def _table_kind(cos, sin) -> np.int32:
    kind = _TABLE_KINDS.get(str(cos.dtype))
    if kind is None:
        raise TypeError(
            f"cupy rope: cos has dtype {cos.dtype}; supported: float32, float16, bfloat16, float64"
        )
    if sin.dtype != cos.dtype:
        raise TypeError(f"cupy rope: sin must have cos's dtype {cos.dtype}, got {sin.dtype}")
    return np.int32(kind)


def _launch(out, x, cos, sin, position_ids, interleaved: bool, sign: float) -> None:
    """Rotate ``x`` into ``out`` (``sign`` -1: the inverse rotation); see the module docstring."""
    t = _rows.same_type("rope", "x", x, out)
    kind = _table_kind(cos, sin)
    position_bytes = (
        np.int32(0)
        if position_ids is None
        else _rows.index_bytes("rope", "position_ids", position_ids)
    )
    batch, heads, seq, dim = x.shape
    r2 = cos.shape[2]
    if 2 * r2 > dim:
        raise ValueError(f"cupy rope: {r2} rotated pairs need a head dim of {2 * r2}, got {dim}")
    in_place = address(out) == address(x) and out.strides == x.strides
    d = 2 * r2 if in_place else dim  # the elements of a row written
    rows = batch * seq
    if rows == 0 or heads == 0 or d == 0:
        return
    v = _vector((out, x), (cos, sin), r2, d, interleaved)
    per_unit = max(v, 2) if interleaved else v  # elements of a rotation unit (a side)
    units = 2 * r2 // per_unit if interleaved else r2 // v
    units += (d - 2 * r2) // v
    grid, block = _geometry(rows, units, heads)
    module = loader_for(x).module(SOURCE, _expressions(t), OPTIONS)
    kernel = module.get_function(f"rope<{t},{v},{_LAYOUTS[interleaved]}>")
    args = (
        out,
        x,
        cos,
        sin,
        kind,
        _rows.ptr(position_ids),
        position_bytes,
        np.int64(cos.shape[1]),
        np.float32(sign),
        np.int64(rows),
        np.int64(seq),
        np.int64(heads),
        np.int32(r2),
        np.int32(d),
        *_rows.strides(out, range(3)),
        *_rows.strides(x, range(3)),
        *_rows.strides(cos, range(2)),
        *_rows.strides(sin, range(2)),
        *_rows.strides(position_ids, range(2)),
    )
    kernel(grid, block, args)


def forward(out, x, cos, sin, position_ids, *, interleaved: bool) -> None:
    """``out`` = ``x`` with its pairs rotated forward: ``(x1 c - x2 s, x2 c + x1 s)``.

    ``out`` of ``x``'s dtype; ``cos`` and ``sin`` of one dtype of float32, float16,
    bfloat16 or float64, not necessarily ``x``'s; ``2 R2 <= D``. The contract of
    :class:`xpkernels.backends.protocol.RopeModule`.
    """
    _launch(out, x, cos, sin, position_ids, interleaved, 1.0)


def backward(dx, dout, cos, sin, position_ids, *, interleaved: bool) -> None:
    """``dx`` = ``dout`` with its pairs rotated back: ``(d1 c + d2 s, d2 c - d1 s)``.

    Dtypes as :func:`forward`'s. The contract of :class:`xpkernels.backends.protocol.RopeModule`.
    """
    _launch(dx, dout, cos, sin, position_ids, interleaved, -1.0)
