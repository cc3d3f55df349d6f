"""LayerNorm conformance declaration.

Cases without a scale or shift (``affine`` of ``"w"``, ``"b"`` or ``""``)
still carry ``w`` and ``b`` inputs so the harness's gradient names line up:
the missing one is a ``(0,)``-shaped placeholder that is never passed to the
kernels, whose gradient has no elements to compare.
"""

from __future__ import annotations

import numpy as np

import xpkernels as xk
from xpkernels.buffers import Duplicated
from xpkernels.layer_norm import LayerNormBackwardScratch, LayerNormCheckpoints
from xpkernels.testing import references as ref
from xpkernels.testing.harness import Backward, Case, ErrorCase, OpSpec

EPS = 1e-5


def _cases():
    return [
        Case("rows1-M1", {"shape": (1, 1)}, interpreter=True),
        Case("3x1", {"shape": (3, 1)}, interpreter=True),
        Case("vector-M33", {"shape": (33,)}, interpreter=True),
        Case("2x3x96", {"shape": (2, 3, 96)}, interpreter=True, quick=True),
        Case("5x1000", {"shape": (5, 1000)}, interpreter=True),
        Case("no-affine-4x160", {"shape": (4, 160), "affine": ""}, interpreter=True),
        Case("weight-only-3x130", {"shape": (3, 130), "affine": "w"}, interpreter=True),
        Case("bias-only-3x130", {"shape": (3, 130), "affine": "b"}, interpreter=True),
        Case("mean-offset-4x256", {"shape": (4, 256), "x_offset": 30.0}, interpreter=True),
        # Rows whose mean (1e5) dwarfs their spread (1): a float32 mean is off by up to
        # half an ulp of 1e5 (0.004) unless refined from the centred row. float16 cannot
        # hold 1e5 and bfloat16 rounds the spread away, so the case runs in float32/64 only.
        Case(
            "mean-1e5-spread-1-4x512",
            {"shape": (4, 512), "x_offset": 1e5, "x_scale": 1.0},
            interpreter=True,
            dtypes=("float64", "float32"),
        ),
        Case(
            "transposed-leading", {"shape": (3, 4, 64), "permute_leading": True}, interpreter=True
        ),
        Case("7x4097", {"shape": (7, 4097)}),
        Case("wide-2x16384", {"shape": (2, 16384)}),
        Case("rows-3000x64", {"shape": (3000, 64)}),
    ]


def _has(case, name):
    return name in case.params.get("affine", "wb")


def _affine(case, arrays):
    """The ``(w, b)`` a case passes to the kernels: None where it has no scale / shift."""
    return (
        arrays["w"] if _has(case, "w") else None,
        arrays["b"] if _has(case, "b") else None,
    )


def _arrange(case, arrays, target):
    if not case.params.get("permute_leading"):
        return arrays
    return {**arrays, "x": target.leading_transposed(arrays["x"])}


def _inputs(case, rng):
    shape = case.params["shape"]
    m = shape[-1]
    x = rng.standard_normal(shape) * case.params.get("x_scale", 2.0) + case.params.get(
        "x_offset", 0.0
    )
    w = rng.standard_normal((m,)) if _has(case, "w") else np.zeros((0,))
    b = rng.standard_normal((m,)) if _has(case, "b") else np.zeros((0,))
    return {"x": x, "w": w, "b": b}


def _cotangents(case, rng):
    return {"y": rng.standard_normal(case.params["shape"])}


def _reference(case, inputs):
    w, b = _affine(case, inputs)
    y, mean, rstd = ref.layer_norm(inputs["x"], w, b, eps=EPS)
    return {"y": y}, {"mean": mean.reshape(-1), "rstd": rstd.reshape(-1)}


def _reference_backward(case, inputs, cotangents):
    w, _ = _affine(case, inputs)
    dx, dw, db = ref.layer_norm_backward(inputs["x"], w, cotangents["y"], eps=EPS)
    # A missing scale / shift has a (0,)-shaped placeholder gradient (see the module docstring).
    empty = np.zeros((0,))
    return {"x": dx, "w": empty if dw is None else dw, "b": db if _has(case, "b") else empty}


def _torch_reference(case, inputs, cotangents):
    import torch

    x = torch.tensor(inputs["x"], requires_grad=True)
    w = torch.tensor(inputs["w"], requires_grad=True)
    b = torch.tensor(inputs["b"], requires_grad=True)
    y = torch.nn.functional.layer_norm(
        x, x.shape[-1:], w if _has(case, "w") else None, b if _has(case, "b") else None, eps=EPS
    )
    y.backward(torch.tensor(cotangents["y"]))

    def grad(t):
        return t.grad.numpy() if t.grad is not None else np.zeros((0,))

    return {"y": y.detach().numpy()}, {"x": grad(x), "w": grad(w), "b": grad(b)}


def _allocate_outputs(case, arrays, target, dtype):
    return {"y": target.full(case.params["shape"], np.nan, dtype)}


def _allocate_checkpoints(case, arrays):
    return xk.allocate_checkpoints(xk.layer_norm_, arrays["x"], *_affine(case, arrays))


def _forward_(case, arrays, outs, checkpoints, backend):
    w, b = _affine(case, arrays)
    xk.layer_norm_(outs["y"], arrays["x"], w, b, eps=EPS, checkpoints=checkpoints, backend=backend)


def _forward(case, arrays, checkpoints, backend):
    w, b = _affine(case, arrays)
    return {
        "y": xk.layer_norm(arrays["x"], w, b, eps=EPS, checkpoints=checkpoints, backend=backend)
    }


def _backward_(case, arrays, outs, cotangents, grads, checkpoints, backend):
    w, b = _affine(case, arrays)
    Y = Duplicated(outs["y"], cotangents["y"])
    X = Duplicated(arrays["x"], grads["x"])
    W = None if w is None else Duplicated(w, grads["w"])
    B = None if b is None else Duplicated(b, grads["b"])
    scratch = xk.allocate_scratchspace(xk.layer_norm_backward_, Y, X, W, B, backend=backend)
    xk.layer_norm_backward_(Y, X, W, B, checkpoints=checkpoints, scratch=scratch, backend=backend)


def _backward(case, arrays, outs, cotangents, checkpoints, backend):
    w, b = _affine(case, arrays)
    dx, dw, db = xk.layer_norm_backward(
        cotangents["y"], arrays["x"], w, b, checkpoints=checkpoints, backend=backend
    )
    # A case without a scale / shift compares its (0,)-shaped placeholder instead.
    return {"x": dx, "w": arrays["w"] if dw is None else dw, "b": arrays["b"] if db is None else db}


def _errors():
    def make(t, shape=(4, 8)):
        return (
            t.full(shape, 1.0, "float32"),
            t.full(shape[-1:], 1.0, "float32"),
            t.full(shape[-1:], 0.0, "float32"),
        )

    def forward_with(eps=EPS, **changes):
        """A ``layer_norm_`` call on (4, 8) float32 arrays, with ``changes[name](t)`` replacing an array."""

        def call(t):
            x, w, b = make(t)
            args = {"y": t.full((4, 8), 0, "float32"), "x": x, "w": w, "b": b}
            args.update({name: build(t) for name, build in changes.items()})
            xk.layer_norm_(args["y"], args["x"], args["w"], args["b"], eps=eps)

        return call

    def checkpoints(mean_shape=(4,), mean_dtype="float32", rstd_shape=(4,), rstd_dtype="float32"):
        def build(t):
            return LayerNormCheckpoints(
                mean=t.full(mean_shape, 0, mean_dtype), rstd=t.full(rstd_shape, 0, rstd_dtype)
            )

        return build

    def forward_ckpt(**spec):
        def call(t):
            x, w, b = make(t)
            xk.layer_norm(x, w, b, checkpoints=checkpoints(**spec)(t))

        return call

    def backward_with(scratch=None, ck=True, bare_x=False, b_dtype="float32"):
        def call(t):
            x, w, b = make(t)
            cks = xk.allocate_checkpoints(xk.layer_norm_, x, w, b) if ck else None
            if ck:
                xk.layer_norm_(t.full((4, 8), 0, "float32"), x, w, b, checkpoints=cks)
            B = Duplicated(b, t.full((8,), 0, b_dtype))
            X = x if bare_x else Duplicated(x)
            xk.layer_norm_backward_(
                Duplicated(x),
                X,
                Duplicated(w),
                B,
                checkpoints=cks,
                scratch=None if scratch is None else scratch(t),
            )

        return call

    def partials(dw=((1, 8), "float32"), db=((1, 8), "float32")):
        def build(t):
            return LayerNormBackwardScratch(
                dw_partial=t.full(dw[0], 0, dw[1]), db_partial=t.full(db[0], 0, db[1])
            )

        return build

    def other_namespace(t):
        """A length-8 float32 weight from a namespace other than ``t``'s."""
        import pytest

        if t.namespace == "torch":
            return np.ones(8, dtype=np.float32)
        torch = pytest.importorskip("torch", reason="mixing namespaces needs a second library")
        return torch.ones(8)

    def other_device(t):
        """A length-8 float32 weight on a device other than ``t``'s."""
        import pytest

        if t.namespace == "torch":
            import torch

            return torch.ones(8, device="meta")
        if t.namespace == "array_api_strict":
            import array_api_strict

            return array_api_strict.ones(
                8, dtype=array_api_strict.float32, device=array_api_strict.Device("device1")
            )
        pytest.skip(f"{t.namespace} has a single device here")

    def strided_x(t):
        return t.full((4, 16), 1.0, "float32")[:, ::2]

    def int_array(shape):
        return lambda t: t.asarray(np.ones(shape, dtype=np.int32))

    return [
        ErrorCase(
            "w-rank",
            forward_with(w=lambda t: t.full((8, 8), 1.0, "float32")),
            ValueError,
            r"w must have shape \(8,\)",
        ),
        ErrorCase(
            "x-rank0",
            forward_with(x=lambda t: t.xp.reshape(t.full((1,), 1.0, "float32"), ())),
            ValueError,
            r"x must have shape \(\.\.\., M\)",
        ),
        ErrorCase(
            "M-mismatch-w",
            forward_with(w=lambda t: t.full((9,), 1.0, "float32")),
            ValueError,
            r"w must have shape \(8,\)",
        ),
        ErrorCase(
            "M-mismatch-b",
            forward_with(b=lambda t: t.full((7,), 1.0, "float32")),
            ValueError,
            r"b must have shape \(8,\)",
        ),
        ErrorCase(
            "y-shape",
            forward_with(y=lambda t: t.full((4, 9), 0, "float32")),
            ValueError,
            r"y must have shape \(4, 8\)",
        ),
        ErrorCase("int-x", forward_with(x=int_array((4, 8))), TypeError, r"x must have dtype in"),
        ErrorCase("int-y", forward_with(y=int_array((4, 8))), TypeError, r"y must have dtype in"),
        ErrorCase("int-b", forward_with(b=int_array((8,))), TypeError, r"b must have dtype in"),
        ErrorCase("eps-zero", forward_with(eps=0.0), ValueError, r"eps must be finite and > 0"),
        ErrorCase(
            "eps-negative", forward_with(eps=-1e-5), ValueError, r"eps must be finite and > 0"
        ),
        ErrorCase(
            "eps-nan", forward_with(eps=float("nan")), ValueError, r"eps must be finite and > 0"
        ),
        ErrorCase(
            "eps-inf", forward_with(eps=float("inf")), ValueError, r"eps must be finite and > 0"
        ),
        ErrorCase(
            "mixed-namespaces",
            forward_with(w=other_namespace),
            TypeError,
            r"w is a \w+ array but x is a \w+ array",
        ),
        ErrorCase(
            "mixed-devices",
            forward_with(w=other_device),
            TypeError,
            r"w is on device .* but x is on",
        ),
        ErrorCase(
            "x-last-axis-strided",
            forward_with(x=strided_x),
            ValueError,
            r"x must be contiguous along its last axis",
        ),
        ErrorCase(
            "checkpoint-mean-shape",
            forward_ckpt(mean_shape=(5,)),
            ValueError,
            r"checkpoints.mean must have shape \(4,\)",
        ),
        ErrorCase(
            "checkpoint-rstd-dtype",
            forward_ckpt(rstd_dtype="float64"),
            TypeError,
            r"checkpoints.rstd must be float32",
        ),
        ErrorCase(
            "missing-checkpoints", backward_with(ck=False), ValueError, r"checkpoints are required"
        ),
        ErrorCase(
            "scratch-dw-shape",
            backward_with(scratch=partials(dw=((1, 9), "float32"))),
            ValueError,
            r"dw_partial must have shape \(P, 8\)",
        ),
        ErrorCase(
            "scratch-partials-disagree",
            backward_with(scratch=partials(db=((2, 8), "float32"))),
            ValueError,
            r"db_partial must have the shape of scratch.dw_partial \(1, 8\)",
        ),
        ErrorCase(
            "scratch-db-dtype",
            backward_with(scratch=partials(db=((1, 8), "float64"))),
            TypeError,
            r"db_partial must be",
        ),
        ErrorCase(
            "db-dtype", backward_with(b_dtype="int32"), TypeError, r"B.shadow must have dtype in"
        ),
        ErrorCase("bare-X", backward_with(bare_x=True), TypeError, r"X must be a Duplicated"),
    ]


SPEC = OpSpec(
    name="layer_norm",
    outputs=("y",),
    cases=tuple(_cases()),
    inputs=_inputs,
    reference=_reference,
    allocate_outputs=_allocate_outputs,
    forward_=_forward_,
    forward=_forward,
    errors=_errors,
    checkpoint_names=("mean", "rstd"),
    allocate_checkpoints=_allocate_checkpoints,
    arrange=_arrange,
    backward=Backward(
        grad_names=("x", "w", "b"),
        cotangents=_cotangents,
        reference=_reference_backward,
        inplace=_backward_,
        allocating=_backward,
    ),
    torch_reference=_torch_reference,
)
