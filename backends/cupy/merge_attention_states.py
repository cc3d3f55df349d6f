r"""Merging two attention states in CUDA C (``merge_attention_states.cu``).

.. math::

    m = \max(m_a, m_b),\quad l = l_a e^{m_a - m} + l_b e^{m_b - m},\quad
    o = w_a o_a + w_b o_b,\quad w_a = l_a e^{m_a - m} / l

Backward: ``do_a = w_a do``, ``dlse_a = w_a (rowsum(do * (o_a - o)) +
dlse)``, the same for ``b``. A row ``(b, h, s)`` of the ``(B, H, S)``
states gets ``G`` lanes of a warp (the smallest power of two, at most 32,
with ``G * V >= Dv``), so short rows share a warp and long ones loop; each
access moves ``V`` elements: 16 bytes of the narrowest o-shaped dtype when
every o-shaped array's rows allow it (``Dv``, strides and addresses), else
the widest of :data:`VECTORS` they allow. Offsets are int64 from every
array's own strides. Empty rows (``m = -inf``) merge without NaN, and NaN
propagates as on the array_api backend (see the ``.cu``). Any output may be
the very same array as the input the front allows it to alias.

The same launchers run on a GPU (CuPy arrays, ``cupy.RawModule``) and on the
CPU harness (NumPy arrays inside ``xpkernels.testing.cudacpu.emulate()``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from . import _rows
from ._loader import OPTIONS, address, loader_for
from ._rows import NULL

__all__ = ["backward", "forward", "name_expressions"]

SOURCE = Path(__file__).with_name("merge_attention_states.cu")
#: Threads per block; a block holds ``THREADS // G`` rows.
THREADS = 256
#: Elements per access compiled: 16 bytes of float32 (4) or of a 16-bit dtype (8), and the
#: narrower ones rows of other lengths or strides allow (2, 1).
VECTORS = (1, 2, 4, 8)
_GRID_MAX = 2**31 - 1
_OP = "merge_attention_states"


def name_expressions() -> list[str]:
    """Every template instantiation the launchers may compile (for offline compile reports)."""
    return [
        f"merge_attention_states_{kind}<{v}>" for v in VECTORS for kind in ("forward", "backward")
    ]


def _kind(name: str, a) -> np.int32:
    return _rows.kind(_OP, name, a)


def _vector(tiles) -> int:
    """Elements per access: the widest of :data:`VECTORS` within 16 bytes that every row allows."""
    dv = tiles[0].shape[3]
    widest = 16 // min(a.itemsize for a in tiles)
    for v in sorted(VECTORS, reverse=True):
        ok = v <= widest and dv % v == 0
        if ok and all(
            address(a) % (v * a.itemsize) == 0 and _rows.aligned(a, range(3), v) for a in tiles
        ):
            return v
    return 1


def _geometry(o_a, v: int):
    """``(rows, group, grid)``: ``B * H * S``, lanes per row, blocks."""
    batch, heads, seq, dv = o_a.shape
    rows = batch * heads * seq
    chunks = max(1, -(-dv // v))
    group = min(32, 1 << (chunks - 1).bit_length())
    grid = -(-rows // (THREADS // group))
    if grid > _GRID_MAX:
        raise ValueError(
            f"cupy merge_attention_states: {rows} rows need {grid} blocks, more than {_GRID_MAX}"
        )
    return rows, group, grid


def _launch(kind: str, o_a, tiles, args, strided) -> None:
    v = _vector(tiles)
    rows, group, grid = _geometry(o_a, v)
    if rows == 0:
        return
    _, heads, seq, dv = o_a.shape
    name = f"merge_attention_states_{kind}<{v}>"
    module = loader_for(o_a).module(SOURCE, name_expressions(), OPTIONS)
    module.get_function(name)(
        (grid,),
        (THREADS,),
        (
            *args,
            np.int64(rows),
            np.int64(heads),
            np.int64(seq),
            np.int32(dv),
            np.int32(group),
            *(s for a in strided for s in _rows.strides(a, range(3))),  # (b, h, s) of each
        ),
    )


def forward(o, m, l, o_a, m_a, l_a, o_b, m_b, l_b) -> None:
    """``(o, m, l)`` of attention over both key sets; see the module docstring.

    ``o_a`` and ``o_b`` of one dtype, ``o`` any of float32, float16 or
    bfloat16; the states float32, any strides. The contract of
    :class:`xpkernels.backends.protocol.MergeAttentionStatesModule`.
    """
    _rows.float32s(_OP, m=m, l=l, m_a=m_a, l_a=l_a, m_b=m_b, l_b=l_b)
    in_kind = _kind("o_a", o_a)
    if o_b.dtype != o_a.dtype:
        raise TypeError(f"cupy merge_attention_states: o_b must have o_a's dtype {o_a.dtype}")
    args = (o, _kind("o", o), m, l, o_a, o_b, in_kind, m_a, l_a, m_b, l_b)
    _launch("forward", o_a, (o, o_a, o_b), args, (o, m, l, o_a, m_a, l_a, o_b, m_b, l_b))


def backward(do, dlse, o, m, l, o_a, m_a, l_a, o_b, m_b, l_b, do_a, dlse_a, do_b, dlse_b) -> None:
    """``do_a``, ``dlse_a``, ``do_b``, ``dlse_b``, overwritten in full; see the module docstring.

    The ``o``-shaped arrays each float32, float16 or bfloat16 (``o_b`` of
    ``o_a``'s dtype); the states float32, any strides. The contract of
    :class:`xpkernels.backends.protocol.MergeAttentionStatesModule`.
    """
    _rows.float32s(
        _OP, dlse=dlse, m=m, l=l, m_a=m_a, l_a=l_a, m_b=m_b, l_b=l_b, dlse_a=dlse_a, dlse_b=dlse_b
    )
    in_kind = _kind("o_a", o_a)
    if o_b.dtype != o_a.dtype:
        raise TypeError(f"cupy merge_attention_states: o_b must have o_a's dtype {o_a.dtype}")
    args = (
        do,
        _kind("do", do),
        NULL if dlse is None else dlse,
        o,
        _kind("o", o),
        m,
        l,
        o_a,
        o_b,
        in_kind,
        m_a,
        l_a,
        m_b,
        l_b,
        do_a,
        _kind("do_a", do_a),
        dlse_a,
        do_b,
        _kind("do_b", do_b),
        dlse_b,
    )
    strided = (do, dlse, o, m, l, o_a, m_a, l_a, o_b, m_b, l_b, do_a, dlse_a, do_b, dlse_b)
    _launch("backward", o_a, (do, o, o_a, o_b, do_a, do_b), args, strided)
