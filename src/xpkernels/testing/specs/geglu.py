"""GeGLU (``y = gelu(a) * b``, elementwise, both GELU forms) conformance declaration."""

from __future__ import annotations

import numpy as np

import xpkernels as xk
from xpkernels.backends.protocol import GELU_APPROXIMATIONS
from xpkernels.buffers import Duplicated
from xpkernels.testing import references as ref
from xpkernels.testing.declared_errors import declared_errors, other_device
from xpkernels.testing.harness import Backward, Case, ErrorCase, OpSpec

from ._gated import arrange, cotangents, inputs

#: The shapes of every case, as SwiGLU's: ``(id, params, interpreter, quick)``.
_SHAPES = (
    ("rows1-M1", {"shape": (1, 1)}, True, False),
    ("3x1", {"shape": (3, 1)}, True, False),
    ("vector-M33", {"shape": (33,)}, True, False),
    ("2x3x96", {"shape": (2, 3, 96)}, True, True),
    ("5x1000", {"shape": (5, 1000)}, True, False),
    ("transposed-leading", {"shape": (3, 4, 64), "permute_leading": True}, True, False),
    ("7x4097", {"shape": (7, 4097)}, False, False),
    ("wide-2x16384", {"shape": (2, 16384)}, False, False),
    ("rows-3000x64", {"shape": (3000, 64)}, False, False),
)


def _cases():
    cases = []
    for approximate in GELU_APPROXIMATIONS:
        for name, params, interpreter, quick in _SHAPES:
            cases.append(
                Case(
                    f"{approximate}-{name}",
                    {**params, "approximate": approximate},
                    interpreter=interpreter,
                    quick=quick,
                )
            )
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


def _reference(case, inputs):
    return {"y": ref.geglu(inputs["a"], inputs["b"], case.params["approximate"])}, {}


def _reference_backward(case, inputs, cotangents):
    da, db = ref.geglu_backward(
        inputs["a"], inputs["b"], cotangents["y"], case.params["approximate"]
    )
    return {"a": da, "b": db}


def _torch_reference(case, inputs, cotangents):
    import torch

    a = torch.tensor(inputs["a"], requires_grad=True)
    b = torch.tensor(inputs["b"], requires_grad=True)
    y = torch.nn.functional.gelu(a, approximate=case.params["approximate"]) * b
    y.backward(torch.tensor(cotangents["y"]))
    return {"y": y.detach().numpy()}, {"a": a.grad.numpy(), "b": b.grad.numpy()}


def _allocate_outputs(case, arrays, target, dtype):
    return {"y": target.full(case.params["shape"], np.nan, dtype)}


def _forward_(case, arrays, outs, checkpoints, backend):
    approximate = case.params["approximate"]
    xk.geglu_(outs["y"], arrays["a"], arrays["b"], approximate=approximate, backend=backend)


def _forward(case, arrays, checkpoints, backend):
    approximate = case.params["approximate"]
    return {"y": xk.geglu(arrays["a"], arrays["b"], approximate=approximate, backend=backend)}


def _backward_(case, arrays, outs, cotangents, grads, checkpoints, backend):
    Y = Duplicated(outs["y"], cotangents["y"])
    A = Duplicated(arrays["a"], grads["a"])
    B = Duplicated(arrays["b"], grads["b"])
    xk.geglu_backward_(Y, A, B, approximate=case.params["approximate"], backend=backend)


def _backward(case, arrays, outs, cotangents, checkpoints, backend):
    approximate = case.params["approximate"]
    da, db = xk.geglu_backward(
        cotangents["y"], arrays["a"], arrays["b"], approximate=approximate, backend=backend
    )
    return {"a": da, "b": db}


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


def _errors():
    """What the declaration cannot say: an array on another device, an unknown ``approximate``."""

    def mixed_devices(t):
        rows = t.full((4, 8), 1.0, "float32")
        xk.geglu_(other_device(t, (4, 8)), rows, rows)

    unknown = r"approximate must be one of 'none', 'tanh', got "
    return [
        *declared_errors("geglu"),
        ErrorCase("mixed-devices", mixed_devices, TypeError, r"y is on device .* but a is on"),
        *(
            ErrorCase(f"{fn}-approximate-{label}", _bad_approximate(fn, value), ValueError, unknown)
            for fn in ("geglu", "geglu_", "geglu_backward", "geglu_backward_")
            for label, value in (("exact", "exact"), ("None", None), ("upper-case", "TANH"))
        ),
    ]


SPEC = OpSpec(
    name="geglu",
    outputs=("y",),
    cases=tuple(_cases()),
    inputs=inputs,
    reference=_reference,
    allocate_outputs=_allocate_outputs,
    forward_=_forward_,
    forward=_forward,
    errors=_errors,
    arrange=arrange,
    backward=Backward(
        grad_names=("a", "b"),
        cotangents=cotangents,
        reference=_reference_backward,
        inplace=_backward_,
        allocating=_backward,
    ),
    torch_reference=_torch_reference,
)
