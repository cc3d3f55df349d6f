r"""SwiGLU on the Array API: the gated activation of :mod:`._gated` with SiLU.

.. math::

    y = \mathrm{silu}(a)\,b,\qquad
    da = dy\,b\,s\,\big(1 + a\,(1 - s)\big),\qquad db = dy\,\mathrm{silu}(a),

with :math:`s = \sigma(a)` and :math:`\mathrm{silu}(a) = a\,s`. The sigmoid is
computed from :math:`e = \exp(-|a|)`, which never overflows, so :math:`|a|` of
any size warns nothing, ``NaN`` propagates, and :math:`a = \pm\infty` give what
``torch.nn.functional.silu`` gives (:math:`\mathrm{silu}(+\infty) = +\infty`,
:math:`\mathrm{silu}(-\infty)` and both derivatives at :math:`\pm\infty` NaN:
:math:`\infty \cdot 0`). Blocks, threads and aliasing as :mod:`._gated` says.
"""

from __future__ import annotations

from . import _gated

__all__ = ["backward", "forward"]


def forward(y, a, b) -> None:
    """``y = silu(a) * b`` by :func:`._gated.forward`, in float32 (float64 for float64 ``a``).
    Parameters: the ``swiglu`` Signature's (:func:`xpkernels.backends.protocol.module_functions`).
    """
    _gated.forward(_gated.SILU, y, a, b)


def backward(dy, a, b, da, db) -> None:
    """``da = dy * b * s * (1 + a * (1 - s))``, ``db = dy * silu(a)`` by :func:`._gated.backward`,
    ``s = sigmoid(a)`` recomputed; ``db`` may be ``dy`` too. Parameters: the ``swiglu``
    Signature's (:func:`xpkernels.backends.protocol.module_functions`)."""
    _gated.backward(_gated.SILU, dy, a, b, da, db)
