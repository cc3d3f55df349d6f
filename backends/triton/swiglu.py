r"""SwiGLU in Triton: the gated kernels of :mod:`._gated` with the SiLU activation.

.. math::

    y = \mathrm{silu}(a)\,b,\qquad
    da = dy\,b\,s\,\big(1 + a\,(1 - s)\big),\qquad db = dy\,\mathrm{silu}(a),

with :math:`s = \sigma(a)` and :math:`\mathrm{silu}(a) = a\,s`, recomputed by the
backward; tiles, launch geometry and numerics as :mod:`._gated` says.
"""

from __future__ import annotations

from . import _gated

__all__ = ["backward", "forward"]


def forward(y, a, b) -> None:
    """``y = silu(a) * b`` (:func:`._gated.forward`). Parameters: the ``swiglu`` Signature's
    (:func:`xpkernels.backends.protocol.module_functions`)."""
    _gated.forward(_gated.SILU, y, a, b)


def backward(dy, a, b, da, db) -> None:
    """``da = dy * b * s * (1 + a * (1 - s))``, ``db = dy * silu(a)`` (:func:`._gated.backward`);
    either ``da`` or ``db`` may be the very same tensor as ``dy``. Parameters: the ``swiglu``
    Signature's (:func:`xpkernels.backends.protocol.module_functions`)."""
    _gated.backward(_gated.SILU, dy, a, b, da, db)
