r"""GeGLU in CUDA C (``geglu.cu``: the gated kernels of ``gated.cuh`` with a GELU).

.. math::

    y = \mathrm{gelu}(a)\,b,\qquad
    da = dy\,b\,\mathrm{gelu}'(a),\qquad db = dy\,\mathrm{gelu}(a),

GELU exactly (``approximate="none"``: :math:`a\,\Phi(a)`, :math:`\Phi(a) =
\tfrac12\,\mathrm{erfc}(-a/\sqrt2)`) or in its tanh form (``"tanh"``:
:math:`a\,\sigma(z)`, :math:`z = 2\sqrt{2/\pi}\,(a + 0.044715\,a^3)`),
recomputed by the backward. Computation in float32; geometry and launch as
:mod:`._gated` says.
"""

from __future__ import annotations

from pathlib import Path

from . import _gated

__all__ = ["backward", "forward", "name_expressions"]

SOURCE = Path(__file__).with_name("geglu.cu")
#: The activation type ``geglu.cu`` defines for each ``approximate``.
_ACTIVATION = {"none": "Gelu", "tanh": "GeluTanh"}
_ACTIVATIONS = tuple(_ACTIVATION.values())


def name_expressions() -> list[str]:
    """Every template instantiation the launchers may compile (for offline compile reports)."""
    return _gated.name_expressions(_ACTIVATIONS)


def forward(y, a, b, *, approximate: str) -> None:
    """``y = gelu(a) * b`` (of mixed dtypes, in float32).

    Parameters: the ``geglu`` Signature's (:func:`xpkernels.backends.protocol.module_functions`).
    """
    activation = _ACTIVATION[approximate]
    _gated.launch("geglu", SOURCE, _ACTIVATIONS, activation, "forward", (y, a, b))


def backward(dy, a, b, da, db, *, approximate: str) -> None:
    """``da = dy * b * gelu'(a)``, ``db = dy * gelu(a)`` (of mixed dtypes, in float32).

    Either ``da`` or ``db`` may be the very same array as ``dy``. Parameters:
    the ``geglu`` Signature's (:func:`xpkernels.backends.protocol.module_functions`).
    """
    activation = _ACTIVATION[approximate]
    _gated.launch("geglu", SOURCE, _ACTIVATIONS, activation, "backward", (dy, a, b, da, db))
