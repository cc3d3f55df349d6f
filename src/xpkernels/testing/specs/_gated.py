"""What the gated activations' specs (SwiGLU, GeGLU) share: inputs, cotangents, layouts,
their calls and their declaration."""

from __future__ import annotations

import numpy as np

import xpkernels as xk
from xpkernels.buffers import Duplicated
from xpkernels.testing import references as ref
from xpkernels.testing.declared_errors import declared_errors, other_device
from xpkernels.testing.harness import Backward, ErrorCase, OpSpec

from ._shared import allocate_y

__all__ = ["arrange", "cotangents", "gated_spec", "inputs"]

#: Gate values of the large-gates cases, one of them every third element.
_LARGE = np.array([60.0, -60.0, 1e4, -1e4, 20.0, -20.0, 88.0, -88.0])


def arrange(case, arrays, target):
    """The case's arrays, with their leading axes transposed in memory when it asks."""
    if not case.params.get("permute_leading"):
        return arrays
    return {name: target.leading_transposed(a) for name, a in arrays.items()}


def inputs(case, rng):
    """The gate ``a`` and values ``b``; large-gate cases put a gate far out in a tail every
    third element, with ``b`` in [-1, 1]."""
    shape = case.params["shape"]
    if not case.params.get("large"):
        return {"a": rng.standard_normal(shape) * 3, "b": rng.standard_normal(shape)}
    a = rng.standard_normal(shape) * 30
    flat = a.reshape(-1)
    flat[::3] = np.resize(_LARGE, flat[::3].size)
    return {"a": a, "b": rng.uniform(-1, 1, shape)}


def cotangents(case, rng):
    """``dy``: in [-1, 1] for the large-gate cases (``1e4 * b * dy`` stays finite in float16)."""
    shape = case.params["shape"]
    if case.params.get("large"):
        return {"y": rng.uniform(-1, 1, shape)}
    return {"y": rng.standard_normal(shape)}


def _no_options(case) -> dict:
    return {}


def gated_spec(name, cases, torch_activation, options=_no_options, errors=()) -> OpSpec:
    """The declaration of ``y = act(a) * b``: ``xk.<name>``, ``xk.<name>_`` and their
    backwards against ``references.<name>`` and ``<name>_backward``, each called with the
    keywords ``options(case)``; the torch oracle is ``torch_activation(F, a, **options)``.
    ``errors`` are the op's own error cases beside the declared ones and a mixed-device call.
    """
    forward, forward_ = getattr(xk, name), getattr(xk, f"{name}_")
    backward, backward_ = getattr(xk, f"{name}_backward"), getattr(xk, f"{name}_backward_")
    reference, reference_backward = getattr(ref, name), getattr(ref, f"{name}_backward")

    def _reference(case, inputs):
        return {"y": reference(inputs["a"], inputs["b"], **options(case))}, {}

    def _reference_backward(case, inputs, cotangents):
        da, db = reference_backward(inputs["a"], inputs["b"], cotangents["y"], **options(case))
        return {"a": da, "b": db}

    def _torch_reference(case, inputs, cotangents):
        import torch

        a = torch.tensor(inputs["a"], requires_grad=True)
        b = torch.tensor(inputs["b"], requires_grad=True)
        y = torch_activation(torch.nn.functional, a, **options(case)) * b
        y.backward(torch.tensor(cotangents["y"]))
        return {"y": y.detach().numpy()}, {"a": a.grad.numpy(), "b": b.grad.numpy()}

    def _forward_(case, arrays, outs, checkpoints, backend):
        forward_(outs["y"], arrays["a"], arrays["b"], **options(case), backend=backend)

    def _forward(case, arrays, checkpoints, backend):
        return {"y": forward(arrays["a"], arrays["b"], **options(case), backend=backend)}

    def _backward_(case, arrays, outs, cotangents, grads, checkpoints, backend):
        Y = Duplicated(outs["y"], cotangents["y"])
        A = Duplicated(arrays["a"], grads["a"])
        B = Duplicated(arrays["b"], grads["b"])
        backward_(Y, A, B, **options(case), backend=backend)

    def _backward(case, arrays, outs, cotangents, checkpoints, backend):
        da, db = backward(
            cotangents["y"], arrays["a"], arrays["b"], **options(case), backend=backend
        )
        return {"a": da, "b": db}

    def mixed_devices(t):
        rows = t.full((4, 8), 1.0, "float32")
        forward_(other_device(t, (4, 8)), rows, rows)

    def _errors():
        """What the declaration cannot say: an array on another device, and ``errors``."""
        return [
            *declared_errors(name),
            ErrorCase("mixed-devices", mixed_devices, TypeError, r"y is on device .* but a is on"),
            *errors,
        ]

    return OpSpec(
        name=name,
        outputs=("y",),
        cases=tuple(cases),
        inputs=inputs,
        reference=_reference,
        allocate_outputs=allocate_y,
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
