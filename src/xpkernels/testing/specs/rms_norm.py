"""RMSNorm conformance declaration."""

from __future__ import annotations

import numpy as np

import xpkernels as xk
from xpkernels.buffers import Duplicated
from xpkernels.testing import references as ref
from xpkernels.testing.declared_errors import declared_errors
from xpkernels.testing.harness import Backward, Case, ErrorCase, OpSpec

EPS = 1e-6


def _shape_cases():
    cases = [
        Case("rows1-M1", {"shape": (1, 1)}, interpreter=True),
        Case("3x1", {"shape": (3, 1)}, interpreter=True),
        Case("vector-M33", {"shape": (33,)}, interpreter=True),
        Case("2x3x96", {"shape": (2, 3, 96)}, interpreter=True, quick=True),
        Case("5x1000", {"shape": (5, 1000)}, interpreter=True),
        Case("offset-gemma", {"shape": (4, 160), "offset": 1.0}, interpreter=True),
        Case(
            "transposed-leading", {"shape": (3, 4, 64), "permute_leading": True}, interpreter=True
        ),
        Case("7x4097", {"shape": (7, 4097)}),
        Case("wide-2x16384", {"shape": (2, 16384)}),
        Case("rows-3000x64", {"shape": (3000, 64)}),
    ]
    return cases


def _arrange(case, arrays, target):
    if not case.params.get("permute_leading"):
        return arrays
    return {**arrays, "x": target.leading_transposed(arrays["x"])}


def _inputs(case, rng):
    shape = case.params["shape"]
    return {"x": rng.standard_normal(shape) * 2.0, "w": rng.standard_normal(shape[-1:])}


def _cotangents(case, rng):
    return {"y": rng.standard_normal(case.params["shape"])}


def _reference(case, inputs):
    offset = case.params.get("offset", 0.0)
    y, rstd = ref.rms_norm(inputs["x"], inputs["w"], eps=EPS, offset=offset)
    return {"y": y}, {"rstd": rstd.reshape(-1)}


def _reference_backward(case, inputs, cotangents):
    offset = case.params.get("offset", 0.0)
    dx, dw = ref.rms_norm_backward(
        inputs["x"], inputs["w"], cotangents["y"], eps=EPS, offset=offset
    )
    return {"x": dx, "w": dw}


def _torch_reference(case, inputs, cotangents):
    import torch

    x = torch.tensor(inputs["x"], requires_grad=True)
    w = torch.tensor(inputs["w"], requires_grad=True)
    y = torch.nn.functional.rms_norm(x, x.shape[-1:], w + case.params.get("offset", 0.0), eps=EPS)
    y.backward(torch.tensor(cotangents["y"]))
    return {"y": y.detach().numpy()}, {"x": x.grad.numpy(), "w": w.grad.numpy()}


def _allocate_outputs(case, arrays, target, dtype):
    return {"y": target.full(case.params["shape"], np.nan, dtype)}


def _allocate_checkpoints(case, arrays):
    return xk.allocate_checkpoints(xk.rms_norm_, arrays["x"], arrays["w"])


def _forward_(case, arrays, outs, checkpoints, backend):
    xk.rms_norm_(
        outs["y"],
        arrays["x"],
        arrays["w"],
        eps=EPS,
        offset=case.params.get("offset", 0.0),
        checkpoints=checkpoints,
        backend=backend,
    )


def _forward(case, arrays, checkpoints, backend):
    y = xk.rms_norm(
        arrays["x"],
        arrays["w"],
        eps=EPS,
        offset=case.params.get("offset", 0.0),
        checkpoints=checkpoints,
        backend=backend,
    )
    return {"y": y}


def _backward_(case, arrays, outs, cotangents, grads, checkpoints, backend):
    Y = Duplicated(outs["y"], cotangents["y"])
    X = Duplicated(arrays["x"], grads["x"])
    W = Duplicated(arrays["w"], grads["w"])
    scratch = xk.allocate_scratchspace(xk.rms_norm_backward_, Y, X, W, backend=backend)
    xk.rms_norm_backward_(
        Y,
        X,
        W,
        checkpoints=checkpoints,
        scratch=scratch,
        offset=case.params.get("offset", 0.0),
        backend=backend,
    )


def _backward(case, arrays, outs, cotangents, checkpoints, backend):
    dx, dw = xk.rms_norm_backward(
        cotangents["y"],
        arrays["x"],
        arrays["w"],
        checkpoints=checkpoints,
        offset=case.params.get("offset", 0.0),
        backend=backend,
    )
    return {"x": dx, "w": dw}


def _errors():
    """What the declaration cannot say: the values of ``eps``."""

    def bad_eps(eps):
        def call(t):
            x = t.full((4, 8), 1.0, "float32")
            xk.rms_norm(x, t.full((8,), 1.0, "float32"), eps=eps)

        return call

    return [
        *declared_errors("rms_norm"),
        ErrorCase("eps-zero", bad_eps(0.0), ValueError, r"eps must be finite and > 0"),
        ErrorCase("eps-nan", bad_eps(float("nan")), ValueError, r"eps must be finite and > 0"),
        ErrorCase("eps-inf", bad_eps(float("inf")), ValueError, r"eps must be finite and > 0"),
    ]


SPEC = OpSpec(
    name="rms_norm",
    outputs=("y",),
    cases=tuple(_shape_cases()),
    inputs=_inputs,
    reference=_reference,
    allocate_outputs=_allocate_outputs,
    forward_=_forward_,
    forward=_forward,
    errors=_errors,
    checkpoint_names=("rstd",),
    allocate_checkpoints=_allocate_checkpoints,
    arrange=_arrange,
    backward=Backward(
        grad_names=("x", "w"),
        cotangents=_cotangents,
        reference=_reference_backward,
        inplace=_backward_,
        allocating=_backward,
    ),
    torch_reference=_torch_reference,
)
