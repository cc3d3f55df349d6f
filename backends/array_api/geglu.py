r"""GeGLU on the Array API: the gated activation of :mod:`._gated` with a GELU.

.. math::

    y = \mathrm{gelu}(a)\,b,\qquad
    da = dy\,b\,\mathrm{gelu}'(a),\qquad db = dy\,\mathrm{gelu}(a),

GELU exactly (``approximate="none"``: :math:`a\,\Phi(a)`, :math:`\Phi` from the
approximations of :mod:`._normal_cdf`, as the Array API has no ``erf``) or
in its tanh form (``"tanh"``: :math:`a\,\sigma(z)`, :math:`z = 2\sqrt{2/\pi}\,(a
+ 0.044715\,a^3)`). No :math:`|a|` warns, ``NaN`` propagates, and :math:`a =
\pm\infty` give what ``torch.nn.functional.gelu`` gives
(:math:`\mathrm{gelu}(+\infty) = +\infty`, :math:`\mathrm{gelu}(-\infty)` and
both derivatives at :math:`\pm\infty` NaN: :math:`\infty \cdot 0`). Blocks,
threads and aliasing as :mod:`._gated` says.
"""

from __future__ import annotations

from . import _gated

__all__ = ["backward", "forward"]


def forward(y, a, b, *, approximate: str) -> None:
    """``y = gelu(a) * b`` by :func:`._gated.forward`, in float32 (float64 for float64 ``a``).
    Parameters: the ``geglu`` Signature's (:func:`xpkernels.backends.protocol.module_functions`)."""
    _gated.forward(_gated.GELU[approximate], y, a, b)


def backward(dy, a, b, da, db, *, approximate: str) -> None:
    """``da = dy * b * gelu'(a)``, ``db = dy * gelu(a)`` by :func:`._gated.backward`, ``gelu``
    and ``gelu'`` recomputed in the ``approximate`` form; ``db`` may be ``dy`` too. Parameters:
    the ``geglu`` Signature's (:func:`xpkernels.backends.protocol.module_functions`)."""
    _gated.backward(_gated.GELU[approximate], dy, a, b, da, db)
