r"""GeGLU in Triton: the gated kernels of :mod:`._gated` with a GELU activation.

.. math::

    y = \mathrm{gelu}(a)\,b,\qquad
    da = dy\,b\,\mathrm{gelu}'(a),\qquad db = dy\,\mathrm{gelu}(a),

GELU exactly (``approximate="none"``: :math:`a\,\Phi(a)` through ``tl.math.erf``)
or in its tanh form (``"tanh"``: :math:`a\,\sigma(z)`,
:math:`z = 2\sqrt{2/\pi}\,(a + 0.044715\,a^3)`), recomputed by the backward;
tiles, launch geometry and numerics as :mod:`._gated` says.
"""

from __future__ import annotations

from . import _gated

__all__ = ["backward", "forward"]

#: The kernels' activation for each ``approximate``.
_ACTIVATIONS = {"none": _gated.GELU, "tanh": _gated.GELU_TANH}


def forward(y, a, b, *, approximate: str) -> None:
    """``y = gelu(a) * b`` (:func:`._gated.forward`). Parameters: the ``geglu`` Signature's
    (:func:`xpkernels.backends.protocol.module_functions`)."""
    _gated.forward(_ACTIVATIONS[approximate], y, a, b)


def backward(dy, a, b, da, db, *, approximate: str) -> None:
    """``da = dy * b * gelu'(a)``, ``db = dy * gelu(a)`` (:func:`._gated.backward`); either
    ``da`` or ``db`` may be the very same tensor as ``dy``. Parameters: the ``geglu``
    Signature's (:func:`xpkernels.backends.protocol.module_functions`)."""
    _gated.backward(_ACTIVATIONS[approximate], dy, a, b, da, db)
