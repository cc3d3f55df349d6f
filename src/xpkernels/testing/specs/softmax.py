"""Softmax (last axis) conformance declaration."""

from __future__ import annotations

import numpy as np

import xpkernels as xk
from xpkernels.buffers import Duplicated
from xpkernels.testing import references as ref
from xpkernels.testing.harness import Backward, Case, ErrorCase, OpSpec


def _cases():
    return [
        Case("rows1-M1", {"shape": (1, 1)}, interpreter=True),
        Case("3x1", {"shape": (3, 1)}, interpreter=True),
        Case("vector-M33", {"shape": (33,)}, interpreter=True),
        Case("2x3x96", {"shape": (2, 3, 96)}, interpreter=True, quick=True),
        Case("5x1000", {"shape": (5, 1000)}, interpreter=True),
        Case("large-logits-4x300", {"shape": (4, 300), "scale": 40.0}, interpreter=True),
        Case("masked-4x200", {"shape": (4, 200), "masked": True}, interpreter=True),
        Case(
            "transposed-leading", {"shape": (3, 4, 64), "permute_leading": True}, interpreter=True
        ),
        Case("7x4097", {"shape": (7, 4097)}),
        Case("wide-2x16384", {"shape": (2, 16384)}),
        Case("rows-3000x64", {"shape": (3000, 64)}),
    ]


def _arrange(case, arrays, target):
    if not case.params.get("permute_leading"):
        return arrays
    return {**arrays, "x": target.leading_transposed(arrays["x"])}


def _inputs(case, rng):
    shape = case.params["shape"]
    x = rng.standard_normal(shape) * case.params.get("scale", 2.0)
    if case.params.get("masked"):
        # Masked logits: about half of every row is -inf (never a whole row).
        mask = rng.random(shape) < 0.5
        mask[..., 0] = False
        x = np.where(mask, -np.inf, x)
    return {"x": x}


def _cotangents(case, rng):
    return {"y": rng.standard_normal(case.params["shape"])}


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


def _allocate_outputs(case, arrays, target, dtype):
    return {"y": target.full(case.params["shape"], np.nan, dtype)}


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
    def full(shape, dtype="float32"):
        return lambda t: t.full(shape, 1.0, dtype)

    def int_array(shape):
        return lambda t: t.asarray(np.ones(shape, dtype=np.int32))

    rows = full((4, 8))

    def forward_with(y=rows, x=rows):
        def call(t):
            xk.softmax_(y(t), x(t))

        return call

    def backward_with(y=rows, dy=rows, dx=rows, duplicated=True):
        def call(t):
            Y = Duplicated(y(t), dy(t)) if duplicated else y(t)
            X = Duplicated(dx(t), dx(t))
            xk.softmax_backward_(Y, X)

        return call

    def other_namespace(t):
        """A (4, 8) float32 array from a namespace other than ``t``'s."""
        import pytest

        if t.namespace == "torch":
            return np.ones((4, 8), dtype=np.float32)
        torch = pytest.importorskip("torch", reason="mixing namespaces needs a second library")
        return torch.ones(4, 8)

    def other_device(t):
        """A (4, 8) float32 array on a device other than ``t``'s."""
        import pytest

        if t.namespace == "torch":
            import torch

            return torch.ones(4, 8, device="meta")
        if t.namespace == "array_api_strict":
            import array_api_strict

            return array_api_strict.ones(
                (4, 8), dtype=array_api_strict.float32, device=array_api_strict.Device("device1")
            )
        pytest.skip(f"{t.namespace} has a single device here")

    def strided(t):
        return t.full((4, 16), 1.0, "float32")[:, ::2]

    def rank0(t):
        return t.xp.reshape(t.full((1,), 1.0, "float32"), ())

    return [
        ErrorCase(
            "x-rank0",
            forward_with(y=rank0, x=rank0),
            ValueError,
            r"x must have shape \(\.\.\., M\)",
        ),
        ErrorCase(
            "y-shape", forward_with(y=full((4, 9))), ValueError, r"y must have shape \(4, 8\)"
        ),
        ErrorCase("int-x", forward_with(x=int_array((4, 8))), TypeError, r"x must have dtype in"),
        ErrorCase("int-y", forward_with(y=int_array((4, 8))), TypeError, r"y must have dtype in"),
        ErrorCase(
            "mixed-namespaces",
            forward_with(y=other_namespace),
            TypeError,
            r"y is a \w+ array but x is a \w+ array",
        ),
        ErrorCase(
            "mixed-devices",
            forward_with(y=other_device),
            TypeError,
            r"y is on device .* but x is on",
        ),
        ErrorCase(
            "x-last-axis-strided",
            forward_with(x=strided),
            ValueError,
            r"x must be contiguous along its last axis",
        ),
        ErrorCase(
            "y-last-axis-strided",
            forward_with(y=strided),
            ValueError,
            r"y must be contiguous along its last axis",
        ),
        ErrorCase(
            "dx-shape",
            backward_with(dx=full((4, 9))),
            ValueError,
            r"X.shadow must have shape \(4, 8\)",
        ),
        ErrorCase(
            "dy-dtype",
            backward_with(dy=int_array((4, 8))),
            TypeError,
            r"Y.shadow must have dtype in",
        ),
        ErrorCase(
            "dx-mixed-namespaces",
            backward_with(dx=other_namespace),
            TypeError,
            r"X.shadow is a \w+ array but Y.primal is a \w+ array",
        ),
        ErrorCase("bare-Y", backward_with(duplicated=False), TypeError, r"Y must be a Duplicated"),
    ]


SPEC = OpSpec(
    name="softmax",
    outputs=("y",),
    cases=tuple(_cases()),
    inputs=_inputs,
    reference=_reference,
    allocate_outputs=_allocate_outputs,
    forward_=_forward_,
    forward=_forward,
    errors=_errors,
    arrange=_arrange,
    backward=Backward(
        grad_names=("x",),
        cotangents=_cotangents,
        reference=_reference_backward,
        inplace=_backward_,
        allocating=_backward,
    ),
    torch_reference=_torch_reference,
)
