r"""The standard normal CDF :math:`\Phi` and density :math:`\varphi` on the Array API.

Exact GELU needs :math:`\Phi(a) = \tfrac12\big(1 + \mathrm{erf}(a/\sqrt2)\big)`;
neither the Array API standard nor NumPy has ``erf``. :func:`normal_cdf`
evaluates approximations derived for this module, one per computing dtype:

**float32**: ``erf`` through ``tanh``. With :math:`z(a) = \operatorname{atanh}
\mathrm{erf}(a/\sqrt2)` (odd, :math:`\approx 0.80\,a` near 0, growing as
:math:`a^2/4` in the tails),

.. math::

    \Phi(a) = \tfrac12\big(1 + \tanh z(a)\big), \qquad
    z(a) \approx a\,P(a^2) = a \sum_{k=0}^{6} c_k\,a^{2k},

the :math:`c_k` (:data:`_TANH_COEFFICIENTS`) a least-squares fit, refined to
minimax by Lawson's iteration (in mpmath, 40 digits), of :math:`z(a)/a` over
:math:`a \in [0, 6]`, weighted so that the error it minimises is ``erf``'s
relative error :math:`\delta z\,(1 - t^2)/t`, :math:`t = \mathrm{erf}(a/\sqrt2)`
(beyond :math:`|a| = 5.5`, ``erf`` rounds to :math:`\pm 1` in float32). :math:`P`
has no root for :math:`a^2 \ge 0` (:math:`P \ge c_0`): :math:`z` keeps
:math:`a`'s sign and ``tanh`` saturates to exactly :math:`\pm 1` from
:math:`|a| \approx 5.6` on. As PyTorch's ``0.5 * (1 + erf(a / sqrt(2)))``,
:math:`\Phi` of a very negative :math:`a` is accurate to float32's absolute
rounding, not relative to its own size.

**float64**: the tail, relative to its size everywhere. With :math:`\tau = 1 /
(1 + |a|/5)`,

.. math::

    \Phi(-|a|) = \tau\,R(\tau)\,e^{-a^2/2}, \qquad
    R(\tau) \approx \sum_{k=0}^{20} d_k\,\tau^k, \qquad
    \Phi(|a|) = 1 - \Phi(-|a|),

the :math:`d_k` (:data:`_TAIL_COEFFICIENTS`) a fit of the same kind (50
digits) to the smooth, bounded :math:`\Phi(-a)\,e^{a^2/2}/\tau` over :math:`a \in
[0, 38.6]` (beyond, :math:`\Phi(-a)` underflows float64), minimising the
relative error.

``tests/test_gated_kernels.py`` measures both against mpmath over dense
grids (the figures are in the issue notes of the GeGLU change). Arguments
are clipped to :math:`\pm` :data:`LIMIT` first, so no :math:`|a|` overflows
or warns; NaN propagates, :math:`\Phi(+\infty) = 1`, :math:`\Phi(-\infty) = 0`
and :math:`\varphi(\pm\infty) = 0`.

Both functions take ``ops``, a block's elementwise evaluator (see
:class:`._gated.Scratch`): ``ops(name, fn, *args)`` is the Array API
function ``fn`` of ``args``, on NumPy computed into the worker's reused
buffer ``name``. Their buffers are named ``cdf*`` and ``pdf*``.
"""

from __future__ import annotations

import math

__all__ = ["LIMIT", "normal_cdf", "normal_cdf_and_pdf"]

#: Arguments are clipped to :math:`\pm` this: beyond it :math:`\Phi` is exactly 0 or 1 and
#: :math:`\varphi` exactly 0 in float32 and float64 alike, and no square overflows.
LIMIT = 40.0

#: :math:`c_0 \dots c_6` of the float32 form: :math:`\mathrm{erf}(a/\sqrt2) \approx
#: \tanh\big(a \sum_k c_k a^{2k}\big)`.
_TANH_COEFFICIENTS = (
    0.7978846362010817,
    0.03633434980051899,
    -3.3912906709454856e-05,
    -5.4781096515318574e-05,
    3.8729522490169524e-06,
    -1.2524910602685552e-07,
    1.5670669451803469e-09,
)

#: :math:`d_0 \dots d_{20}` of the float64 form: :math:`\Phi(-|a|) \approx \tau
#: \sum_k d_k \tau^k\, e^{-a^2/2}`, :math:`\tau = 1/(1 + |a|/5)`.
_TAIL_COEFFICIENTS = (
    0.07978845605826564,
    0.07978845743788467,
    0.0765968793841786,
    0.0702145064349619,
    0.06101433590611305,
    0.049855829129230096,
    0.037142852556019235,
    0.027843671892823236,
    0.0064471265175555575,
    0.03367216527381967,
    -0.06368913677197913,
    0.1228438323834248,
    -0.18375024423520106,
    0.19561627299798154,
    -0.1440443169978974,
    0.0495382436431015,
    0.024388959829862913,
    -0.039549833834505624,
    0.021360821842463414,
    -0.00571384941611683,
    0.000634969968014302,
)

#: :math:`\tau = 5 / (|a| + 5)`: the variable of :data:`_TAIL_COEFFICIENTS`.
_TAIL_SCALE = 5.0
#: :math:`1/\sqrt{2\pi}`, the density at 0.
_DENSITY_SCALE = 1.0 / math.sqrt(2.0 * math.pi)


def _polynomial(ops, name: str, x, coefficients):
    """:math:`\\sum_k c_k x^k` by Horner's rule into buffer ``name`` (``x`` is not written)."""
    out = ops(name, "multiply", x, coefficients[-1])
    out += coefficients[-2]
    for c in coefficients[-3::-1]:
        out *= x
        out += c
    return out


def _cdf(xp, ops, a, with_pdf: bool):
    """``(Phi(a), phi(a) or None)``: the tail form for float64, the ``tanh`` form otherwise."""
    a = ops("cdf_a", "clip", a, -LIMIT, LIMIT)
    square = ops("cdf_square", "multiply", a, a)
    if a.dtype == xp.float64:
        tau = ops("cdf_tau", "abs", a)
        tau += _TAIL_SCALE
        tau = ops("cdf_tau", "divide", _TAIL_SCALE, tau)
        tail = _polynomial(ops, "cdf", tau, _TAIL_COEFFICIENTS)
        tail *= tau
        square *= -0.5
        density = ops("cdf_square", "exp", square)
        tail *= density
        cdf = xp.where(a >= 0, 1.0 - tail, tail)
    else:
        cdf = _polynomial(ops, "cdf", square, _TANH_COEFFICIENTS)
        cdf *= a
        cdf = ops("cdf", "tanh", cdf)
        cdf *= 0.5
        cdf += 0.5
        if not with_pdf:
            return cdf, None
        square *= -0.5
        density = ops("cdf_square", "exp", square)
    density *= _DENSITY_SCALE
    return cdf, density


def normal_cdf(xp, ops, a):
    """:math:`\\Phi(a)` of a float32 or float64 block, in its dtype; ``a`` is not written."""
    return _cdf(xp, ops, a, False)[0]


def normal_cdf_and_pdf(xp, ops, a):
    """``(Phi(a), phi(a))``, :math:`\\varphi(a) = e^{-a^2/2}/\\sqrt{2\\pi}`, of a float32 or
    float64 block, in its dtype; ``a`` is not written."""
    return _cdf(xp, ops, a, True)
