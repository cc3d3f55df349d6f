"""GeGLU (``y = gelu(a) * b``, elementwise, both GELU forms) conformance declaration."""

from __future__ import annotations

import dataclasses

import numpy as np

import xpkernels as xk
from xpkernels.backends.protocol import GELU_APPROXIMATIONS
from xpkernels.buffers import Duplicated
from xpkernels.testing.harness import Case, ErrorCase

from ._gated import gated_spec
from ._shared import row_cases


def _cases():
    # The row-wise shapes (as SwiGLU's), in each GELU form.
    cases = [
        dataclasses.replace(
            case,
            id=f"{approximate}-{case.id}",
            params={**case.params, "approximate": approximate},
        )
        for approximate in GELU_APPROXIMATIONS
        for case in row_cases()
    ]
    # Gates out in both tails (their erfc underflows every float type; the tanh form's
    # exponent too), b and dy in [-1, 1] so that 1e4 * b * dy stays finite in float16.
    cases.append(
        Case(
            "none-large-gates-4x300",
            {"shape": (4, 300), "approximate": "none", "large": True},
            interpreter=True,
        )
    )
    # Not in float16: the straightforward tanh-form derivative squares a, and 1e4 squared
    # overflows float16 (NaN), so the tolerance rule cannot judge it there;
    # tests/test_gated_kernels.py checks float16 at |a| = 1e4.
    cases.append(
        Case(
            "tanh-large-gates-4x300",
            {"shape": (4, 300), "approximate": "tanh", "large": True},
            interpreter=True,
            dtypes=("float64", "float32", "bfloat16"),
        )
    )
    return cases


def _bad_approximate(fn: str, value):
    """``fn`` (one of the four public functions) called with ``approximate=value``; the
    in-place ones must leave their outputs as they were."""

    def call(t):
        rows = t.full((4, 8), 1.0, "float32")
        out, shadow = t.full((4, 8), 7.0, "float32"), t.full((4, 8), 7.0, "float32")
        try:
            if fn == "geglu":
                xk.geglu(rows, rows, approximate=value)
            elif fn == "geglu_":
                xk.geglu_(out, rows, rows, approximate=value)
            elif fn == "geglu_backward":
                xk.geglu_backward(rows, rows, rows, approximate=value)
            else:
                Y, A, B = Duplicated(rows, rows), Duplicated(rows, out), Duplicated(rows, shadow)
                xk.geglu_backward_(Y, A, B, approximate=value)
        finally:
            for written in (out, shadow):
                assert np.all(t.to_numpy(written) == 7.0), f"{fn}: a refused call wrote"

    return call


def _options(case) -> dict:
    return {"approximate": case.params["approximate"]}


#: Unknown ``approximate`` values, refused by each of the four public functions.
_UNKNOWN = r"approximate must be one of 'none', 'tanh', got "

SPEC = gated_spec(
    "geglu",
    _cases(),
    lambda F, a, approximate: F.gelu(a, approximate=approximate),
    _options,
    [
        ErrorCase(f"{fn}-approximate-{label}", _bad_approximate(fn, value), ValueError, _UNKNOWN)
        for fn in ("geglu", "geglu_", "geglu_backward", "geglu_backward_")
        for label, value in (("exact", "exact"), ("None", None), ("upper-case", "TANH"))
    ],
)
