"""Softmax (last axis) conformance declaration."""

from __future__ import annotations

import numpy as np

import xpkernels as xk
from conformance.harness import Case, ErrorCase, OpSpec
from xpkernels.buffers import Duplicated


def _cases():
    return [
        Case("rows1-M1", {"shape": (1, 1)}, interpreter=True),
        Case("3x1", {"shape": (3, 1)}, interpreter=True),
        Case("vector-M33", {"shape": (33,)}, interpreter=True),
        Case("2x3x96", {"shape": (2, 3, 96)}, interpreter=True),
        Case("5x1000", {"shape": (5, 1000)}, interpreter=True),
        Case("large-logits-4x300", {"shape": (4, 300), "scale": 40.0}, interpreter=True),
        Case("masked-4x200", {"shape": (4, 200), "masked": True}, interpreter=True),
        Case("transposed-leading", {"shape": (3, 4, 64), "permute_leading": True}, interpreter=True),
        Case("7x4097", {"shape": (7, 4097)}),
        Case("wide-2x16384", {"shape": (2, 16384)}),
        Case("rows-3000x64", {"shape": (3000, 64)}),
    ]


def _naive(x):
    shifted = x - np.max(x, axis=-1, keepdims=True)
    e = np.exp(shifted)
    return e / np.sum(e, axis=-1, keepdims=True)


class SoftmaxSpec(OpSpec):
    def cases(self):
        return _cases()

    def arrange(self, case, arrays, target):
        if not case.params.get("permute_leading"):
            return arrays
        return {**arrays, "x": target.leading_transposed(arrays["x"])}

    def inputs(self, case, rng):
        shape = case.params["shape"]
        x = rng.standard_normal(shape) * case.params.get("scale", 2.0)
        if case.params.get("masked"):
            # Masked logits: about half of every row is -inf (never a whole row).
            mask = rng.random(shape) < 0.5
            mask[..., 0] = False
            x = np.where(mask, -np.inf, x)
        return {"x": x}

    def cotangents(self, case, rng):
        return {"y": rng.standard_normal(case.params["shape"])}

    def reference(self, case, inputs):
        return {"y": _naive(inputs["x"])}, {}

    def reference_backward(self, case, inputs, cotangents):
        y = _naive(inputs["x"])
        dy = cotangents["y"]
        return {"x": y * (dy - np.sum(y * dy, axis=-1, keepdims=True))}

    def torch_reference(self, case, inputs, cotangents):
        import torch

        x = torch.tensor(inputs["x"], requires_grad=True)
        y = torch.softmax(x, dim=-1)
        y.backward(torch.tensor(cotangents["y"]))
        return {"y": y.detach().numpy()}, {"x": x.grad.numpy()}

    def allocate_outputs(self, case, arrays, target, dtype):
        return {"y": target.full(case.params["shape"], np.nan, dtype)}

    def allocate_checkpoints(self, case, arrays):
        return None

    def forward_(self, case, arrays, outs, checkpoints, backend):
        xk.softmax_(outs["y"], arrays["x"], backend=backend)

    def forward(self, case, arrays, checkpoints, backend):
        return {"y": xk.softmax(arrays["x"], backend=backend)}

    def backward_(self, case, arrays, outs, cotangents, grads, checkpoints, backend):
        Y = Duplicated(outs["y"], cotangents["y"])
        X = Duplicated(arrays["x"], grads["x"])
        xk.softmax_backward_(Y, X, backend=backend)

    def backward(self, case, arrays, outs, cotangents, checkpoints, backend):
        return {"x": xk.softmax_backward(cotangents["y"], outs["y"], backend=backend)}

    def errors(self):
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
            ErrorCase("x-rank0", forward_with(y=rank0, x=rank0), ValueError, r"x must have shape \(\.\.\., M\)"),
            ErrorCase("y-shape", forward_with(y=full((4, 9))), ValueError, r"y must have shape \(4, 8\)"),
            ErrorCase("int-x", forward_with(x=int_array((4, 8))), TypeError, r"x must have dtype in"),
            ErrorCase("int-y", forward_with(y=int_array((4, 8))), TypeError, r"y must have dtype in"),
            ErrorCase("mixed-namespaces", forward_with(y=other_namespace), TypeError, r"y is a \w+ array but x is a \w+ array"),
            ErrorCase("mixed-devices", forward_with(y=other_device), TypeError, r"y is on device .* but x is on"),
            ErrorCase("x-last-axis-strided", forward_with(x=strided), ValueError, r"x must be contiguous along its last axis"),
            ErrorCase("y-last-axis-strided", forward_with(y=strided), ValueError, r"y must be contiguous along its last axis"),
            ErrorCase("dx-shape", backward_with(dx=full((4, 9))), ValueError, r"X.shadow must have shape \(4, 8\)"),
            ErrorCase("dy-dtype", backward_with(dy=int_array((4, 8))), TypeError, r"Y.shadow must have dtype in"),
            ErrorCase("dx-mixed-namespaces", backward_with(dx=other_namespace), TypeError, r"X.shadow is a \w+ array but Y.primal is a \w+ array"),
            ErrorCase("bare-Y", backward_with(duplicated=False), TypeError, r"Y must be a Duplicated"),
        ]


SPEC = SoftmaxSpec(name="softmax", outputs=("y",), grad_names=("x",))
