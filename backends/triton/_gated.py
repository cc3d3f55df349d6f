r"""Gated activations in Triton (SwiGLU, GeGLU): one elementwise kernel per pass over
``ROWS x BLOCK_M`` tiles, the activation a ``constexpr``.

With an activation :math:`f(a) = a\,g(a)` of the gate ``a``:

.. math::

    y = f(a)\,b, \qquad da = dy\,b\,f'(a), \qquad db = dy\,f(a),

:math:`f` and :math:`f'` recomputed by the backward. The activations
(``ACTIVATION``, :data:`ACTIVATIONS`):

- :data:`SILU`: :math:`g = \sigma(a)`, :math:`f' = s + a\,s\,(1 - s)` with :math:`s = \sigma(a)`;
- :data:`GELU_TANH`: :math:`g = \sigma(z)`, :math:`z = 2\sqrt{2/\pi}\,(a + 0.044715\,a^3)`
  (:math:`\tfrac12(1 + \tanh u) = \sigma(2u)`), :math:`f' = s + a\,s\,(1 - s)\,z'`;
- :data:`GELU`: :math:`g = \Phi(a) = \tfrac12\big(1 + \mathrm{erf}(a/\sqrt2)\big)`
  (``tl.math.erf``: libdevice on a GPU; the interpreter has it too),
  :math:`f' = \Phi(a) + a\,\varphi(a)`, :math:`\varphi(a) = e^{-a^2/2}/\sqrt{2\pi}`.

The sigmoid comes from :math:`e = \exp(-|z|)` (never an overflow, also not in
the interpreter's NumPy): :math:`\sigma(|z|) = 1/(1+e)`, :math:`\sigma(-|z|) =
e/(1+e)`, and :math:`\sigma(z)\,(1 - \sigma(z)) = \sigma(z)\,\sigma(-z)` (no
cancellation near :math:`\sigma = 1`). NaN propagates and :math:`a = \pm\infty` give what PyTorch
gives (:math:`f(+\infty) = +\infty`; :math:`f(-\infty)` and :math:`f'(\pm\infty)`
NaN). As PyTorch's, exact GELU's :math:`\Phi` of a very negative :math:`a` is
accurate to float32's absolute rounding. Computed in float32, stored in each
output's dtype.

Tiles: a program covers ``ROWS`` rows of ``BLOCK_M`` columns (a 1-D grid
over row tiles x column tiles, row offsets in int64). ``BLOCK_M`` is the
padded row up to :data:`COLUMN_BYTES` of the input, ``ROWS`` fills the tile
to :data:`TILE_BYTES` per array, and each thread holds
:data:`VECTORS_PER_THREAD` 16-byte vectors of each array: the accesses are
128-bit wherever the row length, strides and addresses are multiples of 16
(Triton's specialisation), as for the row kernels of :mod:`._common`.
"""

from __future__ import annotations

import math

import triton
import triton.language as tl

from ._common import VECTOR_BYTES, launch, load_tile, row_strides, store_tile

__all__ = ["ACTIVATIONS", "GELU", "GELU_TANH", "SILU", "backward", "forward", "tile_config"]

#: Bytes of one array a program's tile spans along a row, at most.
COLUMN_BYTES = 4096
#: Bytes of one array a tile holds, per pass (the backward keeps three inputs live).
TILE_BYTES = {"forward": 16384, "backward": 8192}
#: 16-byte vectors of each array a thread holds, per pass: sets ``num_warps``.
VECTORS_PER_THREAD = {"forward": 4, "backward": 2}

#: The activations (the kernels' ``ACTIVATION``): SiLU, GELU's tanh form, GELU.
SILU, GELU_TANH, GELU = 0, 1, 2
_GELU_TANH, _GELU = tl.constexpr(GELU_TANH), tl.constexpr(GELU)
#: Every activation by name.
ACTIVATIONS = {"silu": SILU, "gelu_tanh": GELU_TANH, "gelu": GELU}

#: :math:`2\sqrt{2/\pi}` and :math:`0.044715`: the tanh form's :math:`z = s\,(a + c\,a^3)`.
_TANH_SCALE = tl.constexpr(2.0 * math.sqrt(2.0 / math.pi))
_TANH_CUBE = tl.constexpr(0.044715)
#: :math:`1/\sqrt2` and :math:`1/\sqrt{2\pi}`.
_SQRT_HALF = tl.constexpr(math.sqrt(0.5))
_DENSITY_SCALE = tl.constexpr(1.0 / math.sqrt(2.0 * math.pi))
#: Gates are squared clipped to :math:`\pm` this (``_normal_cdf.LIMIT`` of the array_api backend).
_LIMIT = tl.constexpr(40.0)


def tile_config(m: int, itemsize: int, pass_: str) -> tuple[int, int, int]:
    """``(ROWS, BLOCK_M, num_warps)`` of a pass over rows of length ``m``.

    Parameters
    ----------
    m : int
        Row length.
    itemsize : int
        Bytes per element of the lead input (``a``).
    pass_ : {"forward", "backward"}
        Which pass.

    Returns
    -------
    tuple of int
        Powers of two; ``BLOCK_M`` spans at least one 16-byte vector.
    """
    vector = max(1, VECTOR_BYTES // itemsize)
    tile = TILE_BYTES[pass_] // itemsize
    block_m = min(max(triton.next_power_of_2(m), vector), COLUMN_BYTES // itemsize)
    rows = max(1, tile // block_m)
    warps = max(1, rows * block_m // (32 * vector * VECTORS_PER_THREAD[pass_]))
    return rows, block_m, warps


@triton.jit
def _sigmoid(z):
    """``(sigmoid(z), sigmoid(z) * sigmoid(-z))`` of a float32 tile, from ``e = exp(-|z|)``:
    ``sigmoid(|z|) = 1/(1+e)``, ``sigmoid(-|z|) = e/(1+e)`` (no overflow for any ``|z|``, and
    ``sigmoid(z) * (1 - sigmoid(z))`` without cancellation)."""
    e = tl.exp(-tl.abs(z))
    r = 1.0 / (1.0 + e)
    s = tl.where(z >= 0, r, e * r)
    return s, s * tl.where(z >= 0, e * r, r)


@triton.jit
def _activation(a, ACTIVATION: tl.constexpr):
    """``(f(a), f'(a))`` of a float32 tile (the forward's unused ``f'`` is compiled away).

    Squares are taken of ``a`` clipped to :math:`\\pm` :data:`_LIMIT` (no overflow: there the
    gate is exactly 0 or 1 and the density 0), while the factors ``a`` stay unclipped, so that
    :math:`a = \\pm\\infty` gives torch's ``inf * 0`` NaN.
    """
    clipped = tl.minimum(tl.maximum(a, -_LIMIT), _LIMIT)
    square = clipped * clipped
    if ACTIVATION == _GELU:
        cdf = 0.5 + 0.5 * tl.math.erf(a * _SQRT_HALF)
        f = a * cdf
        df = cdf + a * tl.exp(-0.5 * square) * _DENSITY_SCALE
    elif ACTIVATION == _GELU_TANH:
        s, ds = _sigmoid(clipped * (1.0 + square * _TANH_CUBE) * _TANH_SCALE)
        f = a * s
        df = s + a * ds * ((1.0 + square * (3.0 * _TANH_CUBE)) * _TANH_SCALE)
    else:
        s, ds = _sigmoid(a)
        f = a * s
        df = s + a * ds
    return f, df


@triton.jit
def _tile(rows, m, ROWS: tl.constexpr, BLOCK_M: tl.constexpr):
    """This program's ``ROWS x BLOCK_M`` tile: its rows (int64, a column), its columns (a row)
    and the mask of its elements inside ``(rows, m)``."""
    col_tiles = tl.cdiv(m, BLOCK_M)
    pid = tl.program_id(0)
    r = (pid // col_tiles).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = (pid % col_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
    return r[:, None], cols[None, :], (r < rows)[:, None] & (cols < m)[None, :]


def _launch(kernel, activation: int, pass_: str, a, *args) -> None:
    """Launch ``kernel`` (``pass_``'s) with ``ACTIVATION=activation`` over tiles of the gate ``a``."""
    rows, m = a.shape
    tile_rows, block_m, warps = tile_config(m, a.element_size(), pass_)
    grid = (triton.cdiv(rows, tile_rows) * triton.cdiv(m, block_m),)
    meta = {"ROWS": tile_rows, "BLOCK_M": block_m, "ACTIVATION": activation, "num_warps": warps}
    launch(kernel, a, grid, *args, **meta)


@triton.jit
def _forward_kernel(
    y_ptr,  # (rows, M) output; may be a_ptr or b_ptr
    a_ptr, b_ptr,  # (rows, M) gate, gated values
    rows, m,  # number of rows, row length M
    stride_y, stride_a, stride_b,  # elements between rows of y, a, b
    ROWS: tl.constexpr,  # rows per tile
    BLOCK_M: tl.constexpr,  # columns per tile
    ACTIVATION: tl.constexpr,  # SILU, GELU_TANH or GELU
):  # fmt: skip
    r, cols, mask = _tile(rows, m, ROWS, BLOCK_M)
    a = load_tile(a_ptr, r, cols, stride_a, mask)
    b = load_tile(b_ptr, r, cols, stride_b, mask)
    store_tile(y_ptr, r, cols, stride_y, mask, _activation(a, ACTIVATION)[0] * b)


def forward(activation: int, y, a, b) -> None:
    """``y = f(a) * b`` for ``activation`` (one of :data:`ACTIVATIONS`); ``y``, ``a``, ``b`` as
    the ``swiglu``/``geglu`` forward takes them."""
    rows, m = a.shape
    if rows == 0 or m == 0:
        return
    _launch(_forward_kernel, activation, "forward", a, y, a, b, rows, m, *row_strides(y, a, b))


@triton.jit
def _backward_kernel(
    dy_ptr,  # (rows, M) output gradient
    a_ptr, b_ptr,  # (rows, M) gate, gated values
    da_ptr, db_ptr,  # (rows, M) their gradients, overwritten; either may be dy_ptr
    rows, m,  # number of rows, row length M
    stride_dy, stride_a, stride_b, stride_da, stride_db,  # elements between rows of each
    ROWS: tl.constexpr,  # rows per tile
    BLOCK_M: tl.constexpr,  # columns per tile
    ACTIVATION: tl.constexpr,  # SILU, GELU_TANH or GELU
):  # fmt: skip
    r, cols, mask = _tile(rows, m, ROWS, BLOCK_M)
    dy = load_tile(dy_ptr, r, cols, stride_dy, mask)
    a = load_tile(a_ptr, r, cols, stride_a, mask)
    b = load_tile(b_ptr, r, cols, stride_b, mask)
    f, df = _activation(a, ACTIVATION)
    store_tile(da_ptr, r, cols, stride_da, mask, dy * b * df)
    store_tile(db_ptr, r, cols, stride_db, mask, dy * f)


def backward(activation: int, dy, a, b, da, db) -> None:
    """``da = dy * b * f'(a)``, ``db = dy * f(a)`` for ``activation`` (one of :data:`ACTIVATIONS`);
    the arrays as the ``swiglu``/``geglu`` backward takes them, either ``da`` or ``db`` possibly
    ``dy`` (each element is loaded before either is stored)."""
    rows, m = a.shape
    if rows == 0 or m == 0:
        return
    args = (dy, a, b, da, db, rows, m, *row_strides(dy, a, b, da, db))
    _launch(_backward_kernel, activation, "backward", a, *args)
