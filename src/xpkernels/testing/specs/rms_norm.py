"""RMSNorm conformance declaration."""

from __future__ import annotations

import numpy as np

import xpkernels as xk
from xpkernels.buffers import Duplicated
from xpkernels.rms_norm import RMSNormBackwardScratch, RMSNormCheckpoints
from xpkernels.testing import references as ref
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
    def make(target, shape=(4, 8)):
        x = target.full(shape, 1.0, "float32")
        w = target.full(shape[-1:], 1.0, "float32")
        return x, w

    def wrong_rank(t):
        x, w = make(t)
        xk.rms_norm_(t.full((8,), 0, "float32"), x, t.full((8, 8), 1.0, "float32"))

    def m_mismatch(t):
        x, _ = make(t)
        xk.rms_norm_(t.full((4, 8), 0, "float32"), x, t.full((9,), 1.0, "float32"))

    def y_shape(t):
        x, w = make(t)
        xk.rms_norm_(t.full((4, 9), 0, "float32"), x, w)

    def int_input(t):
        _, w = make(t)
        xk.rms_norm(t.asarray(np.ones((4, 8), dtype=np.int32)), w)

    def int_output(t):
        x, w = make(t)
        xk.rms_norm_(t.asarray(np.ones((4, 8), dtype=np.int32)), x, w)

    def bad_eps(eps):
        def call(t):
            x, w = make(t)
            xk.rms_norm(x, w, eps=eps)

        return call

    def ckpt_shape(t):
        x, w = make(t)
        ck = RMSNormCheckpoints(rstd=t.full((5,), 0, "float32"))
        xk.rms_norm(x, w, checkpoints=ck)

    def ckpt_dtype(t):
        x, w = make(t)
        ck = RMSNormCheckpoints(rstd=t.full((4,), 0, "float64"))
        xk.rms_norm(x, w, checkpoints=ck)

    def missing_ckpt(t):
        x, w = make(t)
        xk.rms_norm_backward_(Duplicated(x), Duplicated(x), Duplicated(w), checkpoints=None)

    def scratch_shape(t):
        x, w = make(t)
        ck = xk.allocate_checkpoints(xk.rms_norm_, x, w)
        xk.rms_norm(x, w, checkpoints=ck)
        sc = RMSNormBackwardScratch(dw_partial=t.full((1, 9), 0, "float32"))
        xk.rms_norm_backward_(
            Duplicated(x), Duplicated(x), Duplicated(w), checkpoints=ck, scratch=sc
        )

    def bare_x_backward(t):
        x, w = make(t)
        ck = xk.allocate_checkpoints(xk.rms_norm_, x, w)
        xk.rms_norm_backward_(Duplicated(x), x, Duplicated(w), checkpoints=ck)

    return [
        ErrorCase("w-rank", wrong_rank, ValueError, r"w must have shape \(8,\)"),
        ErrorCase("M-mismatch", m_mismatch, ValueError, r"w must have shape \(8,\)"),
        ErrorCase("y-shape", y_shape, ValueError, r"y must have shape \(4, 8\)"),
        ErrorCase("int-x", int_input, TypeError, r"x must have dtype in"),
        ErrorCase("int-y", int_output, TypeError, r"y must have dtype in"),
        ErrorCase("eps-zero", bad_eps(0.0), ValueError, r"eps must be finite and > 0"),
        ErrorCase("eps-nan", bad_eps(float("nan")), ValueError, r"eps must be finite and > 0"),
        ErrorCase("eps-inf", bad_eps(float("inf")), ValueError, r"eps must be finite and > 0"),
        ErrorCase(
            "checkpoint-shape", ckpt_shape, ValueError, r"checkpoints.rstd must have shape \(4,\)"
        ),
        ErrorCase("checkpoint-dtype", ckpt_dtype, TypeError, r"checkpoints.rstd must be float32"),
        ErrorCase("missing-checkpoints", missing_ckpt, ValueError, r"checkpoints are required"),
        ErrorCase(
            "scratch-shape", scratch_shape, ValueError, r"dw_partial must have shape \(P, 8\)"
        ),
        ErrorCase("bare-X", bare_x_backward, TypeError, r"X must be a Duplicated"),
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
