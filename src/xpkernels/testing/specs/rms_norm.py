"""RMSNorm conformance declaration."""

from __future__ import annotations

import xpkernels as xk
from xpkernels.buffers import Duplicated
from xpkernels.testing import references as ref
from xpkernels.testing.declared_errors import declared_errors
from xpkernels.testing.harness import Backward, Case, ErrorCase, OpSpec

from ._shared import allocate_y, arrange_x, cotangent_y, row_cases

EPS = 1e-6


def _shape_cases():
    return row_cases(Case("offset-gemma", {"shape": (4, 160), "offset": 1.0}, interpreter=True))


def _offset(case) -> float:
    """The constant added to ``w`` (Gemma's 1), 0 unless the case gives one."""
    return case.params.get("offset", 0.0)


def _inputs(case, rng):
    shape = case.params["shape"]
    return {"x": rng.standard_normal(shape) * 2.0, "w": rng.standard_normal(shape[-1:])}


def _reference(case, inputs):
    y, rstd = ref.rms_norm(inputs["x"], inputs["w"], eps=EPS, offset=_offset(case))
    return {"y": y}, {"rstd": rstd.reshape(-1)}


def _reference_backward(case, inputs, cotangents):
    dx, dw = ref.rms_norm_backward(
        inputs["x"], inputs["w"], cotangents["y"], eps=EPS, offset=_offset(case)
    )
    return {"x": dx, "w": dw}


def _torch_reference(case, inputs, cotangents):
    import torch

    x = torch.tensor(inputs["x"], requires_grad=True)
    w = torch.tensor(inputs["w"], requires_grad=True)
    y = torch.nn.functional.rms_norm(x, x.shape[-1:], w + _offset(case), eps=EPS)
    y.backward(torch.tensor(cotangents["y"]))
    return {"y": y.detach().numpy()}, {"x": x.grad.numpy(), "w": w.grad.numpy()}


def _allocate_checkpoints(case, arrays):
    return xk.allocate_checkpoints(xk.rms_norm_, arrays["x"], arrays["w"])


def _forward_(case, arrays, outs, checkpoints, backend):
    xk.rms_norm_(
        outs["y"],
        arrays["x"],
        arrays["w"],
        eps=EPS,
        offset=_offset(case),
        checkpoints=checkpoints,
        backend=backend,
    )


def _forward(case, arrays, checkpoints, backend):
    y = xk.rms_norm(
        arrays["x"],
        arrays["w"],
        eps=EPS,
        offset=_offset(case),
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
        offset=_offset(case),
        backend=backend,
    )


def _backward(case, arrays, outs, cotangents, checkpoints, backend):
    dx, dw = xk.rms_norm_backward(
        cotangents["y"],
        arrays["x"],
        arrays["w"],
        checkpoints=checkpoints,
        offset=_offset(case),
        backend=backend,
    )
    return {"x": dx, "w": dw}


def _errors():
    """What the declaration cannot say: the values of ``eps`` (a string or a bool is no number)."""

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
        ErrorCase("eps-string", bad_eps("1e-6"), TypeError, r"eps must be a real number, got str"),
        ErrorCase("eps-bool", bad_eps(True), TypeError, r"eps must be a real number, got bool"),
    ]


SPEC = OpSpec(
    name="rms_norm",
    outputs=("y",),
    cases=tuple(_shape_cases()),
    inputs=_inputs,
    reference=_reference,
    allocate_outputs=allocate_y,
    forward_=_forward_,
    forward=_forward,
    errors=_errors,
    checkpoint_names=("rstd",),
    allocate_checkpoints=_allocate_checkpoints,
    arrange=arrange_x,
    backward=Backward(
        grad_names=("x", "w"),
        cotangents=cotangent_y,
        reference=_reference_backward,
        inplace=_backward_,
        allocating=_backward,
    ),
    torch_reference=_torch_reference,
)
