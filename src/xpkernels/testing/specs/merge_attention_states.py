"""Merge of two attention states: conformance declaration.

Inputs are two states ``(o, m, l)`` shaped as attention's (``o (B, H, S, Dv)``,
``m, l (B, H, S)``), with empty rows (``m = -inf``, ``l = 0``) on one side or
both where a case asks. The harness rounds every float input to the target
dtype; :func:`_arrange` then gives the checkpoints ``m``, ``l`` to the kernels
as float32 (float64 for float64 cases), as the contract wants: the rounded
values are exact there. The forward's outputs are ``o``, ``m`` and ``l``. The
backward's cotangents are ``do`` (named ``o``) and the merged lse's ``dlse``
(named ``m``: it is the gradient of ``m`` when the state is used through its
lse); its gradients are ``do_a``, ``do_b`` (named ``o_a``, ``o_b``) and
``dlse_a``, ``dlse_b`` (named ``m_a``, ``m_b``, the gradients of ``m_a`` and
``m_b``; those of ``l_a``, ``l_b`` are ``dlse / l``).
"""

from __future__ import annotations

import numpy as np

import xpkernels as xk
from xpkernels.buffers import Duplicated
from xpkernels.testing import references as ref
from xpkernels.testing.declared_errors import declared_errors
from xpkernels.testing.declared_fronts import Extra
from xpkernels.testing.harness import Backward, Case, ErrorCase, OpSpec

from ._shared import bshd

_STATES = ("m_a", "l_a", "m_b", "l_b")


def _cases():
    return [
        Case("1x1x1x1", {"shape": (1, 1, 1, 1)}, interpreter=True),
        Case("2x3x5x8", {"shape": (2, 3, 5, 8)}, interpreter=True, quick=True),
        Case("empty-rows-2x2x9x16", {"shape": (2, 2, 9, 16), "empty": True}, interpreter=True),
        Case("gap-60-1x2x7x12", {"shape": (1, 2, 7, 12), "gap": 60.0}, interpreter=True),
        Case("bshd-2x4x6x20", {"shape": (2, 4, 6, 20), "bshd": True}, interpreter=True),
        Case("Dv1-3x1x4x1", {"shape": (3, 1, 4, 1), "empty": True}, interpreter=True),
        Case("2x8x300x64", {"shape": (2, 8, 300, 64), "empty": True}),
        Case("1x4x129x256", {"shape": (1, 4, 129, 256)}),
    ]


def _arrange(case, arrays, target):
    xp = target.xp
    stat = xp.float64 if arrays["o_a"].dtype == xp.float64 else xp.float32
    arrays = {n: xp.astype(a, stat) if n in _STATES else a for n, a in arrays.items()}
    if case.params.get("bshd"):
        arrays = {n: bshd(target, a) for n, a in arrays.items()}
    return arrays


def _side(rng, shape, empty):
    """One state: ``o`` of unit scale, ``m`` around 0, ``l >= 1``; ``empty`` rows ``(0, -inf, 0)``."""
    o = rng.standard_normal(shape)
    m = rng.standard_normal(shape[:3]) * 3.0
    lse_sum = 1.0 + rng.random(shape[:3]) * 30.0
    o[empty] = 0.0
    m[empty] = -np.inf
    lse_sum[empty] = 0.0
    return o, m, lse_sum


def _inputs(case, rng):
    shape = case.params["shape"]
    rows = shape[:3]
    if case.params.get("empty"):
        # About a quarter of the rows empty on each side, so some are empty on both.
        empty_a, empty_b = rng.random(rows) < 0.25, rng.random(rows) < 0.25
        empty_a.flat[0] = empty_b.flat[0] = True
    else:
        empty_a = empty_b = np.zeros(rows, dtype=bool)
    o_a, m_a, l_a = _side(rng, shape, empty_a)
    o_b, m_b, l_b = _side(rng, shape, empty_b)
    m_b = m_b + case.params.get("gap", 0.0)
    return {"o_a": o_a, "m_a": m_a, "l_a": l_a, "o_b": o_b, "m_b": m_b, "l_b": l_b}


def _cotangents(case, rng):
    shape = case.params["shape"]
    return {"o": rng.standard_normal(shape), "m": rng.standard_normal(shape[:3])}


def _states(inputs):
    return [inputs[n] for n in ("o_a", "m_a", "l_a", "o_b", "m_b", "l_b")]


def _reference(case, inputs):
    o, m, lse_sum = ref.merge_attention_states(*_states(inputs))
    return {"o": o, "m": m, "l": lse_sum}, {}


def _reference_backward(case, inputs, cotangents):
    do_a, do_b, dlse_a, dlse_b = ref.merge_attention_states_backward(
        *_states(inputs), cotangents["o"], cotangents["m"]
    )
    return {"o_a": do_a, "o_b": do_b, "m_a": dlse_a, "m_b": dlse_b}


def _allocate_outputs(case, arrays, target, dtype):
    shape = case.params["shape"]
    stat = "float64" if dtype == "float64" else "float32"
    return {
        "o": target.full(shape, np.nan, dtype),
        "m": target.full(shape[:3], np.nan, stat),
        "l": target.full(shape[:3], np.nan, stat),
    }


def _forward_(case, arrays, outs, checkpoints, backend):
    xk.merge_attention_states_(outs["o"], outs["m"], outs["l"], *_states(arrays), backend=backend)


def _forward(case, arrays, checkpoints, backend):
    o, m, lse_sum = xk.merge_attention_states(*_states(arrays), backend=backend)
    return {"o": o, "m": m, "l": lse_sum}


def _as_state(arrays, a):
    """``a`` in the dtype of the states (the harness hands reference outputs in the input dtype)."""
    import array_api_compat

    xp = array_api_compat.array_namespace(a)
    return a if a.dtype == arrays["m_a"].dtype else xp.astype(a, arrays["m_a"].dtype)


def _backward_(case, arrays, outs, cotangents, grads, checkpoints, backend):
    xk.merge_attention_states_backward_(
        Duplicated(outs["o"], cotangents["o"]),
        _as_state(arrays, outs["m"]),
        _as_state(arrays, outs["l"]),
        Duplicated(arrays["o_a"], grads["o_a"]),
        arrays["m_a"],
        arrays["l_a"],
        Duplicated(arrays["o_b"], grads["o_b"]),
        arrays["m_b"],
        arrays["l_b"],
        dlse_a=grads["m_a"],
        dlse_b=grads["m_b"],
        dlse=_as_state(arrays, cotangents["m"]),
        backend=backend,
    )


def _backward(case, arrays, outs, cotangents, checkpoints, backend):
    do_a, do_b, dlse_a, dlse_b = xk.merge_attention_states_backward(
        cotangents["o"],
        outs["o"],
        _as_state(arrays, outs["m"]),
        _as_state(arrays, outs["l"]),
        *_states(arrays),
        dlse=_as_state(arrays, cotangents["m"]),
        backend=backend,
    )
    return {"o_a": do_a, "o_b": do_b, "m_a": dlse_a, "m_b": dlse_b}


#: The backward's arrays its Signature does not declare: each side's lse gradient (written,
#: and it may be the merged one's ``dlse`` itself), and the merged lse's cotangent (read).
EXTRA = {
    "dlse_a": Extra("m_a", written=True, aliases=("dlse",)),
    "dlse_b": Extra("m_b", written=True, aliases=("dlse",)),
    "dlse": Extra("m", written=False),
}


def _errors():
    """What the declaration cannot say: the statistics are float32 (float64 only with float64
    ``o``), and both sides' ``o`` share a dtype."""
    shape, rows = (2, 3, 4, 8), (2, 3, 4)

    def state(t, o_dtype="float32", m_dtype="float32"):
        return [
            t.full(shape, 1.0, o_dtype),
            t.full(rows, 0.0, m_dtype),
            t.full(rows, 1.0, m_dtype),
        ]

    def forward_with(a=state, b=state):
        def call(t):
            xk.merge_attention_states_(*state(t), *a(t), *b(t))

        return call

    def dlse_a_float64(t):
        o, m, lse_sum = state(t)
        a, b = state(t), state(t)
        xk.merge_attention_states_backward_(
            Duplicated(o, t.full(shape, 1.0, "float32")),
            m,
            lse_sum,
            Duplicated(a[0], t.full(shape, 0.0, "float32")),
            *a[1:],
            Duplicated(b[0], t.full(shape, 0.0, "float32")),
            *b[1:],
            dlse_a=t.full(rows, 0.0, "float64"),
            dlse_b=t.full(rows, 0.0, "float32"),
        )

    return [
        *declared_errors("merge_attention_states", extra=EXTRA),
        ErrorCase(
            "m_a-float64",
            forward_with(a=lambda t: state(t, m_dtype="float64")),
            TypeError,
            r"m_a must be float32",
        ),
        ErrorCase(
            "o_b-dtype",
            forward_with(b=lambda t: state(t, o_dtype="float64")),
            TypeError,
            r"o_b must have o_a's dtype",
        ),
        ErrorCase("dlse_a-dtype", dlse_a_float64, TypeError, r"dlse_a must be float32"),
    ]


SPEC = OpSpec(
    name="merge_attention_states",
    outputs=("o", "m", "l"),
    cases=tuple(_cases()),
    inputs=_inputs,
    reference=_reference,
    allocate_outputs=_allocate_outputs,
    forward_=_forward_,
    forward=_forward,
    errors=_errors,
    arrange=_arrange,
    backward=Backward(
        grad_names=("o_a", "m_a", "o_b", "m_b"),
        cotangents=_cotangents,
        reference=_reference_backward,
        inplace=_backward_,
        allocating=_backward,
    ),
)
