r"""SwiGLU in CUDA C (``swiglu.cu``: the gated kernels of ``gated.cuh`` with SiLU).

.. math::

    y = \mathrm{silu}(a)\,b,\qquad
    da = dy\,b\,s\,\big(1 + a\,(1 - s)\big),\qquad db = dy\,\mathrm{silu}(a),

with :math:`s = \sigma(a)` (from :math:`\exp(-|a|)`: no overflow for any
:math:`|a|`), recomputed by the backward. Computation in float32; geometry
and launch as :mod:`._gated` says.
"""

from __future__ import annotations

from pathlib import Path

from . import _gated

__all__ = ["backward", "forward", "name_expressions"]

SOURCE = Path(__file__).with_name("swiglu.cu")
#: The activation types ``swiglu.cu`` defines.
_ACTIVATIONS = ("Silu",)


def name_expressions() -> list[str]:
    """Every template instantiation the launchers may compile (for offline compile reports)."""
    return _gated.name_expressions(_ACTIVATIONS)


def forward(y, a, b) -> None:
    """``y = silu(a) * b`` (of mixed dtypes, in float32).

    Parameters: the ``swiglu`` Signature's (:func:`xpkernels.backends.protocol.module_functions`).
    """
    _gated.launch("swiglu", SOURCE, _ACTIVATIONS, "Silu", "forward", (y, a, b))


def backward(dy, a, b, da, db) -> None:
    """``da = dy * b * s * (1 + a * (1 - s))``, ``db = dy * silu(a)`` (of mixed dtypes, in float32).

    Either ``da`` or ``db`` may be the very same array as ``dy``. Parameters:
    the ``swiglu`` Signature's (:func:`xpkernels.backends.protocol.module_functions`).
    """
    _gated.launch("swiglu", SOURCE, _ACTIVATIONS, "Silu", "backward", (dy, a, b, da, db))
