"""SwiGLU (``y = silu(a) * b``, elementwise) conformance declaration."""

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


#: Gate values of the large-gates case, one of them every third element.
_LARGE = np.array([60.0, -60.0, 1e4, -1e4, 20.0, -20.0, 88.0, -88.0])


def _arrange(case, arrays, target):
    if not case.params.get("permute_leading"):
        return arrays
    return {name: target.leading_transposed(a) for name, a in arrays.items()}


def _inputs(case, rng):
    shape = case.params["shape"]
    if not case.params.get("large"):
        return {"a": rng.standard_normal(shape) * 3, "b": rng.standard_normal(shape)}
    a = rng.standard_normal(shape) * 30
    flat = a.reshape(-1)
    flat[::3] = np.resize(_LARGE, flat[::3].size)
    return {"a": a, "b": rng.uniform(-1, 1, shape)}


def _cotangents(case, rng):
    shape = case.params["shape"]
    if case.params.get("large"):
        return {"y": rng.uniform(-1, 1, shape)}
    return {"y": rng.standard_normal(shape)}


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
    def full(shape, dtype="float32"):
        return lambda t: t.full(shape, 1.0, dtype)

    def int_array(shape):
        return lambda t: t.asarray(np.ones(shape, dtype=np.int32))

    rows = full((4, 8))

    def forward_with(y=rows, a=rows, b=rows):
        def call(t):
            xk.swiglu_(y(t), a(t), b(t))

        return call

    def backward_with(dy=rows, a=rows, b=rows, da=rows, db=rows, duplicated=True):
        def call(t):
            Y = Duplicated(t.full((4, 8), 1.0, "float32"), dy(t)) if duplicated else dy(t)
            A = Duplicated(a(t), da(t))
            B = Duplicated(b(t), db(t))
            xk.swiglu_backward_(Y, A, B)

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

    def y_overlapping(input_name):
        """``y`` a view one column off the ``input_name`` input: partly the same memory."""

        def call(t):
            buf = t.full((4, 9), 1.0, "float32")
            inputs = {"a": t.full((4, 8), 1.0, "float32"), "b": t.full((4, 8), 1.0, "float32")}
            inputs[input_name] = buf[:, :8]
            xk.swiglu_(buf[:, 1:], inputs["a"], inputs["b"])

        return call

    def db_is_dy(t):
        dy = t.full((4, 8), 1.0, "float32")
        Y = Duplicated(t.full((4, 8), 1.0, "float32"), dy)
        A = Duplicated(t.full((4, 8), 1.0, "float32"), t.full((4, 8), 1.0, "float32"))
        xk.swiglu_backward_(Y, A, Duplicated(t.full((4, 8), 1.0, "float32"), dy))

    return [
        ErrorCase(
            "a-rank0",
            forward_with(y=rank0, a=rank0, b=rank0),
            ValueError,
            r"a must have shape \(\.\.\., M\)",
        ),
        ErrorCase(
            "b-shape", forward_with(b=full((4, 9))), ValueError, r"b must have shape \(4, 8\)"
        ),
        ErrorCase(
            "y-shape", forward_with(y=full((4, 9))), ValueError, r"y must have shape \(4, 8\)"
        ),
        ErrorCase("int-a", forward_with(a=int_array((4, 8))), TypeError, r"a must have dtype in"),
        ErrorCase("int-b", forward_with(b=int_array((4, 8))), TypeError, r"b must have dtype in"),
        ErrorCase("int-y", forward_with(y=int_array((4, 8))), TypeError, r"y must have dtype in"),
        ErrorCase(
            "mixed-namespaces",
            forward_with(b=other_namespace),
            TypeError,
            r"b is a \w+ array but a is a \w+ array",
        ),
        ErrorCase(
            "mixed-devices",
            forward_with(y=other_device),
            TypeError,
            r"y is on device .* but a is on",
        ),
        ErrorCase(
            "a-last-axis-strided",
            forward_with(a=strided),
            ValueError,
            r"a must be contiguous along its last axis",
        ),
        ErrorCase(
            "b-last-axis-strided",
            forward_with(b=strided),
            ValueError,
            r"b must be contiguous along its last axis",
        ),
        ErrorCase(
            "y-last-axis-strided",
            forward_with(y=strided),
            ValueError,
            r"y must be contiguous along its last axis",
        ),
        ErrorCase("y-overlaps-a", y_overlapping("a"), ValueError, r"y shares memory with a"),
        ErrorCase("y-overlaps-b", y_overlapping("b"), ValueError, r"y shares memory with b"),
        ErrorCase(
            "b-shape-backward",
            backward_with(b=full((4, 9)), db=full((4, 9))),
            ValueError,
            r"B.primal must have shape \(4, 8\)",
        ),
        ErrorCase(
            "dy-dtype",
            backward_with(dy=int_array((4, 8))),
            TypeError,
            r"Y.shadow must have dtype in",
        ),
        ErrorCase(
            "db-mixed-namespaces",
            backward_with(db=other_namespace),
            TypeError,
            r"B.shadow is a \w+ array but A.primal is a \w+ array",
        ),
        ErrorCase("db-is-dy", db_is_dy, ValueError, r"B.shadow shares memory with Y.shadow"),
        ErrorCase("bare-Y", backward_with(duplicated=False), TypeError, r"Y must be a Duplicated"),
    ]


SPEC = OpSpec(
    name="swiglu",
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
        grad_names=("a", "b"),
        cotangents=_cotangents,
        reference=_reference_backward,
        inplace=_backward_,
        allocating=_backward,
    ),
    torch_reference=_torch_reference,
)
