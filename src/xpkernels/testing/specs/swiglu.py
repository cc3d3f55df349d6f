"""SwiGLU (``y = silu(a) * b``, elementwise) conformance declaration."""

from __future__ import annotations

import numpy as np

import xpkernels as xk
from xpkernels.buffers import Duplicated
from xpkernels.testing import references as ref
from xpkernels.testing.declared_errors import declared_errors, other_device
from xpkernels.testing.harness import Backward, Case, ErrorCase, OpSpec

from ._gated import arrange, cotangents, inputs


def _cases():
    return [
        Case("rows1-M1", {"shape": (1, 1)}, interpreter=True),
        Case("3x1", {"shape": (3, 1)}, interpreter=True),
        Case("vector-M33", {"shape": (33,)}, interpreter=True),
        Case("2x3x96", {"shape": (2, 3, 96)}, interpreter=True, quick=True),
        Case("5x1000", {"shape": (5, 1000)}, interpreter=True),
        # Gates out in both tails (exp(|a|) overflows every float type), b and dy in [-1, 1]
        # so that 1e4 * b * dy stays finite in float16.
        Case("large-gates-4x300", {"shape": (4, 300), "large": True}, interpreter=True),
        Case(
            "transposed-leading", {"shape": (3, 4, 64), "permute_leading": True}, interpreter=True
        ),
        Case("7x4097", {"shape": (7, 4097)}),
        Case("wide-2x16384", {"shape": (2, 16384)}),
        Case("rows-3000x64", {"shape": (3000, 64)}),
    ]


def _reference(case, inputs):
    return {"y": ref.swiglu(inputs["a"], inputs["b"])}, {}


def _reference_backward(case, inputs, cotangents):
    da, db = ref.swiglu_backward(inputs["a"], inputs["b"], cotangents["y"])
    return {"a": da, "b": db}


def _torch_reference(case, inputs, cotangents):
    import torch

    a = torch.tensor(inputs["a"], requires_grad=True)
    b = torch.tensor(inputs["b"], requires_grad=True)
    y = torch.nn.functional.silu(a) * b
    y.backward(torch.tensor(cotangents["y"]))
    return {"y": y.detach().numpy()}, {"a": a.grad.numpy(), "b": b.grad.numpy()}


def _allocate_outputs(case, arrays, target, dtype):
    return {"y": target.full(case.params["shape"], np.nan, dtype)}


def _forward_(case, arrays, outs, checkpoints, backend):
    xk.swiglu_(outs["y"], arrays["a"], arrays["b"], backend=backend)


def _forward(case, arrays, checkpoints, backend):
    return {"y": xk.swiglu(arrays["a"], arrays["b"], backend=backend)}


def _backward_(case, arrays, outs, cotangents, grads, checkpoints, backend):
    Y = Duplicated(outs["y"], cotangents["y"])
    A = Duplicated(arrays["a"], grads["a"])
    B = Duplicated(arrays["b"], grads["b"])
    xk.swiglu_backward_(Y, A, B, backend=backend)


def _backward(case, arrays, outs, cotangents, checkpoints, backend):
    da, db = xk.swiglu_backward(cotangents["y"], arrays["a"], arrays["b"], backend=backend)
    return {"a": da, "b": db}


def _errors():
    """What the declaration cannot say: an array on another device."""

    def mixed_devices(t):
        rows = t.full((4, 8), 1.0, "float32")
        xk.swiglu_(other_device(t, (4, 8)), rows, rows)

    return [
        *declared_errors("swiglu"),
        ErrorCase("mixed-devices", mixed_devices, TypeError, r"y is on device .* but a is on"),
    ]


SPEC = OpSpec(
    name="swiglu",
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
