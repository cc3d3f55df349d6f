r"""Gated activations on the Array API: SwiGLU and GeGLU, one elementwise implementation.

Over ``(rows, M)`` views, with an activation :math:`f(a) = a\,g(a)` of the gate:

.. math::

    y = f(a)\,b, \qquad da = dy\,b\,f'(a), \qquad db = dy\,f(a).

The :class:`Activation` is the only difference between the primitives:

- SiLU (SwiGLU): :math:`g = \sigma(a)`;
- GELU's tanh form (GeGLU, ``approximate="tanh"``): :math:`g = \sigma(z)`,
  :math:`z = 2\sqrt{2/\pi}\,(a + 0.044715\,a^3)`, as
  :math:`\tfrac12(1 + \tanh u) = \sigma(2u)`;
- GELU (GeGLU, ``approximate="none"``): :math:`g = \Phi(a)`,
  :math:`f'(a) = \Phi(a) + a\,\varphi(a)` (:mod:`._normal_cdf`).

The sigmoid gates come from :math:`e = \exp(-|z|)` and :math:`r = 1/(1 + e)`,
which never overflow (:math:`z` has :math:`a`'s sign):

.. math::

    f(a) = \big(\max(a, 0) + e\,\min(a, 0)\big)\,r, \qquad
    \sigma(z) = e^{\min(z, 0)}\,r, \qquad
    f'(a) = \sigma(z) + a\,e\,r^2\,z'(a),

using :math:`\sigma(z)\,(1 - \sigma(z)) = e\,r^2`. Both tails keep their
relative accuracy without a ``where`` (on NumPy a ``where`` over a random
mask cost more than all the rest of the SiLU forward), and :math:`a = \pm\infty`
give what PyTorch gives: :math:`f(+\infty) = +\infty`, :math:`f(-\infty)` and
:math:`f'(\pm\infty)` NaN (:math:`\infty \cdot 0`). NaN propagates. The tanh
form's :math:`z` is taken of :math:`a` clipped to :math:`\pm` :data:`._normal_cdf.LIMIT`
(there :math:`e = 0` already), so :math:`a^2` never overflows.

Computed in float32 (float64 for float64 inputs) over row blocks of
:data:`BLOCK_ELEMENTS`, shared among NumPy worker threads; each block's
temporaries go into reused buffers on NumPy (:class:`Scratch`), and PyTorch
CPU tensors run the NumPy path through zero-copy views
(:func:`._blocks.numpy_views`). Each block reads all of its inputs before it
writes an output, so ``y`` may be ``a`` or ``b``, and ``da`` or ``db`` may be
``dy``.
"""

from __future__ import annotations

import math
from typing import Protocol

import array_api_compat

from ._blocks import acc_dtype, block_rows, for_each_block, path_arrays, store, to, workers
from ._normal_cdf import LIMIT, normal_cdf, normal_cdf_and_pdf

__all__ = ["BLOCK_ELEMENTS", "GELU", "SILU", "Activation", "Scratch", "backward", "forward"]

#: Elements per row block (float32: 256 KiB per temporary): a block's half-dozen buffers and
#: inputs stay in a core's L2 cache (measured best of 2**15..2**17 at (8192, 4096) float32).
BLOCK_ELEMENTS = 1 << 16

#: :math:`2\sqrt{2/\pi}` and :math:`0.044715`: GELU's tanh form is :math:`a\,\sigma\big(s\,(a +
#: c\,a^3)\big)`.
_TANH_SCALE, _TANH_CUBE = 2.0 * math.sqrt(2.0 / math.pi), 0.044715


class Scratch:
    """One worker's block temporaries, by name.

    ``ops = scratch.block(rows)`` gives the block's evaluator:
    ``ops(name, fn, *args)`` is the Array API elementwise function ``fn`` of
    ``args``. On NumPy it is computed into buffer ``name`` (``out=``; made on
    first use, ``(block rows, M)``, reused by every block of the call): a
    fresh temporary of a block would cost a page fault per 4 KiB, which was
    slower than the arithmetic. Elsewhere it is a new array. A value stays
    valid until its name is written again.
    """

    def __init__(self, xp, rows: int, m: int, dtype):
        self._xp = xp
        self._numpy = array_api_compat.is_numpy_namespace(xp)
        self._shape = (block_rows(rows, m, BLOCK_ELEMENTS), m)
        self._dtype = dtype
        self._buffers: dict = {}

    def block(self, rows: int):
        """The evaluator of a block of ``rows`` rows."""
        if not self._numpy:
            return lambda name, fn, *args: getattr(self._xp, fn)(*args)
        import numpy

        def ops(name, fn, *args):
            buffer = self._buffers.get(name)
            if buffer is None:
                buffer = self._buffers[name] = numpy.empty(self._shape, dtype=self._dtype)
            return getattr(numpy, fn)(*args, out=buffer[:rows])

        return ops


def _sigmoid_value(ops, a, z):
    """:math:`a\\,\\sigma(z)` for :math:`z` of :math:`a`'s sign (buffers ``e``, ``value``)."""
    e = ops("e", "abs", z)
    e *= -1.0
    e = ops("e", "exp", e)
    out = ops("value", "minimum", a, 0.0)
    out *= e
    out += ops("positive", "maximum", a, 0.0)
    e += 1.0
    out /= e
    return out


def _sigmoid_value_and_slope(ops, a, z, dz):
    """``(a sigma(z), sigma(z) + a e r^2 z')`` (buffers ``e``, ``value``, ``slope``);
    ``dz`` None stands for :math:`z' = 1`."""
    e = ops("e", "abs", z)
    e *= -1.0
    e = ops("e", "exp", e)
    gate = ops("value", "minimum", z, 0.0)
    gate = ops("value", "exp", gate)
    slope = ops("slope", "multiply", e, a)
    e += 1.0
    gate /= e
    slope /= e
    slope /= e
    if dz is not None:
        slope *= dz
    slope += gate
    gate *= a
    return gate, slope


class Activation(Protocol):
    """A gated activation :math:`f(a) = a\\,g(a)` over row blocks.

    Arrays of ``a``'s dtype made by ``ops`` (a :class:`Scratch` evaluator);
    ``a`` is not written.
    """

    def value(self, xp, ops, a):
        """:math:`f(a)`."""

    def value_and_slope(self, xp, ops, a):
        """``(f(a), f'(a))``."""


class _Silu(Activation):
    """SiLU: :math:`g = \\sigma(a)`."""

    def value(self, xp, ops, a):
        return _sigmoid_value(ops, a, a)

    def value_and_slope(self, xp, ops, a):
        return _sigmoid_value_and_slope(ops, a, a, None)


class _GeluTanh(Activation):
    """GELU's tanh form: :math:`g = \\sigma(z)`, :math:`z = s\\,(a + c\\,a^3)` (:data:`_TANH_SCALE`,
    :data:`_TANH_CUBE`) of :math:`a` clipped to :math:`\\pm` :data:`._normal_cdf.LIMIT`."""

    @staticmethod
    def _argument(ops, a):
        """``(z, a clipped, a clipped squared)`` (buffers ``z``, ``clipped``)."""
        clipped = ops("clipped", "clip", a, -LIMIT, LIMIT)
        square = ops("z", "multiply", clipped, clipped)
        z = ops("z", "multiply", square, _TANH_SCALE * _TANH_CUBE)
        z += _TANH_SCALE
        z *= clipped
        return z, clipped

    def value(self, xp, ops, a):
        return _sigmoid_value(ops, a, self._argument(ops, a)[0])

    def value_and_slope(self, xp, ops, a):
        z, clipped = self._argument(ops, a)
        dz = ops("clipped", "multiply", clipped, clipped)
        dz *= 3.0 * _TANH_SCALE * _TANH_CUBE
        dz += _TANH_SCALE
        return _sigmoid_value_and_slope(ops, a, z, dz)


class _Gelu(Activation):
    """GELU: :math:`g = \\Phi(a)`, :math:`f'(a) = \\Phi(a) + a\\,\\varphi(a)`."""

    def value(self, xp, ops, a):
        out = normal_cdf(xp, ops, a)
        out *= a
        return out

    def value_and_slope(self, xp, ops, a):
        gate, slope = normal_cdf_and_pdf(xp, ops, a)
        slope *= a
        slope += gate
        gate *= a
        return gate, slope


#: SwiGLU's activation: SiLU, :math:`a\,\sigma(a)`.
SILU: Activation = _Silu()
#: GeGLU's activations by ``approximate``: GELU exactly (``"none"``) and its tanh form.
GELU: dict[str, Activation] = {"none": _Gelu(), "tanh": _GeluTanh()}


def forward(activation: Activation, y, a, b) -> None:
    """``y = f(a) * b`` over 2-D ``(rows, M)`` views; ``y`` may be ``a`` or ``b``.

    Computed in float32 (float64 for float64 ``a``), written in ``y``'s dtype.
    """
    y, a, b = path_arrays(y, a, b)
    xp = array_api_compat.array_namespace(y, a, b)
    acc = acc_dtype(xp, a.dtype)
    rows, m = a.shape
    if rows == 0 or m == 0:
        return
    n_workers = workers(xp, rows, m, BLOCK_ELEMENTS)
    scratch = [Scratch(xp, rows, m, acc) for _ in range(n_workers)]

    def block(worker, r0, r1):
        ops = scratch[worker].block(r1 - r0)
        out = activation.value(xp, ops, to(xp, a[r0:r1, :], acc))
        store(xp, y, r0, r1, "multiply", out, to(xp, b[r0:r1, :], acc))

    for_each_block(xp, block, rows, m, n_workers, BLOCK_ELEMENTS)


def backward(activation: Activation, dy, a, b, da, db) -> None:
    """``da = dy * b * f'(a)``, ``db = dy * f(a)`` over ``(rows, M)`` views.

    :math:`f` and :math:`f'` are recomputed from ``a``. ``da`` or ``db``
    (overwritten) may be ``dy``: each block computes ``db`` before it stores
    ``da`` (reading ``dy`` element by element as it writes it), then ``db``.
    """
    dy, a, b, da, db = path_arrays(dy, a, b, da, db)
    xp = array_api_compat.array_namespace(dy, a, b, da, db)
    acc = acc_dtype(xp, a.dtype)
    rows, m = a.shape
    if rows == 0 or m == 0:
        return
    n_workers = workers(xp, rows, m, BLOCK_ELEMENTS)
    scratch = [Scratch(xp, rows, m, acc) for _ in range(n_workers)]

    def block(worker, r0, r1):
        ops = scratch[worker].block(r1 - r0)
        dy_b = to(xp, dy[r0:r1, :], acc)
        value, slope = activation.value_and_slope(xp, ops, to(xp, a[r0:r1, :], acc))
        value *= dy_b
        slope *= to(xp, b[r0:r1, :], acc)
        store(xp, da, r0, r1, "multiply", slope, dy_b)
        db[r0:r1, :] = to(xp, value, db.dtype)

    for_each_block(xp, block, rows, m, n_workers, BLOCK_ELEMENTS)
