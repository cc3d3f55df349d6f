"""Softmax (last axis) conformance declaration."""

from __future__ import annotations

import numpy as np

import xpkernels as xk
from xpkernels.buffers import Duplicated
from xpkernels.testing import references as ref
from xpkernels.testing.declared_errors import declared_errors, other_device
from xpkernels.testing.harness import Backward, Case, ErrorCase, OpSpec

from ._shared import allocate_y, arrange_x, cotangent_y, row_cases


def _cases():
    return row_cases(
        Case("large-logits-4x300", {"shape": (4, 300), "scale": 40.0}, interpreter=True),
        Case("masked-4x200", {"shape": (4, 200), "masked": True}, interpreter=True),
    )


def _inputs(case, rng):
    shape = case.params["shape"]
    x = rng.standard_normal(shape) * case.params.get("scale", 2.0)
    if case.params.get("masked"):
        # Masked logits: about half of every row is -inf (never a whole row).
        mask = rng.random(shape) < 0.5
        mask[..., 0] = False
        x = np.where(mask, -np.inf, x)
    return {"x": x}


def _reference(case, inputs):
    return {"y": ref.softmax(inputs["x"])}, {}


def _reference_backward(case, inputs, cotangents):
    return {"x": ref.softmax_backward(ref.softmax(inputs["x"]), cotangents["y"])}


def _torch_reference(case, inputs, cotangents):
    import torch

    x = torch.tensor(inputs["x"], requires_grad=True)
    y = torch.softmax(x, dim=-1)
    y.backward(torch.tensor(cotangents["y"]))
    return {"y": y.detach().numpy()}, {"x": x.grad.numpy()}


def _forward_(case, arrays, outs, checkpoints, backend):
    xk.softmax_(outs["y"], arrays["x"], backend=backend)


def _forward(case, arrays, checkpoints, backend):
    return {"y": xk.softmax(arrays["x"], backend=backend)}


def _backward_(case, arrays, outs, cotangents, grads, checkpoints, backend):
    Y = Duplicated(outs["y"], cotangents["y"])
    X = Duplicated(arrays["x"], grads["x"])
    xk.softmax_backward_(Y, X, backend=backend)


def _backward(case, arrays, outs, cotangents, checkpoints, backend):
    return {"x": xk.softmax_backward(cotangents["y"], outs["y"], backend=backend)}


def _errors():
    """What the declaration cannot say: an array on another device."""

    def mixed_devices(t):
        xk.softmax_(other_device(t, (4, 8)), t.full((4, 8), 1.0, "float32"))

    return [
        *declared_errors("softmax"),
        ErrorCase("mixed-devices", mixed_devices, TypeError, r"y is on device .* but x is on"),
    ]


SPEC = OpSpec(
    name="softmax",
    outputs=("y",),
    cases=tuple(_cases()),
    inputs=_inputs,
    reference=_reference,
    allocate_outputs=allocate_y,
    forward_=_forward_,
    forward=_forward,
    errors=_errors,
    arrange=arrange_x,
    backward=Backward(
        grad_names=("x",),
        cotangents=cotangent_y,
        reference=_reference_backward,
        inplace=_backward_,
        allocating=_backward,
    ),
    torch_reference=_torch_reference,
)
