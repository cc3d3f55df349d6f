r"""Rotary position embeddings on the Array API.

Pair :math:`i` of a row, :math:`(x_1, x_2)` = ``(x[i], x[i + R2])`` (half
rotation) or ``(x[2i], x[2i + 1])`` (``interleaved``), is rotated by the
table entries :math:`c`, :math:`s` of the row's position:

.. math::

    y_1 = c\,x_1 - \sigma\,s\,x_2, \qquad y_2 = c\,x_2 + \sigma\,s\,x_1,

:math:`\sigma = 1` in the forward and :math:`-1` in the backward (the inverse
rotation of the output's gradient). Features past :math:`R = 2 R_2` are
copied. Position ids are clamped to the table's rows (the front checks their values only
where reading them costs no device sync). Computed in float32 (float64 for float64 inputs) over blocks of
positions of one batch, all heads at once (a block's temporaries stay near
:data:`._blocks.BLOCK_ELEMENTS` elements); each block reads its rows before it
writes them, so the output may be the input. PyTorch CPU tensors run the
NumPy path through zero-copy views (:func:`._blocks.numpy_views`).
"""

from __future__ import annotations

import array_api_compat

from ._blocks import BLOCK_ELEMENTS, acc_dtype, path_arrays, to

__all__ = ["backward", "forward"]


def _pairs(r2: int, interleaved: bool) -> tuple[slice, slice]:
    """The feature slices of the pairs' first and second members."""
    if interleaved:
        return slice(0, 2 * r2, 2), slice(1, 2 * r2, 2)
    return slice(0, r2), slice(r2, 2 * r2)


def _rotate(out, x, cos, sin, position_ids, interleaved: bool, sign: float) -> None:
    out, x, cos, sin, position_ids = path_arrays(out, x, cos, sin, position_ids)
    xp = array_api_compat.array_namespace(out, x, cos, sin)
    acc = acc_dtype(xp, x.dtype)
    batch, heads, seq, dim = x.shape
    r2 = cos.shape[-1]
    first, second = _pairs(r2, interleaved)
    step = max(1, BLOCK_ELEMENTS // (heads * dim))
    for b in range(batch):
        for s0 in range(0, seq, step):
            s1 = min(seq, s0 + step)
            if position_ids is None:
                c, s = cos[b, s0:s1, :], sin[b, s0:s1, :]
            else:
                rows = xp.clip(position_ids[b, s0:s1], 0, cos.shape[1] - 1)
                c, s = xp.take(cos[b, ...], rows, axis=0), xp.take(sin[b, ...], rows, axis=0)
            c, s = to(xp, c, acc)[None, ...], to(xp, s, acc)[None, ...]
            if sign < 0:
                s = -s
            block = x[b, :, s0:s1, :]
            x1, x2 = to(xp, block[..., first], acc), to(xp, block[..., second], acc)
            y1, y2 = c * x1 - s * x2, c * x2 + s * x1
            if 2 * r2 < dim:
                out[b, :, s0:s1, 2 * r2 :] = block[..., 2 * r2 :]
            out[b, :, s0:s1, first] = to(xp, y1, out.dtype)
            out[b, :, s0:s1, second] = to(xp, y2, out.dtype)


def forward(out, x, cos, sin, position_ids, *, interleaved: bool) -> None:
    """``out`` = ``x`` rotated by the table rows ``position_ids`` (None: row ``s``).
    The contract of :class:`xpkernels.backends.protocol.RopeModule`."""
    _rotate(out, x, cos, sin, position_ids, interleaved, 1.0)


def backward(dx, dout, cos, sin, position_ids, *, interleaved: bool) -> None:
    """``dx`` = ``dout`` rotated back (the sines negated).
    The contract of :class:`xpkernels.backends.protocol.RopeModule`."""
    _rotate(dx, dout, cos, sin, position_ids, interleaved, -1.0)
